"""Per-head sums and per-head broadcasts over a token's row, written as whole-row ops.

MHAR's merges (``heads > 1``) need two per-head operations for each token:
- the sum over each head's ``d / H`` columns (the source's logit in the forward, the
  gradient of the head's weight in the backward);
- a per-head value spread over the head's columns (the weight times the row).

As a view ``(*batch, H, d / H)`` with a sum over its last dimension, each sum is a
reduction of another shape (T * H rows of d / H) than the row reductions around it (the
key's RMS statistic; the branch norm's after the merge: T rows of d). Inductor's Triton
backend fuses reductions of one shape only. So a 16-head merge and its branch norm took 3
kernels forward and 3 backward, each reading the rows, and the backward wrote and read a
float32 gradient of the rows in between. With one head it is one kernel each way
(Inductor's Triton code, generated on the CPU, session 71; docs/design.md "MHAR's merges
as whole-row reductions").

Here each head's sum is a reduction over the whole row of the row with the other heads'
columns set to zero, and the spread is a chain of selects by the column's head. That is
H times the arithmetic, and the rows are read once. Each head's value is a tensor of its
own, ``(*batch, 1)``, never stacked: a stack of reductions is one buffer that Inductor's
consumers read at offsets other than those each reduction wrote, which splits the kernels
again (session 70, ``route_many.MERGE_SOFTMAX_BY_TERMS``).

``MASKED_HEAD_SUMS = False`` gives the merges their view-and-sum form (before session 71).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["MASKED_HEAD_SUMS", "head_masks", "head_sums", "spread_heads"]

#: the merges' per-head sums and spreads as whole-row ops (the module docstring); False:
#: a view per head and a sum over it
MASKED_HEAD_SUMS = True


def head_masks(d: int, heads: int, device: torch.device) -> Tensor:
    """``(heads, d)`` bool: row ``h`` is True on head ``h``'s columns ``[h d/H, (h+1) d/H)``."""
    column_head = torch.arange(d, device=device) // (d // heads)
    return column_head == torch.arange(heads, device=device).unsqueeze(-1)


def head_sums(x: Tensor, heads: int) -> list[Tensor]:
    """``[x[..., head h's columns].sum(-1, keepdim=True) for each h]`` as sums over the
    whole row with the other columns zeroed (selected, not multiplied: an infinity in
    another head stays there): ``heads`` tensors of shape ``(*batch, 1)``."""
    masks = head_masks(x.shape[-1], heads, x.device)
    zero = x.new_zeros(())
    return [torch.where(masks[h], x, zero).sum(-1, keepdim=True) for h in range(heads)]


def spread_heads(values: Sequence[Tensor], d: int) -> Tensor:
    """``(*batch, d)``: column ``c`` holds ``values[c // (d / H)]`` (each ``(*batch, 1)``,
    ``H = len(values)``), by selects: exactly the values."""
    masks = head_masks(d, len(values), values[0].device)
    spread = values[0].expand(*values[0].shape[:-1], d)
    for h in range(1, len(values)):
        spread = torch.where(masks[h], values[h], spread)
    return spread
