"""The split backward of ``depthrewrite::route_many``: the row reductions in one kernel,
the gradient rows in another (one-head calls; ``route_many_triton.route_many_backward``'s
``backward="split"``).

Why: the one-pass kernels of :mod:`route_many_triton` hold a token's rows on chip and form
each source gradient right after that source's row reductions, so a program waits on its
reductions and few tokens are in flight per SM (Nsight Compute, docs/benchmarks.md session
18: latency-bound at 12-15 % occupancy, 3.6-4.3x the HBM floor in the block schemes).
Here the two kinds of work are apart:

- ``_split_stats_kernel`` (tiles of tokens, the row in column chunks): every ``<g_s, v_n>``,
  ``<w_s q_s, k_n>`` and ``sum k_n^2`` at once, accumulated over the chunks, then per source,
  query and token the weight ``a``, ``dz * rstd`` and per source and token the key norm's
  term ``rstd^2 sum_s dz_s z_s / d``, stored in small fp32 tables (``(N, S, T)``: 200 bytes a
  token at N = 4, S = 6, against 2 KiB a row at d = 1024). It reads the output gradients
  and the sources once; it never reads the saved outputs: ``sum_j a_j <v_j, g>`` comes
  from the same terms as the gradient (over ``sum_j a_j``), so it is the exact softmax
  gradient that ``exact_softmax_grad`` asks of the other kernels, at no extra cost.
- ``_split_grads_kernel`` (a column block over a range of tokens per program): per source
  ``d v = sum_s a_s g_s`` and ``d k = sum_s (dz_s rstd) w_s q_s - k * term``: no reduction
  across a row, a stream of loads and stores; the parameter gradient ``r = sum_{t, n}
  (dz rstd) k`` is summed on the way per program and the programs' sums are added in a
  fixed order (deterministic, no atomics).

Bytes: the output gradients are read twice (S rows each), the keys twice and the values
once more with separate keys; without keys 2S + 3N rows against the one-pass kernel's
2S + 2N (it reads the saved outputs), with keys 2S + 5N against the tiled kernel's and its
parameter reduction's 2S + 5N.

Limits (checked by the caller with a clear error): one head, at most SPLIT_MAX_SOURCES
sources and SPLIT_MAX_QUERIES queries (the stats kernel holds an ``(N, S, tokens)``
accumulator per program).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pointer_tables import pointer_tables
from .route_triton import (
    _aligned, _backward_programs, _load_source, _next_pow2, _normalized_sum, _positive_int, _src_ptr, _table_ptrs,
)

__all__ = ["split_backward", "SPLIT_MAX_SOURCES", "SPLIT_MAX_QUERIES"]

#: the most sources and queries of a call the split backward takes (its stats kernel keeps
#: two ``(N, S, tokens)`` fp32 accumulators per program, padded to powers of two)
SPLIT_MAX_SOURCES = 32
SPLIT_MAX_QUERIES = 16
#: the stats kernel: fp32 elements of one accumulator, most tokens per program, fp32
#: elements of its (queries, tokens, columns) tile of output gradients
STATS_ACC_ELEMS = 2048
STATS_MAX_TOKENS = 16
STATS_TILE_ELEMS = 4096
#: the gradient kernel: tokens per tile, fp32 elements of its (queries, tokens, columns)
#: tiles, programs per SM
GRADS_TOKENS = 8
GRADS_TILE_ELEMS = 4096
GRADS_PER_SM = 4
#: the stats kernel: "select" (the sums of every source at once, a select into its slot
#: per chunk) or "per_source" (one source at a time, the sums reduced once per source)
STATS_KERNEL = "select"
STATS_KERNELS = ("select", "per_source")
#: the gradient kernel: "sum" (three-dimensional tiles, sums over the queries) or "dot"
#: (two-dimensional tiles, the key and parameter terms through tl.dot: DOT_TOKENS tokens by
#: DOT_COLUMNS columns, fp32 products as three tf32 ones)
GRADS_KERNEL = "sum"
GRADS_KERNELS = ("sum", "dot")
DOT_TOKENS = 16
DOT_COLUMNS = 64
DOT_PRECISION = "tf32x3"
#: warps of both kernels
SPLIT_WARPS = 4


@triton.jit
def _split_stats_kernel(
    like_ptr, gtab, ltab, gltab, vtab, ktab, qw_ptr, a_ptr, coef_ptr, kterm_ptr, T, N, S, D, eps,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    ALIGNED: tl.constexpr, HAS_KEYS: tl.constexpr, ONE_SOURCE: tl.constexpr,
):
    """Per source ``n``, query ``s`` and token ``t`` of a tile of BLOCK_T tokens: the weight
    ``a`` and ``dz * rstd`` into ``(N, S, T)`` tables, and per source and token the key
    norm's term ``rstd^2 * sum_s dz_s z_s / D`` into an ``(N, T)`` table."""
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = tok < T
    ss = tl.arange(0, BLOCK_S)
    smask = ss < S
    nn = tl.arange(0, BLOCK_N)
    g_ptrs = _table_ptrs(gtab, ss, smask, ptr_ty, ALIGNED)
    dots = tl.zeros((BLOCK_N, BLOCK_S, BLOCK_T), tl.float32)  # <g_s, v_n>
    keyq = tl.zeros((BLOCK_N, BLOCK_S, BLOCK_T), tl.float32)  # <w_s q_s, k_n>
    squares = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)  # sum_c k_n^2
    for c0 in range(0, D, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        cmask = cc < D
        offs = tok[:, None] * D + cc[None, :]
        mask = tmask[:, None] & cmask[None, :]
        g = tl.load(g_ptrs[:, None, None] + offs[None, :, :], mask=smask[:, None, None] & mask[None, :, :],
                    other=0.0).to(tl.float32)
        qw = tl.load(qw_ptr + ss[:, None] * D + cc[None, :], mask=smask[:, None] & cmask[None, :], other=0.0)
        for i in range(N):
            v_raw, k_raw = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
            v = v_raw.to(tl.float32)
            k = v
            if HAS_KEYS:
                k = k_raw.to(tl.float32)
            # the chunk's sums go to source i's slot (the accumulators cannot be indexed by a
            # runtime index: a select over the few sources instead)
            here = (nn == i)[:, None, None]
            dots += tl.where(here, tl.sum(g * v[None, :, :], 2)[None, :, :], 0.0)
            keyq += tl.where(here, tl.sum(qw[:, None, :] * k[None, :, :], 2)[None, :, :], 0.0)
            squares += tl.where((nn == i)[:, None], tl.sum(k * k, 1)[None, :], 0.0)

    st = smask[:, None] & tmask[None, :]
    live = (nn < N)[:, None, None] & st[None, :, :]
    rstd = tl.rsqrt(squares / D + eps)
    z = keyq * rstd[:, None, :]
    g_lse = tl.load(_table_ptrs(gltab, ss, smask, f32_ty)[:, None] + tok[None, :], mask=st, other=0.0)
    if ONE_SOURCE:
        # weight exactly 1 and out = v: dz is d lse exactly (as in the one-pass kernels)
        a = tl.where(live, 1.0, 0.0)
        dz = tl.where(live, g_lse[None, :, :], 0.0)
    else:
        lse = tl.load(_table_ptrs(ltab, ss, smask, f32_ty)[:, None] + tok[None, :], mask=st, other=0.0)
        a = tl.where(live, tl.exp(z - lse[None, :, :]), 0.0)
        # sum_j a_j <v_j, g> over sum_j a_j, from the terms of the gradient; d lse / d z_j = a_j joins it
        s_ada = _normalized_sum(tl.sum(a * dots, 0), tl.sum(a, 0), st) - g_lse
        dz = a * (dots - s_ada[None, :, :])
    kterm = rstd * rstd * tl.sum(dz * z, 1) / D
    rows = (nn[:, None, None].to(tl.int64) * S + ss[None, :, None]) * T + tok[None, None, :]
    tl.store(a_ptr + rows, a, mask=live)
    tl.store(coef_ptr + rows, dz * rstd[:, None, :], mask=live)
    tl.store(kterm_ptr + nn[:, None].to(tl.int64) * T + tok[None, :], kterm, mask=(nn < N)[:, None] & tmask[None, :])


@triton.jit
def _split_stats_per_source_kernel(
    like_ptr, gtab, ltab, gltab, vtab, ktab, qw_ptr, a_ptr, coef_ptr, kterm_ptr, T, N, S, D, eps,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    ALIGNED: tl.constexpr, HAS_KEYS: tl.constexpr, ONE_SOURCE: tl.constexpr,
):
    """``_split_stats_kernel`` one source at a time: per source the chunks' products are
    summed elementwise and reduced across the row once, into this program's slots of the
    output tables (used as scratch: ``a`` takes ``<g_s, v_n>``, ``coef`` ``<w_s q_s, k_n>``,
    ``kterm`` ``sum k_n^2``), read back after the last source. The output-gradient tiles
    come from cache after the first source (BLOCK_T tokens of S rows: a few tens of KiB)."""
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = tok < T
    ss = tl.arange(0, BLOCK_S)
    smask = ss < S
    nn = tl.arange(0, BLOCK_N)
    st = smask[:, None] & tmask[None, :]
    g_ptrs = _table_ptrs(gtab, ss, smask, ptr_ty, ALIGNED)
    for i in range(N):
        dots = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C), tl.float32)
        keyq = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C), tl.float32)
        squares = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for c0 in range(0, D, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            cmask = cc < D
            offs = tok[:, None] * D + cc[None, :]
            mask = tmask[:, None] & cmask[None, :]
            g = tl.load(g_ptrs[:, None, None] + offs[None, :, :], mask=smask[:, None, None] & mask[None, :, :],
                        other=0.0).to(tl.float32)
            qw = tl.load(qw_ptr + ss[:, None] * D + cc[None, :], mask=smask[:, None] & cmask[None, :], other=0.0)
            v_raw, k_raw = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
            v = v_raw.to(tl.float32)
            k = v
            if HAS_KEYS:
                k = k_raw.to(tl.float32)
            dots += g * v[None, :, :]
            keyq += qw[:, None, :] * k[None, :, :]
            squares += k * k
        rows = ((tl.full((), 0, tl.int64) + i) * S + ss[:, None]) * T + tok[None, :]
        tl.store(a_ptr + rows, tl.sum(dots, 2), mask=st)
        tl.store(coef_ptr + rows, tl.sum(keyq, 2), mask=st)
        tl.store(kterm_ptr + (tl.full((), 0, tl.int64) + i) * T + tok, tl.sum(squares, 1), mask=tmask)
    tl.debug_barrier()  # other threads of the program read these sums back

    live = (nn < N)[:, None, None] & st[None, :, :]
    rows = (nn[:, None, None].to(tl.int64) * S + ss[None, :, None]) * T + tok[None, None, :]
    dots = tl.load(a_ptr + rows, mask=live, other=0.0)
    keyq = tl.load(coef_ptr + rows, mask=live, other=0.0)
    kmask = (nn < N)[:, None] & tmask[None, :]
    squares = tl.load(kterm_ptr + nn[:, None].to(tl.int64) * T + tok[None, :], mask=kmask, other=0.0)
    tl.debug_barrier()  # every thread has read its sums before any slot is overwritten
    rstd = tl.rsqrt(squares / D + eps)
    z = keyq * rstd[:, None, :]
    g_lse = tl.load(_table_ptrs(gltab, ss, smask, f32_ty)[:, None] + tok[None, :], mask=st, other=0.0)
    if ONE_SOURCE:
        a = tl.where(live, 1.0, 0.0)
        dz = tl.where(live, g_lse[None, :, :], 0.0)
    else:
        lse = tl.load(_table_ptrs(ltab, ss, smask, f32_ty)[:, None] + tok[None, :], mask=st, other=0.0)
        a = tl.where(live, tl.exp(z - lse[None, :, :]), 0.0)
        s_ada = _normalized_sum(tl.sum(a * dots, 0), tl.sum(a, 0), st) - g_lse
        dz = a * (dots - s_ada[None, :, :])
    tl.store(a_ptr + rows, a, mask=live)
    tl.store(coef_ptr + rows, dz * rstd[:, None, :], mask=live)
    tl.store(kterm_ptr + nn[:, None].to(tl.int64) * T + tok[None, :], rstd * rstd * tl.sum(dz * z, 1) / D,
             mask=kmask)


@triton.jit
def _split_grads_kernel(
    like_ptr, gtab, ktab, gvtab, gktab, qw_ptr, a_ptr, coef_ptr, kterm_ptr, part_ptr, T, N, S, D,
    tokens_per_program,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_KEYS: tl.constexpr, STAGES: tl.constexpr = 0,
):
    """One block of columns over one range of tokens: each source's value and key
    gradients (their sum without keys) from the stats tables, and this range's part of
    ``r[s, col] = sum over tokens and sources of (dz rstd) k`` into ``part_ptr``. With
    STAGES >= 2 the sources' loads go through Triton's software pipeline."""
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    cc = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cc < D
    split = tl.program_id(1)
    t_start = split.to(tl.int64) * tokens_per_program
    t_end = tl.minimum(t_start + tokens_per_program, T)
    ss = tl.arange(0, BLOCK_S)
    smask = ss < S
    g_ptrs = _table_ptrs(gtab, ss, smask, ptr_ty, ALIGNED)
    qw = tl.load(qw_ptr + ss[:, None] * D + cc[None, :], mask=smask[:, None] & cmask[None, :], other=0.0)
    r = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C), tl.float32)
    for t0 in range(t_start, t_end, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tmask = tok < t_end
        offs = tok[:, None] * D + cc[None, :]
        mask = tmask[:, None] & cmask[None, :]
        st = smask[:, None] & tmask[None, :]
        g = tl.load(g_ptrs[:, None, None] + offs[None, :, :], mask=smask[:, None, None] & mask[None, :, :],
                    other=0.0).to(tl.float32)
        if STAGES >= 2:
            for i in tl.range(0, N, num_stages=STAGES):
                r = _split_source_grads(r, g, qw, i, tok, tmask, st, offs, mask, ss, ktab, gvtab, gktab, a_ptr,
                                        coef_ptr, kterm_ptr, T, S, ptr_ty, ALIGNED, HAS_KEYS)
        else:
            for i in range(N):
                r = _split_source_grads(r, g, qw, i, tok, tmask, st, offs, mask, ss, ktab, gvtab, gktab, a_ptr,
                                        coef_ptr, kterm_ptr, T, S, ptr_ty, ALIGNED, HAS_KEYS)
    out = part_ptr + split.to(tl.int64) * S * D
    tl.store(out + ss[:, None] * D + cc[None, :], tl.sum(r, 1), mask=smask[:, None] & cmask[None, :])


@triton.jit
def _split_source_grads(r, g, qw, i, tok, tmask, st, offs, mask, ss, ktab, gvtab, gktab, a_ptr, coef_ptr, kterm_ptr,
                        T, S, ptr_ty, ALIGNED: tl.constexpr, HAS_KEYS: tl.constexpr):
    """Source ``i``'s gradient rows of a tile stored; ``r`` plus its parameter terms."""
    rows = ((tl.full((), 0, tl.int64) + i) * S + ss[:, None]) * T + tok[None, :]
    a = tl.load(a_ptr + rows, mask=st, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=st, other=0.0)
    kterm = tl.load(kterm_ptr + (tl.full((), 0, tl.int64) + i) * T + tok, mask=tmask, other=0.0)
    k = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
    d_value = tl.sum(a[:, :, None] * g, 0)
    d_key = tl.sum(coef[:, :, None] * qw[:, None, :], 0) - k * kterm[:, None]
    if HAS_KEYS:
        tl.store(_src_ptr(gvtab, i, ptr_ty, ALIGNED) + offs, d_value.to(ptr_ty.element_ty), mask=mask)
        tl.store(_src_ptr(gktab, i, ptr_ty, ALIGNED) + offs, d_key.to(ptr_ty.element_ty), mask=mask)
    else:
        tl.store(_src_ptr(gvtab, i, ptr_ty, ALIGNED) + offs, (d_value + d_key).to(ptr_ty.element_ty), mask=mask)
    return r + coef[:, :, None] * k[None, :, :]


@triton.jit
def _split_grads_dot_kernel(
    like_ptr, gtab, ktab, gvtab, gktab, qw_ptr, a_ptr, coef_ptr, kterm_ptr, part_ptr, T, N, S, D,
    tokens_per_program,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_KEYS: tl.constexpr, PRECISION: tl.constexpr,
):
    """``_split_grads_kernel`` in two-dimensional tiles: the key gradient's ``sum_s (dz_s
    rstd) w_s q_s`` and the parameter terms as ``tl.dot`` over the queries and over the
    tokens (tensor cores, PRECISION: fp32 through three tf32 products), the value gradient
    one query at a time (each output-gradient tile from cache after the first source)."""
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    cc = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cc < D
    split = tl.program_id(1)
    t_start = split.to(tl.int64) * tokens_per_program
    t_end = tl.minimum(t_start + tokens_per_program, T)
    ss = tl.arange(0, BLOCK_S)
    smask = ss < S
    qw = tl.load(qw_ptr + ss[:, None] * D + cc[None, :], mask=smask[:, None] & cmask[None, :], other=0.0)
    r = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    for t0 in range(t_start, t_end, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tmask = tok < t_end
        offs = tok[:, None] * D + cc[None, :]
        mask = tmask[:, None] & cmask[None, :]
        for i in range(N):
            i64 = tl.full((), 0, tl.int64) + i
            k = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
            coef = tl.load(coef_ptr + (i64 * S + ss[None, :]) * T + tok[:, None], mask=tmask[:, None] & smask[None, :],
                           other=0.0)  # (tokens, queries)
            kterm = tl.load(kterm_ptr + i64 * T + tok, mask=tmask, other=0.0)
            d_key = tl.dot(coef, qw, input_precision=PRECISION) - k * kterm[:, None]
            r += tl.dot(tl.trans(coef), k, input_precision=PRECISION)
            d_value = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
            for s in range(S):
                g = tl.load(_src_ptr(gtab, s, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + (i64 * S + s) * T + tok, mask=tmask, other=0.0)
                d_value += a[:, None] * g
            if HAS_KEYS:
                tl.store(_src_ptr(gvtab, i, ptr_ty, ALIGNED) + offs, d_value.to(act), mask=mask)
                tl.store(_src_ptr(gktab, i, ptr_ty, ALIGNED) + offs, d_key.to(act), mask=mask)
            else:
                tl.store(_src_ptr(gvtab, i, ptr_ty, ALIGNED) + offs, (d_value + d_key).to(act), mask=mask)
    out = part_ptr + split.to(tl.int64) * S * D
    tl.store(out + ss[:, None] * D + cc[None, :], r, mask=smask[:, None] & cmask[None, :])


# ------------------------------------------------------------------------ launcher


def split_backward(g: Sequence[Tensor], gl: Sequence[Tensor], ls: Sequence[Tensor], flat_v: Sequence[Tensor],
                   flat_k: Sequence[Tensor], qw: Tensor, eps: float, cfg: dict
                   ) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Value gradients, key gradients (empty without keys) and ``r`` (fp32 (S, d), the
    gradient of ``w_s * q_s``) of a one-head call; ``qw``: the fp32 ``(S, d)`` rows ``w_s *
    q_s``. ``cfg``: the backward's launch config (``split_t``: the stats kernel's tokens per
    program, ``num_warps``, ``split_per_sm``: the gradient kernel's programs per SM,
    ``stages``: its sources' software pipeline, checked by the caller)."""
    s, d = qw.shape
    tokens, device, n = flat_v[0].numel() // d, flat_v[0].device, len(flat_v)
    grad_v = [torch.empty_like(flat_v[0]) for _ in flat_v]
    grad_k = [torch.empty_like(flat_v[0]) for _ in flat_k]
    if tokens == 0:
        return grad_v, grad_k, torch.zeros((s, d), dtype=torch.float32, device=device)
    block_s, block_n = _next_pow2(s), _next_pow2(n)
    stats_t = _stats_tokens(block_n, block_s, cfg.get("split_t"))
    a = torch.empty((n, s, tokens), dtype=torch.float32, device=device)
    coef = torch.empty((n, s, tokens), dtype=torch.float32, device=device)
    kterm = torch.empty((n, tokens), dtype=torch.float32, device=device)
    gtab, ltab, gltab, vtab, gvtab, ktab, gktab = pointer_tables(device, g, ls, gl, flat_v, grad_v, flat_k, grad_k)
    if not flat_k:  # the keys are the values (empty tables are never read)
        ktab, gktab = vtab, gvtab
    aligned = _aligned(flat_v, grad_v, flat_k, grad_k, g)
    warps = cfg.get("num_warps") or SPLIT_WARPS
    stats = _checked(cfg, "split_stats", STATS_KERNEL, STATS_KERNELS)
    stats_kernel = _split_stats_kernel if stats == "select" else _split_stats_per_source_kernel
    stats_kernel[(triton.cdiv(tokens, stats_t),)](
        flat_v[0], gtab, ltab, gltab, vtab, ktab, qw, a, coef, kterm, tokens, n, s, d, float(eps),
        BLOCK_T=stats_t, BLOCK_S=block_s, BLOCK_N=block_n,
        BLOCK_C=_columns(d, STATS_TILE_ELEMS // (block_s * stats_t)), ALIGNED=aligned, HAS_KEYS=bool(flat_k),
        ONE_SOURCE=n == 1, num_warps=warps)
    dot = _checked(cfg, "split_grads", GRADS_KERNEL, GRADS_KERNELS) == "dot"
    block_t = (cfg.get("split_grads_t") or DOT_TOKENS) if dot else GRADS_TOKENS
    block_c = _columns(d, (cfg.get("split_grads_c") or DOT_COLUMNS) if dot else
                       GRADS_TILE_ELEMS // (block_s * block_t))
    col_blocks = triton.cdiv(d, block_c)
    per_sm = cfg.get("split_per_sm")
    per_sm = GRADS_PER_SM if per_sm is None else _positive_int("route_many", "split_per_sm", per_sm)
    tiles = triton.cdiv(tokens, block_t)
    splits = max(1, _backward_programs(device, tiles * col_blocks, per_sm) // col_blocks)
    per_program = triton.cdiv(triton.cdiv(tokens, splits), block_t) * block_t
    splits = triton.cdiv(tokens, per_program)
    part = torch.empty((splits, s, d), dtype=torch.float32, device=device)
    args = (flat_v[0], gtab, ktab, gvtab, gktab, qw, a, coef, kterm, part, tokens, n, s, d, per_program)
    if dot:  # tl.dot takes at least 16 rows a side
        _split_grads_dot_kernel[(col_blocks, splits)](
            *args, BLOCK_T=block_t, BLOCK_S=max(16, block_s), BLOCK_C=block_c, ALIGNED=aligned,
            HAS_KEYS=bool(flat_k), PRECISION=DOT_PRECISION, num_warps=warps,
            **({"num_stages": cfg["split_grads_stages"]} if cfg.get("split_grads_stages") else {}))
    else:
        _split_grads_kernel[(col_blocks, splits)](
            *args, BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_C=block_c, ALIGNED=aligned, HAS_KEYS=bool(flat_k),
            STAGES=cfg.get("stages") or 0, num_warps=warps)
    return grad_v, grad_k, part.sum(0)  # fixed order: deterministic


def _checked(cfg: dict, name: str, default: str, choices: tuple) -> str:
    """The launch config's entry ``name`` (unset: ``default``), if it is one of ``choices``."""
    choice = cfg.get(name) or default
    if choice not in choices:
        raise ValueError(f"route_many (Triton): config {name} must be one of {choices}; found {choice!r}")
    return choice


def _stats_tokens(block_n: int, block_s: int, requested) -> int:
    """The stats kernel's tokens per program: ``requested`` (the config's ``split_t``: a power
    of two), else as many as keep each accumulator within STATS_ACC_ELEMS, at most STATS_MAX_TOKENS."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1 or requested & (requested - 1):
            raise ValueError(f"route_many (Triton): config split_t must be a power of two; found {requested!r}")
        return requested
    return max(1, min(STATS_MAX_TOKENS, STATS_ACC_ELEMS // (block_n * block_s)))


def _columns(d: int, budget: int) -> int:
    """Columns of a tile: a power of two within ``budget`` elements (at least 16) and no
    wider than the padded row."""
    return max(16, min(_next_pow2(d), 1 << (max(1, budget).bit_length() - 1)))


def split_supported(heads: int, sources: int, queries: int) -> str | None:
    """None if the split backward takes a call of this shape, else why not."""
    if heads != 1:
        return f"it takes one head; found heads={heads}"
    if sources > SPLIT_MAX_SOURCES:
        return f"it takes at most {SPLIT_MAX_SOURCES} sources; found {sources}"
    if queries > SPLIT_MAX_QUERIES:
        return f"it takes at most {SPLIT_MAX_QUERIES} queries; found {queries}"
    return None
