"""The contract between the rewriter and a routing scheme.

A scheme never sees the FX graph. It gets the analysis result (:class:`ResidualStream`)
and provides:

- ``init_state(e)``: the depth state after the embedding, a pytree of tensors (tuples);
- ``site_router(site)``: a module with ``read(state, h) -> x`` (what the branch reads
  instead of ``h``) and ``write(state, u, x, h) -> state`` (record the branch's update).
  Two class attributes say how the block's residual adds change (see route_graph.py):
  ``reads_stream`` (``h`` is passed to read/write; else ``None``) and ``replaces_stream``
  (the add continues from the routed ``x``: ``x + u``; else it stays ``h + u``, or
  ``h + scale_update(u)`` where ``scales_update`` is true);
- ``readout_router()``: a module with ``read(state, h) -> x`` for the final norm.

State is functional: routers return new tuples and never mutate the old ones, so a block
is a pure function of (inputs, state) and gradient checkpointing can replay it.

With ``preserve_identity=True`` every router is wrapped in :class:`DeltaSite` /
:class:`DeltaReadout` (docs/spec.md section 7): the residual stream is kept and the branch reads
``h + g * route(state)`` with a gate ``g`` initialised to zero.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..analysis import ResidualStream, Site

log = logging.getLogger(__name__)

State = Any  # a pytree (nested tuples) of tensors


@dataclasses.dataclass(frozen=True)
class SchemeOptions:
    """Options every scheme takes."""

    preserve_identity: bool = False
    gate: str = "scalar"  # preserve_identity gate: 'scalar' or 'channel' (per-channel)


def is_number(value: object) -> bool:
    """An int or float, not a bool (``True`` is an int to Python, never a size or a scale here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number(scheme: str, name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float, checked here: a nan or inf option would otherwise surface only as
    non-finite output at verification, or in the words of an internal op."""
    if not (is_number(value) and math.isfinite(value)) or (positive and not value > 0):
        raise ValueError(f"{scheme}: {name} must be a {'positive ' if positive else ''}finite number, "
                         f"found {value!r}")
    return float(value)


def check_bool(scheme: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{scheme}: {name} must be True or False, found {value!r}")


class Scheme:
    """Base class of the rewrite passes. Subclasses set ``name``, ``Options`` and
    ``delta_applies`` and implement the three factory methods."""

    name: ClassVar[str]
    Options: ClassVar[type] = SchemeOptions
    #: whether docs/spec.md section 7's identity-preserving form applies (it does not for the
    #: identity rewrite itself)
    delta_applies: ClassVar[bool] = True

    def __init__(self, options: SchemeOptions, stream: ResidualStream, dtype: torch.dtype, device: torch.device,
                 hints: dict | None = None):
        type(self).check_options(options)
        for given, why in self.unused_options(options):
            log.warning("%s: %s is left unused: %s", self.name, given, why)
        self.options, self.stream = options, stream
        self.dtype, self.device = dtype, device
        self.d = stream.d_model
        #: facts about the model that the graph does not show, read from its config by
        #: ``rewrite.model_hints`` (e.g. ``kv_heads``, the default MHAR head count); may be empty
        self.hints = dict(hints or {})

    @classmethod
    def check_options(cls, options: SchemeOptions) -> None:
        """The checks of the options that need no model; those that need its depth or width
        are in ``__init__``. ``scheme_options`` runs them, so that a caller such as
        ``depthrewrite compare`` refuses a bad value before it builds or trains anything."""

    def unused_options(self, options: SchemeOptions) -> list[tuple[str, str]]:
        """``(name=value, why)`` for each option given a value that this rewrite will not
        read: logged as a warning, not refused, since a saved recipe records every option and
        must load back (a recipe saved before this was said would otherwise be refused).
        ``gate`` shapes the gate that ``preserve_identity=True`` adds; schemes that make no
        gate (the identity, the baselines whose identity is an initial value) take it with
        ``preserve_identity`` as they take every common option, so that one set of options
        can go to several schemes (``depthrewrite compare --option``)."""
        if options.gate != "scalar" and not options.preserve_identity:
            return [(f"gate={options.gate!r}", "it shapes the gate that preserve_identity=True adds, and "
                     "preserve_identity is False")]
        return []

    @property
    def delta(self) -> bool:
        return self.options.preserve_identity and self.delta_applies

    # -- to implement -------------------------------------------------------------------
    def init_state(self, e: torch.Tensor) -> State:
        raise NotImplementedError

    def site_router(self, site: Site) -> nn.Module:
        raise NotImplementedError

    def readout_router(self) -> nn.Module:
        raise NotImplementedError

    # -- used by the rewriter -----------------------------------------------------------
    def make_site_router(self, site: Site) -> nn.Module:
        router = self.site_router(site)
        return DeltaSite(router, self._gate()) if self.delta else router

    def make_readout_router(self) -> nn.Module:
        router = self.readout_router()
        return DeltaReadout(router, self._gate()) if self.delta else router

    def param(self, *shape: int, fill: float) -> nn.Parameter:
        return nn.Parameter(torch.full(shape, fill, dtype=self.dtype, device=self.device))

    def _gate(self) -> nn.Parameter:
        shape = (self.d,) if self.options.gate == "channel" else (1,)
        return self.param(*shape, fill=0.0)

    def describe(self) -> dict:
        """The scheme's name and every option as this rewrite used it: defaults filled in,
        automatic choices (``block_size``, ``heads``, ``init``) resolved by the subclasses."""
        return {"scheme": self.name, **dataclasses.asdict(self.options)}

    def resolved_options(self) -> dict:
        """Options that rebuild this rewrite exactly under any version's defaults (what
        checkpoints and ``save_pretrained`` record)."""
        return {k: v for k, v in self.describe().items() if k != "scheme"}


class PassThrough(nn.Module):
    """A router that keeps the plain residual stream and records nothing (the identity
    rewrite; the sites of baselines that only act elsewhere)."""

    reads_stream = True
    replaces_stream = False

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        return h

    def write(self, state: State, u, x, h) -> State:
        return state


class DeltaReadout(nn.Module):
    """``x = h + gate * route(state)``; the residual stream itself is kept (docs/spec.md section 7)."""

    def __init__(self, inner: nn.Module, gate: nn.Parameter):
        super().__init__()
        self.inner = inner
        self.gate = gate

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate * self.inner.read(state, h)


class DeltaSite(DeltaReadout):
    """A site of the identity-preserving form: reads as :class:`DeltaReadout`, records the
    update as the wrapped router does, and leaves the block's residual adds alone."""

    reads_stream = True
    replaces_stream = False

    def __init__(self, inner: nn.Module, gate: nn.Parameter):
        super().__init__(inner, gate)
        self.wants_parts = getattr(inner, "wants_parts", False)  # WAV still needs a parallel site's parts

    def write(self, state: State, u: torch.Tensor, x: torch.Tensor, h: torch.Tensor, **kw) -> State:
        return self.inner.write(state, u, x, h, **kw)


def zero_from(*params: nn.Parameter) -> torch.Tensor:
    """A scalar 0 computed from ``params``, to add where the math leaves them out: a DAR
    site that opens its block has no partial entry to transport, WAV's first site no
    details. Each then still takes part in the backward, with a zero gradient, which
    ``DistributedDataParallel`` requires of every parameter that needs one (without it, its
    second step fails with "Expected to have finished reduction in the prior iteration").
    A parameter may hold -inf on purpose (WAV's ``detail_bias_init=-inf``), and -inf * 0 is
    NaN, so each sum is made finite first (its gradient is 0 either way)."""
    return sum(torch.nan_to_num(p.sum(), nan=0.0, posinf=0.0, neginf=0.0) for p in params) * 0.0


def _state_dtype(state: State) -> torch.dtype | None:
    leaf = next((t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)), None)
    return leaf.dtype if leaf is not None else None


def site_read(router: nn.Module, state: State, h: torch.Tensor) -> torch.Tensor:
    """Called from rewritten block graphs: what the branch reads instead of the stream."""
    return router.read(state, h)


def site_scale(router: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """Called from rewritten block graphs of stream-keeping schemes that scale the update."""
    return router.scale_update(u)


def site_write(router: nn.Module, state: State, u: torch.Tensor, x: torch.Tensor, h: torch.Tensor,
               parts: tuple | None = None) -> State:
    """Called from rewritten block graphs: the state after the branch's update ``u``.
    ``parts`` (attention part, MLP part) is passed only to routers with ``wants_parts`` and
    only for parallel blocks whose graph adds the two parts separately."""
    # Sources are kept in one dtype, the embedding's (the autocast dtype under autocast):
    # a branch may return another (an MoE combining in float32), and routing reads them all.
    dtype = _state_dtype(state)
    if dtype is not None and u.dtype != dtype:
        u = u.to(dtype)
        parts = tuple(p.to(dtype) for p in parts) if parts is not None else None
    if parts is not None:
        return router.write(state, u, x, h, parts=parts)
    return router.write(state, u, x, h)
