"""Rewriting a model built on the meta device, as torchtitan and FSDP2 set-ups build theirs
(under ``torch.device("meta")``, then sharded, then ``to_empty`` and the model's own init).

The analysis runs the model and probes its modules, which needs values. So for the rewrite
the model is materialized on the CPU (``to_empty``, then its ``init_weights()`` or the
``meta_init`` given, which must write every floating tensor: one left as ``to_empty`` left
it is named), rewritten in place there, and moved back to the meta device, with
tied parameters tied again. The global RNG and the module attributes the init set
(transformers' ``_is_hf_initialized`` marks) are left as they were: the user's own init
after ``to_empty`` does what it would have done without the rewrite. The CPU needs the
model's size in memory for the while.

A parameter on the meta device has no value, so after ``to_empty`` the routing parameters
hold whatever memory they got. The model's own init does not know them:
:func:`reset_routing_parameters` writes their initial values, which every routed module
keeps from the rewrite (a few vectors a block).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .capture_refusals import first_meta_tensor, named_tensors
from .errors import CaptureError
from .passes.runtime import ROUTER_ATTR, is_routed, routed_modules

log = logging.getLogger(__name__)

#: where a routed module keeps its routers' initial values (CPU tensors by parameter name)
INITIAL_VALUES_ATTR = "_depth_route_initial"


def has_meta_tensors(model: nn.Module) -> bool:
    return first_meta_tensor(model) is not None


@contextlib.contextmanager
def materialized(model: nn.Module, meta_init: Callable[[nn.Module], None] | None, caller: str) -> Iterator[None]:
    """``model``, on the meta device, on the CPU with values for the body of the block; back
    on the meta device after it, rewritten or not."""
    _refuse_partly_materialized(model, caller)
    init = meta_init if meta_init is not None else _own_init(model, caller)
    ties = _tied_groups(model)
    marks: dict[nn.Module, dict] = {}
    with torch.random.fork_rng(devices=[]):
        model.to_empty(device="cpu")
        _tie(model, ties)
        try:
            _mark_unset(model)
            before = {module: dict(vars(module)) for module in model.modules()}
            try:
                with torch.no_grad():
                    init(model)
            finally:  # only the init's changes: the rewrite's own attributes stay
                marks = _attributes_changed(before)
            _refuse_left_on_meta(model, caller)
            _refuse_left_unset(model, caller)
            yield
        finally:
            model.to("meta")
            _tie(model, ties)
            _restore(marks)


#: an attribute a module did not have
_ABSENT = object()


def _attributes_changed(before: dict[nn.Module, dict]) -> dict[nn.Module, dict]:
    """The module attributes the init set, with what they were: marks such as transformers'
    ``_is_hf_initialized``, which would make the user's own init after ``to_empty`` skip
    those modules, leaving them what ``to_empty`` left."""
    changed = {}
    for module, attributes in before.items():
        now = vars(module)
        diff = {k: attributes.get(k, _ABSENT) for k in now if attributes.get(k, _ABSENT) is not now[k]}
        if diff:
            changed[module] = diff
    return changed


def _restore(changed: dict[nn.Module, dict]) -> None:
    for module, attributes in changed.items():
        for key, value in attributes.items():
            if value is _ABSENT:
                vars(module).pop(key, None)
            else:
                vars(module)[key] = value


def _own_init(model: nn.Module, caller: str) -> Callable[[nn.Module], None]:
    init_weights = getattr(model, "init_weights", None)
    if not callable(init_weights):
        raise CaptureError(
            f"{caller}: {type(model).__name__} is on the meta device and has no init_weights(); depthrewrite "
            "runs the model to find its residual stream, so it materializes it on the CPU for the analysis. "
            "Pass meta_init=<a function that initializes the model's weights and buffers in place>, or "
            "rewrite the model once its weights exist"
        )
    return lambda m: init_weights()


def _refuse_partly_materialized(model: nn.Module, caller: str) -> None:
    """Materializing runs ``to_empty`` and the model's init on every tensor, and the move
    back puts every tensor on the meta device: the values of those not on it would be lost."""
    named = [*model.named_parameters(), *model.named_buffers()]
    real = next((n for n, t in named if not t.is_meta), None)
    if real is not None:
        meta = next(n for n, t in named if t.is_meta)
        raise CaptureError(
            f"{caller}: {type(model).__name__} is partly on the meta device ('{meta}') and partly not "
            f"('{real}', on {dict(named)[real].device}); depthrewrite would lose the values of the latter "
            "materializing the model for the analysis. Build it wholly on the meta device, or give it values first"
        )


def _refuse_left_on_meta(model: nn.Module, caller: str) -> None:
    found = first_meta_tensor(model)
    if found is not None:
        kind, name = found
        raise CaptureError(f"{caller}: {type(model).__name__}'s {kind} '{name}' is still on the meta device "
                           "after to_empty(device='cpu') and the model's init; the analysis needs its value")


#: floating dtypes with no NaN to mark with (packed 4-bit floats)
_WITHOUT_NAN = {getattr(torch, "float4_e2m1fn_x2", None)} - {None}


def _floating_tensors(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    return ((kind, name, tensor) for kind, name, tensor in named_tensors(model)
            if tensor.is_floating_point() and tensor.dtype not in _WITHOUT_NAN)


@torch.no_grad()
def _mark_unset(model: nn.Module) -> None:
    """NaN in every floating tensor ``to_empty`` made: its memory is unset, often zeros or
    an earlier tensor's values, so an init that misses a tensor would otherwise go unseen
    (the analysis would run on whatever was there and fail later, blaming the model's
    structure). Integer buffers (and packed 4-bit floats) have no NaN to mark them with and
    are not checked."""
    for _, _, tensor in _floating_tensors(model):
        tensor.fill_(float("nan"))


def _refuse_left_unset(model: nn.Module, caller: str) -> None:
    for kind, name, tensor in _floating_tensors(model):
        unset = int(tensor.isnan().sum())
        if unset:
            which = f"any of the {tensor.numel()}" if unset == tensor.numel() else f"{unset} of the {tensor.numel()}"
            raise CaptureError(
                f"{caller}: the init did not write {which} values of {type(model).__name__}'s {kind} '{name}' "
                "(still NaN after to_empty(device='cpu') and the init; depthrewrite fills each floating tensor "
                "with NaN first, and the analysis needs values in all of them). The init (init_weights() or "
                "meta_init) must write every parameter and floating buffer")


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place:
    ``to_empty`` and ``to("meta")`` give each place a new parameter of its own."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]


def _tie(model: nn.Module, groups: list[list[tuple[nn.Module, str]]]) -> None:
    for (first, first_name), *others in groups:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]


def keep_initial_values(model: nn.Module) -> None:
    """Keep, on every routed module, a CPU copy of its routers' parameters as they are now
    (the rewrite's initial values), for :func:`reset_routing_parameters`."""
    for module in model.modules():
        if is_routed(module):
            routers = getattr(module, ROUTER_ATTR)
            setattr(module, INITIAL_VALUES_ATTR,
                    {name: p.detach().to("cpu", copy=True) for name, p in routers.named_parameters()})


@torch.no_grad()
def reset_routing_parameters(model: nn.Module) -> int:
    """Write the routing parameters' initial values (those the rewrite gave them), in place:
    after ``to_empty`` and the model's own init, for a model rewritten on the meta device.
    Works through wrappers and on sharded parameters (DTensor, as FSDP2 makes them). Returns
    the number of parameters written."""
    written = 0
    for module in routed_modules(model, "reset_routing_parameters"):
        initial = getattr(module, INITIAL_VALUES_ATTR, None)
        if initial is None:
            raise CaptureError(f"reset_routing_parameters: the routed module {module._depth_path!r} keeps no initial "
                               "values; it was rewritten by a depthrewrite version that did not keep them")
        for name, param in getattr(module, ROUTER_ATTR).named_parameters():
            if param.is_meta:
                raise CaptureError(f"reset_routing_parameters: {module._depth_path}.{ROUTER_ATTR}.{name} is still on "
                                   "the meta device; call model.to_empty(device=...) first")
            param.copy_(_placed_like(initial[name], param))
            written += 1
    log.info("reset %d routing parameters to their initial values", written)
    return written


def _placed_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    value = value.to(dtype=param.dtype)
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # a torch built without distributed: no parameter is a DTensor
        return value.to(param.device)
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return distribute_tensor(value.to(mesh.device_type), mesh, param.placements)
    return value.to(param.device)
