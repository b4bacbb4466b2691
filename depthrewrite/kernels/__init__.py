"""Fused Triton kernels for the ``depthrewrite::`` ops, registered as their CUDA kernels.

Importing this package registers ``depthrewrite::route`` (returns ``(out, lse, normed)``),
``depthrewrite::route_backward`` (takes ``out`` and ``lse`` back), its in-place running-sum
form ``depthrewrite::route_backward_into_`` (:mod:`depthrewrite.ops.route_into`),
``depthrewrite::route_many`` and ``depthrewrite::route_many_backward`` (several queries,
:mod:`.route_many_triton`; its in-place form ``depthrewrite::route_many_backward_into_``),
``depthrewrite::route_merge`` and its backward (the second
phase, :mod:`.route_merge_triton`) and ``depthrewrite::token_weighted_sum`` (the merges'
logit backward's sum over the tokens, :mod:`.token_sum_triton`) for the "cuda" device with
``torch.library.register_kernel`` (or with the dispatcher directly: ``_register``); the CPU
(and any other device) keeps the pure-PyTorch implementation of :mod:`depthrewrite.ops.route`.
Eager CUDA calls and compiled graphs (Inductor calls custom ops through the dispatcher) both
reach the kernels. Triton itself is imported on the first CUDA call, so importing the
package costs nothing on machines without a GPU.

float64 (any input) is not a kernel dtype: such calls run the reference implementation.
The launchers fit their software pipelines to the device's shared memory (:mod:`.shared_memory`).
The kernels can be captured in CUDA graphs (``torch.compile(..., mode="reduce-overhead")``):
their pointer tables are then copied inside the graph from host memory kept for it
(:mod:`.pointer_tables`).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..environment import environment_choice
from ..ops.route import _route_backward_op, _route_op
from ..ops.route_into import _route_backward_into_op, _route_many_backward_into_op, running_sum_lists
from ..ops.route_many import _route_many_backward_op, _route_many_op, stats_shape
from ..ops.route_merge import _route_merge_backward_op, _route_merge_op
from ..ops.source_logit import _token_weighted_sum_op

__all__ = ["triton_available", "implementation_for", "set_fused_enabled", "set_exact_softmax_grad", "FUSED_DTYPES"]

log = logging.getLogger(__name__)

#: dtypes the fused kernels take (fp32 accumulation for all of them)
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_enabled = True
#: how the fused backward kernels form the softmax backward's ``sum_j a_j <v_j, g>``
#: (:func:`set_exact_softmax_grad`); read at each backward call
EXACT_SOFTMAX_GRAD = False


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def set_fused_enabled(enabled: bool) -> bool:
    """Turn the fused CUDA kernels on or off (off: the reference runs on CUDA too, for A/B
    timing). Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def set_exact_softmax_grad(exact: bool) -> bool:
    """How the fused backward kernels of ``route`` and ``route_many`` form the softmax
    backward's ``sum_j a_j <v_j, g>``. Off (the default): as ``<out, g>`` from the saved
    output, as flash-attention does, one pass over the sources. On: from the sources and
    over the weights' own sum, as the reference's normalized softmax does, reading the
    sources twice. In bf16 the saved output is rounded, and the shortcut puts that rounding
    into the routing parameters' gradients (docs/design.md, "The softmax backward's
    shortcut"). Read at each backward call, so it applies to
    compiled models too (a CUDA graph keeps what it captured). Returns the previous setting."""
    global EXACT_SOFTMAX_GRAD
    if not isinstance(exact, bool):
        raise TypeError(f"set_exact_softmax_grad: expected True or False, found {exact!r}")
    previous, EXACT_SOFTMAX_GRAD = EXACT_SOFTMAX_GRAD, exact
    return previous


def _backward_config() -> dict | None:
    return {"exact_softmax_grad": True} if EXACT_SOFTMAX_GRAD else None


def _fused_dtypes(*tensors) -> bool:
    return all(t is None or t.dtype in FUSED_DTYPES for t in tensors)


def implementation_for(device: torch.device | str, *dtypes: torch.dtype) -> str:
    """'triton' where a route call on ``device`` with these dtypes runs the fused kernels,
    else 'reference'."""
    device = torch.device(device)
    fused = device.type == "cuda" and _enabled and triton_available()
    return "triton" if fused and all(dt in FUSED_DTYPES for dt in dtypes) else "reference"


def _use_fused(values, keys, query, key_norm_weight, logit_bias, out_norm_weight=None) -> bool:
    keys0 = keys[0] if keys else None
    return _enabled and _fused_dtypes(values[0], keys0, query, key_norm_weight, logit_bias, out_norm_weight)


def _route_cuda(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
                out_norm_weight=None, out_norm_eps=1e-6):
    if not _use_fused(values, keys, query, key_norm_weight, logit_bias, out_norm_weight):
        return _route_op._init_fn(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
                                  out_norm_weight, out_norm_eps)
    from .route_triton import route_forward

    return route_forward(values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
                         out_norm_weight, out_norm_eps)


def _route_backward_cuda(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale,
                         heads, eps, grad_normed=None, out_norm_weight=None, out_norm_eps=1e-6, grad_values_acc=None,
                         grad_keys_acc=None):
    if not _use_fused(values, keys, query, key_norm_weight, logit_bias, out_norm_weight):
        return _route_backward_op._init_fn(
            grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
            grad_normed, out_norm_weight, out_norm_eps, grad_values_acc, grad_keys_acc,
        )
    from .route_triton import route_backward

    # out and lse may come from the reference forward (the fused kernels switched off
    # for it): it computes the same lse, so the one-pass backward still applies
    return route_backward(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale,
                          heads, eps, grad_normed, out_norm_weight, out_norm_eps, config=_backward_config(),
                          grad_values_acc=grad_values_acc, grad_keys_acc=grad_keys_acc)


def _route_backward_into_cuda(grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale,
                              heads, eps, grad_normed, out_norm_weight, out_norm_eps, grad_values, values_acc_index,
                              grad_keys, keys_acc_index):
    if not _use_fused(values, keys, query, key_norm_weight, logit_bias, out_norm_weight):
        return _route_backward_into_op._init_fn(
            grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps,
            grad_normed, out_norm_weight, out_norm_eps, grad_values, values_acc_index, grad_keys, keys_acc_index)
    from .route_triton import route_backward

    acc_v, acc_k = running_sum_lists(grad_values, values_acc_index, values, grad_keys, keys_acc_index, keys,
                                     "route_backward_into_")
    _, _, *rest = route_backward(
        grad_out, out, lse, values, keys, query, key_norm_weight, logit_bias, source_scale, heads, eps, grad_normed,
        out_norm_weight, out_norm_eps, config=_backward_config(), grad_values_acc=acc_v, grad_keys_acc=acc_k,
        grad_values_out=grad_values, grad_keys_out=grad_keys if keys is not None else None)
    return tuple(rest)


def _route_many_cuda(values, queries, key_norm_weights, heads, eps, keys):
    if not _use_fused(values, keys, queries, key_norm_weights, None):
        return _route_many_op._init_fn(values, queries, key_norm_weights, heads, eps, keys)
    from .route_many_triton import route_many_forward

    stats = values[0].new_empty(stats_shape(values, queries, heads, keys), dtype=torch.float32)
    out, lse = route_many_forward(values, queries, key_norm_weights, heads, eps, keys=keys,
                                  stats=stats if stats.numel() else None)
    return out, lse, stats


def _route_many_backward_cuda(grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads, eps,
                              keys, grad_values_acc=None, grad_keys_acc=None):
    if not _use_fused(values, keys, queries, key_norm_weights, None):
        return _route_many_backward_op._init_fn(grad_out, grad_lse, out, lse, stats, values, queries,
                                                key_norm_weights, heads, eps, keys, grad_values_acc, grad_keys_acc)
    from .route_many_triton import route_many_backward

    return route_many_backward(grad_out, grad_lse, out, lse, values, queries, key_norm_weights, heads, eps,
                               config=_backward_config(), keys=keys, stats=stats if stats.numel() else None,
                               grad_values_acc=grad_values_acc, grad_keys_acc=grad_keys_acc)


def _route_many_backward_into_cuda(grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads,
                                   eps, keys, grad_values, values_acc_index, grad_keys, keys_acc_index):
    if not _use_fused(values, keys, queries, key_norm_weights, None):
        return _route_many_backward_into_op._init_fn(grad_out, grad_lse, out, lse, stats, values, queries,
                                                     key_norm_weights, heads, eps, keys, grad_values,
                                                     values_acc_index, grad_keys, keys_acc_index)
    from .route_many_triton import route_many_backward

    acc_v, acc_k = running_sum_lists(grad_values, values_acc_index, values, grad_keys, keys_acc_index, keys,
                                     "route_many_backward_into_")
    _, _, *rest = route_many_backward(
        grad_out, grad_lse, out, lse, values, queries, key_norm_weights, heads, eps, config=_backward_config(),
        keys=keys, stats=stats if stats.numel() else None, grad_values_acc=acc_v, grad_keys_acc=acc_k,
        grad_values_out=grad_values, grad_keys_out=grad_keys if keys is not None else None)
    return tuple(rest)


def _route_merge_cuda(outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight=None,
                      out_norm_eps=1e-6):
    args = (outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    if not _fused_merge(outs, lses, values, keys, queries, key_norm_weights, mix, out_norm_weight):
        return _route_merge_op._init_fn(*args)
    from .route_merge_triton import route_merge_forward

    return route_merge_forward(*args)


def _route_merge_backward_cuda(grad, outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps,
                               out_norm_weight=None, out_norm_eps=1e-6):
    args = (grad, outs, lses, values, keys, queries, key_norm_weights, mix, heads, eps, out_norm_weight, out_norm_eps)
    if not _fused_merge(outs, lses, values, keys, queries, key_norm_weights, mix, out_norm_weight):
        return _route_merge_backward_op._init_fn(*args)
    from .route_merge_triton import route_merge_backward

    return route_merge_backward(*args)


def _fused_merge(outs, lses, values, keys, queries, key_norm_weights, mix, out_norm_weight) -> bool:
    # the kernels take one or two results (route_merge_triton.MAX_RESULTS) and float32
    # log-sum-exps (route_many's for every kernel dtype); anything else runs the reference
    return (_use_fused(values, keys, queries, key_norm_weights, mix, out_norm_weight) and outs[0].dtype in FUSED_DTYPES
            and len(outs) <= 2 and all(t.dtype == torch.float32 for t in lses))


def _token_weighted_sum_cuda(weights, stored, heads):
    if not (_enabled and stored.dtype in FUSED_DTYPES and weights.dtype == torch.float32):
        return _token_weighted_sum_op._init_fn(weights, stored, heads)
    from .token_sum_triton import token_weighted_sum_triton

    return token_weighted_sum_triton(weights, stored, heads)


#: op name -> its CUDA kernel (the functions above)
CUDA_KERNELS = {
    "route": _route_cuda, "route_backward": _route_backward_cuda, "route_backward_into_": _route_backward_into_cuda,
    "route_many": _route_many_cuda, "route_many_backward": _route_many_backward_cuda,
    "route_many_backward_into_": _route_many_backward_into_cuda,
    "route_merge": _route_merge_cuda, "route_merge_backward": _route_merge_backward_cuda,
    "token_weighted_sum": _token_weighted_sum_cuda,
}

#: environment variable choosing how the kernels are registered (read once, at import)
REGISTRATION_ENV = "DEPTHREWRITE_KERNEL_REGISTRATION"
#: its values: "custom_op" (the default) or "dispatcher" (``_register`` says what each is)
REGISTRATIONS = ("custom_op", "dispatcher")
#: the library the "dispatcher" registration holds (kept: dropping it unregisters them)
_dispatcher_library: torch.library.Library | None = None


def _registration() -> str:
    return environment_choice(REGISTRATION_ENV, REGISTRATIONS, "depthrewrite.kernels")


def _register() -> None:
    """Our kernels as the ops' CUDA kernels.

    "custom_op" (the default): through ``torch.library.register_kernel``, whose wrapper
    around each call (``backend_impl``: the aliasing check of every input and output, Dynamo
    kept out) is most of the op's host time beyond our launcher's under ``cProfile``.
    "dispatcher": with the dispatcher directly (``Library.impl``, Dynamo kept out as the
    wrapper keeps it, no aliasing check: our kernels return new tensors, which the GPU tests
    check). On the H200 it cut the profiled host time of a call by 1.7-2.9x, but the two
    models timed with it were GPU-bound and ran no faster (DAR block 0.676x of the baseline
    against 0.675x; docs/benchmarks.md, session 21, run 4), and on the host-bound ones (WAV,
    the fused merge; session 22, run 2) within the trials' own spread; in session 31 block
    MHAR's fused merge 1 % faster in one run and level in the next, Block AttnRes, DAR block
    and WAV level (docs/benchmarks.md, session 31, runs 1-2). So the default keeps
    the wrapper and its check; the environment variable is the A/B's switch
    (``e2e_throughput.py``'s ``_raw`` configurations)."""
    global _dispatcher_library
    if not triton_available():
        log.debug("triton is not installed: depthrewrite::route keeps its reference CUDA implementation")
        return
    if _registration() == "dispatcher":
        _dispatcher_library = torch.library.Library("depthrewrite", "IMPL")
        for name, kernel in CUDA_KERNELS.items():
            _dispatcher_library.impl(name, torch._disable_dynamo(kernel), "CUDA")
        return
    for name, kernel in CUDA_KERNELS.items():
        torch.library.register_kernel(f"depthrewrite::{name}", "cuda", kernel)


_register()
