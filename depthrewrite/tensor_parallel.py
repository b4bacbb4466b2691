"""Tensor parallelism (``torch.distributed.tensor.parallel``) and the routing.

The routing works token by token: each token's routed value depends on that token's
entries and the routing parameters only. So the forward is right whichever share of the
tokens a rank holds; what needs care is the routing parameters' gradients, sums over the
tokens.

**Plain tensor parallelism works as is.** ``ColwiseParallel`` / ``RowwiseParallel`` on a
block's linears keep the residual stream whole on every rank of the mesh between the
blocks: each rank routes every token with the same routing parameters, and their gradients
are whole on each rank. :func:`parallelize_routing` with ``sequence_parallel=False`` makes
the routing parameters DTensors replicated over the mesh, read whole, for a model whose
other parameters are all DTensors (torch's foreach kernels and ``clip_grad_norm_`` take
DTensors or plain tensors, not both).

**Sequence parallelism needs** :func:`parallelize_routing` **with**
``sequence_parallel=True``. With torchtitan's plan (``SequenceParallel`` on the norms,
``RowwiseParallel(output_layouts=Shard(1))``) the stream between the blocks holds each
rank's share of the tokens, so each rank's routing gradients hold only its tokens' terms.
:func:`parallelize_routing` replicates the routing parameters over the mesh and has the
routers read them through ``to_local(grad_placements=[Partial()])``: each rank's gradient
is then a ``Partial`` share that DTensor sums, as it sums the norms' weights'. Without it,
the routing gradients were off by 17-80 % of their largest element on 2 CPU ranks with no
error, and the ranks' routing parameters would drift apart; so a routed block that runs
with sequence-parallel parameters and routing not declared so raises
:class:`SequenceParallelError`: eagerly from its forward, and compiled from the
``depthrewrite`` backend (another backend compiles it unchecked).

What shows sequence parallelism: a parameter of the block (its routing aside) that is a
DTensor replicated over every dimension of a mesh of more than one rank, which is what
``SequenceParallel`` makes of a norm's weight. Plain tensor parallelism shards its
parameters. A model whose norms have no weight shows nothing: there ``sequence_parallel``
is the user's word alone.

Tested on gloo ranks against one process in float64, every parameter's gradient and two
AdamW steps (tests/e2e/test_tensor_parallel.py): eager, compiled whole, compiled block by
block with ``block.compile()``, under FSDP2 on a 2 x 2 mesh (FSDP2 over ``dp``, this over
``tp``), and under HSDP on a 2 x 1 x 2 mesh (this over the last dimension). Under FSDP2 the
next block's routing parameters are still sharded when phase 1 of the two-phase schemes
reads them, as DTensors over every dimension: the routers' reader leaves those as they are,
and :mod:`depthrewrite.fsdp2` gathers them over FSDP2's shards and, under sequence
parallelism, sums their gradients over ``tp`` too (:func:`reads_shares`).

The routed final norm: its router is its child, so ``SequenceParallel`` on it stops in
torch ("parameter name can't contain '.'": it replicates every parameter below the norm
under its dotted name). Leave it out of the plan: :func:`parallelize_routing` replicates the
norm's own parameters too, read as the routing's are, which is what ``SequenceParallel``
would do to it (the norm then returns a plain tensor, its rank's tokens, which the output
projection's ``input_layouts=Shard(1)`` takes).

The first block's stream is copied where it is ``DTensor.to_local``'s output
(:func:`first_block_stream`: torch computed a wrong gradient through it into a block compiled
alone). ``torch.compile(block)`` around each block fails on that input inside DTensor's
backward, the plain model's blocks as well (torch 2.13, CPU): compile blocks with
``block.compile()``, as torchtitan does, or the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .errors import SequenceParallelError

#: the attribute :func:`parallelize_routing` sets on each routed module (a block, the final
#: norm): its ``sequence_parallel``
DECLARED = "_depth_sequence_parallel"


def parallelize_routing(model: nn.Module, device_mesh, *, sequence_parallel: bool) -> nn.Module:
    """Replicate every routing parameter of the rewritten ``model`` over ``device_mesh``
    (its tensor-parallel mesh, one dimension) as a DTensor, and have the routers read each
    as a plain tensor: with ``sequence_parallel`` through ``to_local(grad_placements=[Partial()])``
    (each rank routes its share of the tokens, and DTensor sums the shares of the
    gradient), else whole. The routed final norm's own parameters are replicated and read
    the same way (leave it out of the plan: module docstring).

    Call it on the rewritten model, after or before the tensor-parallel plan, before FSDP2's
    ``fully_shard`` and before making the optimizer (the parameters are new objects). The
    values are rank 0's (``distribute_tensor``). Every parameter is checked before any is
    replaced. Returns ``model``."""
    from torch.distributed.tensor import DeviceMesh, Partial, Replicate

    from .passes.runtime import ROUTER_ATTR, RoutedReadout, is_routed

    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"parallelize_routing: sequence_parallel must be True or False, found {sequence_parallel!r}")
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        raise ValueError("parallelize_routing: device_mesh must be the tensor-parallel DeviceMesh, one dimension "
                         f"(mesh['tp'] of a 2-D mesh), found {device_mesh!r}")
    routed = [(path, module) for path, module in model.named_modules() if is_routed(module)]
    if not routed:
        raise ValueError(f"parallelize_routing: {type(model).__name__} has no routed module; rewrite it with "
                         "depthrewrite.rewrite first")
    owners = []  # (module, its path): every module whose own parameters are the routing's
    for path, module in routed:
        prefix = f"{path}.{ROUTER_ATTR}" if path else ROUTER_ATTR
        owners.extend((sub, sub_path) for sub_path, sub in getattr(module, ROUTER_ATTR).named_modules(prefix=prefix))
        if isinstance(module, RoutedReadout):  # no plan's style can replicate it (module docstring)
            owners.append((module, path))
    for module, path in owners:
        _check_replicable(module, path, device_mesh)
    grad_placements = (Partial(),) if sequence_parallel else (Replicate(),)
    for module, path in owners:
        _replicate(module, device_mesh, grad_placements)
    for _, module in routed:
        module.__dict__[DECLARED] = sequence_parallel
    return model


def _direct_parameter_names(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, param in module._parameters.items() if param is not None)


def _check_replicable(module: nn.Module, path: str, mesh) -> None:
    from torch.distributed.tensor import DTensor

    for name in _direct_parameter_names(module):
        param = module._parameters[name]
        where = f"{path}.{name}" if path else name
        if isinstance(param, DTensor):
            raise ValueError(f"parallelize_routing: {where} is already a DTensor ({param.placements}); call "
                             "parallelize_routing once, before FSDP2's fully_shard, and leave the routed final "
                             "norm out of the tensor-parallel plan")
        if param.device.type != mesh.device_type:
            raise ValueError(f"parallelize_routing: {where} is on {param.device}, the mesh on "
                             f"{mesh.device_type}; move the model to the mesh's device first")


def _replicate(module: nn.Module, mesh, grad_placements: tuple) -> None:
    """``module``'s own parameters replicated over ``mesh``, and ``module`` given a class
    that reads each as a plain tensor (:func:`_local_class`)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    names = _direct_parameter_names(module)
    if not names:
        return
    for name in names:
        param = module._parameters[name]
        module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()]),
                                                     requires_grad=param.requires_grad))
    module.__class__ = _local_class(type(module), names, grad_placements)


_LOCAL_CLASSES: dict[tuple, type] = {}


def _local_class(cls: type, names: tuple[str, ...], grad_placements: tuple) -> type:
    """A subclass of ``cls`` whose attributes ``names`` read the module's replicated
    parameter as a plain tensor (same name, so that checks by class name hold). The
    parameters stay where they were, so names, state dicts, FSDP2 and optimizers see the
    DTensors; only the module's own code (and Dynamo, which inlines the property) sees the
    local tensor."""
    key = (cls, names, grad_placements)
    if key not in _LOCAL_CLASSES:
        attrs = {name: property(_local_reader(name, grad_placements)) for name in names}
        attrs.update(__module__=cls.__module__, __qualname__=cls.__qualname__, _depth_grad_placements=grad_placements)
        _LOCAL_CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _LOCAL_CLASSES[key]


def _local_reader(name: str, grad_placements: tuple):
    # imported here, once a class is made, not at every read: a read sits on the eager step's path
    from torch.distributed.tensor import DTensor, Replicate

    def read(self):
        param = self._parameters[name]
        # sharded by FSDP2 (outside its block's forward): as it is, for phase 1 to gather (depthrewrite.fsdp2)
        if isinstance(param, DTensor) and all(isinstance(p, Replicate) for p in param.placements):
            return param.to_local(grad_placements=grad_placements)
        return param

    read.__name__ = name
    return read


def reads_shares(module: nn.Module) -> bool:
    """Whether ``module`` reads its parameters as each rank's share of their gradient
    (:func:`parallelize_routing` with ``sequence_parallel=True``)."""
    return _are_shares(getattr(type(module), "_depth_grad_placements", None))


def _are_shares(grad_placements) -> bool:
    """Whether ``grad_placements`` (``to_local``'s) are all ``Partial``: a rank's share."""
    from torch.distributed.tensor import Partial

    return bool(grad_placements) and all(isinstance(p, Partial) for p in grad_placements)


def first_block_stream(stream_arg, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The first block's call arguments, its stream copied where it is ``DTensor.to_local``'s
    output (torchtitan's embedding under sequence parallelism: ``RowwiseParallel(output_layouts=Shard(1))``).

    That output is a view whose autograd node turns its gradient back into a DTensor. A block
    compiled alone that received it as an input got a wrong gradient through it (torch 2.13,
    CPU: ``block.compile()``, the embedding's gradient 43 % off while every other one was
    right; the plain model, unrewritten, fails there inside DTensor's backward instead); the
    copy, made outside the compiled call, is an input of its own. It costs one copy of the
    stream a step, in tensor-parallel runs only. ``torch.compile(block)`` traces this call
    too, so the copy cannot help there: that form fails as the plain model does (module
    docstring)."""
    stream = stream_arg.get(args, kwargs)
    if torch.compiler.is_compiling() or not isinstance(stream, torch.Tensor) or stream.grad_fn is None:
        return args, kwargs
    if type(stream.grad_fn).__name__ != "_ToTorchTensorBackward":  # DTensor.to_local's node
        return args, kwargs
    return stream_arg.replace(args, kwargs, stream.clone())


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
    ``router_attr`` aside) show sequence parallelism and its routing was not declared so by
    :func:`parallelize_routing`. It runs at every eager call of a routed block in a
    distributed run, so the common case, no DTensor, walks the parameter dicts without
    naming them: 9-16 us a call for a DAR block on the dev VM (``named_parameters`` took
    44), about 0.3 ms of an eager step of 24 blocks (docs/benchmarks.md, session 62)."""
    if module.__dict__.get(DECLARED) or not torch.distributed.is_available() or not torch.distributed.is_initialized():
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
    """The backend's check of a graph holding routing ops: where a graph input is
    replicated by sequence parallelism, the routing parameters must be read as
    :func:`parallelize_routing` reads them with ``sequence_parallel=True``. The block's
    parameters reach a compiled graph as its inputs (named by Dynamo after the path it
    first read them by; under FSDP2, as FSDP2's unsharded copies), and Dynamo keeps the
    routers' ``to_local(grad_placements=(Partial(),))`` as a call on the input: inputs read
    so are the declared ones. The declaration is all or nothing for a model, so one such
    read stands for all."""
    if not num_routing_ops:
        return
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    declared = {node for node in placeholders if any(_reads_as_share(user) for user in node.users)}
    found = sequence_parallel_parameters((node.name, value) for node, value in zip(placeholders, example_inputs)
                                         if node not in declared)
    if found and not declared:
        raise _refusal(f"depthrewrite backend: a graph with {num_routing_ops} routing ops",
                       f"its inputs {', '.join(found)}")


def _reads_as_share(node: torch.fx.Node) -> bool:
    """``node`` is ``x.to_local(grad_placements=...)`` with every placement ``Partial``."""
    return node.op == "call_method" and node.target == "to_local" and _are_shares(node.kwargs.get("grad_placements"))


def _refusal(what: str, which: str) -> SequenceParallelError:
    return SequenceParallelError(
        f"{what} runs under sequence parallelism: {which} are DTensors replicated over a mesh of more than "
        "one rank (SequenceParallel's). Each rank routes only its share of the tokens, and the routing "
        "parameters' gradients would miss the other ranks' shares. Call "
        "depthrewrite.tensor_parallel.parallelize_routing(model, tp_mesh, sequence_parallel=True) on the "
        "rewritten model (before fully_shard and the optimizer), and leave its final norm out of the plan; "
        "see depthrewrite/tensor_parallel.py")
