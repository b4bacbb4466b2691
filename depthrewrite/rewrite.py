"""``depthrewrite.rewrite``: capture -> analyze -> rewrite -> verify.

The model is rewritten **in place** and returned (as ``model.to()`` does): its blocks and
final norm stay the same objects, gain routing parameters under ``<block>.depth_route``
and ``<final norm>.depth_route``, and change class to a routed subclass of their own class.
Pass ``inplace=False`` to rewrite a deep copy and leave the original untouched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .analysis import Analysis, ResidualStream, analyze
from .capture import eval_mode, first_tensor
from .errors import AlreadyRewrittenError, DepthRewriteError
from .hf import record_recipe, recorded_recipe
from .meta import has_meta_tensors, keep_initial_values, materialized
from .passes import scheme_class, scheme_options
from .passes.base import check_bool
from .passes.runtime import (
    DepthRuntime, drop_instance_forwards, install_block, install_readout, is_routed, prepare_programs,
    routing_parameters,
)

log = logging.getLogger(__name__)


def find_runtime(model: nn.Module) -> DepthRuntime | None:
    for m in model.modules():
        if is_routed(m):
            return m._depth_runtime
    return None


def inspect(model: nn.Module, example_inputs: Any = None, *, meta_init: Callable | None = None) -> ResidualStream:
    """The residual stream of ``model`` as data (print it for a table). For a rewritten
    model, the analysis the rewrite was made from, with the scheme and its options as used
    (``rewritten_with``). A model on the meta device is analysed materialized on the CPU,
    as :func:`rewrite` does (``meta_init``: see there)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"inspect: model must be a torch.nn.Module, found {type(model).__name__}"
                         + (" (the CLI's `depthrewrite inspect` takes a name)" if isinstance(model, str) else ""))
    if meta_init is not None and not callable(meta_init):
        raise ValueError(f"inspect: meta_init must be a function taking the model, found {type(meta_init).__name__}")
    runtime = find_runtime(model)
    if runtime is not None:
        return dataclasses.replace(runtime.analysis,
                                   rewritten_with=(runtime.scheme.name, runtime.scheme.resolved_options()))
    recipe = recorded_recipe(model)
    if recipe is not None:
        log.warning("inspect: %s is not rewritten, but its config records a rewrite with %r: loaded from a "
                    "checkpoint of a rewritten model without depthrewrite.from_pretrained, it has lost its "
                    "routing parameters (transformers' from_pretrained builds the plain model and leaves them "
                    "out); load it with depthrewrite.from_pretrained(path)", type(model).__name__,
                    recipe.get("scheme"))
    with materialized(model, meta_init, "inspect") if has_meta_tensors(model) else contextlib.nullcontext():
        return analyze(model, example_inputs).stream


def rewrite(model: nn.Module, scheme: str, *, example_inputs: Any = None, inplace: bool = True,
            verify: bool = True, meta_init: Callable[[nn.Module], None] | None = None, **options) -> nn.Module:
    """Rewrite the PreNorm residual stream of ``model`` into ``scheme``.

    ``example_inputs``: what to call the model with once to capture it (a tuple of
    positional arguments, a dict of keyword arguments, or ``(args, kwargs)``); models with
    ``config.vocab_size`` get a small batch of token ids by default. ``verify`` runs the
    rewritten model once on the example and, for the identity rewrite and
    ``preserve_identity=True``, checks that its output equals the original's bit for bit.
    Other keyword arguments are the scheme's options (see ``depthrewrite.SCHEMES``).

    A model on the meta device is materialized on the CPU for the rewrite (with its
    ``init_weights()``, or ``meta_init(model)`` where given: values for the analysis only)
    and put back on the meta device, rewritten; after your ``to_empty`` and init, call
    :func:`depthrewrite.reset_routing_parameters` (``depthrewrite.meta``).
    """
    check_bool("rewrite", "inplace", inplace)  # inplace="no" is truthy: it would rewrite in place
    check_bool("rewrite", "verify", verify)
    cls = scheme_class(scheme)
    opts = scheme_options(cls, options)
    if not isinstance(model, nn.Module):
        raise ValueError(f"rewrite: model must be a torch.nn.Module, found {type(model).__name__}")
    if meta_init is not None and not callable(meta_init):
        raise ValueError(f"rewrite: meta_init must be a function taking the model, found {type(meta_init).__name__}")
    if find_runtime(model) is not None:
        raise AlreadyRewrittenError(
            f"{type(model).__name__} was already rewritten with scheme "
            f"{find_runtime(model).scheme.name!r}; rewrite the original model instead"
        )
    if not inplace:
        model = copy.deepcopy(model)
    on_meta = has_meta_tensors(model)
    with materialized(model, meta_init, "rewrite") if on_meta else contextlib.nullcontext():
        _rewrite(model, scheme, cls, opts, example_inputs, verify)
    if on_meta:
        log.warning("%s was rewritten on the meta device: after model.to_empty(...) and its own weight init, call "
                    "depthrewrite.reset_routing_parameters(model) unless a checkpoint loads them",
                    type(model).__name__)
    return model


def _rewrite(model: nn.Module, scheme: str, cls, opts, example_inputs: Any, verify: bool) -> None:
    start = time.perf_counter()
    analysis = analyze(model, example_inputs)
    stream_dtype, device = analysis.capture.embedding.dtype, analysis.capture.embedding.device
    scheme_obj = cls(opts, analysis.stream, _param_dtype(model, stream_dtype), device, hints=model_hints(model))
    runtime = _install(model, analysis, scheme_obj)
    keep_initial_values(model)
    record_recipe(model, scheme, scheme_obj.resolved_options())
    runtime.report["seconds"] = time.perf_counter() - start
    log.info("rewrote %s with %s: %s", type(model).__name__, scheme, runtime.report)
    if verify:
        _verify(model, analysis, scheme_obj)
    # only verification needed these; the runtime keeps the rest of the capture
    analysis.capture.example = analysis.capture.model_output = None


#: config attributes naming the key/value head count, newest convention first
_KV_HEAD_FIELDS = ("num_key_value_heads", "n_kv_head", "num_kv_heads", "n_kv_heads")
_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def model_hints(model: nn.Module) -> dict:
    """Facts a scheme may default to that the graph does not show: ``kv_heads`` (from
    ``model.config`` when it has one; the MHAR paper's default head count)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    hints = {}
    for fields in (_KV_HEAD_FIELDS, _HEAD_FIELDS):
        value = next((getattr(config, f) for f in fields if isinstance(getattr(config, f, None), int)), None)
        if value is not None:
            hints["kv_heads"] = value
            break
    return hints


def _param_dtype(model: nn.Module, fallback: torch.dtype) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return fallback


def _install(model: nn.Module, analysis: Analysis, scheme) -> DepthRuntime:
    cap = analysis.capture
    runtime = DepthRuntime(scheme=scheme, capture=cap, block_paths=tuple(plan.path for plan in analysis.blocks),
                           analysis=analysis.stream)
    drop_instance_forwards([(plan.module, plan.path) for plan in analysis.blocks]
                           + [(cap.final_norm, cap.final_norm_path)])
    sites = iter(analysis.stream.sites)
    for plan in analysis.blocks:
        # named by position, not by kind: HF checkpoint converters rename keys such as '.mlp.'
        routers = {f"site{site.position}": scheme.make_site_router(site)
                   for site in (next(sites) for _ in plan.sites)}
        install_block(plan.module, plan, runtime, routers)
        prepare_programs(plan.module, plan.traced.spec, plan)
    install_readout(cap.final_norm, cap.final_norm_path, runtime, scheme.make_readout_router())
    new_params = sum(p.numel() for p in routing_parameters(model))
    runtime.report.update(scheme.describe())
    runtime.report.update(sites_rewritten=analysis.stream.num_sites, blocks=len(analysis.blocks),
                          new_parameters=new_params)
    return runtime


@torch.no_grad()
def _verify(model: nn.Module, analysis: Analysis, scheme) -> None:
    """Run the rewritten model on the capture input; identity schemes must match exactly."""
    cap = analysis.capture
    args, kwargs = cap.example
    with eval_mode(model):
        out = first_tensor(model(*args, **kwargs))
    reference = first_tensor(cap.model_output) if cap.model_output is not None else None
    if not torch.isfinite(out).all():
        if reference is not None and not torch.isfinite(reference).all():  # not the rewrite's doing
            raise DepthRewriteError(
                f"verification: {type(model).__name__}'s output was non-finite before the rewrite too, on the "
                "capture input (its weights or its example_inputs?); the rewrite was made, but nothing was checked: "
                "fix the model, or pass verify=False")
        raise DepthRewriteError(f"verification: the rewritten {type(model).__name__} produced non-finite output")
    identity = scheme.name == "residual" or scheme.delta
    if identity and reference is not None and not torch.equal(out, reference):
        diff = (out.double() - reference.double()).abs().max().item()
        raise DepthRewriteError(
            f"verification: {scheme.name} with preserve_identity must reproduce the original "
            f"output exactly, but differs by up to {diff:.3g}; please report this as a bug"
        )
