"""``depthrewrite::route_backward_into_`` and ``depthrewrite::route_many_backward_into_``:
``route_backward`` and ``route_many_backward`` with their running sums updated in place (the
backend's ``accumulate_in_place`` option, :mod:`depthrewrite.grad_accumulation`).

``route_backward(..., grad_values_acc=...)`` returns a new tensor per source, running sum
plus gradient, so while the call runs the old running sums and the new ones both exist: at
WAV's late sites at 350M some 25 running sums of 32 MiB, 0.8 GiB more while a call runs,
beside everything the backward still keeps. These ops write each source's gradient into a tensor they are given: for
a source with a running sum, the running sum itself, to which the gradient is added (the
fused kernel reads and writes each element in the same thread); for the others a new
buffer. (A mutating custom op may not return a list of tensors, hence buffers for all.)
Only the backend's pass puts it in a graph, after AOTAutograd (it is never
differentiated), and only where nothing else reads the running sums it overwrites.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .route import _route_backward_fake, _route_backward_op
from .route_many import _route_many_backward_op

__all__ = ["ROUTE_BACKWARD_INTO_SCHEMA", "ROUTE_MANY_BACKWARD_INTO_SCHEMA", "running_sum_lists", "running_sums"]

ROUTE_BACKWARD_INTO_SCHEMA = (
    "(Tensor grad_out, Tensor out, Tensor lse, Tensor[] values, Tensor[]? keys, Tensor query, "
    "Tensor key_norm_weight, Tensor? logit_bias, Tensor? source_scale, int heads, float eps, "
    "Tensor? grad_normed, Tensor? out_norm_weight, float out_norm_eps, "
    "Tensor(a!)[] grad_values, int[] values_acc_index, Tensor(b!)[] grad_keys, int[] keys_acc_index) "
    "-> (Tensor grad_query, Tensor grad_key_norm_weight, Tensor grad_logit_bias, Tensor grad_out_norm_weight)"
)

#: route_many_backward's arguments, then the outputs in place of its running sums; returns
#: its parameter gradients
ROUTE_MANY_BACKWARD_INTO_SCHEMA = (
    "(Tensor[] grad_out, Tensor[] grad_lse, Tensor[] out, Tensor[] lse, Tensor stats, Tensor[] values, Tensor queries, "
    "Tensor key_norm_weights, int heads, float eps, Tensor[]? keys, "
    "Tensor(a!)[] grad_values, int[] values_acc_index, Tensor(b!)[] grad_keys, int[] keys_acc_index) "
    "-> (Tensor grad_queries, Tensor grad_key_norm_weights)"
)


def running_sums(outputs: Sequence[Tensor], index: Sequence[int], like: Sequence[Tensor] | None,
                 name: str, op: str = "route_backward_into_") -> list[Tensor | None] | None:
    """The entries ``index`` of ``outputs`` (running sums, the others plain outputs) as the
    backward's one-entry-per-source list of running sums (None where a source has none; None
    for none at all), checked: one contiguous output per source, shaped and typed like it,
    and distinct sources in range. ``op``: the op named in the errors."""
    n = len(like or ())
    if len(outputs) != n:
        raise ValueError(f"{op}: `{name}` must have one tensor per source ({n}); found {len(outputs)}")
    for i, (o, t) in enumerate(zip(outputs, like or ())):
        if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device or not o.is_contiguous():
            raise ValueError(f"{op}: `{name}[{i}]` must be contiguous, shaped and typed like "
                             f"source {i} ({tuple(t.shape)}, {t.dtype}, {t.device}); found {tuple(o.shape)}, "
                             f"{o.dtype}, {o.device}, strides {tuple(o.stride())}")
    if len(set(index)) != len(index) or any(not 0 <= i < n for i in index):
        raise ValueError(f"{op}: `{name}` running-sum indices must be distinct sources from 0 to "
                         f"{n - 1}; found {list(index)}")
    if not index:
        return None
    taken = set(index)
    return [outputs[i] if i in taken else None for i in range(n)]


def running_sum_lists(grad_values, values_acc_index, values, grad_keys, keys_acc_index, keys,
                      op: str) -> tuple[list[Tensor | None] | None, list[Tensor | None] | None]:
    """An in-place call's running sums, values' and keys' (:func:`running_sums`)."""
    return (running_sums(grad_values, values_acc_index, values, "grad_values", op),
            running_sums(grad_keys, keys_acc_index, keys, "grad_keys", op))


def _copy_into(grad_values, grad_keys, new_values, new_keys) -> None:
    """The reference's new gradient tensors copied into the outputs given."""
    for outputs, new in ((grad_values, new_values), (grad_keys, new_keys)):
        for o, t in zip(outputs, new):
            o.copy_(t)


@torch.library.custom_op("depthrewrite::route_backward_into_", mutates_args=("grad_values", "grad_keys"),
                         schema=ROUTE_BACKWARD_INTO_SCHEMA)
def _route_backward_into_op(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale,
                            heads, eps, grad_normed, out_norm_weight, out_norm_eps, grad_values, values_acc_index,
                            grad_keys, keys_acc_index):
    # the reference: route_backward's new tensors, copied into the outputs
    acc_v, acc_k = running_sum_lists(grad_values, values_acc_index, values, grad_keys, keys_acc_index, keys,
                                     "route_backward_into_")
    new_values, new_keys, *rest = _route_backward_op._init_fn(
        grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
        grad_normed, out_norm_weight, out_norm_eps, acc_v, acc_k)
    _copy_into(grad_values, grad_keys, new_values, new_keys)
    return tuple(rest)


@_route_backward_into_op.register_fake
def _route_backward_into_fake(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale,
                              heads, eps, grad_normed, out_norm_weight, out_norm_eps, grad_values, values_acc_index,
                              grad_keys, keys_acc_index):
    # route_backward's parameter gradients (its source gradients go into the given outputs)
    return tuple(_route_backward_fake(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias,
                                      source_scale, heads, eps, grad_normed, out_norm_weight, out_norm_eps)[2:])


@torch.library.custom_op("depthrewrite::route_many_backward_into_", mutates_args=("grad_values", "grad_keys"),
                         schema=ROUTE_MANY_BACKWARD_INTO_SCHEMA)
def _route_many_backward_into_op(grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads, eps,
                                 keys, grad_values, values_acc_index, grad_keys, keys_acc_index):
    # the reference: route_many_backward's new tensors, copied into the outputs
    acc_v, acc_k = running_sum_lists(grad_values, values_acc_index, values, grad_keys, keys_acc_index, keys,
                                     "route_many_backward_into_")
    new_values, new_keys, *rest = _route_many_backward_op._init_fn(
        grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads, eps, keys, acc_v, acc_k)
    _copy_into(grad_values, grad_keys, new_values, new_keys)
    return tuple(rest)


@_route_many_backward_into_op.register_fake
def _route_many_backward_into_fake(grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads,
                                   eps, keys, grad_values, values_acc_index, grad_keys, keys_acc_index):
    # route_many_backward's parameter gradients (its source gradients go into the given outputs)
    return torch.empty_like(queries), torch.empty_like(key_norm_weights)
