"""The graph pass: rewrite one block's traced FX graph so that each site's branch reads the
routed value instead of the stream, and the depth state is threaded through the graph.

Before (one site)::

    n = norm(s); u = branch(n); s2 = s + u

After::

    x = site_read(router, state, s_or_None); n = norm(x); u = branch(n)
    state = site_write(router, state, u, x, s_or_None)
    s2 = x + u      # router.replaces_stream: routed schemes, DenseFormer
    s2 = s + u      # otherwise: preserve_identity, the identity and scaling baselines

``s`` is passed to the router only where ``router.reads_stream`` (a routed scheme that
does not read it lets the old residual adds die), and ``u`` becomes
``site_scale(router, u)`` where ``router.scales_update`` (ReZero, LayerScale).

The graph gains a ``depth_state`` placeholder and returns ``(original output, state)``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from ..analysis.residual import SiteGraph
from .base import site_read, site_scale, site_write

STATE_PLACEHOLDER = "depth_state"


@dataclass
class RouteGraphResult:
    graph: fx.Graph
    sites_rewritten: int
    adds_removed: int


def _first_in_order(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return min(nodes, key=order.__getitem__)


def _last_in_order(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return max(nodes, key=order.__getitem__)


def _out_of_place(add: fx.Node) -> None:
    """In-place residual adds (``h += u``) would write into the routed tensor that the norm
    saved for backward; the rewritten graph adds out of place."""
    if add.op == "call_function" and add.target is operator.iadd:
        add.target = operator.add
    elif add.op == "call_method" and add.target in ("add_", "__iadd__"):
        add.target = "add"


def route_block_graph_pass(graph: fx.Graph, sites: list[SiteGraph], routers: dict) -> RouteGraphResult:
    """Rewrite ``graph`` in place. ``routers`` maps each site's attribute path (relative to
    the block) to its router module, in site order. The caller lints the graph once it
    belongs to a module that holds the routers."""
    if len(sites) != len(routers):
        raise ValueError(f"route_block_graph_pass: {len(sites)} sites but {len(routers)} routers")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        state = graph.placeholder(STATE_PLACEHOLDER)
    for site, (target, module) in zip(sites, routers.items()):
        state = _rewrite_site(graph, site, target, module, state)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0], state),)
    removed = _erase_dead_adds(graph, sites)
    return RouteGraphResult(graph=graph, sites_rewritten=len(sites), adds_removed=removed)


def _rewrite_site(graph: fx.Graph, site: SiteGraph, target: str, router_module, state: fx.Node) -> fx.Node:
    h = site.stream if router_module.reads_stream else None
    with graph.inserting_before(_first_in_order(graph, site.norms)):
        router = graph.get_attr(target)
        x = graph.call_function(site_read, (router, state, h))
    for norm in site.norms:
        _feed_routed(graph, norm, site.stream, site.norm_chains.get(norm, ()), x)
    if len(site.parts) == 1:
        u = site.parts[0]
    else:  # a parallel block written as two adds: its update is the sum of both parts
        with graph.inserting_after(_last_in_order(graph, site.parts)):
            u = graph.call_function(operator.add, tuple(site.parts))
    # routers that weigh the two parts of a parallel block differently (WAV) get them too
    parts = tuple(site.parts) if getattr(router_module, "wants_parts", False) and len(site.parts) > 1 else None
    with graph.inserting_after(u):
        new_state = graph.call_function(site_write, (router, state, u, x, h), {"parts": parts} if parts else {})
    if site.add_reshapes:
        _write_in_stream_layout(graph, new_state, x)
    if getattr(router_module, "scales_update", False):
        _scale_update(graph, site, router, u)
    if router_module.replaces_stream:
        _feed_routed(graph, site.adds[0], site.stream, site.add_chain, x)
        for add in site.adds:
            _out_of_place(add)
    return new_state


def _write_in_stream_layout(graph: fx.Graph, write: fx.Node, x: fx.Node) -> None:
    """The add works on a view of the stream (OPT's ``h.reshape(-1, d) + u``): the update
    and its parts are recorded in the stream's own layout, that of ``x``."""
    with graph.inserting_before(write):
        u = graph.call_method("reshape_as", (write.args[2], x))
        parts = write.kwargs.get("parts")
        if parts:
            write.update_kwarg("parts", tuple(graph.call_method("reshape_as", (p, x)) for p in parts))
    write.update_arg(2, u)


def _feed_routed(graph: fx.Graph, consumer: fx.Node, stream: fx.Node, chain: tuple, x: fx.Node) -> None:
    """Make ``consumer`` read the routed ``x`` where it read ``stream``, through a copy of
    the casts and views (``chain``) it read the stream through: the original chain stays
    for the stream's other readers."""
    if not chain:
        consumer.replace_input_with(stream, x)
        return
    prev_old, prev_new = stream, x
    with graph.inserting_before(consumer):
        for node in chain:
            new = graph.node_copy(node, lambda n, old=prev_old, rep=prev_new: rep if n is old else n)
            prev_old, prev_new = node, new
    consumer.replace_input_with(chain[-1], prev_new)


def _scale_update(graph: fx.Graph, site: SiteGraph, router: fx.Node, u: fx.Node) -> None:
    """``s + u`` becomes ``s + router.scale_update(u)`` (ReZero, LayerScale). A two-add
    parallel site scales each part at its own add: the scalings are linear, so this is the
    scaling of their sum."""
    for add, part in zip(site.adds, site.parts):
        with graph.inserting_before(add):
            scaled = graph.call_function(site_scale, (router, part))
        add.replace_input_with(part, scaled)


def _erase_dead_adds(graph: fx.Graph, sites: list[SiteGraph]) -> int:
    """Residual adds whose result nobody reads any more (their stream value was replaced by
    the routed one), then the casts and views that fed only them or the norms. Only those:
    other unused nodes may be calls kept for side effects. Returns the adds removed."""
    removed = 0
    for site in reversed(sites):
        for add in reversed(site.adds):
            if not add.users:
                graph.erase_node(add)
                removed += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
        chained = {n for chain in (site.add_chain, *site.norm_chains.values()) for n in chain}
        for node in sorted(chained, key=order.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)
    return removed
