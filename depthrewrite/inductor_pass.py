"""The post-grad pass the backend gives Inductor (``post_grad_custom_post_pass``): on each
graph Inductor compiles, first the source gradients moved into the routing backward
(:mod:`depthrewrite.grad_accumulation`, option ``accumulate_grads``; with
``accumulate_in_place``, their running sums written in place), then the remaining
long sums fenced (:mod:`depthrewrite.sum_fences`, option ``max_sum_terms``), then, where
Inductor writes its wrapper in C++ (``cpp_wrapper``), the routing calls whose results hold
lists replaced by their flat companions (:mod:`depthrewrite.cpp_wrapper`), then the user's
own post-grad passes, if any. A pass that Inductor runs, rather than a change to
the graph before Inductor sees it, so that its ``uuid`` (this package's pass files and the
settings) is part of Inductor's cache keys: a graph compiled with other settings is never
loaded from the caches in its place.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable

from torch import fx

from . import grad_accumulation, sum_fences
from .cpp_wrapper import cpp_wrapper_on, flatten_nested_results
from .grad_accumulation import MAX_HEADS, accumulate_into_route_backward, write_running_sums_in_place

__all__ = ["backend_pass", "rewrite_gradient_sums"]


def rewrite_gradient_sums(graph: fx.Graph, max_sum_terms: int | None, accumulate_grads: bool,
                          accumulate_max_heads: int | None = MAX_HEADS,
                          accumulate_in_place: bool = False) -> tuple[int, int, int]:
    """The backend's rewrites of one graph, in order: ``(gradients accumulated, fences,
    calls writing their running sums in place)``."""
    accumulated = accumulate_into_route_backward(graph, accumulate_max_heads) if accumulate_grads else 0
    in_place = write_running_sums_in_place(graph) if accumulate_grads and accumulate_in_place else 0
    fences = 0 if max_sum_terms is None else sum_fences.fence_gradient_sums(graph, max_sum_terms)
    return accumulated, fences, in_place


def backend_pass(max_sum_terms: int | None, accumulate_grads: bool, then=None,
                 on_done: Callable[[int, int, int, int], None] | None = None,
                 accumulate_max_heads: int | None = MAX_HEADS, recomputed: tuple[str, ...] | None = None,
                 accumulate_in_place: bool = False):
    """The pass for these settings (``max_sum_terms`` None: no fences). ``then``: the
    user's ``post_grad_custom_post_pass`` (a pass or a list), run after; ``on_done`` is
    told :func:`rewrite_gradient_sums`'s counts for each graph, then how many routing calls
    got flat results for the C++ wrapper. ``recomputed``: the nodes the
    backend marked for recomputation (:mod:`depthrewrite.recompute`; None: the option is
    off), part of the pass's cache key only."""
    then = () if then is None else tuple(then) if isinstance(then, (list, tuple)) else (then,)
    return _pass_class()(max_sum_terms, accumulate_grads, then, on_done, accumulate_max_heads, recomputed,
                         accumulate_in_place)


@functools.cache
def _pass_class():
    # imported here: torch._inductor.custom_graph_pass imports triton.language, which
    # ``import depthrewrite`` should not (Triton's interpreter, for one, must be switched
    # on before triton.language is first imported)
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    here = pathlib.Path(__file__).parent
    sources = tuple(str(here / name)
                    for name in ("inductor_pass.py", "sum_fences.py", "grad_accumulation.py", "recompute.py",
                                 "cpp_wrapper.py", "ops/flat_returns.py"))

    class BackendPass(CustomGraphPass):
        def __init__(self, max_sum_terms, accumulate_grads, then, on_done, accumulate_max_heads, recomputed,
                     accumulate_in_place):
            self.max_sum_terms, self.accumulate_grads = max_sum_terms, accumulate_grads
            self.then, self.on_done, self.accumulate_max_heads = then, on_done, accumulate_max_heads
            self.recomputed, self.accumulate_in_place = recomputed, accumulate_in_place

        def __call__(self, graph: fx.Graph) -> None:
            done = rewrite_gradient_sums(graph, self.max_sum_terms, self.accumulate_grads, self.accumulate_max_heads,
                                         self.accumulate_in_place)
            flattened = flatten_nested_results(graph) if cpp_wrapper_on() else 0
            if self.on_done is not None:
                self.on_done(*done, flattened)
            for user_pass in self.then:
                user_pass(graph)

        def uuid(self):
            then = tuple(getattr(p, "uuid", lambda: None)() for p in self.then)
            if any(u is None for u in then):  # a user pass without an identity: Inductor skips its caches
                return None
            return (get_hash_for_files(sources), self.max_sum_terms, self.accumulate_grads,
                    self.accumulate_max_heads, self.accumulate_in_place, sum_fences.MIN_NUMEL,
                    grad_accumulation.ACCUMULATED_OPS, grad_accumulation.ROUTE_MANY_MAX_QUERIES,
                    grad_accumulation.ROUTE_MANY_MULTI_HEAD, self.recomputed,
                    cpp_wrapper_on(), then)

    return BackendPass
