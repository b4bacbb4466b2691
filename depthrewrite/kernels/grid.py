"""Grid arithmetic the launchers share, in a module of its own so that every kernel module
(``param_grads`` included, which ``route_triton`` imports) can use it without a cycle."""

from __future__ import annotations

__all__ = ["cdiv"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' grids. Not ``triton.cdiv``: in Triton 3.9 (this
    project's CPU VM) that is a ``constexpr_function``, whose wrapper took the host 2.8 us a
    call against 0.1 for this, and a launcher calls it up to six times."""
    return -(-a // b)
