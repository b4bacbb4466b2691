"""Tensor-core (``tl.dot``) kernels for ``depthrewrite::route_many``: tiles of tokens.

Same math as :mod:`depthrewrite.ops.route_many` and the per-token kernels of
:mod:`.route_many_triton`, arranged so that the reductions over a row are matrix products:
for a tile of ``BT`` tokens, the ``N`` source rows of every token form an ``(BT, N, d)``
block and the ``S`` queries' rows an ``(S, d)`` (forward) or per-token ``(BT, S, d)``
(backward) block. The logits are ``(BT * N, d) @ (d, S)``, the outputs the batched product
``a (BT, S, N) @ v (BT, N, d)``, and in the backward ``<v_i, g_s>`` is ``g (BT, S, d) @ v^T``
and the source gradient ``a^T @ g + (dz * rstd)^T @ (w * q) - ...``. A program walks its
rows in column chunks of ``BD`` twice (logits, then outputs or gradients; the second walk
reads the tile again from cache), so no per-(source, query) reduction across threads is
left: the per-token kernels were bound by those reductions' latency.

Precision: tensor cores multiply in the activation dtype. Products of two activations
(``<v, g>``) are exact in bf16/fp16 with fp32 accumulation. Where one factor is fp32 (the
softmax weights, ``w * q``, ``dz * rstd``) it is split as ``hi + lo`` (two rounded parts,
~16 significant bits in bf16) and multiplied twice, so the result keeps about fp32
accuracy; fp32 activations multiply in full fp32 (``input_precision="ieee"``). Padding:
``tl.dot`` needs at least 16 rows, so N and S are padded to 16 (masked; their loads move no
bytes).

The parameter gradients are the reduction over tokens of ``(dz * rstd) v`` that
``_route_many_param_kernel`` (in :mod:`.route_many_triton`) does; this backward writes the
``(N, S, tokens, heads)`` table of ``dz * rstd`` it reads.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Triton's interpreter (the CPU tests) multiplies bf16 blocks as raw integers in ``tl.dot``
#: (triton 3.9: wrong results, not an error); under it the tensor-core products run on the
#: same values upcast to fp32, which is what the hardware computes (a product of two bf16 or
#: fp16 numbers is exact in fp32) up to the order of the fp32 sums. The GPU tests exercise
#: the tensor-core lowering itself.
_UPCAST_DOTS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _bases(tab, idx, mask, ptr_ty, ALIGNED: tl.constexpr):
    """Entries ``idx`` of a pointer table as typed pointers (masked entries: null, never read)."""
    p = tl.load(tab + idx, mask=mask, other=0).to(ptr_ty)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _mma(x, y, acc):
    """``acc + x @ y`` on tensor cores, for two blocks of one 16-bit dtype (fp32 sums)."""
    if _UPCAST_DOTS:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, y, acc)


@triton.jit
def _split(x, ty: tl.constexpr):
    """``x`` (fp32) as two parts in ``ty`` whose sum is ``x`` to about twice ``ty``'s precision."""
    hi = x.to(ty)
    lo = (x - hi.to(tl.float32)).to(ty)
    return hi, lo


@triton.jit
def _dot_act_f32(x, y, acc, EXACT: tl.constexpr, THREE: tl.constexpr):
    """``acc + x @ y`` for activations ``x`` and fp32 ``y`` (2-D or batched 3-D); ``y`` in two
    parts, or three (about fp32's 24 bits: the logits, whose error the log-sum-exp keeps)."""
    if EXACT:
        return tl.dot(x.to(tl.float32), y, acc, input_precision="ieee")
    hi, mid = _split(y, x.dtype)
    acc = _mma(x, hi, acc)
    acc = _mma(x, mid, acc)
    if THREE:
        lo = (y - hi.to(tl.float32) - mid.to(tl.float32)).to(x.dtype)
        acc = _mma(x, lo, acc)
    return acc


@triton.jit
def _dot_f32_act(x, y, acc, EXACT: tl.constexpr):
    """``acc + x @ y`` for fp32 ``x`` and activations ``y``."""
    if EXACT:
        return tl.dot(x, y.to(tl.float32), acc, input_precision="ieee")
    hi, lo = _split(x, y.dtype)
    acc = _mma(hi, y, acc)
    return _mma(lo, y, acc)


@triton.jit
def _dot_f32_f32(x, y, acc, EXACT: tl.constexpr):
    """``acc + x @ y`` for two fp32 factors: bf16 parts ``hi*hi + lo*hi + hi*lo`` (bf16 for
    its range: these factors are not activations)."""
    if EXACT:
        return tl.dot(x, y, acc, input_precision="ieee")
    xh, xl = _split(x, tl.bfloat16)
    yh, yl = _split(y, tl.bfloat16)
    acc = _mma(xh, yh, acc)
    acc = _mma(xl, yh, acc)
    return _mma(xh, yl, acc)


@triton.jit
def _kahan(total, comp, x):
    """``total + x`` with the rounding error carried in ``comp`` (compensated summation)."""
    y = x - comp
    t = total + y
    return t, (t - total) - y


@triton.jit
def _load_block(base, tok, cols, rmask, tmask, cmask, D):
    """The ``(BT, R, BD)`` block of rows ``base[r] + tok * D + cols`` (zeros where masked)."""
    ptrs = base[None, :, None] + (tok[:, None, None] * D + cols[None, None, :])
    mask = tmask[:, None, None] & rmask[None, :, None] & cmask[None, None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_block(base, tok, cols, rmask, tmask, cmask, D, x):
    ptrs = base[None, :, None] + (tok[:, None, None] * D + cols[None, None, :])
    mask = tmask[:, None, None] & rmask[None, :, None] & cmask[None, None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _row_rstd(vbase, tok, tmask, nmask, D, eps, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    """``1 / rms`` of every source row of the tile over the full width (the key statistic)."""
    ssq = tl.zeros((BT, NP), tl.float32)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        v = _load_block(vbase, tok, cols, nmask, tmask, cols < D, D).to(tl.float32)
        ssq += tl.sum(v * v, 2)
    return tl.rsqrt(ssq / D + eps)


@triton.jit
def _logit_step(v, qw, dot, ssq, ONE_HEAD: tl.constexpr, EXACT: tl.constexpr):
    """One column chunk of the logits: ``dot += v @ (w q)`` over the chunk (``v`` a
    ``(BT, NP, BD)`` block, ``qw`` ``(BD, SP)``) and, with one head, the sum of squares."""
    BT: tl.constexpr = v.shape[0]
    NP: tl.constexpr = v.shape[1]
    BD: tl.constexpr = v.shape[2]
    dot = _dot_act_f32(tl.reshape(v, (BT * NP, BD)), qw, dot, EXACT, True)
    if ONE_HEAD:
        vf = v.to(tl.float32)
        ssq += tl.sum(vf * vf, 2)
    return dot, ssq


@triton.jit
def _finish_logits(dot, ssq, rstd, unscale, nmask, D, eps, ONE_HEAD: tl.constexpr, BT: tl.constexpr,
                   NP: tl.constexpr, SP: tl.constexpr):
    """Logits ``(BT, SP, NP)`` (padded sources: -inf) and the key statistic; ``unscale``
    undoes the power-of-two scale of the ``w * q`` rows."""
    if ONE_HEAD:
        rstd = tl.rsqrt(ssq / D + eps)
    z = tl.trans(tl.reshape(dot, (BT, NP, SP)), (0, 2, 1)) * (rstd * unscale)[:, None, :]
    return tl.where(nmask[None, None, :], z, float("-inf")), rstd


@triton.jit
def _qw_block(qw_ptr, ss, smask, cols, cmask, D):
    """``(BD, SP)`` block of the fp32 ``w_s * q_s`` rows."""
    return tl.load(qw_ptr + ss[None, :] * D + cols[:, None], mask=cmask[:, None] & smask[None, :], other=0.0)


@triton.jit
def _route_many_fwd_mma_kernel(
    like_ptr, vtab, otab, ltab, qw_ptr, unscale_ptr, T, N, S, D, C, H, eps,
    BT: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr,
    EXACT: tl.constexpr, ONE_HEAD: tl.constexpr,
):
    ptr_ty = tl.pointer_type(like_ptr.dtype.element_ty)
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    tmask = tok < T
    ii = tl.arange(0, NP)
    ss = tl.arange(0, SP)
    nmask, smask = ii < N, ss < S
    vbase = _bases(vtab, ii, nmask, ptr_ty, ALIGNED)
    obase = _bases(otab, ss, smask, ptr_ty, ALIGNED)
    lbase = _bases(ltab, ss, smask, tl.pointer_type(tl.float32), False)
    unscale = tl.load(unscale_ptr)
    rstd = tl.zeros((BT, NP), tl.float32)
    if not ONE_HEAD:
        rstd = _row_rstd(vbase, tok, tmask, nmask, D, eps, BT, NP, BD)
    for h in range(H):
        dot = tl.zeros((BT * NP, SP), tl.float32)
        ssq = tl.zeros((BT, NP), tl.float32)
        for c0 in range(0, C, BD):
            cc = c0 + tl.arange(0, BD)
            cols = h * C + cc
            v = _load_block(vbase, tok, cols, nmask, tmask, cc < C, D)
            dot, ssq = _logit_step(v, _qw_block(qw_ptr, ss, smask, cols, cc < C, D), dot, ssq, ONE_HEAD, EXACT)
        z, rstd = _finish_logits(dot, ssq, rstd, unscale, nmask, D, eps, ONE_HEAD, BT, NP, SP)
        m = tl.max(z, 2)
        p = tl.exp(z - m[:, :, None])
        l = tl.sum(p, 2)
        a = p / l[:, :, None]  # (BT, SP, NP); one source: exactly 1
        tl.store(lbase[None, :] + (tok[:, None] * H + h), m + tl.log(l), mask=tmask[:, None] & smask[None, :])
        for c0 in range(0, C, BD):
            cc = c0 + tl.arange(0, BD)
            cmask = cc < C
            cols = h * C + cc
            v = _load_block(vbase, tok, cols, nmask, tmask, cmask, D)
            out = _dot_f32_act(a, v, tl.zeros((BT, SP, BD), tl.float32), EXACT)
            _store_block(obase, tok, cols, smask, tmask, cmask, D, out)


@triton.jit
def _slab(tok, T, S, H, h, ii, ss):
    """Offsets ``((i * S + s) * T + tok) * H + h`` of an ``(N, S, tokens, heads)`` fp32 table
    as a ``(BT, SP, NP)`` block (int64)."""
    return ((ii[None, None, :].to(tl.int64) * S + ss[None, :, None]) * T + tok[:, None, None]) * H + h


@triton.jit
def _route_many_bwd_mma_kernel(
    like_ptr, gtab, otab, ltab, gltab, vtab, gvtab, qw_ptr, unscale_ptr, a_ptr, coef_ptr, T, N, S, D, C, H, eps,
    BT: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr,
    EXACT: tl.constexpr, ONE_HEAD: tl.constexpr, ONE_SOURCE: tl.constexpr,
):
    ptr_ty = tl.pointer_type(like_ptr.dtype.element_ty)
    f32_ty = tl.pointer_type(tl.float32)
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    tmask = tok < T
    ii = tl.arange(0, NP)
    ss = tl.arange(0, SP)
    nmask, smask = ii < N, ss < S
    vbase = _bases(vtab, ii, nmask, ptr_ty, ALIGNED)
    gbase = _bases(gtab, ss, smask, ptr_ty, ALIGNED)
    obase = _bases(otab, ss, smask, ptr_ty, ALIGNED)
    gvbase = _bases(gvtab, ii, nmask, ptr_ty, ALIGNED)
    lbase = _bases(ltab, ss, smask, f32_ty, False)
    glbase = _bases(gltab, ss, smask, f32_ty, False)
    valid = tmask[:, None, None] & smask[None, :, None] & nmask[None, None, :]
    ts = tmask[:, None] & smask[None, :]
    unscale = tl.load(unscale_ptr)
    rstd = tl.zeros((BT, NP), tl.float32)
    if not ONE_HEAD:
        rstd = _row_rstd(vbase, tok, tmask, nmask, D, eps, BT, NP, BD)
    mt = tl.zeros((BT, NP), tl.float32)  # sum over queries and heads of dz * z (the norm's term)
    # walk 1, per head: logits, <g_s, v_i>, <g_s, out_s>; then the weights a and dz
    for h in range(H):
        dot = tl.zeros((BT * NP, SP), tl.float32)
        ssq = tl.zeros((BT, NP), tl.float32)
        # <g_s, v_i> and <g_s, out_s> are summed over the row's chunks with compensation: dz
        # takes their difference, which cancels when one source dominates
        da = tl.zeros((BT, SP, NP), tl.float32)
        da_c = tl.zeros((BT, SP, NP), tl.float32)
        go = tl.zeros((BT, SP), tl.float32)
        go_c = tl.zeros((BT, SP), tl.float32)
        for c0 in range(0, C, BD):
            cc = c0 + tl.arange(0, BD)
            cmask = cc < C
            cols = h * C + cc
            v = _load_block(vbase, tok, cols, nmask, tmask, cmask, D)
            dot, ssq = _logit_step(v, _qw_block(qw_ptr, ss, smask, cols, cmask, D), dot, ssq, ONE_HEAD, EXACT)
            if not ONE_SOURCE:
                g = _load_block(gbase, tok, cols, smask, tmask, cmask, D)
                zero = tl.zeros((BT, SP, NP), tl.float32)
                if EXACT:
                    part = tl.dot(g, tl.trans(v, (0, 2, 1)), zero, input_precision="ieee")
                else:  # products of two activations: exact in fp32
                    part = _mma(g, tl.trans(v, (0, 2, 1)), zero)
                da, da_c = _kahan(da, da_c, part)
                o = _load_block(obase, tok, cols, smask, tmask, cmask, D)
                go, go_c = _kahan(go, go_c, tl.sum(g.to(tl.float32) * o.to(tl.float32), 2))
        z, rstd = _finish_logits(dot, ssq, rstd, unscale, nmask, D, eps, ONE_HEAD, BT, NP, SP)
        g_lse = tl.load(glbase[None, :] + (tok[:, None] * H + h), mask=ts, other=0.0)
        if ONE_SOURCE:
            # weight exactly 1, out = v: dz is d lse exactly (the sums would leave rounding noise)
            a = tl.where(valid, 1.0, 0.0)
            dz = tl.where(valid, g_lse[:, :, None], 0.0)
        else:
            lse = tl.load(lbase[None, :] + (tok[:, None] * H + h), mask=ts, other=0.0)
            a = tl.where(valid, tl.exp(z - lse[:, :, None]), 0.0)
            dz = a * (da - (go - g_lse)[:, :, None])
        mt += tl.sum(dz * tl.where(valid, z, 0.0), 1)  # (dz is 0 where z is padding's -inf)
        slab = _slab(tok, T, S, H, h, ii, ss)
        tl.store(a_ptr + slab, a, mask=valid)
        tl.store(coef_ptr + slab, dz * rstd[:, None, :], mask=valid)
    tl.debug_barrier()  # walk 2 reads a and dz * rstd back, in another thread layout
    # walk 2: d v_i = sum_s a g_s + sum_s (dz rstd)(w q)_s - v_i rstd^2 mt / D
    for h in range(H):
        slab = _slab(tok, T, S, H, h, ii, ss)
        a_t = tl.trans(tl.load(a_ptr + slab, mask=valid, other=0.0), (0, 2, 1))  # (BT, NP, SP)
        c_t = tl.reshape(tl.trans(tl.load(coef_ptr + slab, mask=valid, other=0.0), (0, 2, 1)), (BT * NP, SP))
        for c0 in range(0, C, BD):
            cc = c0 + tl.arange(0, BD)
            cmask = cc < C
            cols = h * C + cc
            g = _load_block(gbase, tok, cols, smask, tmask, cmask, D)
            v = _load_block(vbase, tok, cols, nmask, tmask, cmask, D)
            qw = tl.load(qw_ptr + ss[:, None] * D + cols[None, :], mask=smask[:, None] & cmask[None, :], other=0.0)
            d_src = _dot_f32_act(a_t, g, tl.zeros((BT, NP, BD), tl.float32), EXACT)
            d_src += tl.reshape(_dot_f32_f32(c_t, qw, tl.zeros((BT * NP, BD), tl.float32), EXACT), (BT, NP, BD)) * unscale
            d_src -= v.to(tl.float32) * (rstd * rstd * mt / D)[:, :, None]
            _store_block(gvbase, tok, cols, nmask, tmask, cmask, D, d_src)
