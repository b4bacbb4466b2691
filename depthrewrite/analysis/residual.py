"""Find the residual sites inside one traced block, by graph queries on a networkx view of
the FX graph.

Starting from the stream placeholder ``s``, a *site* is an add ``s + u`` (either order, in
place or not) whose other operand ``u`` is computed from ``s``. It is PreNorm when every
path from ``s`` to ``u`` passes through a normalisation module that reads ``s``: remove
those norm nodes and ``s`` no longer reaches ``u``. The add's result is the next stream.
A second add ``(s + a) + m`` whose ``m`` comes from the *previous* stream (not from
``s + a``) is the other half of a parallel block and joins the same site.

Reachability follows values only: reading a tensor for its shape or dtype (``x.size()``,
``u.view(h.shape)``, ``b.expand_as(h)``) is not reading the stream. Ops that carry the
stream's values unchanged (dtype casts, views, ``contiguous``) are transparent: the add or
the norm may read ``s.to(torch.float32)`` or ``s.reshape(-1, d)`` instead of ``s``; each
site records those chains so that the rewrite can replay them on the routed value.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..capture import EXAMPLE_SEQ_LEN
from ..errors import CaptureError, NotPreNormError, NoResidualStreamError, UnsupportedStructureError
from .probes import MIN_PROBE_TOKENS, mixes_tokens, norm_eps, norm_type, run_block_graph, shows_mixing, two_token_copy

log = logging.getLogger(__name__)

_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_", "__add__", "__iadd__", "__radd__"}

#: methods that carry their input's values unchanged into another dtype or memory layout
_CAST_METHODS = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous"}
#: methods that carry their input's values unchanged into another shape, in the same order
_VIEW_METHODS = {"view", "reshape", "view_as", "reshape_as", "flatten"}
#: methods whose argument 1 is read for its shape or dtype only
_SHAPE_OF_ARG1_METHODS = {"expand_as", "view_as", "reshape_as", "type_as"}
#: methods and functions whose result depends on their first argument's shape/dtype only
_SHAPE_OF_ARG0_METHODS = {"size", "dim", "numel", "new_zeros", "new_ones", "new_empty", "new_full"}
_SHAPE_OF_ARG0_FUNCTIONS = {torch.zeros_like, torch.ones_like, torch.empty_like}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda"}


@dataclass
class SiteGraph:
    """A site in terms of the block's FX nodes (internal to the rewrite)."""

    stream: fx.Node  # the stream value the branch reads (before the add)
    norms: list[fx.Node]  # norm calls that read ``stream`` and feed the branch
    parts: list[fx.Node]  # branch outputs added to the stream (2 for a two-add parallel block)
    adds: list[fx.Node]  # the residual add(s); the last one is the next stream
    part_mixes: list[bool] = field(default_factory=list)  # does each part mix tokens
    sum_of_branches: bool = False  # one add of ``a + m`` (GPT-NeoX style parallel block)
    #: per norm, the transparent ops between ``stream`` and the norm's input (empty: reads it)
    norm_chains: dict = field(default_factory=dict)
    #: the transparent ops between ``stream`` and the residual add's stream operand
    add_chain: tuple = ()
    identity_norm: bool = False  # the norm slot is nn.Identity (the branch reads h_0 as is)

    @property
    def add_reshapes(self) -> bool:
        """The add works on a view of the stream (``s.reshape(-1, d) + u``)."""
        return any(n.target in _VIEW_METHODS for n in self.add_chain)

    @property
    def out(self) -> fx.Node:
        return self.adds[-1]

    @property
    def kind(self) -> str:
        if len(self.parts) > 1 or self.sum_of_branches:
            return "parallel"
        return "attention" if self.part_mixes and self.part_mixes[0] else "mlp"


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The value-dependency graph: an edge for every input a node reads the values of."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        shape_only = _shape_only_inputs(node)
        for inp in node.all_input_nodes:
            if inp not in shape_only:
                g.add_edge(inp, node)
    return g


def _shape_only_inputs(node: fx.Node) -> set:
    """Inputs ``node`` reads for their shape, dtype or device only."""
    args = node.args
    if node.op == "call_method" and node.target in _SHAPE_OF_ARG1_METHODS and len(args) > 1:
        return {args[1]} - {args[0]}
    if node.op == "call_method" and node.target in _SHAPE_OF_ARG0_METHODS and args:
        return {args[0]}
    if node.op == "call_function" and node.target in _SHAPE_OF_ARG0_FUNCTIONS and args:
        return {args[0]}
    if node.op == "call_function" and node.target is getattr and len(args) == 2 \
            and args[1] in _METADATA_ATTRIBUTES:
        return {args[0]}
    return set()


def is_add(node: fx.Node) -> bool:
    if node.kwargs.get("alpha") is not None or any(isinstance(a, (tuple, list)) for a in node.args):
        return False  # a scaled add, or a concatenation of tuples
    if node.op == "call_function" and node.target in _ADD_FUNCTIONS:
        return len(node.args) == 2
    if node.op == "call_method" and node.target in _ADD_METHODS:
        return len(node.args) == 2
    return False


def other_operand(add: fx.Node, stream: fx.Node):
    a, b = add.args[0], add.args[1]
    return b if a is stream else a


def module_path(block_path: str, target: str) -> str:
    return f"{block_path}.{target}" if block_path else target


class BlockSiteFinder:
    """Walks one block's graph from its stream placeholder, collecting PreNorm sites.

    ``identity_norm_ok``: the block is the first of the stack, whose stream is the
    embedding output ``h_0``; there an ``nn.Identity`` in a norm slot (the model normed its
    embeddings itself, as ModernBERT-decoder does) counts as the first site's norm.
    """

    def __init__(self, gm: fx.GraphModule, block: nn.Module, block_path: str, stream: fx.Node,
                 d_model: int, norm_cache: dict, identity_norm_ok: bool = False):
        self.gm, self.block, self.block_path = gm, block, block_path
        self.stream0, self.d_model, self.norm_cache = stream, d_model, norm_cache
        self.identity_norm_ok = identity_norm_ok
        self.nx = to_networkx(gm.graph)
        #: the stream value the walk ended at, and whether it ended before the block's end
        #: (no add found, or the block returns something else): the add may then live
        #: inside a child module that the stream is passed to
        self.last_stream: fx.Node = stream
        self.incomplete = False

    def norm_of(self, node: fx.Node) -> str | None:
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            return None
        module = self.gm.get_submodule(node.target)
        if module not in self.norm_cache:
            self.norm_cache[module] = norm_type(module, self.d_model)
        return self.norm_cache[module]

    def _is_identity_slot(self, node: fx.Node) -> bool:
        return node.op == "call_module" and len(node.args) == 1 and not node.kwargs \
            and isinstance(self.gm.get_submodule(node.target), nn.Identity)

    def carried(self, stream: fx.Node) -> dict[fx.Node, tuple]:
        """``stream`` and every value that carries it unchanged (casts, views), each with
        the chain of transparent ops that leads to it from ``stream``."""
        found: dict[fx.Node, tuple] = {stream: ()}
        queue = [stream]
        while queue:
            node = queue.pop()
            for user in node.users:
                if user not in found and self._transparent(user, node):
                    found[user] = found[node] + (user,)
                    queue.append(user)
        return found

    def _transparent(self, node: fx.Node, src: fx.Node) -> bool:
        if node.op != "call_method" or node.target not in _CAST_METHODS | _VIEW_METHODS:
            return False
        if not node.args or node.args[0] is not src:
            return False
        others = [a for a in node.all_input_nodes if a is not src]
        return not any(self.nx.has_edge(a, node) and nx.has_path(self.nx, self.stream0, a) for a in others)

    def find(self) -> list[SiteGraph]:
        sites: list[SiteGraph] = []
        stream = self.stream0
        while True:
            carried = self.carried(stream)
            # adds of a value not computed from the stream (a bias) are no residual adds
            adds = list(dict.fromkeys(u for c in carried for u in c.users if is_add(u) and c in u.args
                                      and self._adds_stream_branch(u, c, stream)))
            if not adds:
                break
            if len(adds) > 1:
                raise NotPreNormError(self._several_adds(stream, adds))
            site = self._site(stream, carried, adds[0], first=not sites)
            self._join_parallel_half(site, sites)
            site.sum_of_branches = self._sum_of_two_branches(site)
            sites.append(site)
            stream = site.out
        self.last_stream = stream
        if not sites:
            self.incomplete = True
            raise NoResidualStreamError(
                f"{self.where()}: no residual add reads the block's stream argument "
                f"'{self.stream0.name}'"
            )
        self._check_returned(stream)
        return sites

    def _adds_stream_branch(self, add: fx.Node, operand: fx.Node, stream: fx.Node) -> bool:
        other = other_operand(add, operand)
        return isinstance(other, fx.Node) and nx.has_path(self.nx, stream, other)

    def _several_adds(self, stream: fx.Node, adds: list[fx.Node]) -> str:
        terms = ", ".join(f"'{a.name}' ({stream.name} + {getattr(other_operand(a, stream), 'name', '?')})"
                          for a in adds)
        msg = f"{self.where()}: the stream value '{stream.name}' is added to {len(adds)} different tensors: {terms}"
        for a in adds:  # one sum feeding the norm of another's branch: the branch reads norm(h + t)
            norm = next((n for n in self.gm.graph.nodes if self.norm_of(n) and nx.has_path(self.nx, a, n)
                         and any(nx.has_path(self.nx, n, b) for b in adds if b is not a)), None)
            if norm is not None:
                return (f"{msg}; '{a.name}' feeds the norm '{module_path(self.block_path, norm.target)}' of "
                        "another branch, which so reads norm(h + t) rather than norm(h) (a stream modified "
                        "before its norm is not PreNorm)")
        return f"{msg}; expected one residual add per site"

    def where(self) -> str:
        return f"block {self.block_path!r} ({type(self.block).__name__})"

    def _site(self, stream: fx.Node, carried: dict, add: fx.Node, first: bool) -> SiteGraph:
        operand = next(a for a in add.args[:2] if a in carried)
        u = other_operand(add, operand)
        if not isinstance(u, fx.Node) or not nx.has_path(self.nx, stream, u):
            raise NotPreNormError(
                f"{self.where()}: the add '{add.name}' adds to the stream a value that is not "
                f"computed from it ({u!r}); a residual site adds a branch of the stream"
            )
        readers = [(n, c) for c in carried for n in c.users
                   if n not in carried and nx.has_path(self.nx, n, u)]
        norms = [n for n, _ in readers if self.norm_of(n) is not None]
        identity = first and self.identity_norm_ok and not norms and any(self._is_identity_slot(n) for n, _ in readers)
        if identity:
            norms = [n for n, _ in readers if self._is_identity_slot(n)]
        self._require_prenorm(stream, norms, u, add)
        chains = {n: carried[c] for n, c in readers if n in norms}
        return SiteGraph(stream=stream, norms=norms, parts=[u], adds=[add], norm_chains=chains,
                         add_chain=carried[operand], identity_norm=identity)

    def _require_prenorm(self, stream: fx.Node, norms: list[fx.Node], u: fx.Node, add: fx.Node) -> None:
        pruned = self.nx.copy()
        pruned.remove_nodes_from(norms)
        if not nx.has_path(pruned, stream, u):
            return
        path = nx.shortest_path(pruned, stream, u)
        reader = next((n for n in path[1:] if n.op == "call_module"), path[1])
        found = (
            f"the branch reads the raw stream through '{module_path(self.block_path, reader.target)}'"
            if reader.op == "call_module" else f"the branch reads the raw stream through '{reader.name}'"
        )
        post_ln = self._post_ln_norm(add)
        if any(self.norm_of(n) for n in path[1:]):  # OLMo 2: the norm sits on the branch, after f
            shape = "post-norm h + norm(f(h))"
        elif post_ln is not None:  # the original Transformer, BERT: the norm's output is the next stream
            norm_class = type(self.gm.get_submodule(post_ln.target)).__name__
            found += f", and the sum goes into the norm '{module_path(self.block_path, post_ln.target)}' ({norm_class})"
            shape = "post-LN norm(h + f(h))"
        else:
            shape = "h + f(h) with no norm"
        hint = ""
        if reader.op == "call_module" and self._is_identity_slot(reader):
            hint = (" (an nn.Identity in a norm slot is accepted only at the first site of the "
                    "first block, whose stream is the embedding output)")
        raise NotPreNormError(
            f"{self.where()}: the residual add '{add.name}' is not PreNorm: {found}{hint} "
            f"(shape found: {shape}); depthrewrite needs h + f(norm(h)), see docs/spec.md section 1"
        )

    def _post_ln_norm(self, add: fx.Node) -> fx.Node | None:
        """The norm whose output replaces the sum as the stream (post-LN ``norm(h + f(h))``):
        the only reader of the sum's values. A norm that reads the sum next to a raw add of
        it is the next site's PreNorm, not a post-LN norm."""
        carried = self.carried(add)
        readers = {r for c in carried for r in self.nx.successors(c) if r not in carried}
        norms = [r for r in readers if self.norm_of(r) is not None]
        return norms[0] if len(norms) == 1 and len(readers) == 1 else None

    def _join_parallel_half(self, site: SiteGraph, earlier: list[SiteGraph]) -> None:
        """``(s + a) + m`` with ``m`` computed from ``s`` (not from ``s + a``): one parallel
        site. With ``m`` computed from an earlier site's norm instead (LongCat-Flash's
        shortcut MoE reads the second site's norm and is added at the end of the block), ``m``
        still enters the stream here: it joins this site as a delayed part of its update."""
        first = site.adds[0]
        nxt = [u for u in first.users if is_add(u) and first in u.args]
        if len(nxt) != 1:
            return
        m = other_operand(nxt[0], first)
        if not isinstance(m, fx.Node) or nx.has_path(self.nx, first, m):
            return
        if not nx.has_path(self.nx, site.stream, m):
            self._join_delayed_part(site, earlier, m, nxt[0])
            return
        carried = self.carried(site.stream)
        readers = [(n, c) for c in carried for n in c.users
                   if self.norm_of(n) is not None and nx.has_path(self.nx, n, m)]
        norms = [n for n, _ in readers]
        self._require_prenorm(site.stream, norms, m, nxt[0])
        site.norm_chains.update({n: carried[c] for n, c in readers})
        site.parts.append(m)
        site.adds.append(nxt[0])
        site.norms = list(dict.fromkeys(site.norms + norms))

    def _join_delayed_part(self, site: SiteGraph, earlier: list[SiteGraph], m: fx.Node, add: fx.Node) -> None:
        norms = [n for e in earlier for n in e.norms]
        if not norms or not nx.has_path(self.nx, self.stream0, m):
            return
        self._require_prenorm(self.stream0, norms, m, add)  # it reads the earlier streams through their norms
        site.parts.append(m)
        site.adds.append(add)

    def _sum_of_two_branches(self, site: SiteGraph) -> bool:
        """A single add of ``a + m`` where both terms come from the normed stream (GPT-NeoX)."""
        u = site.parts[0]
        return len(site.parts) == 1 and is_add(u) and all(
            isinstance(t, fx.Node) and nx.has_path(self.nx, site.stream, t) for t in u.args[:2])

    def classify_parts(self, inputs: list, sites: list[SiteGraph], sized_arguments: tuple[str, ...] = ()) -> None:
        """Label every part of every site as token-mixing or not (one probe run per site).

        ``sized_arguments`` describes the block's arguments, other than the stream, that
        may be sized for the example's sequence (tensors, objects, numbers). A one-token
        example cannot show mixing; without such arguments the probe runs on a two-token
        copy of the stream instead, with them the example is refused."""
        baseline = run_block_graph(self.gm, inputs)
        for site in sites:
            self._require_stream_shape(site, baseline)
        if not shows_mixing(baseline[self.stream0]):
            inputs, baseline = self._two_token_probe(inputs, baseline[self.stream0], sized_arguments)
        for site in sites:
            site.part_mixes = mixes_tokens(self.gm, inputs, site.stream, site.parts, baseline)

    def _two_token_probe(self, inputs: list, stream: torch.Tensor, sized_arguments: tuple[str, ...]):
        """The inputs and node values of a run on a two-token copy of a one-token stream."""
        if sized_arguments or stream.dim() < 2 or stream.shape[-2] != 1:
            why = (f"the block also receives {', '.join(sized_arguments)}, which may be sized for that "
                   "sequence, so depthrewrite cannot make up a longer one") if sized_arguments else ""
            raise CaptureError(self._too_short(stream, why))
        index = [n for n in self.gm.graph.nodes if n.op == "placeholder"].index(self.stream0)
        longer = list(inputs)
        longer[index] = two_token_copy(stream)
        try:
            baseline = run_block_graph(self.gm, longer)
        except Exception as exc:  # noqa: BLE001 - the block's code does not take the longer copy
            raise CaptureError(self._too_short(
                stream, f"running the block on a two-token copy of its stream failed ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:200]})")) from exc
        log.info("%s: the example's stream has one token; branch kinds probed on a two-token copy",
                 self.where())
        return longer, baseline

    def _too_short(self, stream: torch.Tensor, why: str) -> str:
        found = (f"a sequence of {stream.shape[-2]} token{'s' if stream.shape[-2] != 1 else ''} (dim -2)"
                 if stream.dim() >= 2 else "no sequence dimension")
        return (f"{self.where()}: the example input gives the block a stream of shape {tuple(stream.shape)}, "
                f"{found}; whether a branch mixes tokens (attention) or not (mlp) shows only across at least "
                f"{MIN_PROBE_TOKENS} tokens{'; ' + why if why else ''}. Pass example_inputs with a sequence of "
                f"at least {MIN_PROBE_TOKENS} tokens (without example_inputs, a model with config.vocab_size "
                f"is captured on {EXAMPLE_SEQ_LEN} tokens)")

    def _require_stream_shape(self, site: SiteGraph, values: dict) -> None:
        """Routing keeps every source in the shape the block received the stream in."""
        got, want = values[site.stream], values[self.stream0]
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape != want.shape:
            raise UnsupportedStructureError(
                f"{self.where()}: the site at '{site.adds[0].name}' reads the stream as "
                f"'{site.stream.name}' of shape {tuple(got.shape)}, but the block received it with "
                f"shape {tuple(want.shape)}; a stream reshaped between sites is not supported yet"
            )

    def raw_readers(self, stream: fx.Node) -> frozenset:
        """Paths of the child modules, other than norms, that read ``stream``'s values
        directly (through functions and methods, not through another module)."""
        found, seen, queue = set(), {stream}, [stream]
        while queue:
            node = queue.pop()
            for user in self.nx.successors(node):
                if user in seen:
                    continue
                seen.add(user)
                if user.op == "call_module":
                    if self.norm_of(user) is None and not self._is_identity_slot(user):
                        found.add(user.target)
                elif user.op in ("call_function", "call_method"):
                    queue.append(user)
        return frozenset(found)

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
        if site.identity_norm:
            return "identity", None
        kinds = {self.norm_of(n) for n in site.norms}
        eps = {norm_eps(self.gm.get_submodule(n.target)) for n in site.norms}
        return "/".join(sorted(k for k in kinds if k)), next(iter(eps)) if len(eps) == 1 else None

    def _check_returned(self, stream: fx.Node) -> None:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        first = first_node(out.args[0])
        if first not in self.carried(stream):
            self.incomplete = True
            got = first.name if isinstance(first, fx.Node) else repr(first)
            raise NotPreNormError(
                f"{self.where()}: the block returns '{got}' where the stream after its last "
                f"residual add ('{stream.name}') was expected; a norm or another op after the "
                "last add (post-LN) is not PreNorm"
            )


def first_node(value):
    """The first node a block returns; through ``(out,) + rest``, which the trace records
    as a node when ``rest`` came from a leaf module."""
    node = next((leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, fx.Node)), None)
    if node is not None and node.op == "call_function" and node.target is operator.add \
            and isinstance(node.args[0], tuple) and node.args[0]:
        return first_node(node.args[0])
    return node
