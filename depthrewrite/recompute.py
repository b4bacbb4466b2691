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

Besides the sums, ``merge_partial`` (the two-phase merge) tags its float32 copy of the
phase-1 output: saved, that copy is twice the bytes of the output it is made from (DAR
block's saved set on the CPU, d = 128, 12 layers: 243.9 -> 227.9 units, the plain model's
209.9; docs/design.md).

With ``recompute_branch_outputs`` as well (off by default) the branch outputs those sums
are made from are not saved either: the backend follows each tagged sum's other inputs up
to the linear layer that made them (through a dropout of probability 0, dtype conversions
and views) and marks that path too, so the partitioner recomputes the branch's last matmul
in the backward from its input, which the matmul's own backward keeps anyway. One matmul
per site more for one activation per site less: a trade for a run short of memory, see
docs/benchmarks.md for its price. A branch output reached otherwise (no linear layer, or
through a dropout that draws random numbers) stays saved. ``recompute_branch_outputs="narrow"``
recomputes only the outputs of linear layers whose input is no wider than their output
(an attention branch's output projection, d -> d), whose matmul costs the least per
activation saved, and keeps the rest (an MLP's down projection, about 2.7 d -> d in the
bundled GPT, so 2.7 times the matmul for the same activation).

The recomputed sums are the forward's in float32. In bf16 the backward's copy may differ
from the forward's in the last bit where Inductor computes a chain of sums in one kernel
without rounding between them (``emulate_precision_casts`` off, its default).
"""

from __future__ import annotations

import contextlib
import logging
import operator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["recomputable", "mark_recomputable", "branch_output_path"]

log = logging.getLogger(__name__)

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


def _tagged(node: fx.Node) -> bool:
    """An operation traced inside :func:`recomputable`: a function or a method (the casts
    of DAR's entries to the sources' dtype are ``.to`` calls)."""
    (key, value), = TAG.items()
    return node.op in ("call_function", "call_method") and (node.meta.get("custom") or {}).get(key) == value


def mark_recomputable(graph: fx.Graph, branch_outputs: bool | str = False) -> tuple[str, ...]:
    """Mark the tagged operations of a Dynamo graph for recomputation in the backward (with
    ``branch_outputs``, also the branch outputs they are summed from, back to their linear
    layers: :func:`branch_output_path`; ``"narrow"``: only where the linear layer's input is
    no wider than its output); returns the marked nodes' names. Node metadata is
    not part of the compile caches' keys (``GraphModule.__reduce__`` drops it): the backend
    puts these names in its Inductor pass's key, so that a graph compiled without the marks
    is never loaded in its place. A node that already has a policy (a user's selective
    activation checkpointing) keeps it."""
    tagged = [node for node in graph.nodes if _tagged(node)]
    paths = {}
    if branch_outputs:
        for node in tagged:
            for source in node.all_input_nodes:
                if not _tagged(source) and source not in paths and _same_shape(source, node):
                    paths[source] = branch_output_path(source, narrow_only=branch_outputs == "narrow")
        found = sum(1 for path in paths.values() if path)
        log.info("recompute: %d branch outputs recomputed from their linear layers, %d kept (no linear layer "
                 "reached through recomputable ops, or with 'narrow' one wider at its input)", found,
                 len(paths) - found)
    marked = []
    for node in tagged + [n for path in paths.values() for n in path]:
        if "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            marked.append(node.name)
    return tuple(marked)


def _same_shape(source: fx.Node, node: fx.Node) -> bool:
    """Whether ``source`` is computed and shaped like the sum ``node`` (a branch output),
    not a parameter or one of the scalars a sum is weighted by (DAR's transport and gates)."""
    a, b = source.meta.get("example_value"), node.meta.get("example_value")
    return (source.op in ("call_function", "call_method") and isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor) and a.shape == b.shape)


#: the layers a branch output may come from, and what may lie between them and the sums:
#: ops that compute nothing random (a dropout only with probability 0)
_LINEAR = (torch.nn.functional.linear, torch._C._nn.linear, torch.matmul, operator.matmul)
_PASS_METHODS = ("to", "contiguous", "view", "reshape", "float", "bfloat16", "half", "type_as")


def branch_output_path(node: fx.Node, max_steps: int = 4, narrow_only: bool = False) -> list[fx.Node]:
    """The nodes from ``node`` up to and including the linear layer that made it, through
    at most ``max_steps`` pass-through ops (:data:`_PASS_METHODS`, a dropout of probability
    0); empty if there is none (recomputing a random op would draw new numbers), or with
    ``narrow_only`` where that layer's input is wider than its output (or of unknown width)."""
    path = []
    for _ in range(max_steps + 1):
        if node.op == "call_function" and node.target in _LINEAR:
            return path + [node] if not narrow_only or _narrow(node) else []
        if _passes_through(node):
            path.append(node)
            node = node.args[0]
            continue
        return []
    return []


def _narrow(linear: fx.Node) -> bool:
    """Whether a linear layer's input is no wider than its output (last dimensions of the
    example values Dynamo recorded; False where one is missing)."""
    inp = linear.args[0].meta.get("example_value") if isinstance(linear.args[0], fx.Node) else None
    out = linear.meta.get("example_value")
    if not (isinstance(inp, torch.Tensor) and isinstance(out, torch.Tensor) and inp.dim() and out.dim()):
        return False
    return inp.shape[-1] <= out.shape[-1]


def _passes_through(node: fx.Node) -> bool:
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _PASS_METHODS
    if node.op == "call_function" and node.target is torch.nn.functional.dropout:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return p == 0 or training is False
    return False
