"""Source gradients summed inside the routing backward: an FX pass on AOTAutograd's
backward graph (backend option ``accumulate_grads``).

A source read by many ``route`` (or ``route_many``) calls gets one gradient term per call,
summed by a chain of ``add`` nodes (see :mod:`depthrewrite.sum_fences`). Where a term comes
straight from a ``route_backward`` or ``route_many_backward`` call (:data:`ACCUMULATED_OPS`)
and the running sum before it already exists when that call runs,
:func:`accumulate_into_route_backward` hands the running sum to the call
(``grad_values_acc`` / ``grad_keys_acc``) and drops the ``add``: the kernel reads the
running sum and writes running sum plus its gradient, added in float32 and rounded once,
in place of the fresh gradient it wrote before. The same bytes as writing the term and
reading it back in a separate sum, with no sum kernels and no term kept waiting.
``route_many_backward`` takes running sums too, in its calls of one head, no separate keys
and a few queries (:data:`ROUTE_MANY_MAX_QUERIES` says why), and with
:data:`ROUTE_MANY_MULTI_HEAD` in its calls of several heads.

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

#: the routing backwards whose source gradients get running sums (both ops take
#: ``grad_values_acc`` and ``grad_keys_acc``; ``route_many_backward`` since session 36, within
#: ROUTE_MANY_MAX_QUERIES)
ACCUMULATED_OPS = ("route_backward", "route_many_backward")
#: the ``route_many_backward`` calls that get running sums: one head, no separate keys, at most
#: this many queries (None: every call). Measured on the H200 (350M GPT, docs/benchmarks.md
#: session 36), each sum read one source ahead in the per-token backward: full AttnRes (4
#: queries a group call, 1 for its own-group calls and the readout) ran its route_many kernels
#: 3.5 ms a step longer and Inductor's 4.5 ms shorter (its 95 separate two-term sums gone),
#: 0.759x the baseline against 0.754x; Block AttnRes's 6-query block calls (8 padded query
#: rows, where the kernel already spills) 1.2 ms longer for 0.5 ms of Inductor's; DAR block's
#: keyed calls 1.7 ms longer for 1.2 (its peak 1.151x the baseline's against 1.175x; sums
#: loaded at the store)
ROUTE_MANY_MAX_QUERIES: int | None = 4
#: whether ``route_many_backward`` calls of several heads (no separate keys; the tiled kernel)
#: get running sums at any query count, whatever ROUTE_MANY_MAX_QUERIES says. Off: level
#: where measured (H200, 350M GPT, docs/benchmarks.md session 40). Block MHAR 99.2 against
#: 99.5 ms a step, within its trials' spread; grouped full MHAR (not a default) 4.4 ms less
#: of Inductor's sums for 3.3 ms more in the tiled kernel, which loads each sum just before
#: its store
ROUTE_MANY_MULTI_HEAD: bool = False
#: their outputs that are per-source gradient lists, and the argument that takes each one's
#: running sums
_ACC_ARG = {0: "grad_values_acc", 1: "grad_keys_acc"}
#: the default most heads of a route_backward call that gets running sums; None: no limit
#: (module docstring)
MAX_HEADS: int | None = None


def _route_gradient(node: fx.Node, max_heads: int | None) -> tuple[fx.Node, int, int] | None:
    """``(call, output list, source)`` when ``node`` is ``call(...)[list][source]`` for a
    per-source gradient list of a call of one of :data:`ACCUMULATED_OPS`, else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    group, source = node.args
    if not (isinstance(group, fx.Node) and group.op == "call_function" and group.target is operator.getitem):
        return None
    call, which = group.args
    if not (isinstance(call, fx.Node) and _accumulates(call)):
        return None
    if max_heads is not None and _heads(call) > max_heads:
        return None
    if call.target is torch.ops.depthrewrite.route_many_backward.default and not _narrow_many(call):
        return None
    return (call, which, source) if which in _ACC_ARG else None


def _narrow_many(call: fx.Node) -> bool:
    """Whether a ``route_many_backward`` call is one that takes running sums
    (:data:`ROUTE_MANY_MAX_QUERIES`, :data:`ROUTE_MANY_MULTI_HEAD`)."""
    if ROUTE_MANY_MAX_QUERIES is None:
        return True
    bound = _arguments(call)
    if bound["keys"]:
        return False
    if bound["heads"] > 1:
        return ROUTE_MANY_MULTI_HEAD
    return bound["queries"].meta["val"].shape[0] <= ROUTE_MANY_MAX_QUERIES


def _accumulates(call: fx.Node) -> bool:
    return call.op == "call_function" and any(
        call.target is getattr(torch.ops.depthrewrite, name).default for name in ACCUMULATED_OPS)


def _arguments(call: fx.Node) -> dict:
    """Every argument of an op call by name, as the op's schema binds them (its defaults
    for those not given)."""
    schema = call.target._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), call.args))
    bound.update(call.kwargs)
    return bound


def _heads(call: fx.Node) -> int:
    return _arguments(call)["heads"]


def _source_count(call: fx.Node, which: int) -> int:
    bound = _arguments(call)
    return len(bound["values"]) if which == 0 else len(bound["keys"] or ())


def accumulate_into_route_backward(graph: fx.Graph, max_heads: int | None = MAX_HEADS) -> int:
    """Rewrite every ``add(running_sum, call(...)[g][i])`` of a routing backward ``call``
    (:data:`ACCUMULATED_OPS`) that can be (the call has at most ``max_heads`` heads unless
    that is None, the term has no other user, the running sum is defined before the call
    and has the term's dtype, the call has no running sum for that source yet); returns how
    many."""
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


#: ops whose outputs are new tensors that a running sum may be: the chain's additions, the
#: routing backwards' gradients and the buffers this pass makes for them (``empty_like``;
#: a running sum made by any other op is left alone: some, like ``aten._unsafe_view``,
#: return storage that another node may still read)
_FRESH_LISTS = ("route_backward", "route_many_backward")


def _made_fresh(node: fx.Node) -> bool:
    if node.target in (torch.ops.aten.add.Tensor, torch.ops.aten.empty_like.default):
        return True
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node.op == "call_function" and any(
        node.target is getattr(torch.ops.depthrewrite, name).default for name in _FRESH_LISTS)


def _keeps_no_alias(user: fx.Node) -> bool:
    """Whether ``user`` returns no alias of its inputs: an aten or custom op whose schema
    says so (``_unsafe_view``'s does not say that it aliases: named here). It may write
    them (an earlier ``route_backward_into_`` adding into the same running sum)."""
    target = user.target
    return (user.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target is not torch.ops.aten._unsafe_view.default
            and not any(r.alias_info is not None for r in target._schema.returns))


def _finished_before(user: fx.Node, call: fx.Node, position: dict) -> bool:
    """Whether ``user`` is done with its input before ``call`` runs: it runs earlier and
    keeps no alias, or it is a view all of whose readers are done with it before ``call``."""
    if position[user] >= position[call]:
        return False
    if _keeps_no_alias(user):
        return True
    return bool(getattr(user.target, "is_view", False)) and all(
        _finished_before(u, call, position) for u in user.users)


def _overwritable(running: list, call: fx.Node, position: dict) -> bool:
    """Running sums ``call`` may write into: distinct tensors this graph makes as new ones
    (not inputs, not views), contiguous, that ``call`` reads as nothing else (a running sum
    that were also, say, its output gradient would be overwritten while still being read)
    and whose other readers are all done with them before ``call`` (:func:`_finished_before`)."""
    nodes = [r for r in running if r is not None]
    other_inputs = []
    fx.node.map_arg((call.args, {k: v for k, v in call.kwargs.items() if k not in _ACC_ARG.values()}),
                    other_inputs.append)
    return len(set(nodes)) == len(nodes) and all(
        isinstance(r, fx.Node) and r.op == "call_function" and _made_fresh(r) and r.meta["val"].is_contiguous()
        and r not in other_inputs and all(u is call or _finished_before(u, call, position) for u in r.users)
        for r in nodes)


def _gradient_users(call: fx.Node) -> dict[int, list[fx.Node]] | None:
    """``{output: [getitem nodes]}`` of a routing backward call, None if any user is not an
    indexing of its outputs (and, for the two gradient lists, of their entries)."""
    users: dict[int, list[fx.Node]] = {}
    for user in call.users:
        if user.target is not operator.getitem:
            return None
        which = user.args[1]
        if which in _ACC_ARG and any(u.target is not operator.getitem for u in user.users):
            return None
        users.setdefault(which, []).append(user)
    return users


#: the routing backwards whose running sums can be written in place, and their in-place forms
#: (``route_many_backward``'s since session 48)
IN_PLACE_FORMS = {"route_backward": "route_backward_into_", "route_many_backward": "route_many_backward_into_"}


def _in_place_form(call: fx.Node):
    """The in-place form of ``call``'s op (:data:`IN_PLACE_FORMS`), or None."""
    if call.op != "call_function":
        return None
    for name, into in IN_PLACE_FORMS.items():
        if call.target is getattr(torch.ops.depthrewrite, name).default:
            return getattr(torch.ops.depthrewrite, into).default
    return None


def write_running_sums_in_place(graph: fx.Graph) -> int:
    """Replace every ``route_backward`` or ``route_many_backward`` call that has running sums
    (after :func:`accumulate_into_route_backward`) by its in-place form
    (:data:`IN_PLACE_FORMS`) where that is safe (:func:`_overwritable`): the call writes
    each new sum into its running sum and every other source's gradient into a buffer made
    for it (``empty_like`` the source), and the readers of a gradient read that tensor,
    after the call. Returns how many calls."""
    replaced = 0
    position = {node: k for k, node in enumerate(graph.nodes)}
    for call in list(graph.nodes):
        into_op = _in_place_form(call)
        if into_op is None:
            continue
        running = {which: list(call.kwargs.get(arg) or []) for which, arg in _ACC_ARG.items()}
        if all(r is None for lst in running.values() for r in lst):
            continue
        users = _gradient_users(call)
        if users is None or not _overwritable(running[0] + running[1], call, position):
            continue
        _replace_in_place(graph, call, running, users, into_op)
        replaced += 1
        position = {node: k for k, node in enumerate(graph.nodes)}  # the nodes it added, in order
    return replaced


def _replace_in_place(graph: fx.Graph, call: fx.Node, running: dict, users: dict, into_op) -> None:
    bound = _arguments(call)
    sources = {0: bound["values"], 1: bound["keys"] or []}
    outputs, index = {}, {}
    with graph.inserting_before(call):
        for which, lst in sources.items():
            sums = running[which] or [None] * len(lst)
            index[which] = [i for i, r in enumerate(sums) if r is not None]
            outputs[which] = [r if r is not None else _empty_like(graph, source) for r, source in zip(sums, lst)]
        # the backward's own arguments, then the outputs in place of the running sums
        bound.update(grad_values=outputs[0], values_acc_index=index[0], grad_keys=outputs[1],
                     keys_acc_index=index[1])
        into = graph.call_function(into_op, tuple(bound[a.name] for a in into_op._schema.arguments))
    old = call.meta["val"]
    into.meta["val"] = tuple(old[2:])
    for which, nodes in users.items():
        for user in nodes:
            if which in _ACC_ARG:  # readers of source i's gradient read its output, after the call
                for entry in list(user.users):
                    entry.replace_all_uses_with(outputs[which][entry.args[1]])
                    graph.erase_node(entry)
            else:
                with graph.inserting_before(user):
                    moved = graph.call_function(operator.getitem, (into, which - len(_ACC_ARG)))
                moved.meta["val"] = user.meta["val"]
                user.replace_all_uses_with(moved)
            graph.erase_node(user)
    graph.erase_node(call)


def _empty_like(graph: fx.Graph, source: fx.Node) -> fx.Node:
    buffer = graph.call_function(torch.ops.aten.empty_like.default, (source,),
                                 {"memory_format": torch.contiguous_format})
    buffer.meta["val"] = torch.empty_like(source.meta["val"], memory_format=torch.contiguous_format)
    return buffer
