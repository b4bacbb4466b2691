"""Record the depth-routing weights of a rewritten model: which sources each site reads.

The routers of ``attnres`` and ``block_attnres`` (``passes/attnres.py``: ``FullRouter``,
``BlockRouter``/``BlockReadout``, all ``DepthQuery``), and MHAR's subclasses of them
(``passes/mhar.py``, with ``heads``; the heatmap then shows the mean over heads),
compute their mix with ``self.route(sources)``; the weights themselves stay inside the
``depthrewrite::route`` op. :func:`record_routing_weights` wraps each router's ``route`` (an instance attribute
that shadows the method, removed afterwards) so that, besides calling the real op, it
recomputes the softmax from the router's parameters and the sources with the formula of
``depthrewrite.ops.route_reference``::

    a_{i,h} = softmax_i( sum_{c in head h} query[c] * RMSNorm_g(v_i)[c] )     (per token)

and averages it over the tokens. The forward pass itself is unchanged.

Schemes whose routers are not known here (``residual``, ``none``, the scaling baselines,
and until they are added DAR, WAV, Hyper-Connections, DenseFormer) are skipped with a
logged note: :func:`record_routing_weights` returns ``None``. DAR's two streams are
recorded by ``stream_similarity`` instead (cross-stream CKA, shadowing the readout's ``read``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..passes.attnres import BlockRouter, DepthQuery, FullRouter
from ..passes.base import DeltaReadout, DeltaSite
from ..passes.runtime import ROUTER_ATTR

log = logging.getLogger(__name__)


@dataclass
class RoutingWeights:
    """Token-averaged routing weights of one forward pass.

    ``rows[k]`` is site ``labels[k]`` (``"1"``..``"L"``, then ``"F"`` for the final readout);
    ``weights[k]`` has one entry per source that site read, in the router's order;
    ``source_labels[k]`` names them (``e``, ``u1``, ... for full AttnRes; ``b0``, ``b1``, ...,
    ``partial`` for Block AttnRes)."""

    scheme: str
    labels: list[str]
    weights: list[torch.Tensor]
    source_labels: list[list[str]]

    def columns(self) -> list[str]:
        """All source names, in first-seen order: the heatmap's columns."""
        seen: dict[str, None] = {}
        for names in self.source_labels:
            seen.update(dict.fromkeys(names))
        return _order_columns(list(seen))

    def matrix(self) -> torch.Tensor:
        """(sites + readout, columns) with NaN where a site does not read that source."""
        cols = {name: j for j, name in enumerate(self.columns())}
        out = torch.full((len(self.labels), len(cols)), float("nan"))
        for k, (w, names) in enumerate(zip(self.weights, self.source_labels)):
            for value, name in zip(w.tolist(), names):
                out[k, cols[name]] = value
        return out


def _order_columns(names: list[str]) -> list[str]:
    def key(name: str):
        if name in ("e", "b0"):
            return (0, 0)
        if name == "partial":
            return (2, 0)
        return (1, int(name.lstrip("ub")))

    return sorted(names, key=key)


def token_weights(router: DepthQuery, sources) -> torch.Tensor:
    """``route_reference``'s weights for one router: shape (N, *batch, heads). ``heads`` is
    the router's ``heads`` attribute (MHAR's routers have one), else 1; the key RMS
    statistic is over the full width, the query is read as ``heads`` slices."""
    heads = getattr(router, "heads", 1)
    src = torch.stack([s.float() for s in sources])
    d = src.shape[-1]
    khat = F.rms_norm(src, (d,), weight=router.key_norm_weight.float(), eps=float(router.eps))
    logits = (khat * router.query.float()).unflatten(-1, (heads, -1)).sum(-1)
    return torch.softmax(logits, dim=0)


def softmax_weights(router: DepthQuery, sources) -> torch.Tensor:
    """The router's weights averaged over tokens (and over heads for MHAR): shape (N,)."""
    return token_weights(router, sources).flatten(1).mean(1).cpu()


def _unwrap(router: nn.Module) -> nn.Module:
    return router.inner if isinstance(router, (DeltaSite, DeltaReadout)) else router


def _known_routers(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """(label, router) for every site in order and the readout last, or None when the model
    has routers of a kind not known here."""
    sites, readout = [], None
    for module in model.modules():
        table = getattr(module, ROUTER_ATTR, None)
        if not isinstance(table, nn.ModuleDict):
            continue
        for name, router in table.items():
            if name == "readout":
                readout = _unwrap(router)
            else:
                sites.append(_unwrap(router))
    routers = sites + ([readout] if readout is not None else [])
    if not routers or not all(isinstance(r, (FullRouter, BlockRouter)) for r in routers):
        return None
    return [(str(i + 1), r) for i, r in enumerate(sites)] + [("F", readout)]


def _source_labels(router: DepthQuery, n: int, state) -> list[str]:
    if isinstance(router, BlockRouter):
        blocks, partial = state[:2]  # a two-phase state has a third entry
        names = [f"b{j}" for j in range(len(blocks))]
        return names + (["partial"] if partial is not None else [])
    return ["e"] + [f"u{j}" for j in range(1, n)]


@contextlib.contextmanager
def _recording(routers: list[tuple[str, nn.Module]], record: dict):
    """Shadow each router's ``read`` (to see its state) and ``route`` (to see its sources).
    A two-phase Block AttnRes plan is switched off meanwhile, so that every site routes."""
    plans = {id(p): p for _, r in routers if (p := getattr(r, "_plan", None)) is not None}
    was_enabled = {key: plan.enabled for key, plan in plans.items()}
    for plan in plans.values():
        plan.enabled = False
    for label, router in routers:
        def read(state, h, _router=router, _label=label, _read=router.read):
            record[_label] = {"state": state}
            return _read(state, h)

        def route(sources, _router=router, _label=label, _route=router.route):
            entry = record.setdefault(_label, {})
            entry["weights"] = softmax_weights(_router, sources)
            entry["labels"] = _source_labels(_router, len(sources), entry.get("state"))
            return _route(sources)

        router.__dict__["read"] = read
        router.__dict__["route"] = route
    try:
        yield
    finally:
        for _, router in routers:
            router.__dict__.pop("read", None)
            router.__dict__.pop("route", None)
        for key, plan in plans.items():
            plan.enabled = was_enabled[key]


@torch.no_grad()
def record_routing_weights(model: nn.Module, input_ids: torch.Tensor, scheme: str = "") -> RoutingWeights | None:
    """Run ``model(input_ids)`` in eval mode and return the token-averaged routing weights of
    every site and of the readout; ``None`` (with a logged note) for unknown schemes."""
    routers = _known_routers(model)
    if routers is None:
        log.info("routing weights: no attnres/block_attnres/mhar routers in %s (scheme %r); heatmap skipped",
                 type(model).__name__, scheme)
        return None
    record: dict = {}
    was_training = model.training
    model.eval()
    try:
        with _recording(routers, record):
            model(input_ids)
    finally:
        model.train(was_training)
    labels = [label for label, _ in routers]
    missing = [label for label in labels if "weights" not in record.get(label, {})]
    if missing:
        raise RuntimeError(f"routing weights: sites {missing} did not route during the forward pass")
    return RoutingWeights(scheme, labels, [record[k]["weights"] for k in labels], [record[k]["labels"] for k in labels])
