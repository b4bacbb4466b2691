"""Fused Triton kernels for ``depthrewrite::route_merge`` (:mod:`depthrewrite.ops.route_merge`):
the second phase of the two-phase computation, J merged results mixed, forward and backward.

Both kernels take BLOCK_T tokens per step as ``(BLOCK_T, BLOCK_H, BLOCK_C)`` tiles (H heads
of C channels, padded to powers of two), as ``route``'s kernels do, and J = 1 or 2 results
(Block AttnRes, block MHAR: 1; DAR: 2, one per stream), each as an unrolled call of one
helper. The rows are read through int64 pointer tables (:mod:`.pointer_tables`), in the
activation dtype, with float32 math.

- forward: per token and result, the key's RMS statistic and per-head logit, the new
  source's weight ``a = sigmoid(z - lse)``, the merged row, summed with its mix weight:
  reads ``out_j``, ``v_j`` (and ``k_j``) once, writes ``x`` (with the fused output norm
  ``rms_norm(x) * w`` instead: the row is whole on chip).
- backward: a persistent grid (``PER_SM`` programs per SM) over blocks of tokens; per token
  and result it recomputes the forward's statistics from the same rows, writes the
  gradients of ``out_j``, ``lse_j``, ``v_j`` (and ``k_j``), and adds the parameter
  gradients' ``dz * khat`` and the mix weight's ``<g, r_j>`` to per-program partial sums,
  added afterwards in a fixed order (deterministic, no atomics). With the output norm it
  first makes ``x`` again from the same rows (on sm_90 the compiler keeps them in registers
  for the gradients: no second load, ``benchmarks/kernel_registers.py``) and runs the
  norm's backward, its weight's gradient summed per program likewise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .grid import cdiv
from .param_grads import PartialSums, finish
from .pointer_tables import pointer_tables
from .shared_memory import fit_stages
from ..ops.route_merge import _check_inputs as check_route_merge_inputs
from .route_triton import (
    NARROW_ROW, _aligned, _backward_programs, _check_block_t, _check_stages, _check_supported, _configured,
    _contiguous, _positive_int, _row_blocks, _src_ptr, _tokens_per_program, check_gradient,
)

#: results a launch merges (one per DAR stream); more run the reference
MAX_RESULTS = 2
#: backward programs per SM of the persistent grid
PER_SM = 4
#: the backward's software-pipeline stages over its token blocks (0: none), for one-head
#: rows; multi-head rows (block MHAR) take MULTI_HEAD_BACKWARD_STAGES: 3 stages made their
#: backward 12 % faster at d = 1024 with 16 heads, 16384 tokens, CUDA-graph replays on H200
#: (docs/benchmarks.md: 0.091 against 0.104 ms in session 27, 0.081 against 0.093 and with
#: the branch norm fused, the fused merge's form, 0.098 against 0.111 in session 30; end to
#: end 3.18 against 4.17 ms a step, block MHAR's fused merge 0.848x against 0.844x the
#: baseline, session 31), where the one-head cases were slower with them in the normed forms
#: the fused merge takes
BACKWARD_STAGES = 0
MULTI_HEAD_BACKWARD_STAGES = 3


@triton.jit
def _row_tiles(H, C, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """The ``(BLOCK_H, BLOCK_C)`` column offsets of a row and their mask."""
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    return hh[:, None] * C + cc[None, :], (hh[:, None] < H) & (cc[None, :] < C)


@triton.jit
def _tiles(pid, T, H, C, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """Token indices (int64), row offsets and masks of token block ``pid``."""
    tok = (tl.full((), 0, tl.int64) + pid) * BLOCK_T + tl.arange(0, BLOCK_T)  # pid may be a Python int (interpreter)
    hh = tl.arange(0, BLOCK_H)
    col, cmask = _row_tiles(H, C, BLOCK_H, BLOCK_C)
    tmask = tok < T
    mask = tmask[:, None, None] & cmask[None, :, :]
    hmask = tmask[:, None] & (hh[None, :] < H)
    offs = tok[:, None, None] * (H * C) + col[None, :, :]
    hoffs = tok[:, None] * H + hh[None, :]
    return tok, col, cmask, mask, hmask, offs, hoffs


@triton.jit
def _merge_rows(j, otab, ltab, vtab, ktab, q_ptr, w_ptr, offs, mask, hoffs, hmask, col, cmask, D, eps, ptr_ty,
                HAS_KEYS: tl.constexpr, ALIGNED: tl.constexpr):
    """Result ``j``'s rows and statistics for a token block: ``out``, ``v``, the normalized
    key ``khat``, its ``rstd``, the per-query row ``qw`` and the weight ``a`` (float32)."""
    o = tl.load(_src_ptr(otab, j, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(_src_ptr(vtab, j, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
    k = v
    if HAS_KEYS:
        k = tl.load(_src_ptr(ktab, j, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(_src_ptr(ltab, j, tl.pointer_type(tl.float32), False) + hoffs, mask=hmask, other=0.0)
    qw = (tl.load(q_ptr + j * D + col, mask=cmask, other=0.0).to(tl.float32)
          * tl.load(w_ptr + j * D + col, mask=cmask, other=0.0).to(tl.float32))
    rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 2), 1) / D + eps)
    khat = k * rstd[:, None, None]
    a = tl.sigmoid(tl.sum(khat * qw[None, :, :], 2) - lse)
    return o, v, khat, rstd, qw, a


@triton.jit
def _merged(otab, ltab, vtab, ktab, q_ptr, w_ptr, m_ptr, offs, mask, hoffs, hmask, col, cmask, D, eps, ptr_ty,
            J: tl.constexpr, HAS_KEYS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr):
    """``x = sum_j m_j (out_j + a_j (v_j - out_j))`` for a token block, float32."""
    x = tl.zeros((BLOCK_T, BLOCK_H, BLOCK_C), tl.float32)
    for j in tl.static_range(J):
        o, v, khat, rstd, qw, a = _merge_rows(j, otab, ltab, vtab, ktab, q_ptr, w_ptr, offs, mask, hoffs, hmask,
                                              col, cmask, D, eps, ptr_ty, HAS_KEYS, ALIGNED)
        x += tl.load(m_ptr + j).to(tl.float32) * (o + a[:, :, None] * (v - o))
    return x


@triton.jit
def _out_norm_stats(x, mask, D, norm_eps):
    """The normalized rows of ``x`` (float32, not rounded) and their RMS statistic per token
    (over the full width)."""
    x = tl.where(mask, x, 0.0)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, 2), 1) / D + norm_eps)
    return x * rstd[:, None, None], rstd


@triton.jit
def _route_merge_fwd_kernel(otab, ltab, vtab, ktab, q_ptr, w_ptr, m_ptr, nw_ptr, x_ptr, T, D, C, H, eps, norm_eps,
                            J: tl.constexpr, HAS_KEYS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr):
    """``x`` (or with HAS_NORM ``rms_norm(x) * nw``) for one block of BLOCK_T tokens."""
    act = x_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    tok, col, cmask, mask, hmask, offs, hoffs = _tiles(tl.program_id(0), T, H, C, BLOCK_T, BLOCK_H, BLOCK_C)
    x = _merged(otab, ltab, vtab, ktab, q_ptr, w_ptr, m_ptr, offs, mask, hoffs, hmask, col, cmask, D, eps, ptr_ty,
                J, HAS_KEYS, BLOCK_T, BLOCK_H, BLOCK_C, ALIGNED)
    if HAS_NORM:
        xhat, _ = _out_norm_stats(x, mask, D, norm_eps)
        x = xhat * tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)[None, :, :]
    tl.store(x_ptr + offs, x.to(act), mask=mask)


@triton.jit
def _route_merge_bwd_kernel(g_ptr, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr, w_ptr, m_ptr, nw_ptr,
                            part_r_ptr, part_m_ptr, part_n_ptr, T, D, C, H, eps, norm_eps, num_blocks,
                            J: tl.constexpr, HAS_KEYS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr,
                            STAGES: tl.constexpr = 0):
    """A persistent grid over blocks of tokens: every gradient row written once; per program
    the sums over its tokens of ``dz_j * khat_j`` (the parameter gradients before the
    parameter products) and of ``<g, r_j>`` (the mix weights'), one row / entry per result;
    with HAS_NORM (``g_ptr`` is the gradient of the normed output) first the norm's backward,
    ``x`` made again from the same rows, and the sum of ``g * xhat`` (the norm weight's).
    STAGES >= 2: the token blocks through Triton's software pipeline (the next blocks' rows
    copied into shared memory while this one's are used)."""
    pid = tl.program_id(0)
    r0 = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    r1 = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    n_acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    m0 = tl.zeros((BLOCK_H,), tl.float32)
    m1 = tl.zeros((BLOCK_H,), tl.float32)
    col, cmask = _row_tiles(H, C, BLOCK_H, BLOCK_C)
    if STAGES >= 2:
        for blk in tl.range(pid, num_blocks, tl.num_programs(0), num_stages=STAGES):
            r0, m0, r1, m1, n_acc = _merge_block_grads(
                blk, r0, m0, r1, m1, n_acc, g_ptr, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr, w_ptr,
                m_ptr, nw_ptr, col, cmask, T, D, C, H, eps, norm_eps, J, HAS_KEYS, HAS_NORM, BLOCK_T, BLOCK_H,
                BLOCK_C, ALIGNED)
    else:
        for blk in range(pid, num_blocks, tl.num_programs(0)):
            r0, m0, r1, m1, n_acc = _merge_block_grads(
                blk, r0, m0, r1, m1, n_acc, g_ptr, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr, w_ptr,
                m_ptr, nw_ptr, col, cmask, T, D, C, H, eps, norm_eps, J, HAS_KEYS, HAS_NORM, BLOCK_T, BLOCK_H,
                BLOCK_C, ALIGNED)
    row = pid.to(tl.int64) * J
    tl.store(part_r_ptr + row * D + col, r0, mask=cmask)
    tl.store(part_m_ptr + row, tl.sum(m0, 0))
    if J == 2:
        tl.store(part_r_ptr + (row + 1) * D + col, r1, mask=cmask)
        tl.store(part_m_ptr + row + 1, tl.sum(m1, 0))
    if HAS_NORM:
        tl.store(part_n_ptr + pid.to(tl.int64) * D + col, n_acc, mask=cmask)


@triton.jit
def _merge_block_grads(blk, r0, m0, r1, m1, n_acc, g_ptr, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr,
                       w_ptr, m_ptr, nw_ptr, col, cmask, T, D, C, H, eps, norm_eps, J: tl.constexpr,
                       HAS_KEYS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr):
    """Token block ``blk`` of the backward: its gradient rows written, its terms added to the
    program's partial sums (returned)."""
    act = g_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    _, _, _, mask, hmask, offs, hoffs = _tiles(blk, T, H, C, BLOCK_T, BLOCK_H, BLOCK_C)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        x = _merged(otab, ltab, vtab, ktab, q_ptr, w_ptr, m_ptr, offs, mask, hoffs, hmask, col, cmask, D, eps,
                    ptr_ty, J, HAS_KEYS, BLOCK_T, BLOCK_H, BLOCK_C, ALIGNED)
        xhat, rstd = _out_norm_stats(x, mask, D, norm_eps)
        n_acc += tl.sum(tl.where(mask, g * xhat, 0.0), 0)
        # RMSNorm backward: the statistic couples all channels of a row
        g_xhat = g * tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)[None, :, :]
        mt = tl.sum(tl.sum(g_xhat * xhat, 2), 1) / D
        g = tl.where(mask, rstd[:, None, None] * (g_xhat - xhat * mt[:, None, None]), 0.0)
    r0, m0 = _merge_grads(0, g, r0, m0, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr, w_ptr,
                          m_ptr, offs, mask, hoffs, hmask, col, cmask, D, eps, ptr_ty, f32_ty, HAS_KEYS, ALIGNED)
    if J == 2:
        r1, m1 = _merge_grads(1, g, r1, m1, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr, w_ptr,
                              m_ptr, offs, mask, hoffs, hmask, col, cmask, D, eps, ptr_ty, f32_ty, HAS_KEYS, ALIGNED)
    return r0, m0, r1, m1, n_acc


@triton.jit
def _merge_grads(j, g, r_acc, m_acc, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, q_ptr, w_ptr, m_ptr, offs,
                 mask, hoffs, hmask, col, cmask, D, eps, ptr_ty, f32_ty, HAS_KEYS: tl.constexpr,
                 ALIGNED: tl.constexpr):
    """Result ``j``'s gradients for a token block (``g``: the gradient of ``x``, float32),
    written; its partial sums ``r_acc`` and ``m_acc`` returned with this block added."""
    o, v, khat, rstd, qw, a = _merge_rows(j, otab, ltab, vtab, ktab, q_ptr, w_ptr, offs, mask, hoffs, hmask, col,
                                          cmask, D, eps, ptr_ty, HAS_KEYS, ALIGNED)
    diff = v - o
    # padded tokens, heads or channels may carry NaN (eps = 0 on a zero row): kept out of the sums
    m_acc += tl.sum(tl.sum(tl.where(mask, g * (o + a[:, :, None] * diff), 0.0), 2), 0)
    gr = tl.load(m_ptr + j).to(tl.float32) * g
    dz = tl.where(hmask, tl.sum(gr * diff, 2) * a * (1.0 - a), 0.0)
    tl.store(_src_ptr(gltab, j, f32_ty, False) + hoffs, -dz, mask=hmask)
    r_acc += tl.sum(tl.where(mask, dz[:, :, None] * khat, 0.0), 0)
    # RMSNorm backward: the key's statistic couples all of its channels
    dkhat = dz[:, :, None] * qw[None, :, :]
    mt = tl.sum(tl.sum(dkhat * khat, 2), 1) / D
    g_key = rstd[:, None, None] * (dkhat - khat * mt[:, None, None])
    g_value = gr * a[:, :, None]
    act = ptr_ty.element_ty
    if HAS_KEYS:
        tl.store(_src_ptr(gktab, j, ptr_ty, ALIGNED) + offs, g_key.to(act), mask=mask)
    else:
        g_value += g_key
    tl.store(_src_ptr(gvtab, j, ptr_ty, ALIGNED) + offs, g_value.to(act), mask=mask)
    tl.store(_src_ptr(gotab, j, ptr_ty, ALIGNED) + offs, (gr * (1.0 - a[:, :, None])).to(act), mask=mask)
    return r_acc, m_acc


# ------------------------------------------------------------------------ launchers


def _check_launch(outs: Sequence[Tensor], lses: Sequence[Tensor], values, keys, queries, key_norm_weights,
                  mix, heads: int, eps: float, out_norm_weight=None, out_norm_eps: float = 1e-6) -> None:
    # depthrewrite.ops.route_merge's checks, made again at every launch (a compiled graph or
    # a caller of torch.ops.depthrewrite.route_merge reaches the launchers unchecked), then
    # what the kernels take of what the op takes
    check_route_merge_inputs(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight,
                             out_norm_eps)
    _check_supported(values, keys, ("outs", outs[0]), ("queries", queries), ("key_norm_weights", key_norm_weights),
                     ("mix", mix), ("out_norm_weight", out_norm_weight), op="route_merge")
    if len(outs) > MAX_RESULTS:
        raise ValueError(f"route_merge (Triton): at most {MAX_RESULTS} results a launch; found {len(outs)}")
    if any(t.dtype != torch.float32 for t in lses):
        raise ValueError(f"route_merge (Triton): `lses` must be float32 (route_many's for fp32/bf16/fp16 "
                         f"sources); found {[t.dtype for t in lses]}")


def _backward_stage_bytes(block_t: int, row: int, results: int, has_keys: bool, itemsize: int,
                          out_norm_weight: Tensor | None) -> int:
    """Shared memory a stage of the backward's pipeline may take: its loop body loads, per
    token block, the gradient's tile and per result the tiles of its output, value and key,
    and the result's query and key-norm weight rows (counted as float32); with the output
    norm, ``x`` is made again first, loading each result's rows once more, and the norm's
    weight. An upper bound: the compiler may load a row once for both."""
    passes = 2 if out_norm_weight is not None else 1
    tiles = (1 + results * (2 + has_keys) * passes) * block_t * row * itemsize
    weights = (2 * results * passes * 4 + (out_norm_weight.itemsize if out_norm_weight is not None else 0)) * row
    return tiles + weights


def _launch(config: dict | None, row: int, heads: int, results: int, normed: bool) -> dict:
    """Launch choices: ``config``'s entries (``block_t``, ``num_warps``, ``per_sm``, ``stages``:
    the backward's software pipeline; tuning runs, ``benchmarks/route_merge_speed.py``),
    checked, over the defaults."""
    stages = BACKWARD_STAGES if heads == 1 else MULTI_HEAD_BACKWARD_STAGES
    cfg = {"block_t": _tokens_per_program(row), "num_warps": _warps(row, heads, results, normed), "per_sm": PER_SM,
           "stages": stages, **(config or {})}
    unknown = set(cfg) - {"block_t", "num_warps", "per_sm", "stages"}
    if unknown:
        raise ValueError(f"route_merge (Triton): unknown config entries {sorted(unknown)}; "
                         f"expected block_t, num_warps, per_sm, stages")
    cfg["stages"] = _check_stages(cfg["stages"], stages, "route_merge")
    _check_block_t(cfg["block_t"], "route_merge")
    _positive_int("route_merge", "per_sm", cfg["per_sm"])
    warps = _positive_int("route_merge", "num_warps", cfg["num_warps"])
    if warps & (warps - 1):
        raise ValueError(f"route_merge (Triton): config num_warps must be a power of two; found {warps!r}")
    return cfg


def route_merge_forward(outs: Sequence[Tensor], lses: Sequence[Tensor], values: Sequence[Tensor],
                        keys: Sequence[Tensor] | None, queries: Tensor, key_norm_weights: Tensor, mix: Tensor,
                        heads: int, eps: float, out_norm_weight: Tensor | None = None, out_norm_eps: float = 1e-6,
                        config: dict | None = None) -> Tensor:
    """Fused forward; inputs as checked by ``depthrewrite.ops.route_merge``. Returns ``x``, or
    with ``out_norm_weight`` ``rms_norm(x) * out_norm_weight`` (``x`` is not written).
    ``config``: launch choices for tuning runs (:func:`_launch`)."""
    _check_launch(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    d, shape, device = outs[0].shape[-1], outs[0].shape, outs[0].device
    block_h, block_c = _row_blocks(d, heads, "route_merge")
    x = torch.empty(shape, dtype=outs[0].dtype, device=device)
    tokens = math.prod(shape[:-1])
    if tokens == 0:
        return x
    launch = _launch(config, block_h * block_c, heads, len(outs), out_norm_weight is not None)
    flat_o, flat_l, flat_v = _contiguous(outs), _contiguous(lses), _contiguous(values)
    flat_k = _contiguous(keys) if keys is not None else []
    tables = pointer_tables(device, flat_o, flat_l, flat_v, flat_k)
    otab, ltab, vtab, ktab = tables
    _route_merge_fwd_kernel[(cdiv(tokens, launch["block_t"]),)](
        otab, ltab, vtab, ktab if flat_k else vtab, queries.contiguous(), key_norm_weights.contiguous(),
        mix.contiguous(), queries if out_norm_weight is None else out_norm_weight.contiguous(), x, tokens, d,
        d // heads, heads, float(eps), float(out_norm_eps),
        J=len(outs), HAS_KEYS=bool(flat_k), HAS_NORM=out_norm_weight is not None, BLOCK_T=launch["block_t"],
        BLOCK_H=block_h, BLOCK_C=block_c, ALIGNED=tables.all_aligned(0, 2, 3) and _aligned([x]),  # all but the fp32 lses
        num_warps=launch["num_warps"],
    )
    return x


def route_merge_backward(grad: Tensor, outs: Sequence[Tensor], lses: Sequence[Tensor], values: Sequence[Tensor],
                         keys: Sequence[Tensor] | None, queries: Tensor, key_norm_weights: Tensor, mix: Tensor,
                         heads: int, eps: float, out_norm_weight: Tensor | None = None, out_norm_eps: float = 1e-6,
                         config: dict | None = None) -> tuple:
    """Fused backward: what ``depthrewrite::route_merge_backward`` returns (``grad``: the
    gradient of the op's output, ``normed``'s with ``out_norm_weight``). ``config``: launch
    choices for tuning runs (:func:`_launch`)."""
    _check_launch(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    check_gradient("grad", grad, outs[0], "route_merge")
    j, d, shape, device = len(outs), outs[0].shape[-1], outs[0].shape, outs[0].device
    act = outs[0].dtype
    grad_outs = [torch.empty(shape, dtype=act, device=device) for _ in range(j)]
    grad_values = [torch.empty(shape, dtype=act, device=device) for _ in range(j)]
    grad_keys = [torch.empty(shape, dtype=act, device=device) for _ in range(j)] if keys is not None else []
    grad_lses = [torch.empty(t.shape, dtype=torch.float32, device=device) for t in lses]
    tokens = math.prod(shape[:-1])
    block_h, block_c = _row_blocks(d, heads, "route_merge")
    launch = _launch(config, block_h * block_c, heads, len(outs), out_norm_weight is not None)
    block_t = launch["block_t"]
    launch["stages"] = fit_stages("route_merge", launch["stages"],
                                  _backward_stage_bytes(block_t, block_h * block_c, j, keys is not None, act.itemsize,
                                                        out_norm_weight),
                                  device, _configured(config, "stages"))
    num_blocks = cdiv(tokens, block_t)
    programs = _backward_programs(device, num_blocks, launch["per_sm"])
    # every entry written by its program (no tokens: no launch, the sums stay zero)
    new = torch.zeros if tokens == 0 else torch.empty
    part_r = new((programs, j, d), dtype=torch.float32, device=device)
    part_m = new((programs, j), dtype=torch.float32, device=device)
    has_norm = out_norm_weight is not None
    # without the norm the kernel writes no part_n: part_r stands in for the unread pointer
    part_n = new((programs, d), dtype=torch.float32, device=device) if has_norm else part_r
    if tokens > 0:
        flat_o, flat_l, flat_v = _contiguous(outs), _contiguous(lses), _contiguous(values)
        flat_k = _contiguous(keys) if keys is not None else []
        g = grad.to(act).contiguous()
        tables = pointer_tables(device, flat_o, flat_l, flat_v, flat_k, grad_outs, grad_lses, grad_values, grad_keys)
        otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab = tables
        if not flat_k:
            ktab, gktab = vtab, gvtab
        _route_merge_bwd_kernel[(programs,)](
            g, otab, ltab, vtab, ktab, gotab, gltab, gvtab, gktab, queries.contiguous(),
            key_norm_weights.contiguous(), mix.contiguous(), out_norm_weight.contiguous() if has_norm else queries,
            part_r, part_m, part_n, tokens, d, d // heads, heads, float(eps), float(out_norm_eps), num_blocks,
            J=j, HAS_KEYS=bool(flat_k), HAS_NORM=has_norm, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_C=block_c,
            ALIGNED=tables.all_aligned(0, 2, 3, 4, 6, 7) and _aligned([g]),  # all but the fp32 lses' tables
            STAGES=launch["stages"], num_warps=launch["num_warps"],
        )
    # second pass of the deterministic reductions: fixed-order sums over the programs
    extra = [(PartialSums.of(part_m), mix)] + ([(PartialSums.of(part_n), out_norm_weight)] if has_norm else [])
    grad_queries, grad_weights, grad_mix, *grad_norm = finish(PartialSums.of(part_r), queries, key_norm_weights,
                                                              *extra)
    grad_norm_weight = grad_norm[0] if has_norm else queries.new_empty((0,))
    return grad_outs, grad_lses, grad_values, grad_keys, grad_queries, grad_weights, grad_mix, grad_norm_weight


def _warps(row: int, heads: int, results: int, normed: bool) -> int:
    """One warp per 256 padded elements of a row, 1 to 8; half that for one-head rows of
    NARROW_ROW padded elements in two of the four one-head cases: Block AttnRes's merge with
    the branch norm (one result) and DAR's without (two). Measured on H200 at d = 1024, 16384
    tokens, CUDA-graph replays (docs/benchmarks.md, sessions 22 and 27): the first's backward
    0.111 ms against 0.150 (2 warps against 4; both sessions), DAR's 0.151 against 0.203
    (session 27), their forwards level. With 2 warps DAR's merge with the norm was 3 % slower
    and Block AttnRes's without it 4 % slower; 16 heads (block MHAR, without the norm, the one
    multi-head case timed) 7 % faster, not taken untimed with the norm."""
    warps = max(1, min(8, row // 256))
    if heads == 1 and row == NARROW_ROW and (results, normed) in ((1, True), (2, False)):
        return warps // 2
    return warps
