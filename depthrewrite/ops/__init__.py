"""Reference implementations of the ``depthrewrite::`` custom ops.

Importing this package registers the ops with ``torch.library``.
"""

from depthrewrite.ops.route import route, route_reference
import depthrewrite.kernels  # noqa: E402,F401  registers the fused CUDA kernels (Triton loads lazily)

__all__ = ["route", "route_reference"]
