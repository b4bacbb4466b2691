"""``route_many``'s forward with a program per block of tokens and head (the ``"heads"``
layout of :func:`.route_many_triton.route_many_forward`; off by default, not yet timed).

Why: at 16 heads the default forward (a program per token and query, walking every source)
ran at 4.0-4.4x its floor at grouped full MHAR's calls, no faster than the separate
``route`` calls it replaces (docs/benchmarks.md, session 41): each (token, source, query)
step's 16 head sums, softmax updates and 1,024-column accumulator update set its time, not
the bytes. Here a program holds BLOCK_T tokens of one head and every query of the call, so
its accumulators are (BLOCK_T, queries, C) values, a few registers a thread, and a
source's tile of the head is read once for all queries.

A head's logit needs the key's RMS statistic over the full width d, which no head program
sees whole. A first pass (:func:`_key_rstd_kernel`) stores it per source and token, an
(N, T) float32 table, reading each key row once more: the forward moves 2N + S rows
where the default's floor is N + S. The backward is unchanged (``route_many_backward``
recomputes what it needs from the rows); no statistics table is kept (``route_many`` keeps
one for one head only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .grid import cdiv
from .route_triton import _check_block_t, _next_pow2, _row64, _src_ptr, online_softmax_update

__all__ = ["heads_forward", "HEADS_TOKENS", "HEADS_WARPS", "HEADS_MAX_ELEMS", "RSTD_TOKENS"]

#: tokens a head program holds (at most: fewer where its accumulators would pass
#: HEADS_MAX_ELEMS), and its warps
HEADS_TOKENS = 32
HEADS_WARPS = 4
#: float32 accumulator values a head program holds at most (tokens x padded queries x
#: padded head width). sm_90 code of Triton 3.6 at 16 heads, d = 1024, 4 warps
#: (benchmarks/kernel_registers.py): 8 tokens of 4 queries (2,048 values) 120-125 registers,
#: 4 programs an SM; 16 tokens of 4 or 8 of 8 (4,096) 185-198, 2 an SM; 16 of 8 or 32 of 4
#: (8,192) spill 172-412 bytes
HEADS_MAX_ELEMS = 2048
#: tokens a program of the statistic pass reduces, and its warps
RSTD_TOKENS = 4
RSTD_WARPS = 4


@triton.jit
def _key_rstd_kernel(like_ptr, ktab, rstd_ptr, T, D, eps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """``rstd[i, t] = 1 / sqrt(mean(k_i[t]^2) + eps)`` (float32) for BLOCK_T tokens of key
    ``i = program_id(1)``."""
    ptr_ty = tl.pointer_type(like_ptr.dtype.element_ty)
    i = tl.program_id(1)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    tmask = tok < T
    k = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + tok[:, None] * D + cols[None, :],
                mask=tmask[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    tl.store(rstd_ptr + _row64(tok, i, T), tl.rsqrt(tl.sum(k * k, 1) / D + eps), mask=tmask)


@triton.jit
def _route_many_fwd_heads_kernel(like_ptr, vtab, ktab, otab, ltab, qw_ptr, rstd_ptr, T, N, S, D, C, H,
                                 BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr,
                                 ALIGNED: tl.constexpr, HAS_KEYS: tl.constexpr, LAZY: tl.constexpr):
    """BLOCK_T tokens of head ``h`` for every query: per source, the head's (tokens, C) key
    tile against each query's ``w_s * g_s`` columns of the head, scaled by the key's
    ``rstd``, into the running softmax of each (token, query). The programs of a block of
    tokens are neighbours (``h`` varies fastest), so that a source's rows are read from
    memory about once."""
    ptr_ty = tl.pointer_type(like_ptr.dtype.element_ty)
    f32_ty = tl.pointer_type(tl.float32)
    pid = tl.program_id(0)
    h = pid % H
    tok = (pid // H).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    qq = tl.arange(0, BLOCK_Q)
    cc = tl.arange(0, BLOCK_C)
    tmask = tok < T
    qmask = qq < S
    cmask = cc < C
    col = h * C + cc
    rows = tok[:, None] * D + col[None, :]  # (T, C)
    tile_mask = tmask[:, None] & cmask[None, :]
    qw = tl.load(qw_ptr + qq[:, None] * D + col[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0)
    m = tl.full((BLOCK_T, BLOCK_Q), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_T, BLOCK_Q), tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_Q, BLOCK_C), tl.float32)
    for i in range(N):
        v = tl.load(_src_ptr(vtab, i, ptr_ty, ALIGNED) + rows, mask=tile_mask, other=0.0).to(tl.float32)
        k = v
        if HAS_KEYS:
            k = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + rows, mask=tile_mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + _row64(tok, i, T), mask=tmask, other=0.0)
        z = tl.sum(k[:, None, :] * qw[None, :, :], 2) * rstd[:, None]  # (T, Q)
        m, l, acc = online_softmax_update(z, v[:, None, :], m, l, acc, LAZY)
    out_mask = tmask[:, None, None] & qmask[None, :, None] & cmask[None, None, :]
    out_ptrs = tl.load(otab + qq, mask=qmask, other=0).to(ptr_ty)
    if ALIGNED:  # 16-byte stores along a head's columns
        out_ptrs = tl.multiple_of(out_ptrs, 16)
    tl.store(out_ptrs[None, :, None] + rows[:, None, :], (acc / l[:, :, None]).to(like_ptr.dtype.element_ty),
             mask=out_mask)
    lse_ptrs = tl.load(ltab + qq, mask=qmask, other=0).to(f32_ty)
    tl.store(lse_ptrs[None, :] + (tok * H + h)[:, None], m + tl.log(l), mask=tmask[:, None] & qmask[None, :])


def heads_forward(flat_v: list[Tensor], has_keys: bool, vtab: Tensor, ktab: Tensor, otab: Tensor, ltab: Tensor,
                  qw: Tensor, tokens: int, heads: int, eps: float, aligned: bool, config: dict) -> None:
    """Fill the outputs and log-sum-exps behind ``otab`` and ``ltab`` for a call of
    ``qw.shape[0]`` queries over the sources ``flat_v`` (``route_many_forward``'s tensors
    and tables, ``ktab`` the keys' or the sources'; ``config``'s ``block_t``, ``num_warps``
    and ``lazy_rescale`` over HEADS_TOKENS, HEADS_WARPS and the lazy rescale)."""
    s, d = qw.shape
    n, c = len(flat_v), d // heads
    rstd = torch.empty((n, tokens), dtype=torch.float32, device=flat_v[0].device)
    _key_rstd_kernel[(cdiv(tokens, RSTD_TOKENS), n)](
        flat_v[0], ktab, rstd, tokens, d, float(eps), BLOCK_T=RSTD_TOKENS, BLOCK_D=_next_pow2(d), ALIGNED=aligned,
        num_warps=RSTD_WARPS)
    block_q, block_c = _next_pow2(s), _next_pow2(c)
    block_t = _heads_tokens(config.get("block_t"), block_q * block_c)
    _route_many_fwd_heads_kernel[(cdiv(tokens, block_t) * heads,)](
        flat_v[0], vtab, ktab, otab, ltab, qw, rstd, tokens, n, s, d, c, heads, BLOCK_T=block_t,
        BLOCK_Q=block_q, BLOCK_C=block_c, ALIGNED=aligned, HAS_KEYS=has_keys,
        LAZY=config.get("lazy_rescale", True), num_warps=config.get("num_warps") or HEADS_WARPS)


def _heads_tokens(block_t: int | None, per_token: int) -> int:
    """Tokens a head program holds: ``block_t`` (a config's, checked), else the most up to
    HEADS_TOKENS whose ``per_token`` accumulator values a token fit HEADS_MAX_ELEMS."""
    if block_t is not None:
        block_t = _check_block_t(block_t, "route_many")
        if block_t * per_token > HEADS_MAX_ELEMS:
            raise ValueError(f"route_many (Triton): config block_t={block_t} with layout='heads' holds "
                             f"{block_t * per_token} accumulator values a program (padded queries x head width "
                             f"{per_token} a token); at most {HEADS_MAX_ELEMS}")
        return block_t
    if per_token > HEADS_MAX_ELEMS:
        raise ValueError(f"route_many (Triton): layout='heads' holds the padded queries x head width of a token "
                         f"on chip, {per_token} values here; at most {HEADS_MAX_ELEMS} (fewer queries a call, "
                         "or more heads)")
    block_t = HEADS_TOKENS
    while block_t * per_token > HEADS_MAX_ELEMS:
        block_t //= 2
    return block_t
