"""Source gradients summed inside the routing backward: an FX pass on AOTAutograd's
backward graph (backend option ``accumulate_grads``).

A source read by many ``route`` calls gets one gradient term per call, summed by a chain
of ``add`` nodes (see :mod:`depthrewrite.sum_fences`). Where a term comes straight from a
``route_backward`` call and the running sum before it already exists when that call runs,
:func:`accumulate_into_route_backward` hands the running sum to the call
(``grad_values_acc`` / ``grad_keys_acc``) and drops the ``add``: the kernel reads the
running sum and writes running sum plus its gradient, added in float32 and rounded once,
in place of the fresh gradient it wrote before. The same bytes as writing the term and
reading it back in a separate sum, with no sum kernels and no term kept waiting.

Only calls with at most ``max_heads`` heads are rewritten (backend option
``accumulate_max_heads``, default ``MAX_HEADS`` = 1): with MHAR's 16 heads the fused
backward with running sums measured twice as slow (H200, 350M GPT, full MHAR: routing
kernels 78.3 ms a step against 38.6 ms without, step 154.5 ms against 139.1 ms;
docs/benchmarks.md, session 7), more than the sum kernels it saves; with one head it is
the faster choice (full AttnRes, DAR, WAV, session 6).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .sum_fences import is_chain_add

__all__ = ["accumulate_into_route_backward"]

#: route_backward's outputs that are per-source gradient lists, and the argument that takes
#: each one's running sums
_ACC_ARG = {0: "grad_values_acc", 1: "grad_keys_acc"}
#: the default most heads of a route_backward call that gets running sums (module docstring)
MAX_HEADS = 1
#: position of ``heads`` in route_backward's arguments
_HEADS_ARG = 9


def _route_gradient(node: fx.Node, max_heads: int) -> tuple[fx.Node, int, int] | None:
    """``(route_backward call, output list, source)`` when ``node`` is
    ``route_backward(...)[list][source]`` for a per-source gradient list, else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    group, source = node.args
    if not (isinstance(group, fx.Node) and group.op == "call_function" and group.target is operator.getitem):
        return None
    call, which = group.args
    if not (isinstance(call, fx.Node) and call.target is torch.ops.depthrewrite.route_backward.default):
        return None
    if _heads(call) > max_heads:
        return None
    return (call, which, source) if which in _ACC_ARG else None


def _heads(call: fx.Node) -> int:
    return call.args[_HEADS_ARG] if len(call.args) > _HEADS_ARG else call.kwargs["heads"]


def _source_count(call: fx.Node, which: int) -> int:
    values, keys = call.args[3], call.args[4]
    return len(values) if which == 0 else len(keys or ())


def accumulate_into_route_backward(graph: fx.Graph, max_heads: int = MAX_HEADS) -> int:
    """Rewrite every ``add(running_sum, route_backward(...)[g][i])`` that can be (the call
    has at most ``max_heads`` heads, the term has no other user, the running sum is defined
    before the call and has the term's dtype, the call has no running sum for that source
    yet); returns how many."""
    position = {node: k for k, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        if not is_chain_add(node):
            continue
        for term, running in (node.args, node.args[::-1]):
            found = _route_gradient(term, max_heads)
            if found is None or len(term.users) != 1:
                continue
            call, which, source = found
            if position[running] > position[call] or running.meta["val"].dtype != term.meta["val"].dtype:
                continue
            arg = _ACC_ARG[which]
            acc = list(call.kwargs.get(arg) or [None] * _source_count(call, which))
            if acc[source] is not None:
                continue
            acc[source] = running
            call.update_kwarg(arg, acc)
            node.replace_all_uses_with(term)
            graph.erase_node(node)
            rewritten += 1
            break
    return rewritten
