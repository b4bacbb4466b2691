"""Companions of the routing ops whose results hold lists, with a flat tuple of tensors.

Inductor's C++ wrapper (``cpp_wrapper=True``) calls an op it does not generate code for
through the dispatcher, and takes its results as tensors or one list of tensors. It fails
on a result that is a tuple holding lists: "fallback kernels with runtime lookup currently
only support tensor returns" (torch 2.13). ``route_many``, ``route_many_backward``,
``route_backward`` and ``route_merge_backward`` return such tuples. For each, and for each
number of result tensors a call has, this module defines ``depthrewrite::<op>_flat<count>``:
the same arguments, the same results laid end to end as ``count`` tensors
(:func:`flat_layout`). Its kernel calls the op itself, so that the fused kernels run on
CUDA and the reference elsewhere, as for the op. The backend puts the companions in the
graphs it gives a C++ wrapper (:mod:`depthrewrite.cpp_wrapper`); nothing else calls them.

A fixed count of tensors, not one ``Tensor[]``: the C++ wrapper calls an op whose results
are tensors straight through the dispatcher, but one whose result is a list back through
Python, which converts every tensor argument and result (torch's ``custom_op_wrapper``;
twice the C++ wrapper's gain on the CPU, docs/benchmarks.md session 58). The counts are
known only when a graph is compiled, so each companion is defined at its first request
(:func:`flat_op`), and the backend requests them before Inductor reads its caches.
"""

from __future__ import annotations

import threading

import torch

from . import route, route_many, route_merge  # noqa: F401  (registers the ops the companions call)

__all__ = ["NESTED_RESULT_OPS", "flat_op", "flat_layout", "flatten"]

#: the routing ops whose results are tuples holding lists of tensors
NESTED_RESULT_OPS = ("route_backward", "route_many", "route_many_backward", "route_merge_backward")

_SUFFIX = "_flat"
_library = torch.library.Library("depthrewrite", "FRAGMENT")


def flatten(result) -> list:
    """A tuple of tensors and lists of tensors, laid end to end."""
    flat: list = []
    for part in result:
        if isinstance(part, (list, tuple)):
            flat.extend(part)
        else:
            flat.append(part)
    return flat


def flat_layout(result) -> list[tuple[int, int | None]]:
    """Where each part of an op's result starts in its flat companion's result, and how many
    tensors it holds there (None: one tensor, not a list)."""
    layout, start = [], 0
    for part in result:
        count = len(part) if isinstance(part, (list, tuple)) else None
        layout.append((start, count))
        start += 1 if count is None else count
    return layout


def _define(name: str, count: int) -> None:
    op = getattr(torch.ops.depthrewrite, name).default
    schema = str(op._schema)
    arguments = schema[schema.index("(") : schema.rindex(" -> ")]
    qualified = f"{name}{_SUFFIX}{count}"
    _library.define(f"{qualified}{arguments} -> ({', '.join(['Tensor'] * count)})")

    def call(*args, **kwargs):
        return tuple(flatten(op(*args, **kwargs)))

    # CompositeExplicitAutograd: one kernel for every device, below autograd (the backend's
    # graphs are past AOTAutograd); the op it calls dispatches to its own kernels
    _library.impl(qualified, call, "CompositeExplicitAutograd")
    torch.library.register_fake(f"depthrewrite::{qualified}", call, lib=_library)


_defined: set[tuple[str, int]] = set()
_lock = threading.Lock()


def flat_op(name: str, count: int) -> torch._ops.OpOverload:
    """The flat companion of the routing op ``name`` (one of :data:`NESTED_RESULT_OPS`) for
    results of ``count`` tensors, defined at its first request."""
    if name not in NESTED_RESULT_OPS:
        raise ValueError(f"flat_op: `name` must be one of {NESTED_RESULT_OPS}; found {name!r}")
    with _lock:
        if (name, count) not in _defined:
            _define(name, count)
            _defined.add((name, count))
    return getattr(torch.ops.depthrewrite, f"{name}{_SUFFIX}{count}").default
