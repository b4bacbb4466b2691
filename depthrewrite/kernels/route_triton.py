"""Fused Triton kernels for ``depthrewrite::route`` and ``depthrewrite::route_backward``.

Same math as :mod:`depthrewrite.ops.route` (SPEC sections 2-4). The N sources are never
stacked: their data pointers go to the kernel in a small int64 table and each program
casts entry ``i`` back to a pointer, so any N works without a copy of the sources.

Forward (one program per block of tokens): an online softmax over the sources, as in
flash attention, so each source row is read from memory exactly once. Per source it
computes the RMS statistic over the full width, the per-head logits, rescales the running
fp32 accumulator and adds the weighted source.

Backward (a persistent grid; each program walks a fixed, strided set of token blocks, so
the work order, and with it every rounding, is fixed): pass 1 reads every source once and
keeps, per token and head, the online-softmax max, normaliser and ``sum_j e^{z_j} da_j``
(``da_j = <src_j, g>``), which give ``sum_j a_j da_j`` without storing the N logits;
pass 2 reads each key again, recomputes its logit, and writes the source gradients (with
separate keys, ``da_j`` goes through a small (N, tokens, H) fp32 scratch instead, so the
values are not read a third time). Parameter gradients: ``d query`` and
``d key_norm_weight`` share one accumulator, ``sum_{t,i} dz * norm_i`` times ``w`` or ``q``,
reduced per program into a (programs, d) fp32 buffer; the bias gradient goes per source and
token into an (N, tokens) buffer; fixed-order torch sums finish both: deterministic, no
atomics.

Limits (checked, ValueError): the padded row ``next_pow2(H) * next_pow2(d / H)`` must be
at most ``MAX_ROW`` elements (a program holds a row on chip). Any number of sources.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["route_forward", "route_backward", "MAX_ROW", "SUPPORTED_DTYPES"]

#: largest padded row (elements) a program holds on chip
MAX_ROW = 32768
#: dtypes the kernels take; float64 goes to the reference implementation
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
def _row64(tok, i, T):
    """``i * T + tok`` in int64 (an (N, tokens) table can pass 2**31 elements)."""
    return (tl.zeros_like(tok) + i) * T + tok


@triton.jit
def _route_fwd_kernel(
    vtab, ktab, q_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
    T, N, D, C, H, eps,
    HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ONE_SOURCE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr,
):
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
    # PREFETCH: the loads of source i + 1 are issued before source i is used, so one
    # program keeps two rows in flight (a masked-off load moves no bytes at the end)
    if PREFETCH:
        v_raw = tl.load(_src_ptr(vtab, 0, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
        k_raw = v_raw
        if HAS_KEYS:
            k_raw = tl.load(_src_ptr(ktab, 0, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
    for i in range(N):
        if not PREFETCH:
            v_raw = tl.load(_src_ptr(vtab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
            k_raw = v_raw
            if HAS_KEYS:
                k_raw = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
        v = v_raw.to(tl.float32)
        k = k_raw.to(tl.float32)
        if PREFETCH:
            nxt = tl.minimum(i + 1, N - 1)
            more = mask & ((tl.zeros_like(tok) + i + 1) < N)[:, None, None]  # a tensor also in the interpreter
            v_raw = tl.load(_src_ptr(vtab, nxt, ptr_ty, ALIGNED) + offs, mask=more, other=0.0)
            if HAS_KEYS:
                k_raw = tl.load(_src_ptr(ktab, nxt, ptr_ty, ALIGNED) + offs, mask=more, other=0.0)
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
            rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 2), 1) / D + eps)
            z = tl.sum(k * qw[None, :, :], 2) * rstd[:, None]
            if HAS_BIAS:
                z = z + tl.load(bias_ptr + i).to(tl.float32)
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            p = tl.exp(z - m_new)
            l = l * alpha + p
            acc = acc * alpha[:, :, None] + p[:, :, None] * v
            m = m_new
    if not ONE_SOURCE:
        acc = acc / l[:, :, None]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _route_bwd_kernel(
    g_ptr, vtab, ktab, gvtab, gktab, q_ptr, w_ptr, bias_ptr, scale_ptr,
    da_ptr, part_r_ptr, part_b_ptr,
    T, N, D, C, H, eps, num_blocks,
    HAS_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ONE_SOURCE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ALIGNED: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ptr_ty = tl.pointer_type(g_ptr.dtype.element_ty)
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    col = hh[:, None] * C + cc[None, :]
    cmask = (hh[:, None] < H) & (cc[None, :] < C)
    q = tl.load(q_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    qw = q * w
    r_acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)  # sum_{t,i} dz * norm, this program's share

    for blk in range(pid, num_blocks, nprog):
        tok = blk * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # int64: tok * D below
        tmask = tok < T
        offs = tok[:, None, None] * D + col[None, :, :]
        mask = tmask[:, None, None] & cmask[None, :, :]
        # the per-source scratch for d a (separate keys only) is (N, tokens, H)
        da_mask = tmask[:, None] & (hh[None, :] < H)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)

        # pass 1, online over the sources: max m, normaliser l and sum_j exp(z_j - m) da_j
        m = tl.full((BLOCK_T, BLOCK_H), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
        sad = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
        if not ONE_SOURCE:
            if PREFETCH:
                v_nx = tl.load(_src_ptr(vtab, 0, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
                k_nx = v_nx
                if HAS_KEYS:
                    k_nx = tl.load(_src_ptr(ktab, 0, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
            for i in range(N):
                if PREFETCH:
                    v_cur = v_nx
                    k_cur = k_nx
                    nxt = tl.minimum(i + 1, N - 1)
                    more = mask & ((tl.zeros_like(tok) + i + 1) < N)[:, None, None]
                    v_nx = tl.load(_src_ptr(vtab, nxt, ptr_ty, ALIGNED) + offs, mask=more, other=0.0)
                    k_nx = v_nx
                    if HAS_KEYS:
                        k_nx = tl.load(_src_ptr(ktab, nxt, ptr_ty, ALIGNED) + offs, mask=more, other=0.0)
                else:
                    v_cur = tl.load(_src_ptr(vtab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
                    k_cur = v_cur
                    if HAS_KEYS:
                        k_cur = tl.load(_src_ptr(ktab, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
                v = v_cur.to(tl.float32)
                if HAS_SCALE:
                    s = tl.load(scale_ptr + _row64(tok, i, T), mask=tmask, other=0.0)
                    v = v * s[:, None, None]
                if HAS_KEYS:
                    k = k_cur.to(tl.float32)
                    if HAS_SCALE:
                        k = k * s[:, None, None]
                else:
                    k = v
                rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 2), 1) / D + eps)
                z = tl.sum(k * qw[None, :, :], 2) * rstd[:, None]
                if HAS_BIAS:
                    z = z + tl.load(bias_ptr + i).to(tl.float32)
                da = tl.sum(v * g, 2)
                if HAS_KEYS:
                    # pass 2 reads the keys, not the values: keep d a for it
                    tl.store(da_ptr + _row64(tok, i, T)[:, None] * H + hh[None, :], da, mask=da_mask)
                m_new = tl.maximum(m, z)
                alpha = tl.exp(m - m_new)
                p = tl.exp(z - m_new)
                l = l * alpha + p
                sad = sad * alpha + p * da
                m = m_new
        s_ada = sad / l  # sum_j a_j da_j per token and head
        if HAS_KEYS:
            tl.debug_barrier()  # the d a scratch written above is read by other threads below

        # pass 2: recompute the logits from the (re)loaded key, then every gradient
        # (the key of source i is the value itself unless keys are separate)
        if HAS_KEYS:
            ksrc = ktab
        else:
            ksrc = vtab
        if PREFETCH and not ONE_SOURCE:
            k_nx = tl.load(_src_ptr(ksrc, 0, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
        for i in range(N):
            if HAS_SCALE:
                s = tl.load(scale_ptr + _row64(tok, i, T), mask=tmask, other=0.0)
            if ONE_SOURCE:
                d_src = g
            else:
                if PREFETCH:
                    k_cur = k_nx
                    nxt = tl.minimum(i + 1, N - 1)
                    more = mask & ((tl.zeros_like(tok) + i + 1) < N)[:, None, None]
                    k_nx = tl.load(_src_ptr(ksrc, nxt, ptr_ty, ALIGNED) + offs, mask=more, other=0.0)
                else:
                    k_cur = tl.load(_src_ptr(ksrc, i, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
                k = k_cur.to(tl.float32)
                if HAS_SCALE:
                    k = k * s[:, None, None]
                rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 2), 1) / D + eps)
                zr = tl.sum(k * qw[None, :, :], 2) * rstd[:, None]
                z = zr
                if HAS_BIAS:
                    z = z + tl.load(bias_ptr + i).to(tl.float32)
                a = tl.exp(z - m) / l
                if HAS_KEYS:
                    da = tl.load(da_ptr + _row64(tok, i, T)[:, None] * H + hh[None, :], mask=da_mask, other=0.0)
                else:
                    da = tl.sum(k * g, 2)  # k is the scaled value here
                dz = a * (da - s_ada)
                # padded tokens/heads may carry NaN (eps = 0 on a zero row): keep them out of the sums
                dz = tl.where(tmask[:, None] & (hh[None, :] < H), dz, 0.0)
                tl.store(part_b_ptr + _row64(tok, i, T), tl.sum(dz, 1), mask=tmask)
                mt = tl.sum(dz * zr, 1) / D  # mean_c(d_norm * norm) of the RMSNorm backward
                norm = k * rstd[:, None, None]
                r_acc += tl.sum(tl.where(mask, dz[:, :, None] * norm, 0.0), 0)
                d_key = rstd[:, None, None] * (dz[:, :, None] * qw[None, :, :] - norm * mt[:, None, None])
                d_src = a[:, :, None] * g
                if HAS_KEYS:
                    if HAS_SCALE:
                        d_key = d_key * s[:, None, None]
                    gk_ptr = _src_ptr(gktab, i, ptr_ty, ALIGNED)
                    tl.store(gk_ptr + offs, d_key.to(g_ptr.dtype.element_ty), mask=mask)
                else:
                    d_src = d_src + d_key
            if HAS_SCALE:
                d_src = d_src * s[:, None, None]
            gv_ptr = _src_ptr(gvtab, i, ptr_ty, ALIGNED)
            tl.store(gv_ptr + offs, d_src.to(g_ptr.dtype.element_ty), mask=mask)

    tl.store(part_r_ptr + pid.to(tl.int64) * D + col, r_acc, mask=cmask)


# ------------------------------------------------------------------------ launchers


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _row_blocks(d: int, heads: int) -> tuple[int, int]:
    block_h, block_c = _next_pow2(heads), _next_pow2(d // heads)
    if block_h * block_c > MAX_ROW:
        raise ValueError(
            f"route (Triton): width d={d} with heads={heads} pads to a row of {block_h * block_c} "
            f"elements; the fused kernel holds a row on chip and takes at most {MAX_ROW}"
        )
    return block_h, block_c


def _check_block_t(block_t: int) -> int:
    if not isinstance(block_t, int) or block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"route (Triton): config block_t must be a power of two; found {block_t!r}")
    return block_t


def _num_warps(elements: int) -> int:
    return min(16, max(4, _next_pow2(elements) // 512))


def _pointer_table(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    ptrs = [t.data_ptr() for t in tensors]
    if device.type != "cuda":
        return torch.tensor(ptrs, dtype=torch.int64, device=device)
    # pinned + non_blocking: a pageable copy would make the host wait for the GPU to drain
    # at every call; the caching host allocator keeps the block until the copy is done
    return torch.tensor(ptrs, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def _aligned(*groups) -> bool:
    return all(t.data_ptr() % 16 == 0 for group in groups if group for t in group)


def _check_supported(values: Sequence[Tensor], keys, *params) -> None:
    for name, t in (("values", values[0]), ("keys", keys[0] if keys else None)) + params:
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"route (Triton): `{name}` must be one of {SUPPORTED_DTYPES}; found {t.dtype}")


def _flat(tensors: Sequence[Tensor], d: int) -> list[Tensor]:
    # contiguous() is a no-op for the usual contiguous activations; reshape then never copies
    return [t.contiguous().reshape(-1, d) for t in tensors]


def _scale_table(source_scale: Tensor | None, n: int, tokens: int) -> Tensor | None:
    if source_scale is None:
        return None
    return source_scale.detach().to(torch.float32).contiguous().reshape(n, tokens)


def route_forward(
    values: Sequence[Tensor], keys: Sequence[Tensor] | None, query: Tensor, key_norm_weight: Tensor,
    logit_bias: Tensor | None, source_scale: Tensor | None, heads: int, eps: float,
    config: dict | None = None,
) -> Tensor:
    """Fused forward; inputs as checked by ``depthrewrite.ops.route``. ``config`` overrides
    the launch choices (``block_t``, ``num_warps``, ``prefetch``) for tuning runs."""
    _check_supported(values, keys, ("query", query), ("key_norm_weight", key_norm_weight), ("logit_bias", logit_bias))
    n, d = len(values), values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads)
    flat_v = _flat(values, d)
    tokens = flat_v[0].shape[0]
    out = torch.empty_like(flat_v[0])
    if tokens == 0:
        return out.reshape(values[0].shape)
    flat_k = _flat(keys, d) if keys is not None else None
    device = flat_v[0].device
    vtab = _pointer_table(flat_v, device)
    ktab = _pointer_table(flat_k, device) if flat_k is not None else vtab
    scale = _scale_table(source_scale, n, tokens)
    row = block_h * block_c
    # one token per program from d = 2048 up (measured on H200: docs/benchmarks.md)
    cfg = {"block_t": max(1, min(64, 2048 // row)), "prefetch": True, **(config or {})}
    block_t = _check_block_t(cfg["block_t"])
    grid = (triton.cdiv(tokens, block_t),)
    _route_fwd_kernel[grid](
        vtab, ktab, query.contiguous(), key_norm_weight.contiguous(),
        logit_bias if logit_bias is not None else query, scale if scale is not None else query, out,
        tokens, n, d, d // heads, heads, float(eps),
        HAS_KEYS=flat_k is not None, HAS_BIAS=logit_bias is not None, HAS_SCALE=scale is not None,
        ONE_SOURCE=n == 1, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=cfg["prefetch"],
        ALIGNED=_aligned(flat_v, flat_k),
        num_warps=cfg.get("num_warps") or _num_warps(block_t * row),
    )
    return out.reshape(values[0].shape)


def _backward_programs(device: torch.device, num_blocks: int, per_sm: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(num_blocks, per_sm * sms))
    return max(1, min(num_blocks, 4))  # the interpreter: few programs, same code path


def route_backward(
    grad_out: Tensor, values: Sequence[Tensor], keys: Sequence[Tensor] | None, query: Tensor,
    key_norm_weight: Tensor, logit_bias: Tensor | None, source_scale: Tensor | None, heads: int, eps: float,
    config: dict | None = None,
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor]:
    """Fused backward; returns what ``depthrewrite::route_backward`` returns. ``config``
    overrides the launch choices (``block_t``, ``num_warps``, ``per_sm``, ``prefetch``) for
    tuning runs."""
    _check_supported(values, keys, ("query", query), ("key_norm_weight", key_norm_weight), ("logit_bias", logit_bias))
    n, d = len(values), values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads)
    shape = values[0].shape
    flat_v = _flat(values, d)
    flat_k = _flat(keys, d) if keys is not None else None
    tokens = flat_v[0].shape[0]
    device = flat_v[0].device
    g = grad_out.to(values[0].dtype).contiguous().reshape(-1, d)
    grad_v = [torch.empty_like(flat_v[0]) for _ in range(n)]
    # one source: the weight is the constant 1, so the keys get exactly zero gradient
    new_k = torch.zeros_like if n == 1 else torch.empty_like
    grad_k = [new_k(flat_k[0]) for _ in range(n)] if flat_k is not None else []
    row = block_h * block_c
    # prefetch off by default: not yet timed on the GPU for the backward (docs/benchmarks.md)
    cfg = {"block_t": max(1, min(64, 2048 // row)), "per_sm": 4, "prefetch": False, **(config or {})}
    block_t = _check_block_t(cfg["block_t"])
    num_blocks = triton.cdiv(tokens, block_t)
    programs = _backward_programs(device, num_blocks, cfg["per_sm"])
    part_r = torch.zeros((programs, d), dtype=torch.float32, device=device)
    # per source and token: sum over heads of d z (the bias gradient before the token sum)
    part_b = torch.zeros((n, tokens), dtype=torch.float32, device=device)
    # d a of each source for pass 2, needed only when pass 2 reads keys instead of values
    scratch = torch.empty((n, tokens, heads) if keys is not None and n > 1 else (1,), dtype=torch.float32, device=device)
    if tokens > 0:
        vtab = _pointer_table(flat_v, device)
        gvtab = _pointer_table(grad_v, device)
        ktab = _pointer_table(flat_k, device) if flat_k is not None else vtab
        gktab = _pointer_table(grad_k, device) if flat_k is not None else gvtab
        scale = _scale_table(source_scale, n, tokens)
        _route_bwd_kernel[(programs,)](
            g, vtab, ktab, gvtab, gktab, query.contiguous(), key_norm_weight.contiguous(),
            logit_bias if logit_bias is not None else query, scale if scale is not None else query,
            scratch, part_r, part_b,
            tokens, n, d, d // heads, heads, float(eps), num_blocks,
            HAS_KEYS=flat_k is not None, HAS_BIAS=logit_bias is not None, HAS_SCALE=scale is not None,
            ONE_SOURCE=n == 1, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_C=block_c,
            ALIGNED=_aligned(flat_v, flat_k, grad_v, grad_k), PREFETCH=cfg["prefetch"],
            num_warps=cfg.get("num_warps") or _num_warps(block_t * row),
        )
    # second pass of the deterministic reduction: a fixed-order sum over the programs
    r = part_r.sum(0)
    grad_query = (r * key_norm_weight.to(torch.float32)).to(query.dtype)
    grad_weight = (r * query.to(torch.float32)).to(key_norm_weight.dtype)
    if logit_bias is None:
        grad_bias = query.new_empty((0,))
    else:
        grad_bias = part_b.sum(1).to(logit_bias.dtype)
    grad_values = [t.reshape(shape) for t in grad_v]
    grad_keys = [t.reshape(shape) for t in grad_k]
    return grad_values, grad_keys, grad_query, grad_weight, grad_bias
