"""Bounded gradient sums: an FX pass the backend has Inductor run on every graph it compiles.

A tensor read by many routing calls (an early block summary, ``e``, every source of full
AttnRes) gets its gradient as the sum of one term per call: AOTAutograd writes a chain of
``add`` nodes in the order the backward produces the terms. Inductor fuses the whole chain
into ONE kernel placed after the last term, so every term stays alive until then (at 350M
with DAR, chains of up to ~170 terms of 32 MiB each), and the kernel, reading all of them
at once, ran at about a tenth of the memory bandwidth (10.5 ms for one such sum, H200;
docs/benchmarks.md, session 5).

:func:`fence_gradient_sums` puts :func:`depthrewrite.ops.fence.fence_` after every
``max_terms``-th term of such a chain, so each piece is its own kernel of at most
``max_terms`` terms plus the running sum, run as soon as its terms exist. The sum is the
same additions in the same order; the partial sums are stored in the tensor's dtype at
each fence (eager PyTorch stores every one).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)

__all__ = ["fence_gradient_sums", "check_max_terms", "is_chain_add", "DEFAULT_MAX_TERMS", "MIN_NUMEL"]

#: terms per fused piece of a long sum (chosen from the session-5 H200 runs, docs/benchmarks.md)
DEFAULT_MAX_TERMS = 4
#: smaller sums (parameter gradients) are left to Inductor: their chains cost nothing
MIN_NUMEL = 1 << 16

_ADD = torch.ops.aten.add.Tensor


def is_chain_add(node: fx.Node) -> bool:
    """An ``add`` of two tensors of the same shape (no alpha, no broadcasting)."""
    if node.op != "call_function" or node.target is not _ADD or len(node.args) != 2 or node.kwargs:
        return False
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args]
    return all(isinstance(v, torch.Tensor) for v in vals) and vals[0].shape == vals[1].shape


def _big(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() >= MIN_NUMEL


def check_max_terms(max_terms: object, where: str) -> None:
    """``max_terms`` must be an int >= 2 (``where`` names the argument in the error)."""
    if isinstance(max_terms, bool) or not isinstance(max_terms, int) or max_terms < 2:
        raise ValueError(f"{where} must be an int >= 2, found {max_terms!r}")


def fence_gradient_sums(graph: fx.Graph, max_terms: int = DEFAULT_MAX_TERMS) -> int:
    """Fence every chain of same-shape ``add`` nodes (each feeding only the next) after
    every ``max_terms`` terms; returns the number of fences inserted."""
    check_max_terms(max_terms, "fence_gradient_sums: max_terms")
    terms: dict[fx.Node, int] = {}  # unfenced chain add -> terms it fuses so far
    fences = 0
    for node in list(graph.nodes):
        if not (is_chain_add(node) and _big(node)):
            continue
        terms[node] = sum(terms.get(a, 1) for a in node.args)
        users = list(node.users)
        feeds_chain = len(users) == 1 and is_chain_add(users[0])
        if feeds_chain and terms[node] >= max_terms:
            with graph.inserting_after(node):
                graph.call_function(torch.ops.depthrewrite.fence_.default, (node,))
            terms.pop(node)  # its consumer counts it as one term
            fences += 1
        elif not feeds_chain:
            terms.pop(node)
    if fences:
        log.debug("depthrewrite: %d fences in long sums (at most %d terms per fused piece)", fences, max_terms)
    return fences
