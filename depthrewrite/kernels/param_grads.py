"""The last step of the backward kernels' deterministic parameter reductions, in one launch.

The backward kernels of ``route_many`` and ``route_merge`` (and ``route``) add each
parameter gradient's terms into float32 partial sums, one row per program (or per range of
tokens), so that no two programs add into one address (no atomics, a fixed order). What is
left is a sum over those rows, and for the query and the key-norm weight a product: their
gradients are ``r * key_norm_weight`` and ``r * query`` for ``r = sum dz * khat``. As torch
ops that step was three to seven small launches a call (the sums, the products, the
casts); :func:`finish` does it in one: each program sums a block of columns over the rows,
in order, and writes the results in their own dtypes. Session 30 measured (H200,
docs/benchmarks.md): ``route_merge``'s backward 47-49 us less host time a call, and 1.5-1.6
ms less GPU time a step in block MHAR's and DAR block's fused merge (40 calls). ``route``'s
backward, with three launches to replace, showed no gain and keeps the torch ops
(``route_triton._parameter_grads``).

``FUSED = False`` takes the torch ops instead (read at each call: the A/B of
``benchmarks/e2e_throughput.py``'s ``_tfin`` configurations).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .grid import cdiv

__all__ = ["PartialSums", "finish", "query_and_weight_grads", "FUSED"]

#: one launch for the sums and products (False: torch ops, for A/B timing)
FUSED = True
#: columns and rows of one program's tile (4096 float32 values, 32 a thread at 4 warps)
BLOCK_W = 64
BLOCK_P = 64
NUM_WARPS = 4


class PartialSums(NamedTuple):
    """Float32 partial sums of one gradient: ``rows`` rows of ``width`` entries, row ``p`` at
    ``p * stride`` elements from the start of ``part`` (each row contiguous). The gradient
    is their sum over the rows."""

    part: Tensor
    rows: int
    stride: int
    width: int

    @classmethod
    def of(cls, part: Tensor) -> PartialSums:
        """A contiguous tensor whose first dimension is the rows."""
        rows = part.shape[0]
        width = part.numel() // rows if rows else 0
        return cls(part, rows, width, width)

    def total(self) -> Tensor:
        """The sum over the rows as a torch op (float32, flat ``(width,)``)."""
        if self.part.shape == (self.rows, self.width) and self.part.is_contiguous():
            return self.part.sum(0)  # exactly these rows as they lie: one op, not a view and a sum
        rows = self.part.as_strided((self.rows, self.width), (self.stride, 1))
        return rows.sum(0)


@triton.jit
def _sum_columns(block, sums, rows, stride, width, a_ptr, b_ptr, out_a, out_b, PRODUCTS: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    """Column block ``block`` of ``sums``' rows added in order; writes the sum (cast to
    ``out_a``'s dtype), or with PRODUCTS ``sum * a`` to ``out_a`` and ``sum * b`` to ``out_b``."""
    cols = block * BLOCK_W + tl.arange(0, BLOCK_W)
    cmask = cols < width
    acc = tl.zeros((BLOCK_W,), tl.float32)
    for p0 in range(0, rows, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        offs = p[:, None].to(tl.int64) * stride + cols[None, :]
        acc += tl.sum(tl.load(sums + offs, mask=(p[:, None] < rows) & cmask[None, :], other=0.0), 0)
    if PRODUCTS:
        a = tl.load(a_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_a + cols, (acc * a).to(out_a.dtype.element_ty), mask=cmask)
        tl.store(out_b + cols, (acc * b).to(out_b.dtype.element_ty), mask=cmask)
    else:
        tl.store(out_a + cols, acc.to(out_a.dtype.element_ty), mask=cmask)


@triton.jit
def _finish_kernel(r_ptr, r_rows, r_stride, r_width, kw_ptr, q_ptr, gq_ptr, gkw_ptr, r_blocks,
                   s1_ptr, s1_rows, s1_stride, s1_width, o1_ptr, s1_blocks,
                   s2_ptr, s2_rows, s2_stride, s2_width, o2_ptr,
                   EXTRA: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    """Programs ``[0, r_blocks)``: the query's and key-norm weight's gradients from ``r``'s
    partial sums; the next ``s1_blocks``: the first extra sum; the rest: the second."""
    pid = tl.program_id(0)
    if pid < r_blocks:
        _sum_columns(pid, r_ptr, r_rows, r_stride, r_width, kw_ptr, q_ptr, gq_ptr, gkw_ptr, True, BLOCK_P, BLOCK_W)
    elif EXTRA >= 1:
        if pid < r_blocks + s1_blocks:
            _sum_columns(pid - r_blocks, s1_ptr, s1_rows, s1_stride, s1_width, o1_ptr, o1_ptr, o1_ptr, o1_ptr,
                         False, BLOCK_P, BLOCK_W)
        elif EXTRA >= 2:
            _sum_columns(pid - r_blocks - s1_blocks, s2_ptr, s2_rows, s2_stride, s2_width, o2_ptr, o2_ptr, o2_ptr,
                         o2_ptr, False, BLOCK_P, BLOCK_W)


def finish(r: PartialSums, query: Tensor, key_norm_weight: Tensor,
           *extra: tuple[PartialSums, Tensor]) -> tuple[Tensor, ...]:
    """``(grad_query, grad_key_norm_weight, *extra sums)``: ``r``'s sum times
    ``key_norm_weight`` in ``query``'s dtype and shape, times ``query`` in ``key_norm_weight``'s
    (``r.width`` is their element count), then each extra ``(sums, like)`` summed into a new
    tensor of ``like``'s shape and dtype (at most two). Float32 math, one rounding."""
    if len(extra) > 2:
        raise ValueError(f"param_grads.finish: at most 2 extra sums; found {len(extra)}")
    for sums, like in ((r, query), *extra):
        _check_width("finish", sums, like)
    outs = [_empty(like, query.device) for _, like in extra]
    if not FUSED:
        for out, (sums, _) in zip(outs, extra):
            out.view(-1).copy_(sums.total())
        return (*_torch_products(r, query, key_norm_weight), *outs)
    grad_query, grad_weight = _empty(query), _empty(key_norm_weight, query.device)
    blocks = [cdiv(s.width, BLOCK_W) for s in (r, *(sums for sums, _ in extra))]
    pad = [(r.part, 0, 0, 0, grad_query)] * (2 - len(extra))  # unread arguments of absent sums
    (s1, rows1, stride1, width1, o1), (s2, rows2, stride2, width2, o2) = (
        [(s.part, s.rows, s.stride, s.width, o) for (s, _), o in zip(extra, outs)] + pad)
    _finish_kernel[(sum(blocks),)](
        r.part, r.rows, r.stride, r.width, key_norm_weight.contiguous(), query.contiguous(), grad_query,
        grad_weight, blocks[0], s1, rows1, stride1, width1, o1, blocks[1] if len(blocks) > 1 else 0,
        s2, rows2, stride2, width2, o2,
        EXTRA=len(extra), BLOCK_P=BLOCK_P, BLOCK_W=BLOCK_W, num_warps=NUM_WARPS,
    )
    return (grad_query, grad_weight, *outs)


def query_and_weight_grads(r: PartialSums, query: Tensor, key_norm_weight: Tensor) -> tuple[Tensor, Tensor]:
    """``finish``'s first two results as torch ops (a sum and two products, no extra sums):
    what ``route``'s backward takes, where the kernel measured no gain (module docstring)."""
    _check_width("query_and_weight_grads", r, query)
    return _torch_products(r, query, key_norm_weight)


def _check_width(where: str, sums: PartialSums, like: Tensor) -> None:
    if sums.width != like.numel():
        raise ValueError(f"param_grads.{where}: partial sums of width {sums.width} for a gradient of "
                         f"{like.numel()} entries")


def _empty(like: Tensor, device: torch.device | None = None) -> Tensor:
    """A new contiguous tensor of ``like``'s shape and dtype (on ``device``, else ``like``'s)."""
    return torch.empty(like.shape, dtype=like.dtype, device=device or like.device)


def _torch_products(r: PartialSums, query: Tensor, key_norm_weight: Tensor) -> tuple[Tensor, Tensor]:
    """``r``'s sum times ``key_norm_weight`` in ``query``'s dtype and shape, and times ``query``
    in ``key_norm_weight``'s: float32 products, each rounded once, one launch each."""
    total = r.total()
    return _product(total, key_norm_weight, query), _product(total, query, key_norm_weight)


def _product(total: Tensor, factor: Tensor, like: Tensor) -> Tensor:
    """``total * factor`` (float32 math) shaped and typed like ``like``. The common case (all
    float32 and contiguous) is one op that allocates its result; otherwise the product is
    written into a tensor of ``like``'s dtype, rounded once."""
    if like.dtype == torch.float32 and factor.dtype == torch.float32 and factor.is_contiguous():
        if like.shape == total.shape and factor.shape == total.shape:  # route's (d,) parameters: no views
            return torch.mul(total, factor)
        return torch.mul(total, factor.view(-1)).view(like.shape)
    out = _empty(like, total.device)
    torch.mul(total, factor.reshape(-1), out=out.view(-1))
    return out
