"""Why a block that carries a stream shows no PreNorm residual site: is its update not
``h + u`` at all? Asked only after the site search failed, so it costs nothing for the
models that rewrite. Each reason names the op that was found, so that the refusal
(:class:`~depthrewrite.errors.NotAdditiveStreamError`) says what the model does.

- several parallel streams (hyper-connections): the stream has one more axis than what its
  norms read (a learned mix of the streams feeds each branch), or a child that receives it
  returns it next to an n times narrower mix;
- a rescaled stream (``a * h + u``): a residual add reads the stream through a
  multiplication or a mix rather than as is;
- a rescaled block output: the block multiplies the stream after its last add.
"""

from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx

from .probes import norm_type, run_block_graph
from .residual import BlockSiteFinder, first_node, module_path, is_add


def not_additive_reason(finder: BlockSiteFinder, values: list | None) -> str | None:
    """A sentence saying how the block's stream update differs from ``h + u``, or None."""
    reason = _parallel_streams(finder, values)
    if reason is None and finder.incomplete:  # the walk stopped where no add reads the stream as is
        reason = _rescaled_add(finder) or _rescaled_output(finder)
    return reason


def _parallel_streams(finder: BlockSiteFinder, values: list | None) -> str | None:
    if values is None:
        return None
    try:
        env = run_block_graph(finder.gm, values)
    except Exception:  # noqa: BLE001 - a graph the probe cannot run gives no evidence either way
        return None
    stream = env.get(finder.stream0)
    if not isinstance(stream, torch.Tensor):
        return None
    for node in finder.gm.graph.nodes:
        read = env.get(node.args[0]) if _single_input_module(node) else None
        if (_narrower_view(read, stream) or _narrower_width(read, stream)) and _is_norm(finder, node, read) \
                and _reaches(finder, finder.stream0, node.args[0]):
            return (
                f"the stream has shape {tuple(stream.shape)} but the norm "
                f"'{module_path(finder.block_path, node.target)}' reads a tensor of shape "
                f"{tuple(read.shape)} computed from it, 1/{stream.numel() // read.numel()} of it: the block carries "
                "parallel streams, mixed into each branch and updated by a learned mix (hyper-connections)"
            )
    return _collapsing_child(finder, env, stream)


def _single_input_module(node: fx.Node) -> bool:
    return node.op == "call_module" and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node)


def _is_norm(finder: BlockSiteFinder, node: fx.Node, read: torch.Tensor) -> bool:
    """A norm of the width it reads (one stream's width, not the stream's)."""
    return norm_type(finder.gm.get_submodule(node.target), read.shape[-1]) is not None


def _collapsing_child(finder: BlockSiteFinder, env: dict, stream: torch.Tensor) -> str | None:
    """A child that receives the stream and returns the stream itself next to a tensor n
    times narrower (Qwen4-exp's ``*GatedResidual`` returns (mixed input, the stream, weights))."""
    for node in finder.gm.graph.nodes:
        out = env.get(node) if node.op == "call_module" and finder.stream0 in node.all_input_nodes else None
        if not isinstance(out, tuple) or not any(o is stream for o in out):
            continue
        narrow = next((o for o in out if _narrower_width(o, stream)), None)
        if narrow is not None:
            return (
                f"the stream (shape {tuple(stream.shape)}) goes into "
                f"'{module_path(finder.block_path, node.target)}', which returns it unchanged next to a "
                f"tensor of shape {tuple(narrow.shape)}, 1/{stream.shape[-1] // narrow.shape[-1]} of its width: "
                "the block carries parallel streams, mixed into each branch (hyper-connections)"
            )
    return None


def _narrower_view(read, stream: torch.Tensor) -> bool:
    """``read`` has fewer axes and fewer elements than the stream (one of its n streams)."""
    return isinstance(read, torch.Tensor) and read.dim() < stream.dim() and 0 < read.numel() < stream.numel()


def _narrower_width(value, stream: torch.Tensor) -> bool:
    """``value`` is the stream's shape with the last axis divided by some n > 1."""
    return isinstance(value, torch.Tensor) and value.shape[:-1] == stream.shape[:-1] and value.dim() == stream.dim() \
        and 0 < value.shape[-1] < stream.shape[-1] and stream.shape[-1] % value.shape[-1] == 0


def _reaches(finder: BlockSiteFinder, src: fx.Node, dst: fx.Node) -> bool:
    return nx.has_path(finder.nx, src, dst)


def _light_reach(finder: BlockSiteFinder, stream: fx.Node) -> dict[fx.Node, fx.Node | None]:
    """Values computed from ``stream`` by functions, methods and norms only (no branch
    module), each with the node it was reached from."""
    seen: dict[fx.Node, fx.Node | None] = {stream: None}
    queue = [stream]
    while queue:
        node = queue.pop(0)
        for user in finder.nx.successors(node):
            light = user.op in ("call_function", "call_method") or finder.norm_of(user) is not None
            if user not in seen and light:
                seen[user] = node
                queue.append(user)
    return seen


def _rescaled_add(finder: BlockSiteFinder) -> str | None:
    stream = finder.last_stream
    light, carried = _light_reach(finder, stream), finder.carried(stream)
    for node in finder.gm.graph.nodes:
        if not is_add(node) or not all(isinstance(a, fx.Node) for a in node.args[:2]):
            continue
        for operand, other in (node.args[:2], node.args[1::-1]):
            if operand in light and operand not in carried and _scales(light, operand) and other not in light \
                    and _reaches(finder, stream, other):
                return (
                    f"the stream is rescaled: the residual add '{node.name}' reads {describe(operand)} "
                    f"(through {_chain(light, operand)}), not the stream itself (a * h + u)"
                )
    return None


#: ops that rescale or mix the stream on its way to an add (``a * h``, ``comb @ H``)
_SCALING_FUNCTIONS = {operator.mul, operator.imul, operator.truediv, operator.matmul, torch.mul, torch.div,
                      torch.matmul, torch.einsum}
_SCALING_METHODS = {"mul", "mul_", "div", "div_", "matmul", "__mul__", "__rmul__", "__truediv__"}


def _scales(preds: dict, node: fx.Node) -> bool:
    """Does the path from the stream to ``node`` rescale or mix it (a stream that is only
    normed, cast or shifted by a bias is not what this reports)?"""
    while node is not None:
        if (node.op == "call_function" and node.target in _SCALING_FUNCTIONS) or \
                (node.op == "call_method" and node.target in _SCALING_METHODS):
            return True
        node = preds[node]
    return False


def _rescaled_output(finder: BlockSiteFinder) -> str | None:
    stream = finder.last_stream
    out = next(n for n in finder.gm.graph.nodes if n.op == "output")
    first = first_node(out.args[0])
    light = _light_reach(finder, stream)
    if first in light and first not in finder.carried(stream) and _scales(light, first):
        return (f"the stream is rescaled after the last residual add: the block returns "
                f"{describe(first)} (from '{stream.name}' through {_chain(light, first)})")
    return None


def _chain(preds: dict, node: fx.Node) -> str:
    names = []
    while node is not None:
        names.append(node.name)
        node = preds[node]
    return " -> ".join(reversed(names))


def describe(node: fx.Node) -> str:
    """``mul(hidden_states, input_residual)``: an op with its operands, as a user reads it."""
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
    else:
        name = str(node.target)

    def operand(a) -> str:
        if isinstance(a, fx.Node):
            return str(a.target) if a.op == "get_attr" else a.name
        return f"{a:.4g}" if isinstance(a, float) else repr(a)

    return f"{name}({', '.join(operand(a) for a in node.args)})"
