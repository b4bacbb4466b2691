"""The second phase of the two-phase computation as one op: ``depthrewrite::route_merge``.

For J finished routing results ``(out_j, lse_j)`` (each one query's :func:`route_many`
result over some sources) and one more source per result, its value ``v_j`` with its key
``k_j`` (the value itself without ``keys``), the op returns the mix of the J merged
results (docs/spec.md section 3's online softmax; DAR's gate, docs/spec.md section 6)::

    khat_j  = RMSNorm(k_j)                              statistic over the full width d
    z_j[h]  = sum_{c in head h} q_j[c] g_j[c] khat_j[c]
    a_j[h]  = sigmoid(z_j[h] - lse_j[h])                the new source's softmax weight
    r_j     = out_j + a_j[head(c)] * (v_j - out_j)      :func:`merge_partial`'s result
    x       = sum_j m_j r_j

Block AttnRes and block MHAR merge one result (J = 1, ``m = (1,)``); DAR merges one per
stream and mixes them with its gate (J = 2, ``m = (s, 1 - s)``). Float32 math (float64 when
an input is), ``x`` in ``outs[0]``'s dtype; differentiable in every tensor argument
(``lse_j`` included: it comes from ``route_many``, whose log-sum-exp is).

Optional fused output norm (the branch's own PreNorm, as ``route``'s): given
``out_norm_weight`` (shape ``(d,)``), the op returns ``normed = rms_norm(x) * out_norm_weight``
(statistic over the full width, ``out_norm_eps``; ``x`` in float32, not rounded first, unlike
``route``'s norm of its returned output) INSTEAD of ``x``: in PreNorm the routed input is
read by the branch's norm only, so ``x`` need not be written at all (the backward makes it
again on chip). A model's own norm reads ``x`` rounded to the activation dtype: the fused
result differs from it by that rounding.

Why an op: as plain torch ops (``merge_partial`` and the gate) they are Inductor's to fuse,
and DAR block's Inductor kernels named after them and its transport took 19 ms of a 118
ms step at 350M (docs/design.md "The second phase in one op"). The op's CUDA kernels (:mod:`depthrewrite.kernels.route_merge_triton`) read each row once per pass and
sum the parameter gradients per program, in a fixed order. Which schemes route their
second phase through it: ``two_phase.FUSED_MERGE``.

The pure-PyTorch implementation registered here (CPU, float64, and CUDA when the kernels
are off) is :func:`route_merge_reference`; its backward writes the gradients out by hand from
the recomputed statistics (tests: a float64 gradcheck, and against autograd through the
reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .flat_autograd import register_autograd
from .route import _check_eps, _check_param, _check_sources, _compute_dtype, _describe, _out_norm_backward

__all__ = ["route_merge", "route_merge_reference"]

ROUTE_MERGE_SCHEMA = (
    "(Tensor[] outs, Tensor[] lses, Tensor[] values, Tensor[]? keys, Tensor queries, Tensor key_norm_weights, "
    "Tensor mix, int heads, float eps, Tensor? out_norm_weight=None, float out_norm_eps=1e-06) -> Tensor"
)
ROUTE_MERGE_BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor[] outs, Tensor[] lses, Tensor[] values, Tensor[]? keys, Tensor queries, "
    "Tensor key_norm_weights, Tensor mix, int heads, float eps, Tensor? out_norm_weight=None, "
    "float out_norm_eps=1e-06) "
    "-> (Tensor[] grad_outs, Tensor[] grad_lses, Tensor[] grad_values, Tensor[] grad_keys, Tensor grad_queries, "
    "Tensor grad_key_norm_weights, Tensor grad_mix, Tensor grad_out_norm_weight)"
)


# --------------------------------------------------------------------------- math


def _reference(outs, lses, values, keys, queries, key_norm_weights, mix, heads: int, eps: float,
               out_norm_weight: Tensor | None = None, out_norm_eps: float = 1e-6) -> Tensor:
    """Differentiable torch ops (module docstring), in the compute dtype, cast to ``outs[0]``'s."""
    dtype = _compute_dtype(outs[0], values[0], queries, key_norm_weights, mix)
    x = _merged(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, dtype)
    if out_norm_weight is not None:
        x = F.rms_norm(x, (x.shape[-1],), weight=out_norm_weight.to(dtype), eps=float(out_norm_eps))
    return x.to(outs[0].dtype)


def _merged(outs, lses, values, keys, queries, key_norm_weights, mix, heads: int, eps: float, dtype) -> Tensor:
    """``x`` in ``dtype`` (differentiable torch ops)."""
    x = None
    for j in range(len(outs)):
        out, value, _, _, _, a = _merge_statistics(j, outs, lses, values, keys, queries, key_norm_weights, heads, eps,
                                                   dtype)
        o = out.unflatten(-1, (heads, -1))
        merged = (o + a * (value.unflatten(-1, (heads, -1)) - o)).flatten(-2)
        term = mix[j].to(dtype) * merged
        x = term if x is None else x + term
    return x


def _merge_statistics(j, outs, lses, values, keys, queries, key_norm_weights, heads: int, eps: float, dtype) -> tuple:
    """Result ``j``'s rows in ``dtype`` and the statistics of its new entry's key: ``(out,
    value, rstd, khat, per_query, a)``, ``a`` the entry's weight shaped ``(*batch, H, 1)``
    (differentiable torch ops: the forward's and the hand-written backward's)."""
    out, value = outs[j].to(dtype), values[j].to(dtype)
    key = value if keys is None else keys[j].to(dtype)
    rstd = torch.rsqrt(key.square().mean(-1, keepdim=True) + eps)
    khat = key * rstd
    per_query = queries[j].to(dtype) * key_norm_weights[j].to(dtype)
    z = (khat * per_query).unflatten(-1, (heads, -1)).sum(-1)  # (*batch, H)
    a = torch.sigmoid(z - lses[j].to(dtype)).unsqueeze(-1)
    return out, value, rstd, khat, per_query, a


# ---------------------------------------------------------------------- the ops


@torch.library.custom_op("depthrewrite::route_merge", mutates_args=(), schema=ROUTE_MERGE_SCHEMA)
def _route_merge_op(outs: list[Tensor], lses: list[Tensor], values: list[Tensor], keys: list[Tensor] | None,
                    queries: Tensor, key_norm_weights: Tensor, mix: Tensor, heads: int, eps: float,
                    out_norm_weight: Tensor | None = None, out_norm_eps: float = 1e-6) -> Tensor:
    # checked here too: a caller of torch.ops.depthrewrite.route_merge skips route_merge()'s checks
    _check_inputs(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    return _reference(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight,
                      out_norm_eps)


@_route_merge_op.register_fake
def _route_merge_fake(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight=None,
                      out_norm_eps=1e-6):
    return outs[0].new_empty(outs[0].shape)  # contiguous, as the implementations return it


@torch.library.custom_op("depthrewrite::route_merge_backward", mutates_args=(), schema=ROUTE_MERGE_BACKWARD_SCHEMA)
def _route_merge_backward_op(grad: Tensor, outs: list[Tensor], lses: list[Tensor], values: list[Tensor],
                             keys: list[Tensor] | None, queries: Tensor, key_norm_weights: Tensor, mix: Tensor,
                             heads: int, eps: float, out_norm_weight: Tensor | None = None,
                             out_norm_eps: float = 1e-6) -> tuple:
    # the gradients written out by hand from the forward's statistics, recomputed (tests:
    # against autograd through the reference, and a float64 gradcheck)
    dtype = _compute_dtype(outs[0], values[0], queries, key_norm_weights, mix)
    g = grad.to(dtype)
    grad_norm_weight = queries.new_empty((0,))
    if out_norm_weight is not None:  # grad is normed's: x made again, through the norm's backward
        with torch.no_grad():
            x = _merged(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, dtype)
        g, grad_norm_weight = _out_norm_backward(x, g, out_norm_weight, out_norm_eps, dtype)
    grads = [_result_grads(g, j, outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, dtype)
             for j in range(len(outs))]
    grad_outs, grad_lses, grad_values, grad_keys, r, grad_mix = (list(part) for part in zip(*grads))
    r = torch.stack(r)  # (J, d): sum over tokens of dz * khat
    return (grad_outs, grad_lses, grad_values, grad_keys if keys is not None else [],
            (r * key_norm_weights.to(dtype)).to(queries.dtype), (r * queries.to(dtype)).to(key_norm_weights.dtype),
            torch.stack(grad_mix).to(mix.dtype), grad_norm_weight)


def _result_grads(g, j, outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, dtype) -> tuple:
    """Result ``j``'s share of the backward: the gradients of ``outs[j]``, ``lses[j]``,
    ``values[j]`` and ``keys[j]`` (None without keys), ``sum dz * khat`` over the tokens
    (d,) and the mix weight's gradient (a scalar)."""
    def heads_of(t):
        return t.unflatten(-1, (heads, -1))

    out, value, rstd, khat, per_query, a = _merge_statistics(j, outs, lses, values, keys, queries, key_norm_weights,
                                                             heads, eps, dtype)
    diff = heads_of(value - out)
    grad_mix = (g * (out + (a * diff).flatten(-2))).sum()
    gr = heads_of(mix[j].to(dtype) * g)
    dz = (gr * diff).sum(-1, keepdim=True) * a * (1 - a)  # (*batch, H, 1)
    d_khat = (dz * heads_of(per_query.expand_as(khat))).flatten(-2)
    # RMSNorm backward: the key's statistic couples all of its channels
    grad_key = rstd * (d_khat - khat * (d_khat * khat).mean(-1, keepdim=True))
    grad_value = (gr * a).flatten(-2)
    if keys is None:
        grad_value = grad_value + grad_key
    r = (dz * heads_of(khat)).flatten(-2).reshape(-1, khat.shape[-1]).sum(0)
    act = outs[0].dtype
    return ((gr * (1 - a)).flatten(-2).to(act), (-dz.squeeze(-1)).to(lses[j].dtype), grad_value.to(values[j].dtype),
            None if keys is None else grad_key.to(keys[j].dtype), r, grad_mix)


@_route_merge_backward_op.register_fake
def _route_merge_backward_fake(grad, outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps,
                               out_norm_weight=None, out_norm_eps=1e-6):
    def like(ts):
        return [t.new_empty(t.shape) for t in ts]

    return (like(outs), like(lses), like(values), like(keys or []), torch.empty_like(queries),
            torch.empty_like(key_norm_weights), torch.empty_like(mix),
            queries.new_empty((0,)) if out_norm_weight is None else torch.empty_like(out_norm_weight))


def _setup_context(ctx, inputs, output) -> None:
    outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps = inputs
    ctx.num, ctx.has_keys, ctx.heads, ctx.eps, ctx.out_norm_eps = len(outs), keys is not None, heads, eps, out_norm_eps
    ctx.save_for_backward(*outs, *lses, *values, *(keys or ()), queries, key_norm_weights, mix, out_norm_weight)


def _backward(ctx, grad):
    j, saved = ctx.num, ctx.saved_tensors
    outs, lses, values = list(saved[:j]), list(saved[j:2 * j]), list(saved[2 * j:3 * j])
    keys = list(saved[3 * j:4 * j]) if ctx.has_keys else None
    queries, key_norm_weights, mix, out_norm_weight = saved[-4:]
    (grad_outs, grad_lses, grad_values, grad_keys, grad_queries, grad_weights, grad_mix,
     grad_norm_weight) = _route_merge_backward_op(grad.contiguous(), outs, lses, values, keys, queries,
                                                  key_norm_weights, mix, ctx.heads, ctx.eps, out_norm_weight,
                                                  ctx.out_norm_eps)
    grads = (grad_outs, grad_lses, grad_values, grad_keys if ctx.has_keys else None, grad_queries, grad_weights,
             grad_mix, None, None, grad_norm_weight if out_norm_weight is not None else None, None)
    # one gradient per argument the caller passed: the trailing defaulted norm arguments
    # may have been left out (ctx.needs_input_grad has the caller's structure), as route's
    return grads[: len(ctx.needs_input_grad)]


register_autograd(_route_merge_op, _backward, _setup_context)


# ---------------------------------------------------------------- input checks


def _fail(arg: str, expected: str, found: object) -> ValueError:
    return ValueError(f"route_merge: `{arg}` must be {expected}; found {found}")


def _check_inputs(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight=None,
                  out_norm_eps=1e-6) -> None:
    outs = _check_sources("outs", outs, None, None, op="route_merge", first_name="outs")
    j, first = len(outs), outs[0]
    _check_sources("values", values, j, first, op="route_merge", first_name="outs")
    if keys is not None:
        _check_sources("keys", keys, j, first, op="route_merge", first_name="outs")
    d = first.shape[-1]
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d % heads != 0:
        raise _fail("heads", f"a positive int dividing the width d={d}", repr(heads))
    if not isinstance(lses, (list, tuple)) or len(lses) != j:
        raise _fail("lses", f"a list of {j} tensors (one per result in `outs`)", _found(lses))
    lse_shape = tuple(first.shape[:-1]) + (heads,)
    for i, t in enumerate(lses):
        if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != lse_shape \
                or t.device != first.device:
            raise _fail(f"lses[{i}]", f"a floating-point tensor of shape {lse_shape} on {first.device}", _found(t))
    params = (("queries", queries, (j, d), False), ("key_norm_weights", key_norm_weights, (j, d), False),
              ("mix", mix, (j,), False), ("out_norm_weight", out_norm_weight, (d,), True))
    for arg, t, shape, optional in params:
        _check_param(arg, t, shape, first.device, optional, op="route_merge")
    _check_eps("eps", eps, op="route_merge")
    _check_eps("out_norm_eps", out_norm_eps, op="route_merge")


def _found(t: object) -> str:
    if isinstance(t, Tensor):
        return _describe(t)
    return f"{len(t)} entries" if isinstance(t, (list, tuple)) else type(t).__name__


# ------------------------------------------------------------------- public API


def route_merge(outs: Sequence[Tensor], lses: Sequence[Tensor], values: Sequence[Tensor],
                keys: Sequence[Tensor] | None = None, *, queries: Tensor, key_norm_weights: Tensor, mix: Tensor,
                heads: int = 1, eps: float = 1e-6, out_norm_weight: Tensor | None = None,
                out_norm_eps: float = 1e-6) -> Tensor:
    """``sum_j mix[j] * merge_partial(outs[j], lses[j], values[j], partial_key=keys[j],
    query=queries[j], key_norm_weight=key_norm_weights[j])`` in one op (module docstring).

    ``outs``, ``values`` (and ``keys``): J tensors of shape ``(*batch, d)``; ``lses``: J of
    shape ``(*batch, heads)`` (:func:`route_many`'s); ``queries`` and ``key_norm_weights``:
    ``(J, d)``; ``mix``: ``(J,)``. Returns ``x`` shaped like ``outs[0]``, in its dtype, or
    with ``out_norm_weight`` (``(d,)``) ``rms_norm(x) * out_norm_weight`` instead."""
    _check_inputs(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    return torch.ops.depthrewrite.route_merge(list(outs), list(lses), list(values),
                                              None if keys is None else list(keys), queries, key_norm_weights,
                                              mix, heads, float(eps), out_norm_weight, float(out_norm_eps))


def route_merge_reference(outs: Sequence[Tensor], lses: Sequence[Tensor], values: Sequence[Tensor],
                          keys: Sequence[Tensor] | None = None, *, queries: Tensor, key_norm_weights: Tensor,
                          mix: Tensor, heads: int = 1, eps: float = 1e-6, out_norm_weight: Tensor | None = None,
                          out_norm_eps: float = 1e-6) -> Tensor:
    """``route_merge`` written with plain differentiable torch ops (the test oracle)."""
    _check_inputs(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    return _reference(list(outs), list(lses), list(values), None if keys is None else list(keys), queries,
                      key_norm_weights, mix, heads, float(eps), out_norm_weight, float(out_norm_eps))
