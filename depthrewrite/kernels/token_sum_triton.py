"""A Triton kernel for ``depthrewrite::token_weighted_sum``
(:mod:`depthrewrite.ops.source_logit`): the merges' logit backward's sum over every token,

    out[c] = sum_t weights[t, c // (d / heads)] * stored[t, c]        (float32)

Why a kernel: as cuBLAS's product of the weights' bf16 parts with ``stored`` (the op's
default implementation) it ran at 1.0-1.15 TB/s in every operand layout, 29-39 us a call to
read a 32 MiB source that HBM gives in 7-10 us (H100 and H200, sessions 68 and 80,
docs/benchmarks.md): the product's tiles are 64 rows tall for 3 to 48 weight columns, and
its split over the tokens adds a reduction kernel. Here the weights stay float32 (no
parts), and each program reads its run of tokens' rows once.

Two stages, deterministic: a grid of (runs of tokens) x (blocks of columns), each program
summing its run into one float32 row of partial sums (in a fixed order: a tile of rows at a
time, then over them), and ``partials.sum(0)`` over the runs (PyTorch's reduction, no
atomics). The runs are sized to give every SM ``PROGRAMS_PER_SM`` programs.

A program's columns lie in one head wherever a power of two of at least
``MIN_ONE_HEAD_BLOCK_D`` columns divides the head's width (one head: always; block MHAR's
16 heads of 64: blocks of 64). Its weights are then one float32 a row, broadcast over the
columns. Otherwise each column gathers its head's weight: a load per term, not per row. The
session-81 form gathered in every case; on an H100 it read 1.35 TB/s at one head and 0.60 at
16, under Inductor's reduction of the same sum (1.86 and 1.05, session 82,
docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .grid import cdiv
from .route_triton import _multiprocessors

__all__ = ["token_weighted_sum_triton", "column_blocks", "TILE", "MAX_BLOCK_D", "MIN_ONE_HEAD_BLOCK_D",
           "PROGRAMS_PER_SM", "NUM_WARPS", "SUPPORTED_DTYPES"]

#: float32 terms of a program's tile (rows x columns, summed per step): the rows are
#: TILE // the block's columns
TILE = 8192
#: the widest block of columns a program reads: 256 bf16 = 512 contiguous bytes of each row
MAX_BLOCK_D = 256
#: the narrowest block of one head's columns the broadcast-weight path takes (32 bf16: 64
#: contiguous bytes of a row); narrower heads gather a weight per column
MIN_ONE_HEAD_BLOCK_D = 32
#: programs per SM the runs of tokens are sized for (the grid fills the GPU at any width)
PROGRAMS_PER_SM = 4
#: warps of a program
NUM_WARPS = 4
#: the dtypes of ``stored`` the kernel reads (the weights are float32)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _token_sum_partials(weights_ptr, stored_ptr, partials_ptr, tokens, width, head_width, heads,
                        tokens_per_run, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ONE_HEAD: tl.constexpr):
    run = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < width
    # both paths' head indices before the loop (the compiler drops the one a path does not
    # use): computed in the ONE_HEAD branch, one head took 126 registers a thread, not 96
    # (benchmarks/kernel_registers.py, Triton 3.9, session 82)
    head_of_col = cols // head_width
    head = (block * BLOCK_D) // head_width  # with ONE_HEAD, the head of every column
    first = run.to(tl.int64) * tokens_per_run
    end = tl.minimum(first + tokens_per_run, tokens)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for start in range(first, end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T).to(tl.int64)
        row_ok = rows < end
        ok = row_ok[:, None] & col_ok[None, :]
        row = tl.load(stored_ptr + rows[:, None] * width + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if ONE_HEAD:  # one weight a row, broadcast over the columns
            weight = tl.load(weights_ptr + rows * heads + head, mask=row_ok, other=0.0)[:, None]
        else:  # a weight per term: the column's head's
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
    block_d, one_head = column_blocks(d, heads)
    block_t = TILE // block_d
    blocks = cdiv(d, block_d)
    runs = min(cdiv(tokens, block_t), cdiv(_programs(rows.device), blocks))  # >= 1: tokens > 0
    # each run a whole number of tiles, so a program's steps are full tiles but its last
    tokens_per_run = cdiv(cdiv(tokens, runs), block_t) * block_t
    runs = cdiv(tokens, tokens_per_run)
    partials = rows.new_empty((runs, d), dtype=torch.float32)
    _token_sum_partials[(runs, blocks)](weight_rows, rows, partials, tokens, d, d // heads, heads, tokens_per_run,
                                        BLOCK_T=block_t, BLOCK_D=block_d, ONE_HEAD=one_head, num_warps=NUM_WARPS)
    return partials.sum(0)


def column_blocks(width: int, heads: int) -> tuple[int, bool]:
    """``(columns of a program, whether they lie in one head)``: the largest power of two
    dividing the head's width, at most :data:`MAX_BLOCK_D`, where it is at least
    :data:`MIN_ONE_HEAD_BLOCK_D` (one head: any block lies in it); else :data:`MAX_BLOCK_D`
    columns of several heads."""
    head_width = width // heads
    if heads == 1:
        return MAX_BLOCK_D, True
    block = min(head_width & -head_width, MAX_BLOCK_D)
    if block >= MIN_ONE_HEAD_BLOCK_D:
        return block, True
    return MAX_BLOCK_D, False


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
