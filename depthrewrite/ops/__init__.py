"""Reference implementations of the ``depthrewrite::`` custom ops.

Importing this package registers the ops with ``torch.library``.
"""

from depthrewrite.ops.route import route, route_reference

__all__ = ["route", "route_reference"]
