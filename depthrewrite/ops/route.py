"""Depth routing (Attention Residuals, MHAR) as ``depthrewrite::`` custom ops.

For N sources ``v_i`` of shape ``(*batch, d)`` (docs/spec.md sections 2-4)::

    k_i   = keys[i] if keys else v_i          (both times source_scale[i], if given)
    khat  = RMSNorm_g(k_i)                    statistic over the FULL width d
    z[i,h] = sum_{c in head h} query[c] * khat_i[c]  (+ logit_bias[i])
    a[:,h] = softmax over the N sources of z[:,h], per token
    out[c] = sum_i a[i, head(c)] * v_i[c]

The op ``depthrewrite::route`` returns ``(out, lse, normed)``: ``lse[..., h]`` is the
log-sum-exp over the sources of ``z[:, ..., h]`` (float32, shape ``(*batch, H)``), so that
``a[i, h] = exp(z[i, h] - lse[h])``. With one source the softmax weight is exactly 1
whatever the logit, and ``lse`` is defined as 0 (no logit is computed; the backward then
needs none). ``lse`` is not differentiable (marked so; a gradient flowing into it is
ignored). Autograd saves the inputs, ``out`` and ``lse``: the fused CUDA backward
(:mod:`depthrewrite.kernels.route_triton`) reads each source once and gets the softmax
weights from ``lse`` and ``sum_j a_j da_j`` from ``<g, out>`` instead of recomputing the
forward statistics. ``depthrewrite::route_backward`` takes ``out`` and ``lse`` for that
reason; the pure-PyTorch implementation registered here (CPU, float64, and CUDA when the
kernels are off) ignores them and recomputes everything, so it stays an independent check
of the fused kernels.

Optional fused output norm (the branch's own PreNorm): given ``out_norm_weight`` (shape
``(d,)``) and ``out_norm_eps``, the op's third output is
``normed = rms_norm(out) * out_norm_weight`` of the output as returned (statistic over the
full width, fp32 math, cast to the values' dtype), and its backward adds the norm's
gradient to ``grad_out`` before the routing backward and returns the weight's gradient.
Without a weight the third output is an empty tensor (custom-op outputs cannot be None)
and receives no gradient. When only ``normed`` is used (the usual case: the branch reads
it), ``out`` is still saved for the backward; an unfused RMSNorm would have saved it too.

``route`` is the user-facing wrapper: it checks its inputs, calls
``torch.ops.depthrewrite.route`` and returns ``out`` alone; ``route_and_norm`` returns
``(out, normed)``. ``route_reference`` and ``route_and_norm_reference`` are the same
computations written with ordinary differentiable torch ops, kept as test oracles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .flat_autograd import register_autograd

__all__ = ["route", "route_and_norm", "route_reference", "route_and_norm_reference", "route_logits_reference"]

ROUTE_SCHEMA = (
    "(Tensor[] values, Tensor[]? keys, Tensor query, Tensor key_norm_weight, "
    "Tensor? logit_bias, Tensor? source_scale, int heads, float eps, "
    "Tensor? out_norm_weight=None, float out_norm_eps=1e-06) -> (Tensor out, Tensor lse, Tensor normed)"
)
ROUTE_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor out, Tensor lse, Tensor[] values, Tensor[]? keys, Tensor query, "
    "Tensor key_norm_weight, Tensor? logit_bias, Tensor? source_scale, int heads, "
    "float eps, Tensor? grad_normed=None, Tensor? out_norm_weight=None, float out_norm_eps=1e-06, "
    "Tensor?[]? grad_values_acc=None, Tensor?[]? grad_keys_acc=None) "
    "-> (Tensor[] grad_values, Tensor[] grad_keys, Tensor grad_query, "
    "Tensor grad_key_norm_weight, Tensor grad_logit_bias, Tensor grad_out_norm_weight)"
)


# --------------------------------------------------------------------------- math


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    # float32 arithmetic for half/bf16 activations, float64 as soon as anything is float64.
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


@dataclass
class _Parts:
    """Forward quantities, recomputed by the backward instead of being saved."""

    src: Tensor  # (N, *batch, d) scaled values, compute dtype
    norm: Tensor  # (N, *batch, d) keys * r, before the norm weight
    rstd: Tensor  # (N, *batch, 1)
    weights: Tensor  # (N, *batch, H) softmax over the sources
    lse: Tensor  # (*batch, H) log-sum-exp of the logits over the sources (0 for one source)
    dtype: torch.dtype


def _scaled_stack(tensors: Sequence[Tensor], scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    stacked = torch.stack(list(tensors)).to(dtype)
    if scale is None:
        return stacked
    return stacked * scale.to(dtype).unsqueeze(-1)


def _forward_parts(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps) -> _Parts:
    dtype = _compute_dtype(values[0], keys[0] if keys else None, query, key_norm_weight, logit_bias)
    src = _scaled_stack(values, source_scale, dtype)
    key = src if keys is None else _scaled_stack(keys, source_scale, dtype)
    rstd = torch.rsqrt(key.square().mean(-1, keepdim=True) + eps)
    norm = key * rstd
    if len(values) == 1:
        # softmax over one source is exactly 1, whatever the logit
        weights = src.new_ones(src.shape[:-1] + (heads,))
        lse = _one_source_lse(values[0], heads)
    else:
        khat = norm * key_norm_weight.to(dtype)
        logits = (khat * query.to(dtype)).unflatten(-1, (heads, -1)).sum(-1)
        if logit_bias is not None:
            logits = logits + logit_bias.to(dtype).reshape((-1,) + (1,) * (logits.dim() - 1))
        weights = torch.softmax(logits, dim=0)
        lse = torch.logsumexp(logits, dim=0).to(torch.float32)
    return _Parts(src, norm, rstd, weights, lse, dtype)


def _one_source_lse(value: Tensor, heads: int) -> Tensor:
    # defined as 0: exp(z - lse) must be the weight 1, and no logit is computed for one source
    return value.new_zeros(value.shape[:-1] + (heads,), dtype=torch.float32)


def _mix(weights: Tensor, src: Tensor, heads: int) -> Tensor:
    return (weights.unsqueeze(-1) * src.unflatten(-1, (heads, -1))).sum(0).flatten(-2)


def _all_but_last(t: Tensor) -> tuple[int, ...]:
    return tuple(range(t.dim() - 1))


def _split_fresh(stacked: Tensor, dtype: torch.dtype, acc: Sequence[Tensor | None] | None = None) -> list[Tensor]:
    """One fresh tensor per source (custom-op outputs may not alias each other, so no views
    of one stacked buffer), each plus its running sum ``acc[i]`` where one is given (in the
    compute dtype, then rounded once)."""
    parts = stacked.unbind(0)
    if acc is not None:
        parts = [t if a is None else t + a.to(t.dtype) for t, a in zip(parts, acc)]
    return [t.to(dtype, copy=True) for t in parts]


def _check_acc(name: str, acc, like: Sequence[Tensor] | None, op: str = "route_backward") -> None:
    """``grad_values_acc`` / ``grad_keys_acc`` of ``op``: None, or one entry per source, each
    None or a tensor shaped and typed like that source's gradient. ``like``: the sources,
    already checked alike (the op's input checks), so every entry is held against the first."""
    if acc is None:
        return
    if like is None:
        raise ValueError(f"{op}: `{name}` must be None when there are no keys; found {len(acc)} entries")
    if len(acc) != len(like):
        raise ValueError(f"{op}: `{name}` must have one entry per source ({len(like)}); found {len(acc)}")
    # every launch pays this: one pass of quick tests, the loop below only names the culprit
    shape, dtype, device = like[0].shape, like[0].dtype, like[0].device
    if all(a is None or (a.shape == shape and a.dtype is dtype and a.device == device) for a in acc):
        return
    for i, (a, t) in enumerate(zip(acc, like)):
        if a is not None and (a.shape != t.shape or a.dtype != t.dtype or a.device != t.device):
            raise ValueError(f"{op}: `{name}[{i}]` must be None or shaped and typed like source {i} "
                             f"({_describe(t)}); found {_describe(a)}")


# ---------------------------------------------------------------------- the ops


@torch.library.custom_op("depthrewrite::route", mutates_args=(), schema=ROUTE_SCHEMA)
def _route_op(
    values: list[Tensor],
    keys: list[Tensor] | None,
    query: Tensor,
    key_norm_weight: Tensor,
    logit_bias: Tensor | None,
    source_scale: Tensor | None,
    heads: int,
    eps: float,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    # checked here too: a caller of torch.ops.depthrewrite.route skips route()'s checks
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    if out_norm_weight is not None:
        _check_out_norm(values, out_norm_weight, out_norm_eps)
    out_dtype = values[0].dtype
    if len(values) == 1:
        # bit-identical to the single source: no stack, no reduction, just one multiply
        src = values[0].to(_compute_dtype(values[0], query, key_norm_weight, logit_bias))
        if source_scale is not None:
            src = src * source_scale[0].to(src.dtype).unsqueeze(-1)
        out, lse = (src * 1.0).to(out_dtype), _one_source_lse(values[0], heads)
    else:
        parts = _forward_parts(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
        out, lse = _mix(parts.weights, parts.src, heads).to(out_dtype), parts.lse
    return out, lse, _out_norm(out, out_norm_weight, out_norm_eps)


def _out_norm(out: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``rms_norm(out) * weight`` of the op's (rounded) output, fp32 math, in out's dtype;
    an empty tensor without a weight (custom-op outputs cannot be None)."""
    if weight is None:
        return out.new_empty((0,))
    dtype = _compute_dtype(out, weight)
    return F.rms_norm(out.to(dtype), (out.shape[-1],), weight=weight.to(dtype), eps=float(eps)).to(out.dtype)


@_route_op.register_fake
def _route_fake(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
                out_norm_weight=None, out_norm_eps=1e-6):
    # contiguous, as the implementations return them whatever the sources' strides
    lse = values[0].new_empty(values[0].shape[:-1] + (heads,), dtype=torch.float32)
    normed = values[0].new_empty((0,)) if out_norm_weight is None else values[0].new_empty(values[0].shape)
    return values[0].new_empty(values[0].shape), lse, normed


@torch.library.custom_op("depthrewrite::route_backward", mutates_args=(), schema=ROUTE_BACKWARD_SCHEMA)
def _route_backward_op(
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    values: list[Tensor],
    keys: list[Tensor] | None,
    query: Tensor,
    key_norm_weight: Tensor,
    logit_bias: Tensor | None,
    source_scale: Tensor | None,
    heads: int,
    eps: float,
    grad_normed: Tensor | None = None,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float = 1e-6,
    grad_values_acc: list[Tensor | None] | None = None,
    grad_keys_acc: list[Tensor | None] | None = None,
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor, Tensor]:
    # the reference recomputes everything and ignores out and lse (the fused kernel's
    # shortcut), so that it stays an independent check of the kernel. grad_*_acc: running
    # sums the gradients are added to (depthrewrite.grad_accumulation puts them there),
    # checked against the sources once those are
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    _check_acc("grad_values_acc", grad_values_acc, values)
    _check_acc("grad_keys_acc", grad_keys_acc, keys)
    p = _forward_parts(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    a = p.weights  # (N, *batch, H)
    g = grad_out.to(p.dtype)
    grad_norm_weight = query.new_empty((0,))
    if out_norm_weight is not None:
        # the output as the forward returned it (rounded to its dtype), then its norm
        routed = _mix(a, p.src, heads).to(values[0].dtype)
        d_routed, grad_norm_weight = _out_norm_backward(routed, grad_normed, out_norm_weight, out_norm_eps, p.dtype)
        g = g + d_routed
    g = g.unflatten(-1, (heads, -1))  # (*batch, H, d/H)

    d_src = (a.unsqueeze(-1) * g).flatten(-2)
    d_a = (p.src.unflatten(-1, (heads, -1)) * g).sum(-1)
    d_z = a * (d_a - (a * d_a).sum(0, keepdim=True))  # softmax backward over sources

    w = key_norm_weight.to(p.dtype)
    khat = (p.norm * w).unflatten(-1, (heads, -1))
    d_query = (d_z.unsqueeze(-1) * khat).sum(_all_but_last(d_z)).flatten()
    d_khat = (d_z.unsqueeze(-1) * query.to(p.dtype).unflatten(-1, (heads, -1))).flatten(-2)
    d_weight = (d_khat * p.norm).sum(_all_but_last(d_khat))
    d_norm = d_khat * w
    # RMSNorm backward: the statistic couples all d channels of a key
    d_key = p.rstd * (d_norm - p.norm * (d_norm * p.norm).mean(-1, keepdim=True))

    if keys is None:
        d_src = d_src + d_key
    if source_scale is not None:
        scale = source_scale.to(p.dtype).unsqueeze(-1)
        d_src = d_src * scale
        d_key = d_key * scale

    grad_values = _split_fresh(d_src, values[0].dtype, grad_values_acc)
    grad_keys = [] if keys is None else _split_fresh(d_key, keys[0].dtype, grad_keys_acc)
    if logit_bias is None:
        grad_bias = query.new_empty((0,))
    else:
        grad_bias = d_z.sum(tuple(range(1, d_z.dim()))).to(logit_bias.dtype)
    return (
        grad_values,
        grad_keys,
        d_query.to(query.dtype),
        d_weight.to(key_norm_weight.dtype),
        grad_bias,
        grad_norm_weight,
    )


def _out_norm_backward(routed: Tensor, grad_normed: Tensor | None, weight: Tensor, eps: float, dtype: torch.dtype):
    """Gradient of ``rms_norm(routed) * weight`` w.r.t. ``routed`` and ``weight``."""
    x = routed.to(dtype)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    norm = x * rstd
    if grad_normed is None:  # normed unused: no gradient through it
        return torch.zeros_like(x), torch.zeros_like(weight)
    gn = grad_normed.to(dtype)
    d_norm = gn * weight.to(dtype)
    d_x = rstd * (d_norm - norm * (d_norm * norm).mean(-1, keepdim=True))
    # reshape, not sum over all-but-last dims: with no batch dims that tuple is empty, and
    # sum(()) would reduce everything
    return d_x, (gn * norm).reshape(-1, norm.shape[-1]).sum(0).to(weight.dtype)


@_route_backward_op.register_fake
def _route_backward_fake(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
                         grad_normed=None, out_norm_weight=None, out_norm_eps=1e-6, grad_values_acc=None,
                         grad_keys_acc=None):
    return (
        [v.new_empty(v.shape) for v in values],  # contiguous, as the implementations return them
        [] if keys is None else [k.new_empty(k.shape) for k in keys],
        torch.empty_like(query),
        torch.empty_like(key_norm_weight),
        query.new_empty((0,)) if logit_bias is None else torch.empty_like(logit_bias),
        query.new_empty((0,)) if out_norm_weight is None else torch.empty_like(out_norm_weight),
    )


def _setup_context(ctx, inputs, output) -> None:
    values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, out_norm_weight, out_norm_eps = inputs
    out, lse, normed = output
    ctx.num_sources = len(values)
    ctx.has_keys = keys is not None
    ctx.heads = heads
    ctx.eps = eps
    ctx.out_norm_eps = out_norm_eps
    # one call: a second mark_non_differentiable replaces the first's set
    ctx.mark_non_differentiable(*((lse,) if out_norm_weight is not None else (lse, normed)))  # normed: empty placeholder
    # save_for_backward takes a flat sequence (None allowed), so lists are spliced in. out
    # costs no extra memory in practice: the branch's norm that reads it (or, fused, whose
    # backward needs it) would keep it alive anyway.
    ctx.save_for_backward(out, lse, out_norm_weight, *values, *(keys or ()), query, key_norm_weight, logit_bias,
                          source_scale)


def _backward(ctx, grad_out, _grad_lse, grad_normed):
    # _grad_lse is ignored: lse is marked non-differentiable (an output for the backward only)
    out, lse, out_norm_weight, *saved = ctx.saved_tensors
    n = ctx.num_sources
    values = list(saved[:n])
    keys = list(saved[n : 2 * n]) if ctx.has_keys else None
    query, key_norm_weight, logit_bias, source_scale = saved[(2 if ctx.has_keys else 1) * n :]
    grad_values, grad_keys, grad_query, grad_weight, grad_bias, grad_norm_weight = _route_backward_op(
        grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale, ctx.heads, ctx.eps,
        grad_normed if out_norm_weight is not None else None, out_norm_weight, ctx.out_norm_eps,
    )
    grads = (
        grad_values,
        grad_keys if ctx.has_keys else None,
        grad_query,
        grad_weight,
        grad_bias if logit_bias is not None else None,
        None,  # source_scale is a constant of the routing (docs/spec.md section 5: detached RMS matching)
        None,
        None,
        grad_norm_weight if out_norm_weight is not None else None,
        None,
    )
    # one gradient per argument the caller passed: the trailing defaulted norm arguments
    # may have been left out (ctx.needs_input_grad has the caller's structure)
    return grads[: len(ctx.needs_input_grad)]


register_autograd(_route_op, _backward, _setup_context)


# ---------------------------------------------------------------- input checks


def _fail(arg: str, expected: str, found: object, op: str = "route") -> ValueError:
    return ValueError(f"{op}: `{arg}` must be {expected}; found {found}")


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_sources(arg: str, tensors: object, count: int | None, like: Tensor | None, op: str = "route",
                   first_name: str = "values") -> list[Tensor]:
    """``tensors`` as a list, each shaped, typed and placed like ``like`` (None: the first),
    ``count`` of them unless None; ``first_name``: the list that sets both, for the messages."""
    if not isinstance(tensors, (list, tuple)):
        raise _fail(arg, "a list or tuple of tensors", type(tensors).__name__, op)
    if count is not None and len(tensors) != count:
        raise _fail(arg, f"{count} tensors (one per entry of `{first_name}`)", f"{len(tensors)}", op)
    if not tensors:
        raise _fail(arg, "a non-empty list of tensors", "an empty sequence", op)
    first = tensors[0] if like is None else like
    if isinstance(first, Tensor) and first.is_floating_point() and first.dim() > 0:
        # every call of every routing op and launcher pays this: one pass of quick tests
        # (half the time of the loop below, which then only looks for the culprit)
        shape, dtype, device = first.shape, first.dtype, first.device
        if all(isinstance(t, Tensor) and t.dtype is dtype and t.shape == shape and t.device == device
               for t in tensors):
            return list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise _fail(f"{arg}[{i}]", "a tensor", type(t).__name__, op)
        if not t.is_floating_point() or t.dim() == 0:
            raise _fail(f"{arg}[{i}]", "a floating-point tensor of shape (*batch, d)", _describe(t), op)
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise _fail(f"{arg}[{i}]", f"like {first_name}[0] ({_describe(first)})", _describe(t), op)
    return list(tensors)


def _check_param(arg: str, t: object, shape: tuple[int, ...], device: torch.device, optional: bool,
                 op: str = "route") -> None:
    if t is None and optional:
        return
    none_or = "None or " if optional else ""
    if not isinstance(t, Tensor):
        raise _fail(arg, f"{none_or}a tensor of shape {shape}", type(t).__name__, op)
    if not t.is_floating_point() or tuple(t.shape) != shape or t.device != device:
        raise _fail(arg, f"{none_or}a floating-point tensor of shape {shape} on {device}", _describe(t), op)


def _check_eps(arg: str, eps: object, op: str = "route") -> None:
    # > 0: an RMSNorm divides by sqrt(mean square + eps), so 0 makes an all-zero row NaN
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < math.inf):
        raise _fail(arg, "a finite positive float", repr(eps), op)


def _check_out_norm(values, out_norm_weight, out_norm_eps) -> None:
    d = values[0].shape[-1]
    _check_param("out_norm_weight", out_norm_weight, (d,), values[0].device, optional=False)
    _check_eps("out_norm_eps", out_norm_eps)


def _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps) -> None:
    values = _check_sources("values", values, None, None)
    if keys is not None:
        _check_sources("keys", keys, len(values), values[0])
    n, batch, d = len(values), tuple(values[0].shape[:-1]), values[0].shape[-1]
    device = values[0].device
    _check_param("query", query, (d,), device, optional=False)
    _check_param("key_norm_weight", key_norm_weight, (d,), device, optional=False)
    _check_param("logit_bias", logit_bias, (n,), device, optional=True)
    _check_param("source_scale", source_scale, (n, *batch), device, optional=True)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d % heads != 0:
        raise _fail("heads", f"a positive int dividing the width d={d}", repr(heads))
    _check_eps("eps", eps)


# ------------------------------------------------------------------- public API


def route(
    values: Sequence[Tensor],
    keys: Sequence[Tensor] | None = None,
    *,
    query: Tensor,
    key_norm_weight: Tensor,
    logit_bias: Tensor | None = None,
    source_scale: Tensor | None = None,
    heads: int = 1,
    eps: float = 1e-6,
) -> Tensor:
    """Softmax-over-depth mix of ``values`` (N tensors of shape ``(*batch, d)``).

    ``keys`` (same count and shape) default to the values; ``query`` and
    ``key_norm_weight`` have shape ``(d,)``, ``logit_bias`` ``(N,)``,
    ``source_scale`` ``(N, *batch)`` (a per-token multiplier of each source,
    keys included, that receives no gradient). ``heads`` splits the width into
    that many softmaxes (MHAR); the key RMS statistic is over the full width.
    Returns a tensor shaped and typed like the values (the op's ``lse`` output is only for
    its backward).
    """
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    return _call_op(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, None, 1e-6)[0]


def route_and_norm(
    values: Sequence[Tensor],
    keys: Sequence[Tensor] | None = None,
    *,
    query: Tensor,
    key_norm_weight: Tensor,
    out_norm_weight: Tensor,
    logit_bias: Tensor | None = None,
    source_scale: Tensor | None = None,
    heads: int = 1,
    eps: float = 1e-6,
    out_norm_eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """``route`` followed by the branch's own PreNorm, fused: returns ``(out, normed)`` with
    ``normed = rms_norm(out) * out_norm_weight`` (statistic over the full width, fp32 math,
    in the values' dtype; ``out`` as ``route`` returns it). ``out_norm_weight`` has shape
    ``(d,)``; the other arguments are those of ``route``."""
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    _check_out_norm(values, out_norm_weight, out_norm_eps)
    return _call_op(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, out_norm_weight,
                    out_norm_eps)


def _call_op(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, out_norm_weight,
             out_norm_eps) -> tuple[Tensor, Tensor]:
    """``(out, normed)`` of ``depthrewrite::route`` on checked inputs (its ``lse`` output is
    only for its backward)."""
    out, _lse, normed = torch.ops.depthrewrite.route(
        list(values), None if keys is None else list(keys), query, key_norm_weight, logit_bias, source_scale,
        heads, float(eps), out_norm_weight, float(out_norm_eps),
    )
    return out, normed


def route_and_norm_reference(
    values: Sequence[Tensor],
    keys: Sequence[Tensor] | None = None,
    *,
    query: Tensor,
    key_norm_weight: Tensor,
    out_norm_weight: Tensor,
    logit_bias: Tensor | None = None,
    source_scale: Tensor | None = None,
    heads: int = 1,
    eps: float = 1e-6,
    out_norm_eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """``route_and_norm`` written with plain differentiable torch ops (the test oracle)."""
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    _check_out_norm(values, out_norm_weight, out_norm_eps)
    out = route_reference(values, keys, query=query, key_norm_weight=key_norm_weight, logit_bias=logit_bias,
                          source_scale=source_scale, heads=heads, eps=eps)
    dtype = _compute_dtype(out, out_norm_weight)
    normed = F.rms_norm(out.to(dtype), (out.shape[-1],), weight=out_norm_weight.to(dtype), eps=float(out_norm_eps))
    return out, normed.to(out.dtype)


def route_reference(
    values: Sequence[Tensor],
    keys: Sequence[Tensor] | None = None,
    *,
    query: Tensor,
    key_norm_weight: Tensor,
    logit_bias: Tensor | None = None,
    source_scale: Tensor | None = None,
    heads: int = 1,
    eps: float = 1e-6,
) -> Tensor:
    """``route`` written with plain differentiable torch ops (the test oracle)."""
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    src, logits = _reference_logits(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    weights = torch.softmax(logits, dim=0)
    out = torch.einsum("n...h,n...hc->...hc", weights, src.unflatten(-1, (heads, -1)))
    return out.flatten(-2).to(values[0].dtype)


def route_logits_reference(
    values: Sequence[Tensor],
    keys: Sequence[Tensor] | None = None,
    *,
    query: Tensor,
    key_norm_weight: Tensor,
    logit_bias: Tensor | None = None,
    source_scale: Tensor | None = None,
    heads: int = 1,
    eps: float = 1e-6,
) -> Tensor:
    """The logits ``z`` of ``route_reference``, shape ``(N, *batch, heads)``, in the compute
    dtype (float32, or float64 when an input is), differentiable: the oracle for the
    op's ``lse`` (``logsumexp(z, 0)``; for one source the op defines it as 0)."""
    _check_inputs(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)
    return _reference_logits(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps)[1]


def _reference_logits(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps):
    dtype = _compute_dtype(values[0], query, key_norm_weight, logit_bias)
    d = values[0].shape[-1]
    src = torch.stack([v.to(dtype) for v in values])
    key = src if keys is None else torch.stack([k.to(dtype) for k in keys])
    if source_scale is not None:
        scale = source_scale.detach().to(dtype).unsqueeze(-1)
        src, key = src * scale, key * scale
    khat = F.rms_norm(key, (d,), weight=key_norm_weight.to(dtype), eps=float(eps))
    per_head = query.to(dtype).reshape(heads, d // heads)
    logits = torch.einsum("n...hc,hc->n...h", khat.unflatten(-1, (heads, -1)), per_head)
    if logit_bias is not None:
        logits = logits + logit_bias.to(dtype).reshape((-1,) + (1,) * (logits.dim() - 1))
    return src, logits
