"""Record the depth-routing weights of a rewritten model: which sources each site reads,
and with what weight.

Every depth-routing scheme makes a site's input ``x`` as a weighted sum of tensors of the
depth state (docs/spec.md sections 2-6, 8); :func:`record_routing_weights` runs one
forward pass and returns, for every site and the final readout, those weights and the
names of the sources they weigh:

- ``attnres``, ``block_attnres``, ``mhar`` (full and block), ``wav``: the router's
  softmax, recomputed beside the real op from the arguments of the router's ``route`` call
  (sources, logit bias, per-token source scale) with the formula of
  :func:`depthrewrite.ops.route.route_logits_reference`. Sources: ``e``, ``u1``, ... (full);
  ``b0``, ``b1``, ..., ``partial`` (block); ``e``, then ``C{n}``, ``Dphase{n}``,
  ``Dsplit{n}`` per completed block ``n`` and ``P``, ``Pphase``, ``Psplit`` for the
  partial one (WAV: the details as routed, RMS-matched). MHAR: one softmax per head.
- ``dar``: ``x = s r^0 + (1 - s) r^1`` with ``r^j`` routed over target stream j's values,
  so ``x`` weighs each value entry by ``s a^0_i`` or ``(1 - s) a^1_i`` (summed where both
  targets read the same entry: ``e``, or every entry for ``fixedkv``). Sources: ``e``,
  ``H{k}_{i}`` (stream k's completed entry i), ``P{k}`` (stream k's partial entry).
- ``denseformer``: the static DWA weights of the first site of every layer after the
  first (and of the readout) over ``e = X0``, ``X1``, ... (the layers' outputs); a linear
  combination, not a softmax (``static``), and the same for every token.

``residual``, ``rezero``, ``layerscale`` and the Hyper-Connections (``hyperconn``,
``mhc``: streams mixed by matrices, no depth sources) have none: :func:`has_routing_weights`
says so, and :func:`record_routing_weights` refuses them.

How: each router's ``read`` (to see the depth state) and the call that routes (``route``;
DAR's ``_route``) are shadowed by instance attributes, removed afterwards; the forward
pass itself is unchanged. Two-phase plans are switched off meanwhile, so that every site
routes its own sources: the same function (docs/design.md, "Two-phase Block AttnRes").
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from .ops.route import route_logits_reference
from .passes.attnres import BlockRouter, DepthQuery
from .passes.base import DeltaReadout, DeltaSite, PassThrough
from .passes.baselines import DepthWeightedAverage
from .passes.dar import VARIANTS, DualRoute
from .passes.runtime import ROUTER_ATTR
from .passes.wav import WavReadout, WavRouter
from .rewrite import find_runtime

log = logging.getLogger(__name__)

#: the routers whose sites have depth-routing weights (module docstring)
WEIGHTED_ROUTERS = (DepthQuery, DualRoute, DepthWeightedAverage)


@dataclass
class RoutingWeights:
    """The routing weights of one forward pass.

    ``labels[k]`` names site k (its index in the stack, ``"1"``..``"L"``, then ``"F"`` for
    the final readout; sites without weights, such as DenseFormer's later sites of a layer,
    are left out); ``weights[k]`` has one entry per source that site read, averaged over
    the tokens (and MHAR's heads), and ``source_labels[k]`` names them. With
    ``per_token``, ``per_token[k]`` holds the weights before the average, shape
    ``(sources, *batch, heads)`` (one head but for MHAR). ``static``: DenseFormer's
    weights, learned scalars that are not a softmax (they need not be positive or sum to 1)."""

    scheme: str
    labels: list[str]
    weights: list[torch.Tensor]
    source_labels: list[list[str]]
    per_token: list[torch.Tensor] | None = None
    static: bool = False

    def columns(self) -> list[str]:
        """Every source name once, in depth order: ``e``, the completed entries by depth,
        then the partial ones (:func:`column_key`)."""
        return sorted({name for names in self.source_labels for name in names}, key=column_key)

    def matrix(self) -> torch.Tensor:
        """(sites + readout, columns) with NaN where a site does not read that source."""
        cols = {name: j for j, name in enumerate(self.columns())}
        out = torch.full((len(self.labels), len(cols)), float("nan"))
        for k, (w, names) in enumerate(zip(self.weights, self.source_labels)):
            for value, name in zip(w.tolist(), names):
                out[k, cols[name]] = value
        return out

    def table(self, digits: int = 2) -> str:
        """A text table of :meth:`matrix`: a row per site (``F``: the final readout), a
        column per source, blank where a site does not read that source."""
        cols = self.columns()
        cells = [[""] + cols] + [[label] + ["" if math.isnan(v) else f"{v:.{digits}f}" for v in row.tolist()]
                                 for label, row in zip(self.labels, self.matrix())]
        widths = [max(len(row[j]) for row in cells) for j in range(len(cells[0]))]
        return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in cells)

    def to_record(self) -> dict:
        """The token-averaged weights as plain JSON data (the training harness writes one
        into ``metrics.jsonl`` at each evaluation); ``per_token`` is left out. Weights keep
        ``RECORD_DIGITS`` significant digits."""
        return {"scheme": self.scheme, "sites": list(self.labels), "sources": [list(n) for n in self.source_labels],
                "weights": [[float(f"{v:.{RECORD_DIGITS}g}") for v in w.tolist()] for w in self.weights],
                "static": self.static}

    @classmethod
    def from_record(cls, record: dict) -> RoutingWeights:
        """The inverse of :meth:`to_record`; a record that is not one is a ``ValueError``
        naming what is missing or does not match."""
        missing = [key for key in ("scheme", "sites", "sources", "weights", "static") if key not in record]
        if missing:
            raise ValueError(f"RoutingWeights.from_record: the record lacks {missing}; found keys {sorted(record)}")
        sites, sources, weights = record["sites"], record["sources"], record["weights"]
        lengths = (len(sites), len(sources), len(weights))
        if len(set(lengths)) != 1 or any(len(w) != len(n) for w, n in zip(weights, sources)):
            raise ValueError(f"RoutingWeights.from_record: sites, sources and weights must match one to one, "
                             f"found {lengths[0]} sites, {lengths[1]} source lists, {lengths[2]} weight lists "
                             f"(entries per site: {[len(n) for n in sources]} names, {[len(w) for w in weights]} "
                             "weights)")
        return cls(record["scheme"], list(sites), [torch.tensor(w, dtype=torch.float32) for w in weights],
                   [list(n) for n in sources], static=bool(record["static"]))


#: significant digits a weight keeps in :meth:`RoutingWeights.to_record`
RECORD_DIGITS = 6


def token_weights(router: DepthQuery, sources, logit_bias=None, source_scale=None) -> torch.Tensor:
    """The weights ``router`` routes ``sources`` with, per token: shape ``(N, *batch,
    heads)``, in float32 (float64 for float64 inputs). ``heads`` is the router's (MHAR's;
    1 otherwise)."""
    logits = route_logits_reference(sources, query=router.query, key_norm_weight=router.key_norm_weight,
                                    logit_bias=logit_bias, source_scale=source_scale,
                                    heads=getattr(router, "heads", 1), eps=float(router.eps))
    return torch.softmax(logits, dim=0)


def _token_mean(per_token: torch.Tensor) -> torch.Tensor:
    """Per-token weights ``(N, *batch, heads)`` averaged over the tokens and heads: ``(N,)``."""
    return per_token.flatten(1).mean(1).cpu()


# ------------------------------------------------------------------- the sources' names
def _query_sources(router: DepthQuery, state, count: int) -> list[str]:
    """The names of the ``count`` sources a :class:`DepthQuery` router routes in ``state``
    (read with the two-phase plan off), in the order of its ``route`` call."""
    if isinstance(router, (WavRouter, WavReadout)):
        _, completed, partial = state[:3]
        per_block = ("C{}", "Dphase{}", "Dsplit{}") if isinstance(router, WavRouter) else ("C{}",)
        names = ["e"] + [form.format(n) for n in range(len(completed)) for form in per_block]
        partials = ["P", "Pphase", "Psplit"][:len(per_block)]
        return names + (partials if partial is not None else [])
    if isinstance(router, BlockRouter):
        blocks, partial = state[:2]
        return [f"b{j}" for j in range(len(blocks))] + (["partial"] if partial is not None else [])
    return ["e"] + [f"u{j}" for j in range(1, count)]  # full routing: every entry so far, (e, u_1, ...)


def _stream_sources(stream: int, entries: int, has_partial: bool) -> list[str]:
    """DAR: the names of stream ``stream``'s entries as a site routes them."""
    completed = entries - has_partial
    return ["e"] + [f"H{stream}_{i}" for i in range(1, completed)] + ([f"P{stream}"] if has_partial else [])


#: the partial block's sources, last in a row of the heatmap, in this order
_PARTIAL_SOURCES = ("partial", "P", "Pphase", "Psplit", "P0", "P1")
#: the order of the sources of one depth: WAV's summary before its two details
_SAME_DEPTH = {"u": 0, "b": 0, "X": 0, "C": 0, "Dphase": 1, "Dsplit": 2}


def column_key(name: str) -> tuple[int, int, int]:
    """Sort key of a source name: ``e`` first, then the completed entries by depth (at one
    depth WAV's summary before its details, DAR's stream 0 before stream 1), the partial
    entries last."""
    if name == "e":
        return (0, 0, 0)
    if name in _PARTIAL_SOURCES:
        return (2, 0, _PARTIAL_SOURCES.index(name))
    if name.startswith("H"):  # DAR: H{stream}_{entry}
        stream, entry = name[1:].split("_")
        return (1, int(entry), int(stream))
    kind = name.rstrip("0123456789")
    return (1, int(name[len(kind):]), _SAME_DEPTH[kind])


# -------------------------------------------------------------------- recording a site
@dataclass
class _SiteRecord:
    """What one router's shadows saw in the forward pass."""

    state: object = None
    sources: list[str] | None = None
    per_token: torch.Tensor | None = None


def _shadow_query_router(router: DepthQuery, record: _SiteRecord) -> dict:
    """The shadows of a :class:`DepthQuery` router: ``read`` keeps the state, ``route``
    the weights of its call."""
    real_read, real_route = router.read, router.route

    def read(state, h):
        record.state = state
        return real_read(state, h)

    def route(sources, logit_bias=None, source_scale=None):
        names = _query_sources(router, record.state, len(sources))
        _check_count(router, names, len(sources))
        record.sources = names
        record.per_token = token_weights(router, sources, logit_bias, source_scale)
        extra = {k: v for k, v in (("logit_bias", logit_bias), ("source_scale", source_scale)) if v is not None}
        return real_route(sources, **extra)

    return {"read": read, "route": route}


def _shadow_dual_route(router: DualRoute, record: _SiteRecord) -> dict:
    """The shadows of a DAR router: ``_route`` keeps each target stream's weights, ``read``
    joins them by the gate ``s`` over the value entries they weigh."""
    real_read, real_route = router.read, router._route
    targets: dict[int, tuple[list[str], torch.Tensor]] = {}

    def route_one(streams, j):
        values, keys = router.route_inputs(streams, j)
        value_stream = VARIANTS[router.variant](j)[0]
        has_partial = record.state[1] is not None
        weights = route_logits_reference(values, keys, query=router.query[j],
                                         key_norm_weight=router.key_norm_weight[j], eps=float(router.eps))
        targets[j] = (_stream_sources(value_stream, len(values), has_partial), torch.softmax(weights, dim=0))
        return real_route(streams, j)

    def read(state, h):
        record.state = state
        targets.clear()
        out = real_read(state, h)
        s = torch.sigmoid(router.mix.detach()).reshape(())
        joined: dict[str, torch.Tensor] = {}
        for j, gate in ((0, s), (1, 1 - s)):
            for name, w in zip(*targets[j]):
                joined[name] = joined.get(name, 0) + gate.to(w.dtype) * w
        record.sources = sorted(joined, key=column_key)
        record.per_token = torch.stack([joined[name] for name in record.sources])
        return out

    return {"read": read, "_route": route_one}


def _shadow_dwa(router: DepthWeightedAverage, record: _SiteRecord) -> dict:
    """DenseFormer's DWA: static weights over ``X0 = e, X1, ..`` (the state, then ``h``)."""
    real_read = router.read

    def read(state, h):
        record.state = state
        record.sources = ["e"] + [f"X{j}" for j in range(1, len(state) + 1)]
        w = router.weights.detach()
        w = w.to(torch.promote_types(w.dtype, torch.float32))  # as the softmaxes: float32 at least
        record.per_token = w.reshape((-1,) + (1,) * h.dim()).expand(-1, *h.shape[:-1], 1)
        return real_read(state, h)

    return {"read": read}


def _check_count(router: nn.Module, names: list[str], count: int) -> None:
    if len(names) != count:  # the state layout and the route call disagree: a bug here, not the user's
        raise RuntimeError(f"routing weights: {type(router).__name__} routed {count} sources, but its state "
                           f"names {len(names)}: {names}")


def _shadows(router: nn.Module, record: _SiteRecord) -> dict:
    if isinstance(router, DepthQuery):
        return _shadow_query_router(router, record)
    if isinstance(router, DualRoute):
        return _shadow_dual_route(router, record)
    return _shadow_dwa(router, record)


# ------------------------------------------------------------------------ the routers
def _unwrap(router: nn.Module) -> nn.Module:
    return router.inner if isinstance(router, (DeltaSite, DeltaReadout)) else router


def _routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(label, router) for every site in order, then the readout ``"F"``; routers unwrapped
    from the identity-preserving form."""
    sites, readout = [], []
    for module in model.modules():
        table = getattr(module, ROUTER_ATTR, None)
        if not isinstance(table, nn.ModuleDict):
            continue
        for name, router in table.items():
            if name == "readout":
                readout.append(("F", _unwrap(router)))
            else:
                sites.append((str(len(sites) + 1), _unwrap(router)))
    return sites + readout


def _weighted_routers(model: nn.Module, caller: str) -> list[tuple[str, nn.Module]]:
    """The routers with weights; a clear error for a model that has none."""
    routers = _routers(model)
    if not routers:
        raise ValueError(f"{caller}: {type(model).__name__} has no depth routers: rewrite it first "
                         f"(depthrewrite.rewrite)")
    other = sorted({type(r).__name__ for _, r in routers
                    if not isinstance(r, WEIGHTED_ROUTERS + (PassThrough,))})
    weighted = [(label, r) for label, r in routers if isinstance(r, WEIGHTED_ROUTERS)]
    if other or not weighted:
        found = ", ".join(other) if other else "only routers that keep the plain residual stream (PassThrough)"
        raise ValueError(f"{caller}: {type(model).__name__}'s scheme has no depth-routing weights (found "
                         f"{found}); they are recorded for attnres, block_attnres, mhar, wav, dar and denseformer")
    return weighted


def has_routing_weights(model: nn.Module) -> bool:
    """Whether :func:`record_routing_weights` can record ``model`` (rewritten with a scheme
    that weighs depth sources)."""
    try:
        _weighted_routers(getattr(model, "_orig_mod", model), "has_routing_weights")
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _recording(routers: list[tuple[str, nn.Module]], records: dict[str, _SiteRecord]):
    """Shadow every router (see :func:`_shadows`) and switch the two-phase plans off."""
    plans = {id(p): p for _, r in routers if (p := getattr(r, "_plan", None)) is not None}
    was_enabled = {key: plan.enabled for key, plan in plans.items()}
    shadowed = []
    try:
        for plan in plans.values():
            plan.enabled = False
        for label, router in routers:
            records[label] = _SiteRecord()
            shadows = _shadows(router, records[label])
            router.__dict__.update(shadows)
            shadowed.append((router, shadows))
        yield
    finally:
        for router, shadows in shadowed:
            for name in shadows:
                router.__dict__.pop(name, None)
        for key, plan in plans.items():
            plan.enabled = was_enabled[key]


def _scheme_name(model: nn.Module) -> str:
    runtime = find_runtime(model)
    return runtime.scheme.name if runtime is not None else ""


@torch.no_grad()
def record_routing_weights(model: nn.Module, input_ids: torch.Tensor, *, per_token: bool = False,
                           **forward_kwargs) -> RoutingWeights:
    """Run ``model(input_ids, **forward_kwargs)`` once in eval mode and return the routing
    weights of every site and of the final readout (module docstring). ``model`` may be
    the compiled module (``torch.compile``'s wrapper): its original module runs, eagerly.
    ``per_token``: keep each site's weights per token too (:class:`RoutingWeights`).
    A model whose scheme has no such weights is refused with a ``ValueError``."""
    model = getattr(model, "_orig_mod", model)
    routers = _weighted_routers(model, "record_routing_weights")
    records: dict[str, _SiteRecord] = {}
    was_training = model.training
    model.eval()
    try:
        with _recording(routers, records):
            model(input_ids, **forward_kwargs)
    finally:
        model.train(was_training)
    labels = [label for label, _ in routers]
    missing = [label for label in labels if records[label].per_token is None]
    if missing:
        raise RuntimeError(f"record_routing_weights: sites {missing} did not route during the forward pass")
    tokens = [records[label].per_token.cpu() for label in labels]
    return RoutingWeights(_scheme_name(model), labels, [_token_mean(t) for t in tokens],
                          [records[label].sources for label in labels], tokens if per_token else None,
                          static=isinstance(routers[0][1], DepthWeightedAverage))
