"""Per-block torch.fx tracing with every child module kept as a leaf.

A block is traced exactly as the model calls it: tensors and other objects (caches,
tuples of RoPE tensors) become placeholders; ``None``, booleans, numbers and strings are
baked in as constants, because block code branches on them (``if use_cache:``). The
constants and the train/eval mode form the block's :class:`CallSpec`; a call with a
different spec is traced again (the rewritten block keeps one graph per spec).

Tracing goes through a throwaway root module that shares the block's module, parameter
and buffer dictionaries, so node targets are the block's own attribute paths and the
generated code runs with the block itself as ``self``.
"""

from __future__ import annotations

import keyword
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..errors import CaptureError

_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class CallSpec:
    """The shape of one block call: which arguments are traced inputs and which constants."""

    positional: tuple  # per position: ("input", type name) or ("const", value)
    keywords: tuple  # sorted (name, ("input", type name) | ("const", value))
    training: bool

    def input_names(self, param_names: list[str]) -> list[str]:
        names = []
        for i, (mode, _) in enumerate(self.positional):
            if mode == "input":
                names.append(param_names[i] if i < len(param_names) else f"arg{i}")
        names += [k for k, (mode, _) in self.keywords if mode == "input"]
        return [_identifier(n) for n in names]

    @property
    def key(self) -> tuple:
        """A plain-tuple key (cheap to hash, and traceable by torch.compile)."""
        return (self.positional, self.keywords, self.training)

    def input_index(self, position: int | None, keyword: str | None) -> int:
        """Index among the traced inputs of a positional or keyword argument."""
        entries = [("pos", i) for i, (m, _) in enumerate(self.positional) if m == "input"]
        entries += [("kw", k) for k, (m, _) in self.keywords if m == "input"]
        return entries.index(("kw", keyword) if keyword is not None else ("pos", position))

    def with_changes(self, as_input: set, flipped: set) -> "CallSpec":
        """This spec with the ``None`` keywords in ``as_input`` passed as objects instead (an
        attention mask, a KV cache) and the boolean keywords in ``flipped`` negated."""
        def change(k, v):
            if k in as_input and v == ("const", None):
                return INPUT
            if k in flipped and v[0] == "const" and isinstance(v[1], bool):
                return ("const", not v[1])
            return v
        keywords = tuple((k, change(k, v)) for k, v in self.keywords)
        return CallSpec(self.positional, keywords, self.training)

    def with_training(self, training: bool) -> "CallSpec":
        return CallSpec(self.positional, self.keywords, training)

    def none_keywords(self) -> list[str]:
        return [k for k, v in self.keywords if v == ("const", None)]

    def bool_keywords(self) -> list[str]:
        return [k for k, v in self.keywords if v[0] == "const" and isinstance(v[1], bool)]

    def call_arguments(self, inputs: list) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of a call of this spec, from its traced inputs' values."""
        it = iter(inputs)
        args = tuple(next(it) if mode == "input" else value for mode, value in self.positional)
        kwargs = {k: (next(it) if mode == "input" else value) for k, (mode, value) in self.keywords}
        return args, kwargs

    def input_values(self, args: tuple, kwargs: dict) -> list:
        vals = [a for a, (mode, _) in zip(args, self.positional) if mode == "input"]
        vals += [kwargs[k] for k, (mode, _) in self.keywords if mode == "input"]
        return vals


#: every traced input is one opaque placeholder whatever its type (a tensor, a tuple of
#: tensors, a KV cache object): child modules are leaves, so the graph does not depend on it
INPUT = ("input", "any")


#: an int traced as an input (a placeholder) rather than baked in: see :func:`call_spec`
INT_INPUT = ("input", "int")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _classify(value: Any, traced_int: bool = False) -> tuple:
    if traced_int and _is_int(value):
        return INT_INPUT
    if isinstance(value, _CONSTANT_TYPES):
        return ("const", value)
    return INPUT


def call_spec(args: tuple, kwargs: dict, training: bool, int_inputs: frozenset = frozenset()) -> CallSpec:
    """The spec of a call. ``int_inputs`` names the arguments (positions, keywords) whose int
    values are traced inputs instead of constants: a position that changes at every call
    (Meta Llama's ``start_pos`` while decoding) would otherwise need one graph per value."""
    return CallSpec(
        positional=tuple(_classify(a, i in int_inputs) for i, a in enumerate(args)),
        keywords=tuple(sorted((k, _classify(v, k in int_inputs)) for k, v in kwargs.items())),
        training=training,
    )


def varying_ints(spec: CallSpec, seen: list[CallSpec]) -> frozenset:
    """The arguments (positions, keywords) of ``spec`` holding an int that differs from the
    one of a spec in ``seen`` that is otherwise the same; empty if there is none."""
    for other in seen:
        differ = [(name, a, b) for name, a, b in _argument_pairs(spec, other) or () if a != b]
        if differ and all(a[0] == b[0] == "const" and _is_int(a[1]) and _is_int(b[1]) for _, a, b in differ):
            return frozenset(name for name, _, _ in differ)
    return frozenset()


def spec_differences(spec: CallSpec, seen: list[CallSpec], positional_names: list[str]) -> list[str]:
    """How ``spec`` differs from the spec in ``seen`` (same mode, same arguments) that it
    differs from least, one phrase per argument (``positional_names`` names the positions);
    empty where none is comparable."""
    best = None
    for other in seen:
        pairs = _argument_pairs(spec, other)
        if pairs is None:
            continue
        differ = [f"{_argument_name(name, positional_names)} is {_describe_kind(a)} here, "
                  f"{_describe_kind(b)} there" for name, a, b in pairs if a != b]
        if best is None or len(differ) < len(best):
            best = differ
    return best or []


def _argument_pairs(spec: CallSpec, other: CallSpec) -> list[tuple] | None:
    """``(position or keyword, kind in spec, kind in other)`` for every argument; None where
    the two differ in mode or in which arguments they have."""
    if other.training != spec.training or len(other.positional) != len(spec.positional) \
            or [k for k, _ in other.keywords] != [k for k, _ in spec.keywords]:
        return None
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(spec.positional, other.positional))]
    return pairs + [(k, a, b) for (k, a), (_, b) in zip(spec.keywords, other.keywords)]


def _argument_name(name, positional_names: list[str]) -> str:
    if isinstance(name, str):
        return name
    return positional_names[name] if name < len(positional_names) else f"argument {name}"


def _describe_kind(kind: tuple) -> str:
    return "a tensor or object" if kind[0] == "input" else repr(kind[1])


def _identifier(name: str) -> str:
    name = re.sub(r"\W", "_", name)
    if not name or name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    return name


def forward_param_names(fn: Callable) -> list[str]:
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@dataclass(frozen=True)
class TraceHints:
    """What tracing a block needs beyond its code and call spec; found once, from the
    capture's call, and reused for every call spec of the block.

    - ``inline``: children (paths relative to the block) traced through instead of kept as
      leaves, because the residual add lives inside them (BLOOM, BERT-style ``*Output``);
    - ``leaf_outputs``: ``(path, pattern)`` pairs for leaf children that return a tuple
      (``pattern`` has ``None`` where an entry is ``None``, ``True`` elsewhere): a leaf's
      output is opaque to the tracer, so code such as ``bias if bias is not None else ...``
      or ``if isinstance(out, tuple)`` (Qwen2-MoE's sparse MLP in transformers 4.x, which
      returns its router logits beside its output) would otherwise be traced down the
      wrong branch. Found only for blocks whose first trace failed on the recorded call.
    """

    inline: frozenset = frozenset()
    leaf_outputs: tuple = ()


class _LeafChildrenTracer(fx.Tracer):
    """Every module call inside the block is a leaf (the analysis reads the block's own
    code), except the children named in ``hints.inline``: their code is traced into the
    block's graph, their own children staying leaves unless named too."""

    def __init__(self, hints: TraceHints):
        super().__init__()
        self.inline = hints.inline
        self.leaf_outputs = dict(hints.leaf_outputs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.inline

    def call_module(self, m: nn.Module, forward: Callable, args, kwargs):
        out = super().call_module(m, forward, args, kwargs)
        pattern = self.leaf_outputs.get(self.path_of_module(m))
        if pattern is None or not isinstance(out, fx.Proxy):
            return out
        return tuple(None if p is None else out[i] for i, p in enumerate(pattern))


class _TraceRoot(nn.Module):
    """Shares the block's dictionaries so that paths and parameters resolve to the block's."""

    def __init__(self, block: nn.Module):
        super().__init__()
        object.__setattr__(self, "_modules", block._modules)
        object.__setattr__(self, "_parameters", block._parameters)
        object.__setattr__(self, "_buffers", block._buffers)


@dataclass
class TracedBlock:
    graph: fx.Graph
    spec: CallSpec
    input_names: list[str]
    gm: fx.GraphModule  # for running the original graph (analysis probes)
    hints: TraceHints = TraceHints()


def trace_block(block: nn.Module, forward: Callable, spec: CallSpec, hints: TraceHints = TraceHints()) -> TracedBlock:
    """Trace ``forward(block, *args, **kwargs)`` for calls of the given spec: its constants
    baked in, its inputs as placeholders. No argument values are needed (``hints`` carries
    what was learnt from the capture's call)."""
    training = spec.training
    names = spec.input_names(forward_param_names(forward))
    if len(set(names)) != len(names):
        raise CaptureError(f"block {type(block).__name__}: argument names collide after sanitising: {names}")

    def rebuild_and_call(*inputs):
        call_args, call_kwargs = spec.call_arguments(list(inputs))
        return forward(block, *call_args, **call_kwargs)

    root = _TraceRoot(block)
    src = f"def forward(self, {', '.join(names)}):\n    return self._call({', '.join(names)})\n"
    scope: dict[str, Any] = {}
    exec(compile(src, f"<depthrewrite trace of {type(block).__name__}>", "exec"), scope)
    object.__setattr__(root, "_call", rebuild_and_call)
    root_cls = type(f"TraceOf{type(block).__name__}", (_TraceRoot,), {"forward": scope["forward"]})
    root.__class__ = root_cls
    was_training = block.training
    block.train(training)
    try:
        with torch.no_grad():
            graph = _LeafChildrenTracer(hints).trace(root)
    except Exception as exc:
        through = f" (traced through {', '.join(sorted(hints.inline))})" if hints.inline else ""
        raise CaptureError(
            f"torch.fx could not trace block {type(block).__name__} with its children as leaves{through}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        block.train(was_training)
    _fold_tuple_items(graph)
    gm = fx.GraphModule(root, graph, class_name=f"Traced{type(block).__name__}")
    return TracedBlock(graph=graph, spec=spec, input_names=names, gm=gm, hints=hints)


def _fold_tuple_items(graph: fx.Graph) -> None:
    """``((a,) + rest)[0]`` is ``a``. BERT-style code returns ``(out,) + outputs[1:]``
    where ``outputs`` came from a leaf module: the concatenation is recorded as a graph
    node, and reading the stream back through it would hide the value from the analysis."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        src, index = node.args
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.add \
                and isinstance(src.args[0], tuple) and isinstance(index, int) and 0 <= index < len(src.args[0]):
            node.replace_all_uses_with(src.args[0][index])
            graph.erase_node(node)
