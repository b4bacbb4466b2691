"""A Triton kernel for ``depthrewrite::token_weighted_sum``
(:mod:`depthrewrite.ops.source_logit`): the merges' logit backward's sum over every token,

    out[c] = sum_t weights[t, c // (d / heads)] * stored[t, c]        (float32)

Why a kernel: as cuBLAS's product of the weights' bf16 parts with ``stored`` (the op's
default implementation) it ran at 1.0-1.15 TB/s in every operand layout, 29-39 us a call to
read a 32 MiB source that HBM gives in 7-10 us (H100 and H200, sessions 68 and 80,
docs/benchmarks.md): the product's tiles are 64 rows tall for 3 to 48 weight columns, and
its split over the tokens adds a reduction kernel. Here the weights stay float32 (no
parts), and each program reads its run of tokens' rows once.

Two stages, deterministic: a grid of (runs of tokens) x (blocks of BLOCK_D columns), each
program summing its run into one float32 row of partial sums (in a fixed order: BLOCK_T rows
at a time, then over them), and ``partials.sum(0)`` over the runs (PyTorch's reduction, no
atomics). The runs are sized to give every SM ``PROGRAMS_PER_SM`` programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .grid import cdiv
from .route_triton import _multiprocessors

__all__ = ["token_weighted_sum_triton", "BLOCK_T", "BLOCK_D", "PROGRAMS_PER_SM", "SUPPORTED_DTYPES"]

#: rows of a program's tile: BLOCK_T x BLOCK_D float32 terms summed per step
BLOCK_T = 32
#: columns of a program: 256 bf16 = 512 contiguous bytes of each row
BLOCK_D = 256
#: programs per SM the runs of tokens are sized for (the grid fills the GPU at any width)
PROGRAMS_PER_SM = 4
#: the dtypes of ``stored`` the kernel reads (the weights are float32)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _token_sum_partials(weights_ptr, stored_ptr, partials_ptr, tokens, width, head_width, heads,
                        tokens_per_run, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    run = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < width
    head_of_col = cols // head_width
    first = run.to(tl.int64) * tokens_per_run
    end = tl.minimum(first + tokens_per_run, tokens)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for start in range(first, end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T).to(tl.int64)
        ok = (rows < end)[:, None] & col_ok[None, :]
        row = tl.load(stored_ptr + rows[:, None] * width + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        weight = tl.load(weights_ptr + rows[:, None] * heads + head_of_col[None, :], mask=ok, other=0.0)
        acc += weight * row
    tl.store(partials_ptr + run.to(tl.int64) * width + cols, tl.sum(acc, axis=0), mask=col_ok)


def token_weighted_sum_triton(weights: Tensor, stored: Tensor, heads: int) -> Tensor:
    """``out[c] = sum_t weights[t, c // (d / heads)] * stored[t, c]`` in float32 over every
    token ``t`` (all leading dimensions): ``weights`` float32 ``(*batch, heads)``, ``stored``
    ``(*batch, d)`` in a :data:`SUPPORTED_DTYPES` dtype. Returns ``(d,)`` float32."""
    _check_inputs(weights, stored, heads)
    d = stored.shape[-1]
    rows = stored.reshape(-1, d).contiguous()
    weight_rows = weights.reshape(-1, heads).contiguous()
    tokens = rows.shape[0]
    if tokens == 0:
        return rows.new_zeros((d,), dtype=torch.float32)
    column_blocks = cdiv(d, BLOCK_D)
    runs = min(cdiv(tokens, BLOCK_T), cdiv(_programs(rows.device), column_blocks))  # >= 1: tokens > 0
    # each run a whole number of BLOCK_T rows, so a program's steps are full tiles but its last
    tokens_per_run = cdiv(cdiv(tokens, runs), BLOCK_T) * BLOCK_T
    runs = cdiv(tokens, tokens_per_run)
    partials = rows.new_empty((runs, d), dtype=torch.float32)
    _token_sum_partials[(runs, column_blocks)](weight_rows, rows, partials, tokens, d, d // heads, heads,
                                              tokens_per_run, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    return partials.sum(0)


def _programs(device: torch.device) -> int:
    """The programs the grid aims for: :data:`PROGRAMS_PER_SM` on every SM (one SM's worth
    off the GPU: Triton's interpreter)."""
    if device.type != "cuda":
        return PROGRAMS_PER_SM
    return PROGRAMS_PER_SM * _multiprocessors(device)


def _check_inputs(weights: Tensor, stored: Tensor, heads: int) -> None:
    """The op's contract, checked at each launch: the op is internal (the merges' logit
    backward calls it), but a caller of ``torch.ops.depthrewrite.token_weighted_sum`` with
    another dtype or shape would otherwise get a misread sum, not an error."""
    op = "token_weighted_sum (Triton)"
    if stored.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: `stored` must be one of {SUPPORTED_DTYPES}; found {stored.dtype}")
    if weights.dtype != torch.float32:
        raise ValueError(f"{op}: `weights` must be float32; found {weights.dtype}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or stored.shape[-1] % heads:
        raise ValueError(f"{op}: `heads` must be a positive int dividing the width {stored.shape[-1]}; "
                         f"found {heads!r}")
    expected = tuple(stored.shape[:-1]) + (heads,)
    if tuple(weights.shape) != expected or weights.device != stored.device:
        raise ValueError(f"{op}: `weights` must have shape {expected} on {stored.device}; "
                         f"found {tuple(weights.shape)} on {weights.device}")
