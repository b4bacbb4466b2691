"""Find the residual sites inside one traced block, by graph queries on a networkx view of
the FX graph.

Starting from the stream placeholder ``s``, a *site* is an add ``s + u`` (either order, in
place or not) whose other operand ``u`` is computed from ``s``. It is PreNorm when every
path from ``s`` to ``u`` passes through a normalisation module that reads ``s``: remove
those norm nodes and ``s`` no longer reaches ``u``. The add's result is the next stream.
A second add ``(s + a) + m`` whose ``m`` comes from the *previous* stream (not from
``s + a``) is the other half of a parallel block and joins the same site.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import NotPreNormError, NoResidualStreamError
from .probes import mixes_tokens, norm_eps, norm_type, run_block_graph

_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_", "__add__", "__iadd__", "__radd__"}


@dataclass
class SiteGraph:
    """A site in terms of the block's FX nodes (internal to the rewrite)."""

    stream: fx.Node  # the stream value the branch reads (before the add)
    norms: list[fx.Node]  # norm calls that read ``stream`` and feed the branch
    parts: list[fx.Node]  # branch outputs added to the stream (2 for a two-add parallel block)
    adds: list[fx.Node]  # the residual add(s); the last one is the next stream
    part_mixes: list[bool] = field(default_factory=list)  # does each part mix tokens
    sum_of_branches: bool = False  # one add of ``a + m`` (GPT-NeoX style parallel block)

    @property
    def out(self) -> fx.Node:
        return self.adds[-1]

    @property
    def kind(self) -> str:
        if len(self.parts) > 1 or self.sum_of_branches:
            return "parallel"
        return "attention" if self.part_mixes and self.part_mixes[0] else "mlp"


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for inp in node.all_input_nodes:
            g.add_edge(inp, node)
    return g


def is_add(node: fx.Node) -> bool:
    if node.kwargs.get("alpha") is not None:
        return False
    if node.op == "call_function" and node.target in _ADD_FUNCTIONS:
        return len(node.args) == 2
    if node.op == "call_method" and node.target in _ADD_METHODS:
        return len(node.args) == 2
    return False


def other_operand(add: fx.Node, stream: fx.Node):
    a, b = add.args[0], add.args[1]
    return b if a is stream else a


def _module_path(block_path: str, target: str) -> str:
    return f"{block_path}.{target}" if block_path else target


class BlockSiteFinder:
    """Walks one block's graph from its stream placeholder, collecting PreNorm sites."""

    def __init__(self, gm: fx.GraphModule, block: nn.Module, block_path: str, stream: fx.Node,
                 d_model: int, norm_cache: dict):
        self.gm, self.block, self.block_path = gm, block, block_path
        self.stream0, self.d_model, self.norm_cache = stream, d_model, norm_cache
        self.nx = to_networkx(gm.graph)

    def norm_of(self, node: fx.Node) -> str | None:
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            return None
        module = self.gm.get_submodule(node.target)
        if module not in self.norm_cache:
            self.norm_cache[module] = norm_type(module, self.d_model)
        return self.norm_cache[module]

    def find(self) -> list[SiteGraph]:
        sites: list[SiteGraph] = []
        stream = self.stream0
        while True:
            adds = [u for u in stream.users if is_add(u) and stream in u.args]
            if not adds:
                break
            if len(adds) > 1:
                raise NotPreNormError(
                    f"{self._where()}: the stream value '{stream.name}' is added to {len(adds)} "
                    "different tensors; expected one residual add per site"
                )
            site = self._site(stream, adds[0])
            self._join_parallel_half(site)
            site.sum_of_branches = self._sum_of_two_branches(site)
            sites.append(site)
            stream = site.out
        if not sites:
            raise NoResidualStreamError(
                f"{self._where()}: no residual add reads the block's stream argument "
                f"'{self.stream0.name}'"
            )
        self._check_returned(stream)
        return sites

    def _where(self) -> str:
        return f"block {self.block_path!r} ({type(self.block).__name__})"

    def _site(self, stream: fx.Node, add: fx.Node) -> SiteGraph:
        u = other_operand(add, stream)
        if not isinstance(u, fx.Node) or not nx.has_path(self.nx, stream, u):
            raise NotPreNormError(
                f"{self._where()}: the add '{add.name}' adds to the stream a value that is not "
                f"computed from it ({u!r}); a residual site adds a branch of the stream"
            )
        norms = [n for n in stream.users if self.norm_of(n) is not None and nx.has_path(self.nx, n, u)]
        self._require_prenorm(stream, norms, u, add)
        return SiteGraph(stream=stream, norms=norms, parts=[u], adds=[add])

    def _require_prenorm(self, stream: fx.Node, norms: list[fx.Node], u: fx.Node, add: fx.Node) -> None:
        pruned = self.nx.copy()
        pruned.remove_nodes_from(norms)
        if not nx.has_path(pruned, stream, u):
            return
        path = nx.shortest_path(pruned, stream, u)
        reader = next((n for n in path[1:] if n.op == "call_module"), path[1])
        found = (
            f"the branch reads the raw stream through '{_module_path(self.block_path, reader.target)}'"
            if reader.op == "call_module" else f"the branch reads the raw stream through '{reader.name}'"
        )
        shape = "post-norm h + norm(f(h))" if any(self.norm_of(n) for n in path[1:]) else "h + f(h) with no norm"
        raise NotPreNormError(
            f"{self._where()}: the residual add '{add.name}' is not PreNorm: {found} "
            f"(shape found: {shape}); depthrewrite needs h + f(norm(h)), see SPEC section 1"
        )

    def _join_parallel_half(self, site: SiteGraph) -> None:
        """``(s + a) + m`` with ``m`` computed from ``s`` (not from ``s + a``): one parallel site."""
        first = site.adds[0]
        nxt = [u for u in first.users if is_add(u) and first in u.args]
        if len(nxt) != 1:
            return
        m = other_operand(nxt[0], first)
        if not isinstance(m, fx.Node) or nx.has_path(self.nx, first, m) or not nx.has_path(self.nx, site.stream, m):
            return
        norms = [n for n in site.stream.users if self.norm_of(n) is not None and nx.has_path(self.nx, n, m)]
        self._require_prenorm(site.stream, norms, m, nxt[0])
        site.parts.append(m)
        site.adds.append(nxt[0])
        site.norms = list(dict.fromkeys(site.norms + norms))

    def _sum_of_two_branches(self, site: SiteGraph) -> bool:
        """A single add of ``a + m`` where both terms come from the normed stream (GPT-NeoX)."""
        u = site.parts[0]
        return len(site.parts) == 1 and is_add(u) and all(
            isinstance(t, fx.Node) and nx.has_path(self.nx, site.stream, t) for t in u.args[:2])

    def classify_parts(self, inputs: list, sites: list[SiteGraph]) -> None:
        """Label every part of every site as token-mixing or not (one probe run per site)."""
        baseline = run_block_graph(self.gm, inputs)
        for site in sites:
            site.part_mixes = mixes_tokens(self.gm, inputs, site.stream, site.parts, baseline)

    def branch_modules(self, site: SiteGraph) -> list[str]:
        """Module call targets on the branch: reachable from a norm, reaching a part."""
        on_branch = []
        for node in self.gm.graph.nodes:
            if node.op != "call_module" or node in site.norms:
                continue
            if any(nx.has_path(self.nx, n, node) for n in site.norms) and any(
                    node is p or nx.has_path(self.nx, node, p) for p in site.parts):
                on_branch.append(node.target)
        return on_branch

    def norm_info(self, site: SiteGraph) -> tuple[str, float | None]:
        kinds = {self.norm_of(n) for n in site.norms}
        eps = {norm_eps(self.gm.get_submodule(n.target)) for n in site.norms}
        return "/".join(sorted(k for k in kinds if k)), next(iter(eps)) if len(eps) == 1 else None

    def _check_returned(self, stream: fx.Node) -> None:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        first = _first_node(out.args[0])
        if first is not stream:
            got = first.name if isinstance(first, fx.Node) else repr(first)
            raise NotPreNormError(
                f"{self._where()}: the block returns '{got}' where the stream after its last "
                f"residual add ('{stream.name}') was expected; a norm or another op after the "
                "last add (post-LN) is not PreNorm"
            )


def _first_node(value):
    return next((leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, fx.Node)), None)
