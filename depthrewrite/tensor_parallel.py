"""Tensor parallelism (``torch.distributed.tensor.parallel``) and the routing.

**Plain tensor parallelism works.** ``ColwiseParallel`` / ``RowwiseParallel`` on a block's
linears keep the residual stream whole on every rank of the mesh between the blocks: each
rank routes every token with the same routing parameters, and their gradients are whole on
each rank (tests/e2e/test_tensor_parallel.py, 2 CPU ranks against one process).

**Sequence parallelism is refused.** With torchtitan's plan (``SequenceParallel`` on the
norms, ``RowwiseParallel(output_layouts=Shard(1))``) the stream between the blocks holds
each rank's share of the tokens. Each rank then routes its own tokens only, and the
routing parameters, plain tensors, get the gradient of those tokens alone: nothing adds
the other ranks' shares (the norms' weights, replicated DTensors, get a ``Partial``
gradient that DTensor sums). The ranks' routing parameters would drift apart with no
error: on 2 CPU ranks, Block AttnRes's routing gradients were off by 17-80 % of their
largest element (tests/e2e/test_tensor_parallel.py checks that they are off). So a routed
block that runs with sequence-parallel parameters raises :class:`SequenceParallelError`:
eagerly from its forward, and compiled from the ``depthrewrite`` backend (another backend
compiles it unchecked).

What shows sequence parallelism: a parameter of the block (its routing aside) that is a
DTensor replicated over every dimension of a mesh of more than one rank, which is what
``SequenceParallel`` makes of a norm's weight. Plain tensor parallelism shards its
parameters, and FSDP2 hands a block plain tensors while the block runs.

Supporting it would need the routing parameters replicated over the mesh too, and read
through ``to_local(grad_placements=[Partial()])`` wherever a router reads them (the sites,
phase 1 of the next block, the readout). The final norm's router is its child, so
``SequenceParallel`` on a routed final norm stops in torch ("parameter name can't contain
'.'"): it replicates every parameter below the norm under its dotted name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .errors import SequenceParallelError


def sequence_parallel_parameters(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of those parameters that are DTensors replicated over every dimension of
    a mesh of more than one rank (``SequenceParallel``'s norm weights)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    from torch.distributed.tensor import DTensor, Replicate

    return [name for name, param in named_parameters
            if isinstance(param, DTensor) and param.device_mesh.size() > 1
            and all(isinstance(p, Replicate) for p in param.placements)]


def check_no_sequence_parallel(module: nn.Module, path: str, router_attr: str) -> None:
    """Raise :class:`SequenceParallelError` where ``module``'s own parameters (those below
    ``router_attr`` aside) show sequence parallelism. It runs at every eager call of a routed
    block in a distributed run, so the common case, no DTensor, walks the parameter dicts
    without naming them: 9-16 us a call for a DAR block on the dev VM (``named_parameters``
    took 44), about 0.3 ms of an eager step of 24 blocks (docs/benchmarks.md, session 62)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in _own_parameters(module, router_attr)):
        return
    found = sequence_parallel_parameters((n, p) for n, p in module.named_parameters()
                                         if not n.startswith(router_attr + "."))
    if found:
        raise _refusal(f"routed module {path!r}", f"its parameters {found}")


def _own_parameters(module: nn.Module, router_attr: str):
    """``module``'s parameters but those below its child ``router_attr``, unnamed (None
    where a module registered one as None, as ``Linear`` does its missing bias)."""
    yield from module._parameters.values()
    stack = [child for name, child in module._modules.items() if name != router_attr and child is not None]
    while stack:
        child = stack.pop()
        yield from child._parameters.values()
        stack.extend(c for c in child._modules.values() if c is not None)


def check_graph_inputs(gm: torch.fx.GraphModule, example_inputs, num_routing_ops: int) -> None:
    """The backend's check of a graph holding routing ops: no graph input replicated by
    sequence parallelism (the block's parameters reach a compiled graph as its inputs,
    named by Dynamo after their paths)."""
    if not num_routing_ops:
        return
    names = [node.name for node in gm.graph.find_nodes(op="placeholder")]
    found = sequence_parallel_parameters(zip(names, example_inputs))
    if found:
        raise _refusal(f"depthrewrite backend: a graph with {num_routing_ops} routing ops",
                       f"its inputs {', '.join(found)}")


def _refusal(what: str, which: str) -> SequenceParallelError:
    return SequenceParallelError(
        f"{what} runs under sequence parallelism: {which} are DTensors replicated over a mesh of more than "
        "one rank (SequenceParallel's). Each rank would route only its share of the tokens, and the routing "
        "parameters' gradients would miss the other ranks' shares. depthrewrite supports tensor parallelism "
        "without sequence parallelism (the stream whole on every rank between the blocks: RowwiseParallel "
        "with its default output_layouts, no SequenceParallel); see depthrewrite/tensor_parallel.py")
