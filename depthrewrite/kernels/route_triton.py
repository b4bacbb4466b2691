"""Fused Triton kernels for ``depthrewrite::route`` and ``depthrewrite::route_backward``.

Same math as :mod:`depthrewrite.ops.route` (docs/spec.md sections 2-4). The N sources are never
stacked: their data pointers go to the kernel in a small int64 table and each program
casts entry ``i`` back to a pointer, so any N works without a copy of the sources.

Forward (one program per block of tokens): an online softmax over the sources, as in
flash attention, so each source row is read from memory exactly once. Per source it
computes the RMS statistic over the full width, the per-head logits, rescales the running
fp32 accumulator and adds the weighted source. It also writes the per-token, per-head
log-sum-exp ``lse = m + log(l)`` (fp32, ``(tokens, H)``; 0 for one source), which the op's
autograd saves with the output.

Backward, ONE pass over the sources (a persistent grid; each program walks a fixed,
strided set of token blocks, so the work order, and with it every rounding, is fixed).
Per token block it loads ``g``, the saved output ``out`` and ``lse`` and forms
``gout[t, h] = sum_{c in head h} g * out``, which equals ``sum_j a_j da_j``
(``da_j = <src_j, g>`` per head). Then per source i it loads the source (and its key, if
keys are separate; the next source is prefetched by default, ``config["prefetch"]``),
recomputes the RMS statistic and the logit ``z_i``, takes ``a_i = exp(z_i - lse)``,
``dz_i = a_i (da_i - gout)``, and writes the source (and key) gradient. Bytes: N sources
(2N with separate keys) + ``out`` + ``g`` read, ``lse`` read (4H bytes a token), N (2N)
gradients written; nothing of size (N, tokens, H) is kept. Measured on H200 (bf16, the
backward alone, tokens x d x N = 16384x2048x9, 16384x2048x33, 16384x4096x9, 8192x4096x65,
ms): 0.436 / 1.392 / 0.882 / 2.746 with the next source prefetched (the default),
0.532 / 1.766 / 1.102 / 3.640 without; the two-pass backward it replaces took
0.754 / 2.995 / 1.680 / not measured. Parameter gradients: ``d query``
and ``d key_norm_weight`` share one accumulator, ``sum_{t,i} dz * norm_i`` times ``w`` or
``q``, reduced per program into a (programs, d) fp32 buffer; the bias gradient goes per
source and token into an (N, tokens) buffer; fixed-order torch sums finish both:
deterministic, no atomics.

Precision of the one-pass backward: ``out`` is saved in the activation dtype, so ``gout``
carries its rounding (flash attention's ``rowsum(dO * O)`` does the same); the two-pass
backward it replaces rebuilt ``sum_j a_j da_j`` in fp32 from the sources. In fp32 nothing
changes measurably. In bf16/fp16 the parameter gradients (fp32 sums over tokens of ``dz``)
now carry an error of the order of the output's rounding, relative L2 error against
float64 at the test shapes (tests/kernels/test_route_triton.py, worst of 9 shapes, N=1..65,
Triton interpreter), two-pass backward -> one-pass backward:

    gradient of        bf16                 fp16
    output (forward)   4.2e-3 -> 4.2e-3     2.2e-4 -> 2.2e-4
    values             5.5e-3 -> 8.2e-3     3.2e-4 -> 7.9e-4
    keys               5.7e-3 -> 2.5e-2     3.3e-4 -> 1.1e-3
    query              5.2e-7 -> 1.0e-2     4.9e-7 -> 1.0e-3
    key_norm_weight    8.3e-7 -> 9.3e-3     5.7e-7 -> 1.0e-3
    logit_bias         4.8e-7 -> 6.8e-3     2.7e-7 -> 1.2e-3
    (fp32 inputs: every gradient <= 1.6e-6 before, <= 2.2e-6 after)

The interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: a float64 simulation
of the one-pass backward with round-to-nearest gives about half the bf16 figures (keys
1.3e-2, query 6.9e-3). Separate keys show the largest change because their gradient is
``dz`` alone, where a value's gradient is dominated by ``a_i g``, which is unchanged. Against a float64 oracle that uses the
kernel's saved output the same way, every parameter gradient is within 1.4e-6 in every
dtype and every activation gradient within its own dtype's rounding: the rounding of
``out`` is the only new error. ``config["exact_softmax_grad"]`` (session 24; for the
registered kernels ``depthrewrite.kernels.set_exact_softmax_grad``) takes it away again:
a first walk over the sources forms ``sum_j a_j da_j`` and ``sum_j a_j`` from the same
terms as the gradient walk and takes their ratio (the weights ``exp(z - lse)`` sum to 1
only up to ``lse``'s rounding; the sources read twice, nothing of size (N, tokens, H)
stored); the parameter gradients are then within 5e-7 of the exact ones in bf16
(tests/kernels/test_route_triton.py).

Optional output norm (``out_norm_weight``: ``normed = rms_norm(out) * w`` of the output as
stored, fp32 math). Two implementations, both tested, chosen by ``config["fuse_norm"]``:
inside the routing kernels (the forward normalises the row it holds before storing it;
the backward adds the norm's gradient to ``g`` in fp32 before the sources, and sums the
weight's gradient per program), or as passes of their own (a forward pass reading ``out``
and writing ``normed``; a backward pass writing the fp32 total gradient of ``out`` that the
routing backward then reads, plus the same per-program weight-gradient partials). The
separate passes are the default, by measurement (H200, bf16, tokens x d x N = 16384x2048x9,
16384x2048x33, 16384x4096x9, 8192x4096x65, ms): forward 0.239 / 0.677 / 0.484 / 1.287
separate vs 0.253 / 0.766 / 0.541 / 1.584 fused (route alone 0.205 / 0.643 / 0.415 /
1.252); backward 0.590 / 1.547 / 1.179 / 2.914 separate vs 0.729 / 2.145 / 1.463 / 4.101
fused (route alone 0.436 / 1.394 / 0.881 / 2.745). Fusing raises the backward kernel from
127 to 168 (4 warps) or 194 (8 warps) registers, so fewer programs stay resident per SM
(4 -> 3, 2 -> 1), and the latency-bound source loop slows by 30-50 %.

Limits (checked, ValueError): the padded row ``next_pow2(H) * next_pow2(d / H)`` must be
at most ``MAX_ROW`` elements (a program holds a row on chip). Any number of sources.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.route import _check_acc, _check_out_norm, _check_param
from ..ops.route import _check_inputs as check_route_inputs
from .grid import cdiv
from .param_grads import PartialSums, query_and_weight_grads
from .pointer_tables import pointer_tables
from .shared_memory import fit_stages

__all__ = ["route_forward", "route_backward", "MAX_ROW", "SUPPORTED_DTYPES"]

#: largest padded row (elements) a program holds on chip
MAX_ROW = 32768
#: dtypes the kernels take; float64 goes to the reference implementation
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: default of ``config["fuse_norm"]``: the output norm inside the routing kernels (True) or
#: as passes of their own (False, measured faster on H200: module docstring)
FUSE_NORM = False
#: the forwards' online softmax (``route``'s and ``route_many``'s) rescales its running sums
#: only when a logit exceeds the running shift by more than LAZY_RESCALE_MARGIN
#: (:func:`online_softmax_update`; the launch config's ``lazy_rescale``). Weights stay at most
#: exp(8) ~ 3e3; most sources skip the rescale's multiply of every accumulated element: the
#: sm_90 code of route_many's one-head forward (d = 1024, 2 queries a program, without the
#: stats table) takes 323 instructions a source instead of 400, and 226 registers instead of
#: 242 (docs/benchmarks.md, session 34)
LAZY_RESCALE = True
LAZY_RESCALE_MARGIN = tl.constexpr(8.0)


# ------------------------------------------------------------------------ kernels


@triton.jit
def _src_ptr(tab, i, ptr_ty, ALIGNED: tl.constexpr):
    """Entry ``i`` of a pointer table as a typed pointer; ALIGNED tells the compiler the
    base is 16-byte aligned so that row loads become 16-byte vector loads."""
    p = tl.load(tab + i).to(ptr_ty)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED: tl.constexpr, HAS_KEYS: tl.constexpr):
    """The rows of source ``i`` and of its key as stored (the key is the source itself
    unless keys are separate)."""
    v = tl.load(_src_ptr(vtab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
    k = v
    if HAS_KEYS:
        k = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
    return v, k


@triton.jit
def _plus_acc(x, acctab, i, offs, mask, ptr_ty, ALIGNED: tl.constexpr):
    """``x`` plus row block ``offs`` of running sum ``i`` of a table (``x`` unchanged where
    the entry is 0: no running sum for that source; the load is then masked off)."""
    return x + running_sum_row(tl.load(acctab + i), offs, mask, ptr_ty, ALIGNED).to(tl.float32)


@triton.jit
def running_sum_row(address, offs, mask, ptr_ty, ALIGNED: tl.constexpr):
    """Row block ``offs`` of the running sum at ``address`` (a pointer table's int64 entry) as
    stored; zeros where the address is 0 (no running sum: the load is masked off and moves
    no bytes). ALIGNED (the running sums are 16-byte aligned too) makes the row loads vector
    loads: without the hint each element was a 2-byte load of its own (sm_90 PTX)."""
    has = (tl.zeros_like(offs) + address) != 0  # a tensor also in the interpreter
    p = address.to(ptr_ty)
    if ALIGNED:
        p = tl.multiple_of(p, 16)  # 0 (no running sum) is a multiple too
    return tl.load(p + offs, mask=mask & has, other=0.0)


@triton.jit
def _next_source(tok, i, N, mask):
    """Index and load mask of the source prefetched while source ``i`` is used: past the
    last source the mask is off, so the load moves no bytes."""
    nxt = tl.minimum(i + 1, N - 1)
    more = mask & ((tl.zeros_like(tok) + i + 1) < N)[:, None, None]  # a tensor also in the interpreter
    return nxt, more


@triton.jit
def _row64(tok, i, T):
    """``i * T + tok`` in int64 (an (N, tokens) table can pass 2**31 elements)."""
    return (tl.zeros_like(tok) + i) * T + tok


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _route_fwd_kernel(
    vtab, ktab, q_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, lse_ptr, onw_ptr, normed_ptr,
    T, N, D, C, H, eps, out_norm_eps,
    HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ONE_SOURCE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr, HAS_NORM: tl.constexpr, PAIR_REDUCE: tl.constexpr, STAGES: tl.constexpr = 0,
    LAZY: tl.constexpr = False,
):
    """One program per BLOCK_T tokens: the online softmax over the N sources. Their rows
    come through Triton's software pipeline with STAGES >= 2 (copied into shared memory
    STAGES - 1 sources ahead), else with PREFETCH the next source is requested into
    registers while one is used."""
    pid = tl.program_id(0)
    ptr_ty = tl.pointer_type(out_ptr.dtype.element_ty)
    # 64-bit token index: tokens * d overflows int32 at large batch
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    tmask = tok < T
    col = hh[:, None] * C + cc[None, :]  # (H, C) column inside the row
    cmask = (hh[:, None] < H) & (cc[None, :] < C)
    offs = tok[:, None, None] * D + col[None, :, :]
    mask = tmask[:, None, None] & cmask[None, :, :]

    qw = tl.load(q_ptr + col, mask=cmask, other=0.0).to(tl.float32) * tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    m = tl.full((BLOCK_T, BLOCK_H), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_H, BLOCK_C), tl.float32)
    if STAGES >= 2:
        for i in tl.range(0, N, num_stages=STAGES):
            v_raw, k_raw = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
            m, l, acc = _route_fwd_step(v_raw.to(tl.float32), k_raw.to(tl.float32), i, tok, tmask, T, D, eps, qw,
                                        bias_ptr, scale_ptr, m, l, acc, HAS_KEYS, HAS_BIAS, HAS_SCALE, ONE_SOURCE,
                                        PAIR_REDUCE, LAZY)
    else:
        # PREFETCH: the loads of source i + 1 are issued before source i is used, so one
        # program keeps two rows in flight (a masked-off load moves no bytes at the end)
        if PREFETCH:
            v_raw, k_raw = _load_source(vtab, ktab, 0, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
        for i in range(N):
            if not PREFETCH:
                v_raw, k_raw = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
            v = v_raw.to(tl.float32)
            k = k_raw.to(tl.float32)
            if PREFETCH:
                nxt, more = _next_source(tok, i, N, mask)
                v_raw, k_raw = _load_source(vtab, ktab, nxt, offs, more, ptr_ty, ALIGNED, HAS_KEYS)
            m, l, acc = _route_fwd_step(v, k, i, tok, tmask, T, D, eps, qw, bias_ptr, scale_ptr, m, l, acc,
                                        HAS_KEYS, HAS_BIAS, HAS_SCALE, ONE_SOURCE, PAIR_REDUCE, LAZY)
    if ONE_SOURCE:
        lse = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)  # defined as 0: the weight exp(0 - 0) is 1
    else:
        acc = acc / l[:, :, None]
        lse = m + tl.log(l)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(lse_ptr + tok[:, None] * H + hh[None, :], lse, mask=tmask[:, None] & (hh[None, :] < H))
    if HAS_NORM:
        # the branch's PreNorm of the output as stored (rounded), while the row is on chip
        xo = out.to(tl.float32)
        onw = tl.load(onw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        rs = tl.rsqrt(tl.sum(tl.sum(xo * xo, 2), 1) / D + out_norm_eps)
        normed = xo * rs[:, None, None] * onw[None, :, :]
        tl.store(normed_ptr + offs, normed.to(normed_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _route_fwd_step(v, k, i, tok, tmask, T, D, eps, qw, bias_ptr, scale_ptr, m, l, acc,
                    HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                    ONE_SOURCE: tl.constexpr, PAIR_REDUCE: tl.constexpr, LAZY: tl.constexpr):
    """Source ``i``'s step of the forward's online softmax (rows ``v`` / ``k`` in fp32; ``k``
    is read only with HAS_KEYS): the running max ``m``, sum ``l`` and accumulator ``acc``,
    returned."""
    if HAS_SCALE:
        s = tl.load(scale_ptr + _row64(tok, i, T), mask=tmask, other=0.0)
        v = v * s[:, None, None]
    if ONE_SOURCE:
        # softmax over one source is exactly 1, whatever the logit (even NaN)
        acc = v
    else:
        if HAS_KEYS:
            if HAS_SCALE:
                k = k * s[:, None, None]
        else:
            k = v
        if PAIR_REDUCE:
            # the square sum and the query dot in one reduction over the row: one
            # exchange between warps per source instead of two
            ss, dot = tl.reduce((k * k, k * qw[None, :, :]), 2, _add_pair)
            rstd = tl.rsqrt(tl.sum(ss, 1) / D + eps)
            z = dot * rstd[:, None]
        else:
            rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 2), 1) / D + eps)
            z = tl.sum(k * qw[None, :, :], 2) * rstd[:, None]
        if HAS_BIAS:
            z = z + tl.load(bias_ptr + i).to(tl.float32)
        m, l, acc = online_softmax_update(z, v, m, l, acc, LAZY)
    return m, l, acc


@triton.jit
def online_softmax_update(z, v, m, l, acc, LAZY: tl.constexpr):
    """The running softmax after one source: logits ``z`` (rows, heads), its row ``v``
    (broadcast to ``acc``'s (rows, heads, columns)), the running shift ``m``, sum ``l`` and
    weighted sum ``acc``. Without LAZY the sums are rescaled to each new maximum. With LAZY
    only when a logit exceeds the shift by more than LAZY_RESCALE_MARGIN (one branch for the
    whole program, so that all its threads take it or none), and most sources cost one
    multiply-add per accumulated element instead of a multiply and a multiply-add. It is the
    same softmax: the shift cancels in ``acc / l`` and ``m + log(l)``, and a shift at most
    LAZY_RESCALE_MARGIN below the maximum keeps every weight ``exp(z - m)`` at most
    ``exp(LAZY_RESCALE_MARGIN)``, far inside fp32's range. The first source always rescales:
    ``m`` starts at -inf."""
    if LAZY:
        if tl.max(tl.max(z - m, 1), 0) > LAZY_RESCALE_MARGIN:
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            l = l * alpha
            acc = acc * alpha[:, :, None]
            m = m_new
        p = tl.exp(z - m)
        return m, l + p, acc + p[:, :, None] * v
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    p = tl.exp(z - m_new)
    return m_new, l * alpha + p, acc * alpha[:, :, None] + p[:, :, None] * v


@triton.jit
def _route_bwd_kernel(
    g_ptr, out_ptr, lse_ptr, vtab, ktab, gvtab, gktab, gvacc, gkacc, q_ptr, w_ptr, bias_ptr, scale_ptr,
    part_r_ptr, part_b_ptr, gn_ptr, onw_ptr, part_n_ptr,
    T, N, D, C, H, eps, num_blocks, out_norm_eps,
    HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ONE_SOURCE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ALIGNED: tl.constexpr, PREFETCH: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ACC: tl.constexpr,
    STAGES: tl.constexpr = 0, EXACT: tl.constexpr = False, FUSED_SUMS: tl.constexpr = False,
):
    """A persistent grid over blocks of BLOCK_T tokens: each source (and key) read once, each
    gradient written once. With STAGES >= 2 the source rows come through Triton's software
    pipeline (copied into shared memory STAGES - 1 sources ahead), else with PREFETCH the
    next source is requested into registers while one is used. EXACT: ``sum_j a_j <v_j, g>``
    over ``sum_j a_j`` from a first walk over the sources instead of ``<out, g>``
    (route_backward's ``exact_softmax_grad``; the sources are then read twice)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # the activation dtype is out's (g may be the fp32 gradient of a separate norm pass)
    ptr_ty = tl.pointer_type(out_ptr.dtype.element_ty)
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    col = hh[:, None] * C + cc[None, :]
    cmask = (hh[:, None] < H) & (cc[None, :] < C)
    q = tl.load(q_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    qw = q * w
    r_acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)  # sum_{t,i} dz * norm, this program's share
    n_acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)  # sum_t grad_normed * rms_norm(out): d out_norm_weight
    if HAS_NORM:
        onw = tl.load(onw_ptr + col, mask=cmask, other=0.0).to(tl.float32)

    for blk in range(pid, num_blocks, nprog):
        tok = blk * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # int64: tok * D below
        tmask = tok < T
        offs = tok[:, None, None] * D + col[None, :, :]
        mask = tmask[:, None, None] & cmask[None, :, :]
        hmask = tmask[:, None] & (hh[None, :] < H)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM or not (ONE_SOURCE or EXACT):
            o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            # the fused output norm's backward first: its gradient joins g (in fp32)
            gn = tl.load(gn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rs = tl.rsqrt(tl.sum(tl.sum(o * o, 2), 1) / D + out_norm_eps)
            on = o * rs[:, None, None]
            # padded tokens may carry NaN (out_norm_eps = 0 on a zero row): keep them out of the sum
            n_acc += tl.sum(tl.where(mask, gn * on, 0.0), 0)
            dn = gn * onw[None, :, :]
            mn = tl.sum(tl.sum(dn * on, 2), 1) / D
            g = g + rs[:, None, None] * (dn - on * mn[:, None, None])
        s_ada = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)  # with one source: unused
        lse = s_ada
        if not ONE_SOURCE:
            lse = tl.load(lse_ptr + tok[:, None] * H + hh[None, :], mask=hmask, other=0.0)
            if EXACT:  # sum_j a_j <v_j, g> from the terms the gradient walk below forms, over sum_j a_j
                weight = tl.zeros_like(s_ada)
                for j in range(N):
                    v_cur, k_cur = _load_source(vtab, ktab, j, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
                    a, da = _route_source_rows(v_cur, k_cur, j, tok, tmask, g, T, D, eps, qw, lse, bias_ptr,
                                               scale_ptr, HAS_KEYS, HAS_BIAS, HAS_SCALE, FUSED_SUMS)[5:]
                    s_ada += a * da
                    weight += a
                s_ada = _normalized_sum(s_ada, weight, hmask)
            else:
                # the softmax statistics come from the forward, no pass over the sources:
                # a_i = exp(z_i - lse), and sum_j a_j da_j = sum_j a_j <v_j, g> = <out, g> per head
                s_ada = tl.sum(g * o, 2)

        # one pass: each source (and key) is read once, each gradient written once
        if STAGES >= 2 and not ONE_SOURCE:
            for i in tl.range(0, N, num_stages=STAGES):
                v_cur, k_cur = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
                r_acc = _route_bwd_source(
                    v_cur, k_cur, i, tok, tmask, offs, mask, hmask, g, s_ada, lse, qw, r_acc, T, D, eps, bias_ptr,
                    scale_ptr, part_b_ptr, gvtab, gktab, gvacc, gkacc, ptr_ty, ALIGNED, HAS_KEYS, HAS_BIAS, HAS_SCALE,
                    ONE_SOURCE, HAS_ACC, FUSED_SUMS)
        else:
            if PREFETCH and not ONE_SOURCE:
                v_nx, k_nx = _load_source(vtab, ktab, 0, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
            for i in range(N):
                if ONE_SOURCE:
                    v_cur, k_cur = g, g  # not read: the gradient is g itself
                elif PREFETCH:
                    v_cur, k_cur = v_nx, k_nx
                    nxt, more = _next_source(tok, i, N, mask)
                    v_nx, k_nx = _load_source(vtab, ktab, nxt, offs, more, ptr_ty, ALIGNED, HAS_KEYS)
                else:
                    v_cur, k_cur = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
                r_acc = _route_bwd_source(
                    v_cur, k_cur, i, tok, tmask, offs, mask, hmask, g, s_ada, lse, qw, r_acc, T, D, eps, bias_ptr,
                    scale_ptr, part_b_ptr, gvtab, gktab, gvacc, gkacc, ptr_ty, ALIGNED, HAS_KEYS, HAS_BIAS, HAS_SCALE,
                    ONE_SOURCE, HAS_ACC, FUSED_SUMS)

    tl.store(part_r_ptr + pid.to(tl.int64) * D + col, r_acc, mask=cmask)
    if HAS_NORM:
        tl.store(part_n_ptr + pid.to(tl.int64) * D + col, n_acc, mask=cmask)


@triton.jit
def _normalized_sum(total, weight, mask):
    """``sum_j a_j <v_j, g>`` over ``sum_j a_j``: the weights come from the forward's ``lse``
    and sum to 1 only up to its rounding, which would leave that rounding in every ``dz_j``
    of a token alike, as the shortcut does; normalized, ``sum_j dz_j`` is 0 up to one
    rounding, as in the reference's softmax (1 where ``mask`` is off: no weight there)."""
    return total / tl.where(mask, weight, 1.0)


@triton.jit
def _source_scale(i, tok, tmask, T, scale_ptr, HAS_SCALE: tl.constexpr):
    """Source ``i``'s per-token scale with HAS_SCALE, else 1 (not read)."""
    s = tl.full((), 1.0, tl.float32)
    if HAS_SCALE:
        s = tl.load(scale_ptr + _row64(tok, i, T), mask=tmask, other=0.0)
    return s


@triton.jit
def _route_source_rows(v_cur, k_cur, i, tok, tmask, g, T, D, eps, qw, lse, bias_ptr, scale_ptr,
                       HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                       FUSED_SUMS: tl.constexpr):
    """Source ``i`` in the backward (rows ``v_cur`` / ``k_cur`` as stored): its fp32 value
    and key rows (scaled with HAS_SCALE), the scale ``s``, the key's ``rstd``, the logit
    ``zr`` before the bias, the weight ``a = exp(z - lse)`` and ``da = <v, g>`` per token
    and head; with FUSED_SUMS the three row sums in one reduction (:func:`three_row_sums`)."""
    s = _source_scale(i, tok, tmask, T, scale_ptr, HAS_SCALE)
    v = v_cur.to(tl.float32)
    if HAS_SCALE:
        v = v * s[:, None, None]
    if HAS_KEYS:
        k = k_cur.to(tl.float32)
        if HAS_SCALE:
            k = k * s[:, None, None]
    else:
        k = v
    if FUSED_SUMS:
        squares, dots, da = three_row_sums(k * k, k * qw[None, :, :], v * g)
    else:
        squares, dots, da = tl.sum(k * k, 2), tl.sum(k * qw[None, :, :], 2), tl.sum(v * g, 2)
    rstd = tl.rsqrt(tl.sum(squares, 1) / D + eps)
    zr = dots * rstd[:, None]
    z = zr
    if HAS_BIAS:
        z = z + tl.load(bias_ptr + i).to(tl.float32)
    return v, k, s, rstd, zr, tl.exp(z - lse), da


@triton.jit
def three_row_sums(squares, dots, products):
    """``tl.sum(x, 2)`` of three tensors of one shape in one reduction: joined, so that a
    program's warps meet once for the three rather than once each. ``squares`` is joined
    twice, to make a pair of pairs; the compiler reduces its copies once."""
    first, second = tl.split(tl.sum(tl.join(tl.join(squares, dots), tl.join(products, squares)), 2))
    squares, dots = tl.split(first)
    return squares, dots, tl.split(second)[0]


@triton.jit
def _route_bwd_source(v_cur, k_cur, i, tok, tmask, offs, mask, hmask, g, s_ada, lse, qw, r_acc, T, D, eps, bias_ptr,
                      scale_ptr, part_b_ptr, gvtab, gktab, gvacc, gkacc, ptr_ty, ALIGNED: tl.constexpr,
                      HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                      ONE_SOURCE: tl.constexpr, HAS_ACC: tl.constexpr, FUSED_SUMS: tl.constexpr):
    """Source ``i``'s part of the backward (rows ``v_cur`` / ``k_cur`` as stored): its value
    (and key) gradient written, its bias term stored, its ``dz * norm`` added to ``r_acc``
    (returned)."""
    if ONE_SOURCE:
        s = _source_scale(i, tok, tmask, T, scale_ptr, HAS_SCALE)
        d_src = g
    else:
        v, k, s, rstd, zr, a, da = _route_source_rows(v_cur, k_cur, i, tok, tmask, g, T, D, eps, qw, lse, bias_ptr,
                                                      scale_ptr, HAS_KEYS, HAS_BIAS, HAS_SCALE, FUSED_SUMS)
        dz = a * (da - s_ada)
        # padded tokens/heads may carry NaN (eps = 0 on a zero row): keep them out of the sums
        dz = tl.where(hmask, dz, 0.0)
        if HAS_BIAS:
            tl.store(part_b_ptr + _row64(tok, i, T), tl.sum(dz, 1), mask=tmask)
        mt = tl.sum(dz * zr, 1) / D  # mean_c(d_norm * norm) of the RMSNorm backward
        norm = k * rstd[:, None, None]
        r_acc += tl.sum(tl.where(mask, dz[:, :, None] * norm, 0.0), 0)
        d_key = rstd[:, None, None] * (dz[:, :, None] * qw[None, :, :] - norm * mt[:, None, None])
        d_src = a[:, :, None] * g
        if HAS_KEYS:
            _write_source_grad(d_key, s, gkacc, gktab, i, offs, mask, ptr_ty, ALIGNED, HAS_SCALE, HAS_ACC)
        else:
            d_src = d_src + d_key
    _write_source_grad(d_src, s, gvacc, gvtab, i, offs, mask, ptr_ty, ALIGNED, HAS_SCALE, HAS_ACC)
    return r_acc


@triton.jit
def _write_source_grad(grad, s, acctab, gtab, i, offs, mask, ptr_ty, ALIGNED: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_ACC: tl.constexpr):
    """Source ``i``'s gradient row: times its per-token scale ``s`` (HAS_SCALE), plus its
    running sum (HAS_ACC), stored in the activation dtype through the table ``gtab``."""
    if HAS_SCALE:
        grad = grad * s[:, None, None]
    if HAS_ACC:
        grad = _plus_acc(grad, acctab, i, offs, mask, ptr_ty, ALIGNED)
    tl.store(_src_ptr(gtab, i, ptr_ty, ALIGNED) + offs, grad.to(ptr_ty.element_ty), mask=mask)


@triton.jit
def _out_norm_fwd_kernel(out_ptr, w_ptr, normed_ptr, T, D, eps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``normed = rms_norm(out) * w`` as a pass of its own (``config["fuse_norm"] = False``)."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cc = tl.arange(0, BLOCK_D)
    mask = (tok < T)[:, None] & (cc < D)[None, :]
    offs = tok[:, None] * D + cc[None, :]
    x = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rs = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cc, mask=cc < D, other=0.0).to(tl.float32)
    tl.store(normed_ptr + offs, (x * rs[:, None] * w[None, :]).to(normed_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _out_norm_bwd_kernel(g_ptr, out_ptr, gn_ptr, w_ptr, gt_ptr, part_n_ptr, T, D, eps, num_blocks,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The output norm's backward as a pass of its own: ``gt = g + d rms_norm`` in fp32 for
    the routing backward, and per-program partial sums of the weight's gradient (a
    persistent grid with a fixed token order, as the routing backward)."""
    pid = tl.program_id(0)
    cc = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cc, mask=cc < D, other=0.0).to(tl.float32)
    n_acc = tl.zeros((BLOCK_D,), tl.float32)
    for blk in range(pid, num_blocks, tl.num_programs(0)):
        tok = blk * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        mask = (tok < T)[:, None] & (cc < D)[None, :]
        offs = tok[:, None] * D + cc[None, :]
        o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gn = tl.load(gn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rs = tl.rsqrt(tl.sum(o * o, 1) / D + eps)
        # padded tokens may carry NaN (eps = 0 on a zero row): keep them out of the sum
        n_acc += tl.sum(tl.where(mask, gn * o * rs[:, None], 0.0), 0)
        dn = gn * w[None, :]
        mn = tl.sum(dn * o, 1) * (rs * rs) / D  # mean(d_normed * normed) / rs
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(gt_ptr + offs, g + rs[:, None] * (dn - o * mn[:, None]), mask=mask)
    tl.store(part_n_ptr + pid.to(tl.int64) * D + cc, n_acc, mask=cc < D)


# ------------------------------------------------------------------------ launchers


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _row_blocks(d: int, heads: int, op: str = "route") -> tuple[int, int]:
    block_h, block_c = _next_pow2(heads), _next_pow2(d // heads)
    if block_h * block_c > MAX_ROW:
        raise ValueError(
            f"{op} (Triton): width d={d} with heads={heads} pads to a row of {block_h * block_c} "
            f"elements; the fused kernel holds a row on chip and takes at most {MAX_ROW}"
        )
    return block_h, block_c


def _check_block_t(block_t: int, op: str = "route") -> int:
    if not isinstance(block_t, int) or block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"{op} (Triton): config block_t must be a power of two; found {block_t!r}")
    return block_t


def _tokens_per_program(row: int) -> int:
    """Tokens a program takes for rows of ``row`` (padded) elements: about 2048 elements in
    flight, one token from d = 2048 up (measured on H200: docs/benchmarks.md); route's
    forward and backward take WIDE_TOKENS for one-head rows of WIDE_ROW (_route_tokens)."""
    return max(1, min(64, 2048 // row))


def _num_warps(elements: int) -> int:
    return min(16, max(4, _next_pow2(elements) // 512))


#: forward kernels (route, route_many): warps for one-head rows of at most NARROW_ROW padded
#: elements (H200, bf16, 16384 tokens, d = 1024, docs/benchmarks.md session 8: route 2
#: tokens per program 0.055 / 0.160 / 0.302 ms with 2 warps against 0.111 / 0.169 / 0.326
#: with 4 at N = 4 / 16 / 33; route_many 3-11 % faster in two runs). Multi-head rows keep
#: the wider default (16 heads: 4 warps as fast or faster, and in one run 20 % faster).
NARROW_FORWARD_WARPS = 2
NARROW_ROW = 1024


def _forward_warps(heads: int, row: int, otherwise: int, narrow: int = NARROW_FORWARD_WARPS) -> int:
    """``narrow`` warps for one-head rows of at most NARROW_ROW padded elements, else ``otherwise``."""
    return narrow if heads == 1 and row <= NARROW_ROW else otherwise


#: route's launches for one-head rows of WIDE_ROW padded elements (2048 < d <= 4096): 2
#: tokens per program, the forward with 8 warps, the backward with 4 (H200, bf16,
#: docs/benchmarks.md: forward 0.380 / 1.141 ms against 0.412 / 1.249 with one token and 8
#: warps at 16384x4096x9 / 8192x4096x65, session 10 runs 5 and 6; backward 0.844 / 2.654
#: against 0.872 / 2.733 with one token and 8 warps, session 10 run 6, 0.835 / 2.626 against
#: 0.861 / 2.701 in session 11 run 2, and 0.835 against 0.862 at 16384x4096x9 in run 1). At
#: d = 2048 one token stays faster; wider rows and several heads were not timed, nor the
#: backward with running sums, where the 2-token launch's sm_90 PTX spills 116 bytes
#: (kernel_registers.py); it keeps the launch so that the parameter gradients come out bit
#: for bit the same with and without running sums (the per-program partial sums follow it).
WIDE_ROW = 4096
WIDE_TOKENS = 2
WIDE_FORWARD_WARPS = 8
WIDE_BACKWARD_WARPS = 4


def _is_wide(heads: int, row: int) -> bool:
    return heads == 1 and row == WIDE_ROW


def _is_multi_head(heads: int, row: int) -> bool:
    """Several heads on rows of MULTI_HEAD_ROW padded elements: the measured multi-head launches."""
    return heads > 1 and row == MULTI_HEAD_ROW


def _route_tokens(heads: int, row: int) -> int:
    """Tokens per program of route's backward (and forward, but for MULTI_HEAD_FORWARD_TOKENS)
    unless a config sets ``block_t``."""
    return WIDE_TOKENS if _is_wide(heads, row) else _tokens_per_program(row)


#: route's forward for several heads on rows of MULTI_HEAD_ROW padded elements: one token a
#: program on one warp. The fastest launch of session 37's run 1 (H200, bf16, 16384 tokens,
#: d = 1024, 16 heads, full MHAR's sites N = 9 / 25 / 41: 0.107 / 0.248 / 0.384 ms against
#: 0.109 / 0.258 / 0.403 on 2 tokens and 4 warps, _tokens_per_program's and _num_warps'
#: choice, the default before); end to end (session 42 run 2, each model compiled alone) full
#: MHAR's step 123.5 ms against 125.0 (0.640x against 0.632x the baseline's 79.1 ms; the
#: forward kernel 11.7 against 13.7 ms a step)
MULTI_HEAD_FORWARD_TOKENS = 1
MULTI_HEAD_FORWARD_WARPS = 1


def _route_forward_tokens(heads: int, row: int) -> int:
    """Tokens per program of route's forward unless a config sets ``block_t``."""
    if _is_multi_head(heads, row):
        return MULTI_HEAD_FORWARD_TOKENS
    return _route_tokens(heads, row)


def _route_forward_stages(heads: int, row: int) -> int:
    """Pipeline stages of route's forward unless a config sets ``stages`` (ROUTE_FORWARD_STAGES' comment)."""
    return ROUTE_FORWARD_STAGES if heads == 1 and row <= NARROW_ROW else 0


def _route_backward_stages(heads: int, row: int, has_acc: bool, has_keys: bool) -> int:
    """Pipeline stages of route's backward unless a config sets ``stages`` (ROUTE_FORWARD_STAGES'
    and MULTI_HEAD_BACKWARD_MAXNREG's comments; several heads: only as timed, without keys)."""
    if heads > 1:
        return MULTI_HEAD_BACKWARD_STAGES if row == MULTI_HEAD_ROW and not has_keys else 0
    return ROUTE_BACKWARD_STAGES if has_acc or row >= WIDE_ROW else 0


def _route_forward_warps(heads: int, row: int, block_t: int) -> int:
    """Warps of route's forward for ``block_t`` tokens per program unless a config sets them."""
    if _is_wide(heads, row) and block_t == WIDE_TOKENS:
        return WIDE_FORWARD_WARPS
    if _is_multi_head(heads, row) and block_t == MULTI_HEAD_FORWARD_TOKENS:
        return MULTI_HEAD_FORWARD_WARPS
    return _forward_warps(heads, row, _num_warps(block_t * row))


#: route's forward for one head at rows padded to FORWARD_CAPPED_ROW on its default launch
#: (one token, RESIDENCY_WARPS warps) without separate keys: registers capped at
#: FORWARD_MAXNREG, so that 7 programs stay resident per SM instead of the 6 that the
#: compiler's 76 registers allow. H200, bf16, docs/benchmarks.md session 13, 9
#: alternating rounds each: run 3, 0.192 against 0.203 ms at 16384x2048x9 and 0.639 against
#: 0.655 at 16384x2048x33, faster in every round at both; run 4 (as the default) 0.192 /
#: 0.633 against 0.202 / 0.654 uncapped, 0.355 against 0.369 for a WAV-like call (N = 16,
#: bias and scale); capped at 64 (8 programs, spills) it was faster at N = 9 and slower at
#: N = 33 (0.673-0.683), as in session 11 run 5. sm_90 PTX (kernel_registers.py --width
#: 2048 --forward-caps 0, triton 3.6's ptxas): 76 registers uncapped with or without a bias
#: and a source scale, none of which spills at 72; the fused output norm (off by
#: default, FUSE_NORM) spills 4-20 bytes at 72 and keeps the compiler's choice, as do
#: separate keys (not compiled capped).
FORWARD_CAPPED_ROW = 2048
FORWARD_MAXNREG = 72


def _route_forward_cap(heads: int, row: int, has_keys: bool, has_norm: bool, block_t: int,
                       warps: int) -> int | None:
    """Register cap of route's forward unless a config sets one (None: the compiler's
    choice); only on the launch it was timed with."""
    if (heads == 1 and row == FORWARD_CAPPED_ROW and block_t == 1 and warps == RESIDENCY_WARPS
            and not has_keys and not has_norm):
        return FORWARD_MAXNREG
    return None


def _route_backward_warps(heads: int, row: int, block_t: int) -> int:
    """Warps of route's backward for ``block_t`` tokens per program unless a config sets them."""
    if _is_wide(heads, row) and block_t == WIDE_TOKENS:
        return WIDE_BACKWARD_WARPS
    return _num_warps(block_t * row)


#: route's backward programs per SM (a persistent grid), unless a rule below says otherwise
#: (per_sm 8 timed the same as 4 for one head: the registers let 4 stay resident)
BACKWARD_PER_SM = 4
#: route's backward for one head on a launch of RESIDENCY_ELEMS elements per program with
#: RESIDENCY_WARPS warps (route's default at rows padded to 1024, 2 tokens, and to 2048, one
#: token) and no separate keys: registers capped at CAPPED_BACKWARD_MAXNREG so that
#: CAPPED_BACKWARD_PER_SM programs stay resident per SM. sm_90 PTX (kernel_registers.py,
#: triton 3.6): the compiler takes 96-128 registers at d = 1024 (12-16 bytes spilled without
#: a bias or scale) and 108-128 at d = 2048, so 4 programs fit; capped at 96, no bias /
#: scale / running-sum combination spills at either width (with separate keys the cap
#: spills 4-144 bytes, so keyed calls keep the compiler's choice). H200, bf16,
#: docs/benchmarks.md: d = 2048, session 11 run 5, two passes: 0.398 / 0.398 ms against
#: 0.422 / 0.423 at 16384x2048x9, 1.288 / 1.326 against 1.367 / 1.368 at 16384x2048x33
#: (session 12 run 2: 0.399 against 0.422, 1.353-1.392 against 1.382); d = 1024, session 12
#: run 2: 0.125 / 0.358 / 0.690 against 0.132 / 0.377 / 0.730 ms at 16384 tokens and N = 4 /
#: 16 / 33. The cap with 8 programs per SM was slower (0.439 / 1.428 at d = 2048), as were
#: caps at 80 (6 programs, spills) and at d = 4096.
RESIDENCY_ELEMS = 2048
RESIDENCY_WARPS = 4
CAPPED_BACKWARD_MAXNREG = 96
CAPPED_BACKWARD_PER_SM = 5
#: route's backward with several heads at rows padded to MULTI_HEAD_ROW, on the same launch
#: (2 tokens, RESIDENCY_WARPS warps). Sessions 11-12 gave it 8 programs per SM, more than
#: the 3 that its 142-168 registers let stay resident (H200, bf16, 16384 tokens, d = 1024, 16
#: heads: 0.204 / 0.212 ms against 0.214 / 0.277 at N = 8, 0.701 / 0.720 against 0.731 /
#: 0.731 at N = 33; docs/benchmarks.md session 11 run 2, session 12 run 2). Since session 37
#: its sources come through Triton's pipeline in MULTI_HEAD_BACKWARD_STAGES stages at
#: MULTI_HEAD_BACKWARD_MAXNREG registers, 4 programs per SM (sm_90 code of the device's
#: Triton 3.6 with running sums: 128 registers, no spill, 4 resident, against 146 and 3;
#: kernel_registers.py): at full MHAR's sites (16 heads, running sums) 0.272 / 0.677 /
#: 1.121 ms against 0.318 / 0.796 / 1.276 for the old launch at N = 9 / 25 / 41 (its
#: ``_ps8`` timing, the same launch: the default's, timed first at each shape, read 0.511 /
#: 0.942 / 1.280, a warm-up effect), 1.13-1.20x the floor that counts the running sums;
#: full MHAR's step 124.4 against 129.5 ms (0.631x against 0.606x the baseline; our kernels
#: 45.6 against 53.0 ms a step; session 37 runs 1-2). The pipeline alone was 0.442 / 0.769 /
#: 1.225, the cap alone 0.318 / 0.797 / 1.277: the two together. Timed without separate keys
#: (no scheme routes several heads with keys): keyed calls keep the launch before, 8
#: programs per SM at the compiler's registers, no pipeline.
MULTI_HEAD_ROW = 1024
MULTI_HEAD_BACKWARD_PER_SM = 4
MULTI_HEAD_BACKWARD_MAXNREG = 128
KEYED_MULTI_HEAD_BACKWARD_PER_SM = 8
#: route's backward on its wide launch (one-head rows padded to WIDE_ROW, WIDE_TOKENS tokens,
#: WIDE_BACKWARD_WARPS warps; 255 registers, 2 programs resident per SM): 8 programs per SM
#: were faster than 4 in every run that timed both on this launch, by 0.5-1.1 %: 0.830-0.833
#: against 0.834-0.840 ms at 16384x4096x9 and 2.608-2.624 against 2.625-2.647 at
#: 8192x4096x65 (H200, bf16, docs/benchmarks.md: session 11 runs 2, 3, 5a, 5b and session 12
#: runs 1, 2, six of each); 2 per SM was level at N = 9 and 2-3 % slower at N = 65.
WIDE_BACKWARD_PER_SM = 8


def _route_backward_residency(heads: int, row: int, has_keys: bool, block_t: int,
                              warps: int) -> tuple[int | None, int]:
    """Register cap (None: the compiler's choice) and programs per SM of route's backward
    unless a config sets them; each rule only on the launches it was timed with."""
    if _is_wide(heads, row) and block_t == WIDE_TOKENS and warps == WIDE_BACKWARD_WARPS:
        return None, WIDE_BACKWARD_PER_SM
    if block_t * row != RESIDENCY_ELEMS or warps != RESIDENCY_WARPS:
        return None, BACKWARD_PER_SM
    if heads == 1 and row >= 1024 and not has_keys:
        return CAPPED_BACKWARD_MAXNREG, CAPPED_BACKWARD_PER_SM
    if _is_multi_head(heads, row):
        if has_keys:  # the cap was timed without keys: keyed calls keep the launch before
            return None, KEYED_MULTI_HEAD_BACKWARD_PER_SM
        return MULTI_HEAD_BACKWARD_MAXNREG, MULTI_HEAD_BACKWARD_PER_SM
    return None, BACKWARD_PER_SM


#: values of the kernels' ``prefetch`` config: False (each source loaded when used), True
#: (the next source requested while one is used) or, route_many's per-token backward only,
#: 2 (two sources ahead). Two ahead in route's kernels and route_many's forward was slower at
#: every timed shape (H200, docs/benchmarks.md session 11 run 2), and was taken out again.
PREFETCH_DEPTHS = (False, True)
#: software pipeline stages of route's kernels where they were measured faster (else 0:
#: the register prefetch, PREFETCH; H200, bf16, 16384 tokens unless said, session 18's run
#: 4, docs/benchmarks.md): the forward for one-head rows of at most NARROW_ROW elements
#: (d = 1024: 0.150 / 0.286 ms against 0.160 / 0.302 at N = 16 / 33, a WAV site 0.160
#: against 0.178; at d = 2048 and 4096 level or up to 10 % slower), the backward for one
#: head with running sums (a WAV site: 0.462 against 0.524) or on rows of WIDE_ROW (d =
#: 4096: 0.696 against 0.831 ms at N = 9, 2.298 against 2.618 at 8192 tokens, N = 65; level
#: at d = 1024 and 2048 without running sums)
ROUTE_FORWARD_STAGES = 3
ROUTE_BACKWARD_STAGES = 3
#: the backward's stages for several heads on rows of MULTI_HEAD_ROW padded elements
#: without keys, with its register cap (MULTI_HEAD_BACKWARD_MAXNREG's comment; 0: the
#: register prefetch). The multi-head forward keeps the register prefetch: the pipeline was
#: within 2 % of it at full MHAR's sites (session 37 run 1: 0.254 / 0.400 ms against 0.258 /
#: 0.403 at N = 25 / 41), as at N = 4 / 8 in session 18
MULTI_HEAD_BACKWARD_STAGES = 3
#: the backward joins a source's three row sums (the key's squares, ``<k, qw>``, ``<v, g>``)
#: in one reduction (:func:`three_row_sums`; the config's ``fused_sums``). Its sm_90 code
#: (the device's Triton 3.6, d = 1024, one head, ``benchmarks/kernel_registers.py``) has 9
#: barriers where the warps of a program wait for each other instead of 15 (19 against 25
#: with running sums). Session 33 (H200, bf16, 16384 tokens, docs/benchmarks.md): 0.353 /
#: 0.678 ms against 0.359 / 0.691 at N = 16 / 33, a WAV site 0.449 against 0.457, 16 heads
#: level; WAV's backward kernels 17.5 against 18.1 ms a step. Off in the interpreter
#: (:func:`default_fused_sums`)
BACKWARD_FUSED_SUMS = True


def _check_stages(stages, default: int, op: str, name: str = "stages") -> int:
    """Software pipeline stages, the launch config's entry ``name`` (None: ``default``): 0 or 1
    (no pipelining: the loads wait, or are prefetched into registers) or at least 2."""
    if stages is None:
        return default
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 0:
        raise ValueError(f"{op} (Triton): config {name} must be an int >= 0; found {stages!r}")
    return stages


def _configured(config: dict | None, name: str) -> bool:
    """Whether a launch config sets ``name`` (to anything but None, which means the default)."""
    return config is not None and config.get(name) is not None


def _positive_int(op: str, name: str, value) -> int:
    """The launch config's entry ``name``, if it is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{op} (Triton): config {name} must be a positive int; found {value!r}")
    return value


def _check_prefetch(prefetch, op: str, allowed: tuple = PREFETCH_DEPTHS, kernel: str = "") -> int:
    """``prefetch`` as a kernel's PREFETCH depth (0, 1 or 2), checked against ``allowed``
    (``kernel``, e.g. "the tiled backward", names the kernel in the error where an op has several)."""
    if isinstance(prefetch, float) or prefetch not in allowed:
        where = f" for {kernel}" if kernel else ""
        raise ValueError(f"{op} (Triton): config prefetch must be one of {allowed}{where}; found {prefetch!r}")
    return int(prefetch)


#: the range of the ``maxnreg`` config (registers per thread; ptxas takes 16-255): a cap
#: that lets more programs stay resident per SM, at the price of spills
MAXNREG_RANGE = (16, 255)


def _register_cap(cfg: dict, op: str = "route") -> dict:
    """Launch options for ``cfg["maxnreg"]`` (checked; unset or None: no cap, the compiler's
    choice). ``op`` names the op in the error."""
    cap = cfg.get("maxnreg")
    if cap is None:
        return {}
    lo, hi = MAXNREG_RANGE
    if not isinstance(cap, int) or isinstance(cap, bool) or not lo <= cap <= hi:
        raise ValueError(f"{op} (Triton): config maxnreg must be an int from {lo} to {hi} or None; found {cap!r}")
    return {"maxnreg": cap}


def _aligned(*groups) -> bool:
    return all(t.data_ptr() % 16 == 0 for group in groups if group for t in group)


def _check_supported(values: Sequence[Tensor], keys, *params, op: str = "route") -> None:
    """The dtypes the kernels take, of the sources and of ``params`` (``(name, tensor or
    None)`` pairs); the op's own checks come first (:func:`_check_route_call`)."""
    for name, t in (("values", values[0]), ("keys", keys[0] if keys else None)) + params:
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{op} (Triton): `{name}` must be one of {SUPPORTED_DTYPES}; found {t.dtype}")


def _check_route_call(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
                      out_norm_weight, out_norm_eps) -> None:
    """``depthrewrite.ops.route``'s checks, made again at every launch: the kernels also run
    straight from ``torch.ops.depthrewrite.route`` (a compiled graph, or a caller of the op),
    where no wrapper has checked, and a source of another dtype or shape, or a ``heads``
    that does not divide ``d``, would be misread by the kernel, not caught by it."""
    check_route_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    if out_norm_weight is not None:
        _check_out_norm(values, out_norm_weight, out_norm_eps)
    _check_supported(values, keys, ("query", query), ("key_norm_weight", key_norm_weight), ("logit_bias", logit_bias),
                     ("out_norm_weight", out_norm_weight))


def _contiguous(tensors: Sequence[Tensor | None]) -> list[Tensor | None]:
    # the kernels take (tokens, d) rows behind each pointer: no reshape needed, which
    # saves the host a view per tensor and call. None stays None (no running sum)
    return [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]


def _scale_table(source_scale: Tensor | None) -> Tensor | None:
    """The kernels read source ``i``'s scale of token ``t`` at ``i * tokens + t`` of a float32
    buffer: ``source_scale`` (checked ``(N, *batch)``) as it is where it already is one (no op
    on the host), else a float32 copy."""
    if source_scale is None or (source_scale.dtype == torch.float32 and source_scale.is_contiguous()):
        return source_scale
    return source_scale.detach().to(torch.float32).contiguous()


def route_forward(
    values: Sequence[Tensor], keys: Sequence[Tensor] | None, query: Tensor, key_norm_weight: Tensor,
    logit_bias: Tensor | None, source_scale: Tensor | None, heads: int, eps: float,
    out_norm_weight: Tensor | None = None, out_norm_eps: float = 1e-6, config: dict | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused forward; inputs as checked by ``depthrewrite.ops.route``. Returns what
    ``depthrewrite::route`` returns: ``out``, the float32 log-sum-exp ``lse`` of shape
    ``(*batch, heads)`` (0 for one source) and ``normed = rms_norm(out) * out_norm_weight``
    (an empty tensor without ``out_norm_weight``). ``config`` overrides the launch choices
    (``block_t``, ``num_warps``, ``maxnreg``, ``prefetch``, ``fuse_norm``, ``pair_reduce``:
    the row's two sums per source in one reduction, level at 16 heads and slower at d = 2048
    in session 13's runs; ``stages``: the sources through Triton's software pipeline, 0 for
    the register prefetch; unset: ``_route_forward_stages``; ``lazy_rescale``: LAZY_RESCALE's
    choice) for tuning runs."""
    _check_route_call(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, out_norm_weight,
                      out_norm_eps)
    n, d = len(values), values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads)
    flat_v = _contiguous(values)
    shape, device = values[0].shape, values[0].device
    tokens = math.prod(values[0].shape[:-1])
    out = torch.empty(shape, dtype=values[0].dtype, device=device)
    lse = torch.empty(shape[:-1] + (heads,), dtype=torch.float32, device=device)
    has_norm = out_norm_weight is not None
    normed = torch.empty_like(out) if has_norm else out.new_empty((0,))
    if tokens == 0:
        return out, lse, normed
    flat_k = _contiguous(keys) if keys is not None else None
    tables = pointer_tables(device, flat_v, flat_k if flat_k is not None else [])
    vtab, ktab = tables
    if flat_k is None:
        ktab = vtab
    scale = _scale_table(source_scale)
    launch = _forward_launch(config, heads, block_h * block_c, flat_k is not None, has_norm)
    # per pipeline stage: a tile of each source row (and key row) the loop loads
    stage_bytes = launch["block_t"] * block_h * block_c * (1 + (flat_k is not None)) * values[0].dtype.itemsize
    launch["stages"] = fit_stages("route", launch["stages"], stage_bytes, device, _configured(config, "stages"))
    fused_norm = has_norm and launch["fuse_norm"]
    grid = (cdiv(tokens, launch["block_t"]),)
    _route_fwd_kernel[grid](
        vtab, ktab, query.contiguous(), key_norm_weight.contiguous(),
        logit_bias if logit_bias is not None else query, scale if scale is not None else query, out, lse,
        out_norm_weight.contiguous() if fused_norm else query, normed if fused_norm else out,
        tokens, n, d, d // heads, heads, float(eps), float(out_norm_eps),
        HAS_KEYS=flat_k is not None, HAS_BIAS=logit_bias is not None, HAS_SCALE=scale is not None,
        ONE_SOURCE=n == 1, BLOCK_T=launch["block_t"], BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=launch["prefetch"],
        ALIGNED=tables.all_aligned(), HAS_NORM=fused_norm, PAIR_REDUCE=launch["pair_reduce"],
        STAGES=launch["stages"], LAZY=launch["lazy_rescale"], num_warps=launch["num_warps"],
        **_register_cap(launch),
    )
    if has_norm and not fused_norm:
        block_d = _next_pow2(d)
        norm_t = _tokens_per_program(block_d)
        _out_norm_fwd_kernel[(cdiv(tokens, norm_t),)](
            out, out_norm_weight.contiguous(), normed, tokens, d, float(out_norm_eps),
            BLOCK_T=norm_t, BLOCK_D=block_d, num_warps=_num_warps(norm_t * block_d),
        )
    return out, lse, normed


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _backward_programs(device: torch.device, num_blocks: int, per_sm: int) -> int:
    if device.type == "cuda":
        return max(1, min(num_blocks, per_sm * _multiprocessors(device)))
    return max(1, min(num_blocks, 4))  # the interpreter: few programs, same code path


def _forward_launch(config: dict | None, heads: int, row: int, has_keys: bool, has_norm: bool) -> dict:
    """:func:`route_forward`'s launch choices: ``config``'s entries, checked, over the
    measured defaults (``block_t``, ``num_warps``, ``maxnreg``, ``prefetch``, ``fuse_norm``,
    ``pair_reduce``, ``stages``, ``lazy_rescale``)."""
    cfg = {"block_t": _route_forward_tokens(heads, row), "prefetch": True, "fuse_norm": FUSE_NORM, "pair_reduce": False,
           "lazy_rescale": LAZY_RESCALE, **(config or {})}
    block_t = _check_block_t(cfg["block_t"])
    warps = cfg.get("num_warps") or _route_forward_warps(heads, row, block_t)
    fused_norm = has_norm and cfg["fuse_norm"]
    cfg = {"maxnreg": _route_forward_cap(heads, row, has_keys, fused_norm, block_t, warps), **cfg}
    prefetch = _check_prefetch(cfg["prefetch"], "route")
    check_flag(cfg["pair_reduce"], "pair_reduce", "route")
    check_flag(cfg["lazy_rescale"], "lazy_rescale", "route")
    stages = _check_stages(cfg.get("stages"), _route_forward_stages(heads, row), "route")
    return {**cfg, "block_t": block_t, "num_warps": warps, "prefetch": prefetch, "stages": stages}


def _norm_backward_pass(g, out, gn, weight, eps, part_n, tokens, d) -> Tensor:
    block_d = _next_pow2(d)
    block_t = _tokens_per_program(block_d)
    num_blocks = cdiv(tokens, block_t)
    total = torch.empty((tokens, d), dtype=torch.float32, device=g.device)
    _out_norm_bwd_kernel[(part_n.shape[0],)](
        g, out, gn, weight.contiguous(), total, part_n, tokens, d, float(eps), num_blocks,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=_num_warps(block_t * block_d),
    )
    return total


def _check_saved(out: Tensor, lse: Tensor, values: Sequence[Tensor], heads: int, op: str = "route",
                 which: str = "") -> None:
    # out and lse must be what the forward returned for these values: a mismatch would be
    # read out of bounds by the kernel, not caught by it. ``which`` names an entry of a list.
    lse_shape = tuple(values[0].shape[:-1]) + (heads,)
    if out.shape != values[0].shape or out.dtype != values[0].dtype or out.device != values[0].device:
        raise ValueError(f"{op} (Triton): `out{which}` must be the forward output, shaped, typed and placed like "
                         f"values[0] ({tuple(values[0].shape)}, {values[0].dtype}, {values[0].device}); found "
                         f"{tuple(out.shape)}, {out.dtype}, {out.device}")
    if tuple(lse.shape) != lse_shape or lse.dtype != torch.float32 or lse.device != values[0].device:
        raise ValueError(f"{op} (Triton): `lse{which}` must be the forward's float32 log-sum-exp of shape "
                         f"{lse_shape} on {values[0].device}; found shape {tuple(lse.shape)}, dtype {lse.dtype}, "
                         f"device {lse.device}")


def check_gradient(name: str, grad: Tensor, like: Tensor, op: str) -> None:
    """``grad`` shaped like ``like`` and on its device (any floating dtype: the launchers
    convert it); the kernel reads it with ``like``'s row count."""
    _check_param(name, grad, tuple(like.shape), like.device, optional=False, op=f"{op} (Triton)")


def _gradient_outputs(n: int, shape, dtype, device, new, given: Sequence[Tensor] | None, name: str,
                      op: str = "route_backward") -> list[Tensor]:
    """Where the kernel writes each source's gradient: the tensors ``given`` (contiguous,
    one per source; a source's running sum may be among them, read and written element by
    element in one thread), else new ones. ``op``: the op named in the error."""
    if given is None:
        return [new(shape, dtype=dtype, device=device) for _ in range(n)]
    if len(given) != n or any(t.shape != shape or t.dtype != dtype or not t.is_contiguous() for t in given):
        raise ValueError(f"{op} (Triton): `{name}` must be {n} contiguous tensors shaped {tuple(shape)} "
                         f"of {dtype}; found {[(tuple(t.shape), t.dtype, t.is_contiguous()) for t in given]}")
    return list(given)


def route_backward(
    grad_out: Tensor, out: Tensor, lse: Tensor, values: Sequence[Tensor], keys: Sequence[Tensor] | None,
    query: Tensor, key_norm_weight: Tensor, logit_bias: Tensor | None, source_scale: Tensor | None, heads: int,
    eps: float, grad_normed: Tensor | None = None, out_norm_weight: Tensor | None = None, out_norm_eps: float = 1e-6,
    config: dict | None = None, grad_values_acc: Sequence[Tensor | None] | None = None,
    grad_keys_acc: Sequence[Tensor | None] | None = None, grad_values_out: Sequence[Tensor] | None = None,
    grad_keys_out: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor, Tensor]:
    """Fused one-pass backward; ``out`` and ``lse`` are what :func:`route_forward` (or the
    reference op) returned for these inputs; ``grad_normed`` is the gradient of the fused
    output norm's result (None: that result was not used); ``grad_values_acc`` /
    ``grad_keys_acc``: running sums (None or one entry per source, None or a tensor shaped
    like it) that the gradients are added to as they are written; ``grad_values_out`` /
    ``grad_keys_out``: the tensors to write them into (one per source; a running sum may be
    its own source's output: ``depthrewrite::route_backward_into_``), by default new ones. Returns what
    ``depthrewrite::route_backward`` returns. ``config`` overrides the launch choices
    (``block_t``, ``num_warps``, ``maxnreg``, ``per_sm``, ``prefetch``, ``fuse_norm``, ``stages``:
    as the forward's; unset: ``_route_backward_stages``) for tuning runs, and
    ``exact_softmax_grad`` (False by default: the softmax backward's ``sum_j a_j <v_j, g>``
    taken as ``<out, g>`` from the saved output; True: formed from the sources, read twice,
    over ``sum_j a_j``; :mod:`depthrewrite.kernels`' ``set_exact_softmax_grad``)."""
    _check_route_call(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, out_norm_weight,
                      out_norm_eps)
    _check_saved(out, lse, values, heads)
    check_gradient("grad_out", grad_out, values[0], "route")
    if grad_normed is not None:
        check_gradient("grad_normed", grad_normed, values[0], "route")
    _check_acc("grad_values_acc", grad_values_acc, values)
    _check_acc("grad_keys_acc", grad_keys_acc, keys)
    n, d = len(values), values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads)
    shape = values[0].shape
    flat_v = _contiguous(values)
    flat_k = _contiguous(keys) if keys is not None else None
    tokens = math.prod(values[0].shape[:-1])
    device, dtype = values[0].device, values[0].dtype
    g = grad_out.to(dtype).contiguous()
    flat_out = out.contiguous()
    flat_lse = lse.contiguous()
    grad_v = _gradient_outputs(n, shape, dtype, device, torch.empty, grad_values_out, "grad_values_out")
    # one source: the weight is the constant 1, so the keys get exactly zero gradient
    new_k = torch.zeros if n == 1 else torch.empty
    grad_k = (_gradient_outputs(n, shape, dtype, device, new_k, grad_keys_out, "grad_keys_out")
              if flat_k is not None else [])
    has_acc = grad_values_acc is not None or (grad_keys_acc is not None and n > 1)
    launch = _backward_launch(config, heads, block_h * block_c, flat_k is not None, has_acc)
    block_t = launch["block_t"]
    # per pipeline stage: a tile of each source row (and key row) and, with running sums
    # (typed like the sources), of theirs
    stage_bytes = block_t * block_h * block_c * (1 + (flat_k is not None)) * dtype.itemsize * (1 + has_acc)
    launch["stages"] = fit_stages("route", launch["stages"], stage_bytes, device, _configured(config, "stages"))
    num_blocks = cdiv(tokens, block_t)
    programs = _backward_programs(device, num_blocks, launch["per_sm"])
    # the kernel writes every entry of these partial sums (one row per program, one entry
    # per source and token), except with no tokens (no launch) or one source (no logits)
    new_part = torch.zeros if tokens == 0 else torch.empty
    part_r = new_part((programs, d), dtype=torch.float32, device=device)
    # per source and token: sum over heads of d z (the bias gradient before the token sum);
    # without a bias the kernel writes none, and part_r stands in for the unread pointer
    part_b = part_r
    if logit_bias is not None:
        part_b = (torch.zeros if n == 1 else new_part)((n, tokens), dtype=torch.float32, device=device)
    has_norm = out_norm_weight is not None and grad_normed is not None
    # per program: sum over its tokens of grad_normed * rms_norm(out) (the norm weight's
    # gradient); without the norm the kernel writes none (part_r again stands in)
    part_n = new_part((programs, d), dtype=torch.float32, device=device) if has_norm else part_r
    gn = grad_normed.to(dtype).contiguous() if has_norm else g
    fused_norm = has_norm and launch["fuse_norm"]
    if has_norm and not fused_norm and tokens > 0:
        # the norm's backward as a pass of its own: g becomes the fp32 total gradient of out
        g = _norm_backward_pass(g, flat_out, gn, out_norm_weight, out_norm_eps, part_n, tokens, d)
    if n == 1 and flat_k is not None:
        _one_source_key_grad(grad_k[0], grad_keys_acc, grad_keys_out)
    if tokens > 0:
        # running sums as rows; no list given: a table of 0 entries (no source has one)
        acc_v, acc_k = (_contiguous(acc or [None] * n) for acc in (grad_values_acc, grad_keys_acc))
        tables = pointer_tables(device, flat_v, grad_v, flat_k or [], grad_k, acc_v, acc_k)
        vtab, gvtab, ktab, gktab, vacc, kacc = tables
        if flat_k is None:
            ktab, gktab = vtab, gvtab
        scale = _scale_table(source_scale)
        _route_bwd_kernel[(programs,)](
            g, flat_out, flat_lse, vtab, ktab, gvtab, gktab, vacc if has_acc else vtab, kacc if has_acc else vtab,
            query.contiguous(), key_norm_weight.contiguous(),
            logit_bias if logit_bias is not None else query, scale if scale is not None else query,
            part_r, part_b, gn, out_norm_weight.contiguous() if fused_norm else query, part_n,
            tokens, n, d, d // heads, heads, float(eps), num_blocks, float(out_norm_eps),
            HAS_KEYS=flat_k is not None, HAS_BIAS=logit_bias is not None, HAS_SCALE=scale is not None,
            ONE_SOURCE=n == 1, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_C=block_c,
            ALIGNED=tables.all_aligned(),
            PREFETCH=launch["prefetch"], HAS_NORM=fused_norm, HAS_ACC=has_acc, STAGES=launch["stages"],
            EXACT=launch["exact_softmax_grad"], FUSED_SUMS=launch["fused_sums"], num_warps=launch["num_warps"],
            **_register_cap(launch),
        )
    return (grad_v, grad_k, *_parameter_grads(part_r, part_b, part_n, query, key_norm_weight, logit_bias,
                                              out_norm_weight, has_norm))


def _backward_launch(config: dict | None, heads: int, row: int, has_keys: bool, has_acc: bool) -> dict:
    """:func:`route_backward`'s launch choices: ``config``'s entries, checked, over the
    measured defaults (``block_t``, ``num_warps``, ``maxnreg``, ``per_sm``, ``prefetch``,
    ``fuse_norm``, ``stages``)."""
    # prefetch on by default: 18-25 % faster on H200 (module docstring)
    cfg = {"block_t": _route_tokens(heads, row), "prefetch": True, "fuse_norm": FUSE_NORM,
           "exact_softmax_grad": False, **(config or {})}
    check_flag(cfg["exact_softmax_grad"], "exact_softmax_grad", "route")
    cfg["fused_sums"] = check_flag(cfg.get("fused_sums", default_fused_sums(BACKWARD_FUSED_SUMS)), "fused_sums",
                                   "route")
    block_t = _check_block_t(cfg["block_t"])
    warps = cfg.get("num_warps") or _route_backward_warps(heads, row, block_t)
    cap, per_sm = _route_backward_residency(heads, row, has_keys, block_t, warps)
    cfg = {"maxnreg": cap, "per_sm": per_sm, **cfg}
    prefetch = _check_prefetch(cfg["prefetch"], "route")
    stages = _check_stages(cfg.get("stages"), _route_backward_stages(heads, row, has_acc, has_keys), "route")
    return {**cfg, "block_t": block_t, "num_warps": warps, "prefetch": prefetch, "stages": stages}


def check_flag(flag, name: str, op: str) -> bool:
    """A config's entry ``name`` that is True or False, else a ValueError naming ``op``."""
    if not isinstance(flag, bool):
        raise ValueError(f"{op} (Triton): config {name} must be True or False; found {flag!r}")
    return flag


def default_fused_sums(enabled: bool) -> bool:
    """A backward's default for joining its row sums in one reduction (:func:`three_row_sums`):
    ``enabled``, but off in Triton's interpreter. There a reduction over an axis that is not
    the innermost (the joined sums') adds in sequence, which at wide rows is less accurate than
    the GPU's tree (about 30x the error of the separate sums at 7186 columns); the GPU reduces
    each joined operand in the same order as alone."""
    return enabled and not triton.knobs.runtime.interpret


def _one_source_key_grad(grad_k: Tensor, grad_keys_acc, grad_keys_out) -> None:
    """One source: the key's own gradient is zero, so its running sum passes through as is,
    and a given output without one is zeroed (new outputs are made as zeros)."""
    acc0 = grad_keys_acc[0] if grad_keys_acc is not None else None
    if acc0 is not None and acc0 is not grad_k:
        grad_k.copy_(acc0)
    elif acc0 is None and grad_keys_out is not None:
        grad_k.zero_()


def _parameter_grads(part_r, part_b, part_n, query, key_norm_weight, logit_bias, out_norm_weight,
                     has_norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The second pass of the deterministic reduction (a fixed-order sum over the programs'
    partial sums) as torch ops: the gradients of the query, the key-norm weight, the logit
    bias and the output norm's weight (empty for an absent input, zeros when ``normed`` was
    not used). Not in one kernel (:func:`.param_grads.finish`) as ``route_many``'s and
    ``route_merge``'s: without the norm that replaces three small launches (the sum and the
    two products), and session 30 measured no gain: WAV recorded as CUDA graphs 113.2 ms a
    step with the kernel against 112.7 without (its GPU time 0.2 ms less), and the host's
    time per call 336-391 us with it against 296-346 without, within the spread of those
    host timings."""
    grad_query, grad_weight = query_and_weight_grads(PartialSums.of(part_r), query, key_norm_weight)
    if logit_bias is None:
        grad_bias = query.new_empty((0,))
    else:
        grad_bias = part_b.sum(1)
        if logit_bias.dtype != grad_bias.dtype:
            grad_bias = grad_bias.to(logit_bias.dtype)
    if out_norm_weight is None:
        grad_norm_weight = query.new_empty((0,))
    elif has_norm:
        grad_norm_weight = part_n.sum(0).to(out_norm_weight.dtype)
    else:  # normed was not used
        grad_norm_weight = torch.zeros_like(out_norm_weight)
    return grad_query, grad_weight, grad_bias, grad_norm_weight
