"""The routing calls of a graph made callable from Inductor's C++ wrapper (``cpp_wrapper``).

With ``cpp_wrapper=True`` Inductor writes the code that runs a compiled graph in C++
instead of Python, which takes less of the host's time a call. It calls an op it does not
generate code for (our routing ops) through the dispatcher, and takes the op's results as
tensors or as one list of tensors; a tuple holding lists, what ``route_many`` and three
more of our ops return, stops the compilation. :func:`flatten_nested_results`, run by the
backend's post-grad pass where the C++ wrapper is on, replaces each such call by its flat
companion (:mod:`depthrewrite.ops.flat_returns`), and the reads of its results by reads of
the flat tuple: ``result[1][j]`` becomes ``flat[start_1 + j]``.

A graph that Inductor loads from its caches runs no pass, and calls the companions by
name: :func:`define_flat_companions` defines those of each graph before Inductor looks it
up (the backend's inner compiler, with AOTAutograd's own cache off for the compilation,
since a hit there would skip the inner compiler).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .ops.flat_returns import NESTED_RESULT_OPS, flat_layout, flat_op, flatten

__all__ = ["flatten_nested_results", "define_flat_companions", "cpp_wrapper_on", "check_cpp_wrapper_supported",
           "cpp_wrapper_calls_list_arguments"]

_NESTED = {f"depthrewrite::{name}": name for name in NESTED_RESULT_OPS}


def cpp_wrapper_calls_list_arguments() -> bool:
    """Whether this torch's C++ wrapper can call an op that takes a list of tensors, as
    every routing op does: torch 2.13's calls such ops through the dispatcher
    (``_compatible_with_cpp_boxed_dispatch``); torch 2.11's stops on them ("arg type
    List[Tensor] is not yet supported by custom_op_wrapper", H200, session 58)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    return hasattr(CppWrapperCpu, "_compatible_with_cpp_boxed_dispatch")


def check_cpp_wrapper_supported() -> None:
    """Refuse the C++ wrapper where this torch's cannot call the routing ops, before
    Inductor fails on them deep in its code generation."""
    if not cpp_wrapper_calls_list_arguments():
        raise ValueError("depthrewrite_backend: Inductor's cpp_wrapper (options['cpp_wrapper'] or "
                         "torch._inductor.config.cpp_wrapper) needs a torch whose C++ wrapper calls ops that take "
                         "lists of tensors, as every routing op does (torch 2.13 does); found torch "
                         f"{torch.__version__}, whose C++ wrapper does not. Compile with cpp_wrapper=False")


def cpp_wrapper_on(patches: dict | None = None) -> bool:
    """Whether the compilation writes its wrapper in C++: Inductor's setting as patched for
    the compilation under way, or, before it starts, as its ``patches`` will set it."""
    from torch._inductor import config

    return bool(config.cpp_wrapper if patches is None else patches.get("cpp_wrapper", config.cpp_wrapper))


def _nested_op(node: fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return None if schema is None else _NESTED.get(schema.name)


def _item(graph: fx.Graph, flat: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (flat, index))
    item.meta["val"] = flat.meta["val"][index]
    return item


def _index_read(user: fx.Node, source: fx.Node, op: str) -> int:
    """The index ``user`` reads from ``source`` (``source[i]``); anything else is refused."""
    if user.op == "call_function" and user.target is operator.getitem and user.args[0] is source:
        return user.args[1]
    raise RuntimeError(f"depthrewrite backend (cpp_wrapper): the result of a depthrewrite::{op} call "
                       f"({source.name}) is read by {user.format_node()}; expected only indexing, "
                       "which the flat result replaces")


def _replace(graph: fx.Graph, node: fx.Node, op: str) -> None:
    result = node.meta["val"]
    layout = flat_layout(result)
    with graph.inserting_after(node):
        flat = graph.call_function(flat_op(op, len(flatten(result))), node.args, node.kwargs)
    flat.meta = {**node.meta, "val": tuple(flatten(result))}
    for part in list(node.users):
        start, count = layout[_index_read(part, node, op)]
        if count is None:  # a tensor: result[i]
            with graph.inserting_after(part):
                part.replace_all_uses_with(_item(graph, flat, start))
        else:  # a list: result[i][j]
            for read in list(part.users):
                with graph.inserting_after(read):
                    read.replace_all_uses_with(_item(graph, flat, start + _index_read(read, part, op)))
                graph.erase_node(read)
        graph.erase_node(part)
    graph.erase_node(node)


def define_flat_companions(graph: fx.Graph) -> None:
    """Define the flat companions the graph's calls will need, before Inductor looks for the
    graph in its caches: a compiled graph loaded from them calls the companions by name,
    and in a new process nothing else defines them."""
    for node in graph.nodes:
        if (op := _nested_op(node)) is not None:
            flat_op(op, len(flatten(node.meta["val"])))


def flatten_nested_results(graph: fx.Graph) -> int:
    """Replace every call of a routing op whose result holds lists with its flat companion;
    returns how many calls were replaced."""
    calls = [(node, op) for node in graph.nodes if (op := _nested_op(node)) is not None]
    for node, op in calls:
        _replace(graph, node, op)
    return len(calls)
