"""The graph pass: rewrite one block's traced FX graph so that each site's branch reads the
routed value instead of the stream, and the depth state is threaded through the graph.

Before (one site)::

    n = norm(s); u = branch(n); s2 = s + u

After, for a router that replaces the stream (``router.keeps_stream`` false)::

    x = site_read(router, state, None); n = norm(x); u = branch(n)
    state = site_write(router, state, u, x, None)
    s2 = x + u          # the block still returns a stream-like tensor

and for one that keeps it (``preserve_identity``, the identity and scaling baselines)::

    x = site_read(router, state, s); ...
    s2 = s + site_scale(router, u)      # site_scale only where ``router.scales_update``

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
    keeps_stream = router_module.keeps_stream
    h = site.stream if keeps_stream else None
    with graph.inserting_before(_first_in_order(graph, site.norms)):
        router = graph.get_attr(target)
        x = graph.call_function(site_read, (router, state, h))
    for norm in site.norms:
        norm.replace_input_with(site.stream, x)
    if len(site.parts) == 1:
        u = site.parts[0]
    else:  # a parallel block written as two adds: its update is the sum of both parts
        with graph.inserting_after(_last_in_order(graph, site.parts)):
            u = graph.call_function(operator.add, tuple(site.parts))
    with graph.inserting_after(u):
        new_state = graph.call_function(site_write, (router, state, u, x, h))
    if getattr(router_module, "scales_update", False):
        _scale_update(graph, site, router, u)
    if not keeps_stream:
        site.adds[0].replace_input_with(site.stream, x)
        for add in site.adds:
            _out_of_place(add)
    return new_state


def _scale_update(graph: fx.Graph, site: SiteGraph, router: fx.Node, u: fx.Node) -> None:
    """``s + u`` becomes ``s + router.scale_update(u)`` (ReZero, LayerScale)."""
    if len(site.parts) != 1:
        raise ValueError("scaling the update of a two-add parallel site is not supported")
    with graph.inserting_before(site.adds[0]):
        scaled = graph.call_function(site_scale, (router, u))
    site.adds[0].replace_input_with(u, scaled)


def _erase_dead_adds(graph: fx.Graph, sites: list[SiteGraph]) -> int:
    """Residual adds whose result nobody reads any more (their stream value was replaced by
    the routed one). Only those: other unused nodes may be calls kept for side effects."""
    removed = 0
    for site in reversed(sites):
        for add in reversed(site.adds):
            if not add.users:
                graph.erase_node(add)
                removed += 1
    return removed
