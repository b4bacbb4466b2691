"""``depthrewrite::fence_``: an op that does nothing, declared as mutating its input.

The backend puts it after a partial sum of a long gradient sum (:mod:`depthrewrite.sum_fences`).
Inductor cannot fuse the additions before a fence with those after it (the fence is a
fallback kernel that "mutates" the partial sum, so everything after it must wait for it),
so the partial sum becomes its own kernel, computed as soon as its terms exist, and the
terms can be freed. Calling it costs one dispatch; it reads and writes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fence_"]


@torch.library.custom_op("depthrewrite::fence_", mutates_args=("x",))
def fence_(x: Tensor) -> None:
    """Nothing: ``x`` is left as it is (see the module docstring for why the op exists)."""


@fence_.register_fake
def _fence_fake(x: Tensor) -> None:
    return None
