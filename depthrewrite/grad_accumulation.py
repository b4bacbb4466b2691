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
``accumulate_max_heads``, default ``MAX_HEADS`` = None: every call). Session 7 measured the
16-head fused backward with running sums twice as slow and limited them to one-head calls;
the cause was the running sums' loads, 16 scalar 2-byte loads per thread where the row
loads were vector loads. With the 16-byte alignment hint (``_plus_acc``) full MHAR with
running sums is faster and smaller than without (H200, 350M GPT: 130.8 ms / 1.26x peak
against 133.9 ms / 1.39x; MHAR block 93.1 ms against 95.6 ms; docs/benchmarks.md, session
8), so the default is no limit again; the option stays for A/B runs.
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
#: the default most heads of a route_backward call that gets running sums; None: no limit
#: (module docstring)
MAX_HEADS: int | None = None
#: position of ``heads`` in route_backward's arguments
_HEADS_ARG = 9


def _route_gradient(node: fx.Node, max_heads: int | None) -> tuple[fx.Node, int, int] | None:
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
    if max_heads is not None and _heads(call) > max_heads:
        return None
    return (call, which, source) if which in _ACC_ARG else None


def _heads(call: fx.Node) -> int:
    return call.args[_HEADS_ARG] if len(call.args) > _HEADS_ARG else call.kwargs["heads"]


def _source_count(call: fx.Node, which: int) -> int:
    values, keys = call.args[3], call.args[4]
    return len(values) if which == 0 else len(keys or ())


def accumulate_into_route_backward(graph: fx.Graph, max_heads: int | None = MAX_HEADS) -> int:
    """Rewrite every ``add(running_sum, route_backward(...)[g][i])`` that can be (the call
    has at most ``max_heads`` heads unless that is None, the term has no other user, the
    running sum is defined before the call and has the term's dtype, the call has no
    running sum for that source yet); returns how many."""
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
