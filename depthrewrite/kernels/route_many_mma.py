"""A tensor-core (``tl.dot``) backward for ``depthrewrite::route_many``: one token at a time.

Same math as the per-token backward of :mod:`.route_many_triton` (one head, no separate
keys), arranged so that every sum over a row or over the queries is a matrix product. For
a token with output gradients ``G`` (S x d, padded to 16 rows) and a block of its sources
``V`` (NB x d):

- ``<g_s, v_i>`` for every query and source is ``G @ V^T`` (S x NB), over the row in
  column chunks of ``BLOCK_D``; the logits ``z`` and key ``rstd`` come from the forward's
  statistics table (the op's ``stats``), so no other row sum is left;
- ``dz = a (<g, v> - <g, out> + d lse)``, ``a = exp(z - lse)``, as the per-token kernel;
- the gradient of source i, ``sum_s a_s g_s + sum_s (dz_s rstd) (w q)_s - v rstd^2
  sum_s dz_s z_s / d``, is ``A^T @ G + C^T @ QW - ...`` in a second walk over the chunks
  (the block's rows read again, from cache), stored once (plus its running sum, if any).

Why: the per-token kernel forms each (query, source) row sum with multiply-adds on the CUDA
cores and reduces it across the program's warps; at full AttnRes's group shapes (4 queries,
13-45 sources) it issues ~440 instructions a source and thread and runs at 2.3x its memory
floor, issue-bound rather than memory-bound (docs/benchmarks.md session 38). Here the
multiply-adds and reductions are tensor-core products.

Precision: products of two activations (``<g, v>``, ``a g``) are exact in fp32 for bf16 and
fp16 inputs. Where one factor is fp32 (the weights ``a``, the coefficients ``dz rstd``, the
rows ``w q``) it is split as ``hi + lo`` (two rounded parts, ~16 significant bits in bf16)
and multiplied twice (``lo * lo`` left out), so the gradient keeps about fp32 accuracy
before its one rounding to the activation dtype; fp32 activations multiply in full fp32
(``input_precision="ieee"``).

The parameter gradients (the query and key-norm-weight gradients: sums over tokens of
``(dz rstd) v``) are not formed here: the kernel writes the ``(N, S, tokens)`` table of
``dz rstd`` that ``route_many_triton._param_reduction`` reduces (reading the sources once
more), as the tiled backward does. An earlier tensor-core backward (commit 9091829, tiles
of tokens, logits recomputed in three split products) was 2x slower than the per-token
kernel at Block AttnRes's shapes (4-8 sources padded to 16); this one reads the logits
and serves the calls with many sources.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Triton's interpreter (the CPU tests) multiplies bf16 blocks as raw integers in ``tl.dot``
#: (triton 3.9: wrong results, not an error); under it the products run on the same values
#: upcast to fp32, which is what the hardware computes (a product of two bf16 or fp16
#: numbers is exact in fp32) up to the order of the fp32 sums. The GPU tests exercise the
#: tensor-core lowering itself.
_UPCAST_DOTS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

#: the padded query rows of a program: ``tl.dot`` takes at least 16 rows
QUERY_ROWS = 16


@triton.jit
def _mma(x, y, acc):
    """``acc + x @ y`` for two blocks of one dtype: tensor cores with fp32 sums for 16-bit
    blocks, full fp32 products for fp32 blocks."""
    if _UPCAST_DOTS:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
    if x.dtype == tl.float32:
        return tl.dot(x, y, acc, input_precision="ieee")
    return tl.dot(x, y, acc)


@triton.jit
def _split(x, ty: tl.constexpr):
    """``x`` (fp32) as two parts in ``ty`` whose sum is ``x`` to about twice ``ty``'s precision."""
    hi = x.to(ty)
    lo = (x - hi.to(tl.float32)).to(ty)
    return hi, lo


@triton.jit
def _dot_f32_act(x, y, acc):
    """``acc + x @ y`` for fp32 ``x`` and an activation block ``y`` (``x`` split in ``y``'s dtype)."""
    if y.dtype == tl.float32:
        return _mma(x, y, acc)
    hi, lo = _split(x, y.dtype)
    return _mma(lo, y, _mma(hi, y, acc))


@triton.jit
def _dot_f32_f32(x, y, acc, FP32: tl.constexpr):
    """``acc + x @ y`` for two fp32 factors: full fp32 with FP32 (fp32 activations), else bf16
    parts ``hi*hi + lo*hi + hi*lo`` (bf16 for its range: these factors are not activations)."""
    if FP32:
        return _mma(x, y, acc)
    xh, xl = _split(x, tl.bfloat16)
    yh, yl = _split(y, tl.bfloat16)
    return _mma(xh, yl, _mma(xl, yh, _mma(xh, yh, acc)))


@triton.jit
def _chunk(c0, BLOCK_D: tl.constexpr):
    """Columns ``c0 ..`` of a row chunk, declared contiguous from a multiple of BLOCK_D: without
    the hint every element was a 2-byte load of its own (sm_90 PTX: ``ld.global.b16``)."""
    return tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)


@triton.jit
def _rows(base, tok, D, cols, rmask, cmask):
    """Pointers and mask of the ``(R, BLOCK_D)`` block of rows ``base[r] + tok * D + cols``."""
    return base[:, None] + (tok * D + cols)[None, :], rmask[:, None] & cmask[None, :]


@triton.jit
def _bases(tab, idx, mask, ptr_ty, ALIGNED: tl.constexpr):
    """Entries ``idx`` of a pointer table as typed pointers (masked entries: null, never read).
    ALIGNED (the launcher checked every tensor behind the table for 16-byte alignment) tells
    the compiler so, here where the entries are loaded: declared later, inside ``_rows``, the
    hint was lost and the rows were read 2 bytes at a time (sm_90 PTX of Triton 3.6)."""
    p = tl.load(tab + idx, mask=mask, other=0).to(ptr_ty)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _out_grad_dots(g_rows, o_rows, tok, D, qmask, BQ: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    """``<g_s, out_s>`` per query of token ``tok`` (fp32): the products summed chunk by chunk
    in place, reduced across the threads once."""
    go = tl.zeros((BQ, BLOCK_D), tl.float32)
    for c0 in range(0, D, BLOCK_D):
        cols = _chunk(c0, BLOCK_D)
        g_ptrs, mask = _rows(g_rows, tok, D, cols, qmask, cols < D)
        o_ptrs, _ = _rows(o_rows, tok, D, cols, qmask, cols < D)
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        go += g * tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.sum(go, 1)


@triton.jit
def _source_dots(g_rows, v_rows, tok, D, qmask, nmask, BQ: tl.constexpr, NB: tl.constexpr,
                 BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr, STAGES: tl.constexpr):
    """``<g_s, v_i>`` for every query s and source i of a block: ``G @ V^T`` (BQ x NB, fp32)."""
    da = tl.zeros((BQ, NB), tl.float32)
    for c0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        cols = _chunk(c0, BLOCK_D)
        g_ptrs, gmask = _rows(g_rows, tok, D, cols, qmask, cols < D)
        v_ptrs, vmask = _rows(v_rows, tok, D, cols, nmask, cols < D)
        da = _mma(tl.load(g_ptrs, mask=gmask, other=0.0), tl.trans(tl.load(v_ptrs, mask=vmask, other=0.0)), da)
    return da


@triton.jit
def _route_many_bwd_mma_kernel(
    like_ptr, gtab, otab, ltab, gltab, vtab, gvtab, runtab, qw_ptr, stats_ptr, coef_ptr, T, N, S, D,
    NB: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr, ONE_SOURCE: tl.constexpr,
    RUNNING: tl.constexpr, STAGES: tl.constexpr,
):
    """A persistent grid, one token at a time per program, its sources in blocks of NB:
    per block the ``<g, v>`` products over the row, then ``dz`` from the saved logits (the
    ``(T, N, S + 1)`` stats table), its ``dz * rstd`` stored to the ``(N, S, T)`` table
    ``coef_ptr``, then the block's gradient rows chunk by chunk. RUNNING: each gradient is
    stored plus its source's running sum (table ``runtab``, 0 where a source has none)."""
    BQ: tl.constexpr = 16
    act = like_ptr.dtype.element_ty
    FP32: tl.constexpr = act == tl.float32
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    qq = tl.arange(0, BQ)
    nn = tl.arange(0, NB)
    qmask = qq < S
    g_rows = _bases(gtab, qq, qmask, ptr_ty, ALIGNED)
    o_rows = _bases(otab, qq, qmask, ptr_ty, ALIGNED)
    l_rows = _bases(ltab, qq, qmask, f32_ty, False)
    gl_rows = _bases(gltab, qq, qmask, f32_ty, False)
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        tok = tl.full((), 0, tl.int64) + t  # int64 (t may be a Python int in the interpreter)
        g_lse = tl.load(gl_rows + tok, mask=qmask, other=0.0)
        lse = g_lse  # read only with several sources
        s_ada = g_lse
        if not ONE_SOURCE:
            lse = tl.load(l_rows + tok, mask=qmask, other=0.0)
            s_ada = _out_grad_dots(g_rows, o_rows, tok, D, qmask, BQ, BLOCK_D, ALIGNED) - g_lse
        for b0 in range(0, N, NB):
            ii = b0 + nn
            nmask = ii < N
            valid = qmask[:, None] & nmask[None, :]
            v_rows = _bases(vtab, ii, nmask, ptr_ty, ALIGNED)
            stat_rows = stats_ptr + (tok * N + ii) * (S + 1)
            z = tl.load(stat_rows[None, :] + qq[:, None], mask=valid, other=0.0)
            rstd = tl.load(stat_rows + S, mask=nmask, other=0.0)
            if ONE_SOURCE:
                # weight exactly 1 and out = v: dz is d lse exactly (the sums would leave
                # rounding noise where 0 is exact)
                a = tl.where(valid, 1.0, 0.0)
                dz = tl.where(valid, g_lse[:, None], 0.0)
            else:
                da = _source_dots(g_rows, v_rows, tok, D, qmask, nmask, BQ, NB, BLOCK_D, ALIGNED, STAGES)
                a = tl.where(valid, tl.exp(z - lse[:, None]), 0.0)
                dz = a * (da - s_ada[:, None])
            coef = dz * rstd[None, :]
            tl.store(coef_ptr + (ii[None, :].to(tl.int64) * S + qq[:, None]) * T + tok, coef, mask=valid)
            shrink = rstd * rstd * tl.sum(dz * z, 0) / D  # the key RMSNorm's term, per source
            _store_block_grads(g_rows, v_rows, gvtab, runtab, qw_ptr, ii, tok, D, qmask, nmask, tl.trans(a),
                               tl.trans(coef), shrink, ptr_ty, FP32, BQ, NB, BLOCK_D, ALIGNED, RUNNING, STAGES)


@triton.jit
def _store_block_grads(g_rows, v_rows, gvtab, runtab, qw_ptr, ii, tok, D, qmask, nmask, a_t, coef_t, shrink, ptr_ty,
                       FP32: tl.constexpr, BQ: tl.constexpr, NB: tl.constexpr, BLOCK_D: tl.constexpr,
                       ALIGNED: tl.constexpr, RUNNING: tl.constexpr, STAGES: tl.constexpr):
    """The gradient rows of a block of sources, ``a^T @ G + coef^T @ QW - v * shrink`` (plus
    the running sums with RUNNING), chunk by chunk, each rounded once to the activation dtype."""
    qq = tl.arange(0, BQ)
    gv_rows = _bases(gvtab, ii, nmask, ptr_ty, ALIGNED)
    run_rows = v_rows  # read only with RUNNING
    has_run = nmask
    if RUNNING:
        address = tl.load(runtab + ii, mask=nmask, other=0)
        run_rows = address.to(ptr_ty)
        if ALIGNED:  # 0 (no running sum) is a multiple too
            run_rows = tl.multiple_of(run_rows, 16)
        has_run = nmask & (address != 0)
    for c0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        cols = _chunk(c0, BLOCK_D)
        cmask = cols < D
        g_ptrs, gmask = _rows(g_rows, tok, D, cols, qmask, cmask)
        v_ptrs, vmask = _rows(v_rows, tok, D, cols, nmask, cmask)
        qw = tl.load(qw_ptr + qq[:, None] * D + cols[None, :], mask=gmask, other=0.0)
        grad = _dot_f32_act(a_t, tl.load(g_ptrs, mask=gmask, other=0.0), tl.zeros((NB, BLOCK_D), tl.float32))
        grad = _dot_f32_f32(coef_t, qw, grad, FP32)
        grad -= tl.load(v_ptrs, mask=vmask, other=0.0).to(tl.float32) * shrink[:, None]
        if RUNNING:
            r_ptrs, rmask = _rows(run_rows, tok, D, cols, has_run, cmask)
            grad += tl.load(r_ptrs, mask=rmask, other=0.0).to(tl.float32)
        out_ptrs, _ = _rows(gv_rows, tok, D, cols, nmask, cmask)
        tl.store(out_ptrs, grad.to(ptr_ty.element_ty), mask=vmask)
