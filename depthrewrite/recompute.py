"""Partial sums recomputed in the backward instead of saved for it (the backend's
``recompute_partial_sums`` option, on by default).

Some schemes keep several running sums of the branch outputs inside a block, each a new
tensor at every site that the routing backward reads again: WAV the partial block's
summary and its two details, DAR both streams' partial entries. Saved for the backward,
that is three (WAV) or two (DAR) activations per site, where the branch output they are
summed from is one. A scheme makes those sums inside :func:`recomputable`, which tags the
nodes Dynamo records (``torch.fx.traceback.annotate``); with the option on, the backend
marks the tagged nodes ``PREFER_RECOMPUTE`` for AOTAutograd's partitioner, which then
saves the branch outputs and recomputes the sums in the backward (a few elementwise
passes per site). With the option off the tags change nothing. On the H200 at 350M
(docs/benchmarks.md session 13, two runs side by side): WAV's peak 20.56 -> 19.25 GiB,
DAR block's 20.90 -> 20.08 GiB, each step level to 2 % longer (one host-bound WAV run 11 %).

The recomputed sums are the forward's in float32. In bf16 the backward's copy may differ
from the forward's in the last bit where Inductor computes a chain of sums in one kernel
without rounding between them (``emulate_precision_casts`` off, its default).
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["recomputable", "mark_recomputable"]

#: the ``torch.fx.traceback.annotate`` entry that tags a node
TAG = {"depthrewrite": "recompute_in_backward"}


def recomputable(partial: bool = True):
    """Context for the ops that make a scheme's partial sums: tagged while Dynamo traces
    them (where ``torch.fx.traceback.annotate`` exists), nothing in eager mode. ``partial``
    False (a site that closes its block): not tagged, because the closing sum is a
    completed entry that every later site reads; recomputed, it would be rebuilt (with its
    block's whole chain of sums) at its first use in the backward, the readout's, and kept
    from there on: more memory, not less (measured on the CPU)."""
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if not partial or annotate is None or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return annotate(TAG)


def mark_recomputable(graph: fx.Graph) -> tuple[str, ...]:
    """Mark the tagged operations of a Dynamo graph for recomputation in the backward;
    returns the marked nodes' names. Node metadata is not part of the compile caches' keys
    (``GraphModule.__reduce__`` drops it): the backend puts these names in its Inductor
    pass's key, so that a graph compiled without the marks is never loaded in its place.
    A node that already has a policy (a user's selective activation checkpointing) keeps it."""
    (key, value), = TAG.items()
    marked = []
    for node in graph.nodes:
        if (node.op == "call_function" and (node.meta.get("custom") or {}).get(key) == value
                and "recompute" not in node.meta):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            marked.append(node.name)
    return tuple(marked)
