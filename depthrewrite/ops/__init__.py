"""Reference implementations of the ``depthrewrite::`` custom ops.

Importing this package registers the ops with ``torch.library``.
"""

from depthrewrite.ops.route import route, route_and_norm, route_and_norm_reference, route_reference
from depthrewrite.ops.route_many import merge_partial, merge_routes, route_many, route_many_reference
from depthrewrite.ops.route_merge import route_merge, route_merge_reference
import depthrewrite.ops.fence  # noqa: E402,F401  registers depthrewrite::fence_ (used by the backend)
import depthrewrite.ops.route_into  # noqa: E402,F401  registers depthrewrite::route_backward_into_ (the backend's)
import depthrewrite.kernels  # noqa: E402,F401  registers the fused CUDA kernels (Triton loads lazily)

__all__ = ["route", "route_and_norm", "route_reference", "route_and_norm_reference", "route_many",
           "route_many_reference", "merge_partial", "merge_routes", "route_merge", "route_merge_reference"]
