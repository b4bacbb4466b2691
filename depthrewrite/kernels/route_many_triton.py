"""Fused Triton kernels for ``depthrewrite::route_many`` and its backward.

Same math as :mod:`depthrewrite.ops.route_many`: S queries route over the same N sources.
The point is the bytes: each source row is read ONCE for all S queries (the per-site
``route`` reads it once per site), and in the backward each source gradient is written once
with the contributions of all S queries summed on chip (autograd would otherwise add S
gradients one at a time).

Forward: one program per token holds a ``(Q, H, C)`` fp32 accumulator for Q queries at a
time (an online softmax per query and head, as the ``route`` kernel), and writes each
query's output row and its log-sum-exp. Backward: a persistent grid (fixed token order per
program, so every rounding is fixed: deterministic, no atomics); per token it loads the Q
output gradients, the saved outputs, their log-sum-exps and the log-sum-exp gradients, forms
``<g_s, out_s> - d lse_s`` per query and head, then walks the sources once: recomputes the
key statistic and the Q logits, and writes ``sum_s a_s g_s + d key``. The parameter
gradients go per program into a ``(programs, Q, d)`` fp32 buffer summed in a fixed order.

Q queries per launch (measured choices: ``FORWARD_QUERIES`` and the constants below it), at
most ``MANY_ELEMS / row``; the S queries are taken in chunks of Q, each chunk reading the
sources again and (backward) adding into an fp32 partial gradient that the earlier chunks
wrote, one launch after another (still deterministic; the gradient is rounded to the
activation dtype once, by the last chunk). The register footprint of the ``(Q, H, C)`` tiles is
what limits Q: the forward is fastest with 2 queries at a time, so it reads each source
S / 2 times (still S / 2 times fewer than one route per site).

Outputs and their gradients are separate tensors (the op returns lists): the kernels reach
them through int64 pointer tables, as they reach the sources; all tables of a call go up in
one host-to-device copy.

Speed, measured (H200, docs/benchmarks.md): forward + backward at 4.2-5.1x the memory floor
with one head and 7-9x with 16 heads: the ``(Q, H, C)`` tiles push the backward to 255
registers (it spills with 16 heads), so few programs run per SM and each walks its tokens
one at a time through dependent row reductions. Block AttnRes with them trains slightly
faster than with one ``route`` per site (91.7 vs 93.4 ms a step at 350M), far from what the
bytes allow: the next thing to rework.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .route_triton import (
    _aligned, _backward_programs, _check_saved, _check_supported, _flat, _load_source, _next_pow2, _pointer_tables, _row_blocks,
    _src_ptr,
)

__all__ = ["route_many_forward", "route_many_backward", "MANY_ELEMS"]

#: the most fp32 elements of one ``(Q, H, C)`` array a program keeps on chip (Q queries
#: of a padded row); more queries are taken in chunks
MANY_ELEMS = 8192
#: Launch choices, measured on H200 (bf16, 16384 tokens, S = 6 queries; d = 1024 with N = 4
#: and 8 sources, heads 1 and 16; d = 2048, N = 4; ms in docs/benchmarks.md). Forward: 2
#: queries per launch at every shape (the sources are read S / 2 times, but the (Q, H, C)
#: accumulator stays small: 0.29 ms vs 0.40 with all 6 queries at d = 1024, N = 4). Backward,
#: one head: as many queries as MANY_ELEMS allows (0.73 ms vs 1.19 with 2); 16 heads: 2
#: queries and 8 warps (1.27 ms vs 3.83 with all 6: the per-head statistics spill
#: registers). 4 warps otherwise (the per-source reductions cross fewer warps).
FORWARD_QUERIES = 2
MULTI_HEAD_BACKWARD_QUERIES = 2
NUM_WARPS = 4
MULTI_HEAD_BACKWARD_WARPS = 8


@triton.jit
def _table_ptrs(tab, q, qmask, ptr_ty):
    """Entries ``q`` (a vector of query indices) of a pointer table as typed pointers."""
    return tl.load(tab + q, mask=qmask, other=0).to(ptr_ty)


@triton.jit
def _more_sources(hh, i, N, cmask):
    """Load mask of the source prefetched while source ``i`` is used (off past the last)."""
    return cmask & ((tl.zeros_like(hh) + i + 1) < N)[:, None]  # a tensor also in the interpreter


@triton.jit
def _query_tiles(qw_ptr, D, C, H, S_CHUNK, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """Index vectors, masks and the ``(Q, H, C)`` fp32 tile of ``w_s * g_s`` for a chunk of
    queries: query ``qq``, head ``hh``, column ``col`` (H, C) of a row, and the masks of
    real columns, queries, (query, column) and (query, head)."""
    qq = tl.arange(0, BLOCK_Q)
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    col = hh[:, None] * C + cc[None, :]
    cmask = (hh[:, None] < H) & (cc[None, :] < C)
    qmask = qq < S_CHUNK
    qmask3 = qmask[:, None, None] & cmask[None, :, :]
    hq = qmask[:, None] & (hh[None, :] < H)
    qw = tl.load(qw_ptr + qq[:, None, None] * D + col[None, :, :], mask=qmask3, other=0.0)
    return qq, hh, col, cmask, qmask, qmask3, hq, qw


@triton.jit
def _route_many_fwd_kernel(
    like_ptr, vtab, otab, ltab, qw_ptr, N, D, C, H, S_CHUNK, eps,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # one token per program; int64: tok * D overflows int32
    act = like_ptr.dtype.element_ty  # the activation dtype: sources and outputs
    ptr_ty = tl.pointer_type(act)
    qq, hh, col, cmask, qmask, qmask3, hq, qw = _query_tiles(qw_ptr, D, C, H, S_CHUNK, BLOCK_Q, BLOCK_H, BLOCK_C)
    offs = tok * D + col

    m = tl.full((BLOCK_Q, BLOCK_H), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_Q, BLOCK_H), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_H, BLOCK_C), tl.float32)
    # PREFETCH: source i + 1 is requested before source i is used (two rows in flight)
    if PREFETCH:
        v_raw, _k = _load_source(vtab, vtab, 0, offs, cmask, ptr_ty, ALIGNED, False)
    for i in range(N):
        if not PREFETCH:
            v_raw, _k = _load_source(vtab, vtab, i, offs, cmask, ptr_ty, ALIGNED, False)
        v = v_raw.to(tl.float32)
        if PREFETCH:
            v_raw, _k = _load_source(vtab, vtab, tl.minimum(i + 1, N - 1), offs, _more_sources(hh, i, N, cmask),
                                     ptr_ty, ALIGNED, False)
        rstd = tl.rsqrt(tl.sum(tl.sum(v * v, 1), 0) / D + eps)
        z = tl.sum(v[None, :, :] * qw, 2) * rstd
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, :, None] + p[:, :, None] * v[None, :, :]
        m = m_new
    acc = acc / l[:, :, None]
    lse = m + tl.log(l)
    out_ptrs = _table_ptrs(otab, qq, qmask, ptr_ty)
    tl.store(out_ptrs[:, None, None] + offs[None, :, :], acc.to(act), mask=qmask3)
    lse_ptrs = _table_ptrs(ltab, qq, qmask, tl.pointer_type(tl.float32))
    tl.store(lse_ptrs[:, None] + (tok * H + hh)[None, :], lse, mask=hq)


@triton.jit
def _route_many_bwd_kernel(
    like_ptr, gtab, otab, ltab, gltab, vtab, gvtab, acctab, qw_ptr, part_ptr, T, N, D, C, H, S_CHUNK, eps,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr, ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr, ONE_SOURCE: tl.constexpr,
):
    pid = tl.program_id(0)
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    qq, hh, col, cmask, qmask, qmask3, hq, qw = _query_tiles(qw_ptr, D, C, H, S_CHUNK, BLOCK_Q, BLOCK_H, BLOCK_C)
    g_ptrs = _table_ptrs(gtab, qq, qmask, ptr_ty)
    o_ptrs = _table_ptrs(otab, qq, qmask, ptr_ty)
    l_ptrs = _table_ptrs(ltab, qq, qmask, f32_ty)
    gl_ptrs = _table_ptrs(gltab, qq, qmask, f32_ty)
    r_acc = tl.zeros((BLOCK_Q, BLOCK_H, BLOCK_C), tl.float32)  # sum over tokens, sources of dz * norm

    for t in range(pid, T, tl.num_programs(0)):
        tok = tl.full((), 0, tl.int64) + t  # int64 (t may be a Python int in the interpreter)
        offs = tok * D + col
        hoffs = (tok * H + hh)[None, :]
        g = tl.load(g_ptrs[:, None, None] + offs[None, :, :], mask=qmask3, other=0.0).to(tl.float32)
        g_lse = tl.load(gl_ptrs[:, None] + hoffs, mask=hq, other=0.0)
        if not ONE_SOURCE:
            o = tl.load(o_ptrs[:, None, None] + offs[None, :, :], mask=qmask3, other=0.0).to(tl.float32)
            lse = tl.load(l_ptrs[:, None] + hoffs, mask=hq, other=0.0)
            # sum_j a_j <v_j, g> = <out, g> per query and head; d lse / d z_j = a_j joins it
            s_ada = tl.sum(g * o, 2) - g_lse
        if PREFETCH:
            v_nx, _k = _load_source(vtab, vtab, 0, offs, cmask, ptr_ty, ALIGNED, False)
        for i in range(N):
            if PREFETCH:
                v = v_nx.to(tl.float32)
                v_nx, _k = _load_source(vtab, vtab, tl.minimum(i + 1, N - 1), offs, _more_sources(hh, i, N, cmask),
                                        ptr_ty, ALIGNED, False)
            else:
                v_raw, _k = _load_source(vtab, vtab, i, offs, cmask, ptr_ty, ALIGNED, False)
                v = v_raw.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(tl.sum(v * v, 1), 0) / D + eps)
            zr = tl.sum(v[None, :, :] * qw, 2) * rstd
            if ONE_SOURCE:
                # weight exactly 1 and out = v: dz = a (<v, g> - <out, g> + d lse) is d lse
                # exactly (computed, the two sums would leave rounding noise where 0 is exact)
                a = tl.where(hq, 1.0, 0.0)
                dz = g_lse
            else:
                a = tl.where(hq, tl.exp(zr - lse), 0.0)
                da = tl.sum(v[None, :, :] * g, 2)
                dz = a * (da - s_ada)
            mt = tl.sum(tl.sum(dz * zr, 1), 0) / D  # mean_c(d_norm * norm), all queries
            norm = v * rstd
            r_acc += dz[:, :, None] * norm[None, :, :]
            d_key = rstd * (tl.sum(dz[:, :, None] * qw, 0) - norm * mt)
            d_src = tl.sum(a[:, :, None] * g, 0) + d_key
            # chunks of queries: the earlier chunks' part of this gradient is kept in fp32
            # (ACC_IN / ACC_OUT), so that it is rounded to the activation dtype only once
            if ACC_IN:
                d_src += tl.load(_src_ptr(acctab, i, f32_ty, ALIGNED) + offs, mask=cmask, other=0.0)
            if ACC_OUT:
                tl.store(_src_ptr(acctab, i, f32_ty, ALIGNED) + offs, d_src, mask=cmask)
            else:
                tl.store(_src_ptr(gvtab, i, ptr_ty, ALIGNED) + offs, d_src.to(act), mask=cmask)

    part = part_ptr + pid.to(tl.int64) * BLOCK_Q * D
    tl.store(part + qq[:, None, None] * D + col[None, :, :], r_acc, mask=qmask3)


# ------------------------------------------------------------------------ launchers


def _query_block(s: int, row: int, config: dict, preferred: int | None) -> int:
    """Queries per launch: ``config["block_q"]``, else ``preferred``, else all S (padded to a
    power of two), never more than fit the on-chip budget ``many_elems``."""
    fit = max(1, config.get("many_elems", MANY_ELEMS) // row)
    fit = 1 << (fit.bit_length() - 1)  # round down to a power of two
    want = config.get("block_q") or preferred or _next_pow2(s)
    return min(_next_pow2(s), _next_pow2(want), fit)


def _per_query_rows(queries: Tensor, key_norm_weights: Tensor) -> Tensor:
    # the logit needs only w_s * g_s (fp32): one (S, d) table instead of two
    return (queries.to(torch.float32) * key_norm_weights.to(torch.float32)).contiguous()


def route_many_forward(values: Sequence[Tensor], queries: Tensor, key_norm_weights: Tensor, heads: int, eps: float,
                       config: dict | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """Fused forward; inputs as checked by ``depthrewrite.ops.route_many``. Returns what
    ``depthrewrite::route_many`` returns: S outputs and S float32 log-sum-exps. ``config``
    overrides the launch choices (``block_q``, ``many_elems``, ``num_warps``, ``prefetch``)."""
    _check_supported(values, None, ("queries", queries), ("key_norm_weights", key_norm_weights))
    cfg = {"prefetch": True, **(config or {})}
    s, d = queries.shape[0], values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads)
    flat_v = _flat(values, d)
    tokens = flat_v[0].shape[0]
    out = [torch.empty_like(flat_v[0]) for _ in range(s)]
    lse = [torch.empty((tokens, heads), dtype=torch.float32, device=flat_v[0].device) for _ in range(s)]
    if tokens > 0:
        qw = _per_query_rows(queries, key_norm_weights)
        vtab, otab, ltab = _pointer_tables(flat_v[0].device, flat_v, out, lse)
        block_q = _query_block(s, block_h * block_c, cfg, FORWARD_QUERIES)
        for q0 in range(0, s, block_q):
            chunk = min(block_q, s - q0)
            _route_many_fwd_kernel[(tokens,)](
                flat_v[0], vtab, otab[q0:], ltab[q0:], qw[q0:], len(values), d, d // heads, heads, chunk, float(eps),
                BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=cfg["prefetch"],
                ALIGNED=_aligned(flat_v, out), num_warps=cfg.get("num_warps") or NUM_WARPS,
            )
    shape, lse_shape = values[0].shape, values[0].shape[:-1] + (heads,)
    return [o.reshape(shape) for o in out], [t.reshape(lse_shape) for t in lse]


def route_many_backward(grad_out: Sequence[Tensor], grad_lse: Sequence[Tensor], out: Sequence[Tensor],
                        lse: Sequence[Tensor], values: Sequence[Tensor], queries: Tensor, key_norm_weights: Tensor,
                        heads: int, eps: float, config: dict | None = None) -> tuple[list[Tensor], Tensor, Tensor]:
    """Fused backward; ``out`` and ``lse`` are what :func:`route_many_forward` (or the
    reference op) returned for these inputs. Returns what ``depthrewrite::route_many_backward``
    returns. ``config`` overrides ``block_q``, ``many_elems``, ``num_warps``, ``per_sm``, ``prefetch``."""
    _check_supported(values, None, ("queries", queries), ("key_norm_weights", key_norm_weights))
    cfg = {"prefetch": True, "per_sm": 2, **(config or {})}
    s, d = queries.shape[0], values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads)
    _check_saved_many(out, lse, values, s, heads)
    flat_v = _flat(values, d)
    tokens, device = flat_v[0].shape[0], flat_v[0].device
    dtype = values[0].dtype
    g = [t.to(dtype).contiguous().reshape(-1, d) for t in grad_out]
    gl = [t.to(torch.float32).contiguous().reshape(-1, heads) for t in grad_lse]
    o = [t.contiguous().reshape(-1, d) for t in out]
    ls = [t.contiguous().reshape(-1, heads) for t in lse]
    grad_v = [torch.empty_like(flat_v[0]) for _ in values]
    multi_head = heads > 1
    block_q = _query_block(s, block_h * block_c, cfg, MULTI_HEAD_BACKWARD_QUERIES if multi_head else None)
    warps = cfg.get("num_warps") or (MULTI_HEAD_BACKWARD_WARPS if multi_head else NUM_WARPS)
    chunks = list(range(0, s, block_q))
    programs = _backward_programs(device, tokens, cfg["per_sm"])
    part = torch.zeros((len(chunks), programs, block_q, d), dtype=torch.float32, device=device)
    if tokens > 0:
        qw = _per_query_rows(queries, key_norm_weights)
        # fp32 partial gradients between chunks of queries (the gradients themselves if fp32)
        partial = grad_v if dtype == torch.float32 or len(chunks) == 1 else [
            torch.empty(t.shape, dtype=torch.float32, device=device) for t in grad_v]
        gtab, otab, ltab, gltab, vtab, gvtab, acctab = _pointer_tables(device, g, o, ls, gl, flat_v, grad_v, partial)
        for c, q0 in enumerate(chunks):
            _route_many_bwd_kernel[(programs,)](
                flat_v[0], gtab[q0:], otab[q0:], ltab[q0:], gltab[q0:], vtab, gvtab, acctab, qw[q0:], part[c],
                tokens, len(values), d, d // heads, heads, min(block_q, s - q0), float(eps),
                BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=cfg["prefetch"],
                ALIGNED=_aligned(flat_v, grad_v, partial), ACC_IN=c > 0, ACC_OUT=c < len(chunks) - 1,
                ONE_SOURCE=len(values) == 1, num_warps=warps,
            )
    else:
        grad_v = [torch.zeros_like(t) for t in grad_v]
    # second pass of the deterministic reduction: a fixed-order sum over the programs
    r = part.sum(1).reshape(-1, d)[:s]
    grad_queries = (r * key_norm_weights.to(torch.float32)).to(queries.dtype)
    grad_weights = (r * queries.to(torch.float32)).to(key_norm_weights.dtype)
    return [t.reshape(values[0].shape) for t in grad_v], grad_queries, grad_weights


def _check_saved_many(out, lse, values, s: int, heads: int) -> None:
    if len(out) != s or len(lse) != s:
        raise ValueError(f"route_many (Triton): `out` and `lse` must hold one tensor per query ({s}); "
                         f"found {len(out)} and {len(lse)}")
    for i, (o, t) in enumerate(zip(out, lse)):
        _check_saved(o, t, values, heads, op="route_many", which=f"[{i}]")
