"""What the routing needs from FSDP2 (``fully_shard``): phase 1 on routing parameters that
FSDP2 holds as shards, and FSDP2's pre-backward on the depth state.

**Phase 1 on shards.** Phase 1 for block k + 1 runs inside block k
(:class:`two_phase.TwoPhasePlan`). Under FSDP2, with ``fully_shard`` on each block
(torchtitan's layout), the next block's routing parameters are shards there: FSDP2 gathers
a block's parameters only when that block runs. Phase 1 gathers the ones it reads itself
(:func:`gathered`):

- forward: the sharded queries and key-norm weights of the next block's routers are
  all-gathered from their shards in one collective (a few vectors a block; one per process
  group, where they are spread over several), with no autograd through the shards, and
  added to a *tap*: a zero vector of the gathered elements that we own (:func:`tap_for`),
  the one tensor the gradient reaches;
- backward: the tap's post-accumulate hook reduces the tap's gradient as FSDP2 reduces its
  own (:func:`_reduce_onto_shards`): summed over the ranks (one reduce-scatter, and under
  HSDP an all-reduce across the replicas) and divided, parameter by parameter, by the
  divisor FSDP2 uses for it: its group's ``gradient_divide_factor`` where one is set
  (torchtitan sets 1.0 and divides its loss by the global token count), else the number of
  ranks (an average). Each shard is added to its sharded parameter's ``.grad``, which
  holds FSDP2's reduced gradient of the block's own uses, when the backward ends: FSDP2
  writes that gradient on its own CUDA stream, and waits for it only then
  (:func:`_add_after_backward`).

Why a tap and not autograd through the DTensor: inside a checkpointed block compiled by
torch.compile (torchtitan's ``checkpoint_wrapper`` under ``torch.compile``), AOTAutograd
(torch 2.13) stopped when a DTensor input needed a gradient ("expected all
tensors_saved_with_vc_check to be Tensors": it kept the DTensor's DeviceMesh among the
saved tensors). With the tap, no DTensor in a compiled graph needs a gradient, and the
reduction runs in eager code, in the engine's order on every rank.

FSDP2's parameter groups are private to torch. Where one cannot be found for a sharded
parameter (another torch's internals, a DTensor that FSDP2 does not hold),
:func:`gather_plans` gives it none and the plan routes those sites one by one (same
function, more bytes moved). With tensor parallelism over the mesh's last dimension beside
FSDP2 (or HSDP) over the others, the routing parameters replicated over it by
:func:`depthrewrite.tensor_parallel.parallelize_routing`, phase 1 gathers over FSDP2's shard
dimension as without it; under sequence parallelism each rank's gradient is its tokens'
share, and the reduced rows are summed over the last dimension too. The divisor is read
when phase 1 runs: compiled, when the block's graph is made.

**The depth state's gradients unshard the block that made it.** FSDP2 gathers a block's
parameters for its backward when a gradient reaches one of the block's outputs (a hook on
each tensor its ``forward`` returns), and a checkpointed block runs its forward again at
that point. A routed block's depth state leaves the call beside its output
(depthrewrite.passes.runtime), so FSDP2 sees only the output. A gradient can reach the
state first: phase 1's outputs, made in block k for the sites of later blocks and the
readout, get theirs before block k's output does, and their backward then recomputed
block k with its parameters still sharded ("aten.mul.Tensor got mixed torch.Tensor and
DTensor"). :func:`tie_state_to_output` makes the state a block made take its gradients
into the block's graph together with the block's output, in one backward node that runs
after FSDP2's hook on the output. A tensor hook on each state tensor calling FSDP2's
pre-backward would do it in eager, but Dynamo cannot register one inside a compiled block;
the node traces.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.utils.weak
from torch import Tensor, nn

log = logging.getLogger(__name__)

__all__ = ["Keyed", "register", "module_of", "tap_name", "is_sharded", "GatherPlan", "gather_plans", "batch_key",
           "tap_for", "gathered", "tie_state_to_output"]


#: the prefix of what this module keeps on a module for the while (FSDP2's unit of a block, a
#: router's taps): never copied or pickled with it (:class:`Keyed`)
TRANSIENT = "_depth_fsdp_"
#: the modules whose FSDP2 state compiled code asks about, by a key of each (:func:`register`)
_BY_KEY: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()


def register(module: nn.Module) -> str:
    """Give ``module`` (a routed block, a router) the string key compiled code passes to the
    functions here that Dynamo runs as it makes a graph (``assume_constant_result``), and
    return it. A string, not the module: torch 2.11's Dynamo cannot pass a module FSDP2
    manages to such a function ("FSDPManagedNNModuleVariable ... is not a constant"), nor
    an int a block compiled alone may hold as a symbolic one. Called at rewrite time."""
    key = f"{type(module).__name__}@{id(module):x}"
    module._depth_key = key
    _BY_KEY[key] = module
    return key


class Keyed:
    """Mixin of the modules :func:`register` keys (routed blocks, routers): a copy
    (``copy.deepcopy``, pickle) gets a key of its own, and leaves behind what this module
    kept on the original for the while (its FSDP2 unit, its taps), which belong to the
    original's parameters."""

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in [n for n in state if n.startswith(TRANSIENT)]:
            del state[name]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_depth_key" in self.__dict__:
            register(self)


def tap_name(name: str) -> str:
    """The attribute holding the tap of a router's routing parameter ``name``."""
    return f"{TRANSIENT}tap_{name}"


def is_sharded(param: Tensor) -> bool:
    """A DTensor: outside its FSDP2 unit's forward, FSDP2 holds only a shard of it."""
    return type(param).__name__ == "DTensor"


class GatherPlan(NamedTuple):
    """How phase 1 gathers one sharded routing parameter: the process group of its shards
    (by name), its rows and the ranks they are spread over, the divisor FSDP2 applies to its
    summed gradient, whether it is HSDP's (replicated over the mesh's first dimension), and
    the mesh dimension over which each rank's gradient is a share to be summed too (tensor
    parallelism's, under sequence parallelism), or None. Plain values, so that a compiled
    block takes them as constants."""

    group: str
    rows: int
    ranks: int
    divisor: float
    hsdp: bool = False
    share_dim: int | None = None

    @property
    def shard_dim(self) -> int:
        """The mesh dimension of the shards: HSDP's second, else the first (a 1-D mesh's,
        or the data-parallel one beside tensor parallelism)."""
        return 1 if self.hsdp else 0

    @property
    def chunk(self) -> int:
        """torch.chunk's (and FSDP2's) rows a rank: the last holding ranks may have fewer."""
        return -(-self.rows // self.ranks)


def gather_plans(params: Sequence[Tensor], shares_over_tp: bool = False) -> tuple[GatherPlan | None, ...]:
    """For each parameter, its :class:`GatherPlan` where FSDP2 holds it as a shard this
    module can gather, else None (a plain tensor, read as it is, or a shard that phase 1
    cannot gather). ``shares_over_tp``: with FSDP2 over a mesh's data-parallel dimension and
    tensor parallelism over its other, each rank's gradient is its share of the tokens
    (sequence parallelism, :func:`depthrewrite.tensor_parallel.parallelize_routing`)."""
    sharded = [p for p in params if is_sharded(p)]
    groups = _fsdp_groups_of(sharded) if sharded else {}
    return tuple(_gather_plan(groups.get(id(p)), p, shares_over_tp) if is_sharded(p) else None for p in params)


def batch_key(plan: GatherPlan) -> tuple:
    """What the parameters :func:`gathered` gathers in one collective share: the process
    group of their shards, its size, and how their gradients are reduced."""
    return plan.group, plan.ranks, plan.hsdp, plan.share_dim


def _widths(params: Sequence[Tensor], plans: Sequence[GatherPlan]) -> list[int]:
    """The layout of one rank's part of the gather of ``params``: each one's elements in
    it, its chunk of rows (padded), in order."""
    return [q.chunk * math.prod(p.shape[1:]) for p, q in zip(params, plans)]


def tap_for(owner: nn.Module, name: str, params: Sequence[Tensor], plans: Sequence[GatherPlan]) -> Tensor:
    """The tap of the sharded parameters ``params`` (:func:`gathered` gathers them in one
    collective: their ``plans`` share a :func:`batch_key`), kept as ``owner``'s attribute
    :func:`tap_name` of ``name``: a zero vector of the gathered elements (every rank's
    padded chunk of each) that needs a gradient. Not a parameter or buffer (the optimizer
    and the state dict never see it); made again for new parameter objects or plans."""
    made = owner.__dict__.setdefault(f"{TRANSIENT}taps", {})
    refs = tuple(weakref.ref(p) for p in params)
    kept = made.get(name)
    if kept is not None and len(kept[0]) == len(params) and all(r() is p for r, p in zip(kept[0], params)) \
            and kept[1] == tuple(plans):
        return owner.__dict__[tap_name(name)]
    local = params[0].to_local()
    size = plans[0].ranks * sum(_widths(params, plans))
    tap = torch.zeros(size, dtype=local.dtype, device=local.device, requires_grad=True)
    tap.register_post_accumulate_grad_hook(functools.partial(_reduce_onto_shards, refs, tuple(plans)))
    made[name] = (refs, tuple(plans))
    owner.__dict__[tap_name(name)] = tap
    return tap


def gathered(params: Sequence[Tensor], plans: Sequence[GatherPlan], tap: Tensor) -> list[Tensor]:
    """Each of ``params`` whole on every rank (plain tensors), from one all-gather of their
    shards (``plans`` share a :func:`batch_key`), their gradients going to ``tap``
    (:func:`tap_for`). One collective for a group's routing parameters: the gather waits in
    the block's graph, and its latency, not its few bytes, is its cost."""
    import torch.distributed._functional_collectives as funcol

    # no gradient through the shards (the tap takes it); each shard padded to its chunk
    flat = torch.cat([_padded(p.to_local().detach(), q.chunk).reshape(-1) for p, q in zip(params, plans)])
    ranks = plans[0].ranks
    whole = (funcol.all_gather_tensor(flat, 0, plans[0].group) + tap).view(ranks, flat.numel())
    # the tap is zero: the same values
    return [part.reshape(ranks * q.chunk, *p.shape[1:])[: q.rows]
            for p, q, part in zip(params, plans, whole.split(_widths(params, plans), dim=1))]


def _padded(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows added after its own, up to ``rows``."""
    if t.shape[0] == rows:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def _reduce_onto_shards(param_refs: tuple, plans: tuple[GatherPlan, ...], tap: Tensor) -> None:
    """The tap's gradient (this rank's part of every gathered parameter's) summed over the
    ranks in one reduce-scatter, each parameter's rows of it divided by its plan's divisor,
    to be added to the sharded parameter's ``.grad`` when the backward ends
    (:func:`_add_after_backward`)."""
    grad, tap.grad = tap.grad, None
    params = [ref() for ref in param_refs]
    if grad is None or any(p is None for p in params):
        return
    mesh, plan = params[0].device_mesh, plans[0]
    shard = torch.empty(grad.numel() // plan.ranks, dtype=grad.dtype, device=grad.device)
    torch.distributed.reduce_scatter_tensor(shard, grad.contiguous(), group=mesh.get_group(plan.shard_dim))
    if plan.hsdp:  # the replicas' sums added too, as FSDP2 all-reduces them
        torch.distributed.all_reduce(shard, group=mesh.get_group(0))
    if plan.share_dim is not None:  # the other tokens' shares, as DTensor sums the Partial gradient
        torch.distributed.all_reduce(shard, group=mesh.get_group(plan.share_dim))
    parts = shard.split(_widths(params, plans))
    _add_after_backward([(param, part.view(plan.chunk, *param.shape[1:])[: param.to_local().shape[0]] / plan.divisor)
                         for param, plan, part in zip(params, plans, parts)])


#: per running backward (autograd's graph task id), ``(sharded parameter, this rank's
#: reduced rows)`` still to be added to ``.grad`` when it ends. A backward that failed
#: leaves its entries, never added
_TO_ADD: dict[int, list[tuple[Tensor, Tensor]]] = {}


def _add_after_backward(additions: list[tuple[Tensor, Tensor]]) -> None:
    """Add each reduced shard to its parameter's ``.grad`` when the backward ends, not now.
    FSDP2 has set that ``.grad`` already (the block holding the parameter ran its backward
    before the block whose phase 1 read it) to the output of a reduce-scatter still running
    on FSDP2's own CUDA stream; FSDP2's final callback, queued as the backward began, makes
    the current stream wait for it, and ours, queued after, runs after it. Inside a nested
    backward (a reentrant checkpoint of the block's forward, Hugging Face's
    ``gradient_checkpointing_enable()`` with ``use_reentrant=True``) ours is queued on the
    nested one and runs before FSDP2's final callback: :func:`_add_now` then waits for
    FSDP2's reductions itself."""
    task = torch._C._current_graph_task_id()
    if task not in _TO_ADD:
        _TO_ADD[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_add_now, task))
    _TO_ADD[task].extend(additions)


def _add_now(task: int) -> None:
    """The reduced shards of backward ``task`` added to the parameters' ``.grad`` (a DTensor
    like the parameter, as FSDP2 keeps it)."""
    from torch.distributed.tensor import DTensor

    additions = _TO_ADD.pop(task, [])
    if additions:
        wait_for_fsdp_reductions([param for param, _ in additions])
    for param, rows in additions:
        reduced = DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
        param.grad = reduced if param.grad is None else param.grad + reduced


def wait_for_fsdp_reductions(params: Sequence[Tensor]) -> None:
    """Make the current stream wait for the reductions FSDP2 has issued into the ``.grad``
    of ``params`` and not yet waited for, as its own final callback waits
    (``FSDPParamGroup._wait_for_post_backward``): each holding group's post-reduce event
    and, under HSDP, its all-reduce's. Without CUDA streams (gloo on the CPU) there is
    nothing to wait for. Waiting again for an event that FSDP2 waits for later is harmless;
    the events are left for FSDP2 to clear."""
    for group in holding_groups(params):
        handle = getattr(group, "device_handle", None)
        for event in pending_reductions(group) if handle is not None else ():
            handle.current_stream().wait_event(event)


def holding_groups(params: Sequence[Tensor]) -> list:
    """The FSDP2 parameter groups holding ``params``, each once."""
    return list({id(g): g for g in _fsdp_groups_of(params).values()}.values())


def pending_reductions(group) -> list:
    """The events of the reductions FSDP2's parameter group ``group`` has issued and not yet
    waited for: its post-reduce event and, under HSDP, its all-reduce's (None where unset)."""
    all_reduce = getattr(group, "_all_reduce_state", None)
    events = (getattr(group, "_post_reduce_event", None), getattr(all_reduce, "event", None))
    return [event for event in events if event is not None]


def tie_state_to_output(block: nn.Module, out, leaves: Sequence, received: Sequence) -> tuple:
    """``(out, leaves)``, where an FSDP2 unit holds ``block``, with ``out`` and the state
    tensors among ``leaves`` (the new depth state's) that the call made (not in
    ``received``, the state it was given) through one identity node, so that they take
    their gradients into the block's graph when its output does, after FSDP2's
    pre-backward hook on that output has gathered the block's parameters. Elsewhere as they
    are. ``out``: the block's output (a tensor, or a tuple whose first tensor is the
    stream)."""
    old_stream = out[0] if isinstance(out, tuple) else out
    if not (torch.is_grad_enabled() and isinstance(old_stream, Tensor) and old_stream.requires_grad
            and _held_by_unit(block._depth_key)):
        return out, leaves
    # the stream itself, where the state holds it too, goes through the node once. By
    # identity, not id(): Dynamo guards on ids, and each call would compile again
    tied = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad and t is not old_stream
            and not any(t is r for r in received)]
    if not tied:
        return out, leaves
    stream, *state = _StateAfterOutput.apply(old_stream, *(leaves[i] for i in tied))
    if torch.compiler.is_compiling():
        # a view of each, taken outside the node: under a checkpoint around the block's call
        # (checkpoint_wrapper), Dynamo (torch 2.13) failed on the node's outputs reaching the
        # depth state ("Argument ... of Node 'output' does not belong to this Graph"), as on
        # phase 1's (two_phase._seen_outside)
        stream, state = stream.view_as(stream), [t.view_as(t) for t in state]
    leaves = [stream if t is old_stream else t for t in leaves]
    for i, t in zip(tied, state):
        leaves[i] = t
    return ((stream, *out[1:]) if isinstance(out, tuple) else stream), leaves


class _StateAfterOutput(torch.autograd.Function):
    """The identity on ``(stream, *state)``, as one backward node: its backward runs once
    every gradient it takes is there, and the hooks on the stream's gradient (FSDP2's
    pre-backward) run first. Its outputs are views, so they must not be changed in place
    (FSDP2 warns of that for a unit's outputs already)."""

    @staticmethod
    def forward(ctx, stream: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        return (stream.view_as(stream), *(t.view_as(t) for t in state))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor, ...]:
        return grads


@torch.compiler.assume_constant_result
def _held_by_unit(key: str) -> bool:
    """Whether an FSDP2 unit holds the block :func:`register` gave ``key``. Compiled, read
    once as the graph is made: it walks FSDP2's state, which Dynamo must not trace."""
    block = _BY_KEY.get(key)
    return block is not None and _unit_of(block) is not None


def module_of(key: str) -> nn.Module | None:
    """The module :func:`register` gave ``key`` (None: no longer alive)."""
    return _BY_KEY.get(key)


def _unit_of(block: nn.Module):
    """The FSDP2 state of the unit holding ``block`` (the innermost), or None. FSDP2 keeps
    its states in a weak map of the modules ``fully_shard`` was called on, which holds
    none before the model is sharded: then nothing is looked for."""
    states = _fsdp_states()
    if not states:
        return None
    cached = block.__dict__.get(f"{TRANSIENT}unit")
    if cached is not None and cached[0] == len(states):
        return cached[1]
    best, depth = None, None
    for state in states:
        for module in getattr(state, "_modules", ()):
            for name, sub in module.named_modules():
                # the innermost unit: the one whose module reaches the block by the shortest path
                if sub is block and (depth is None or name.count(".") < depth):
                    best, depth = state, name.count(".")
    block.__dict__[f"{TRANSIENT}unit"] = (len(states), best)
    return best


def _fsdp_states() -> list:
    """FSDP2's live states, or none where this torch keeps them elsewhere."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as exc:  # another torch's layout: phase 1 routed site by site
        log.debug("FSDP2's states cannot be read (%s)", exc)
        return []
    return [state for state in (ref() for ref in list(_module_state_mapping.values())) if isinstance(state, FSDPState)]


#: sharded parameter -> a weak reference to the FSDP2 parameter group holding it. A parameter
#: object stays in its group for its life (sharding anew makes new parameters), so an entry
#: whose group is alive is right. Eager phase 1 asks at every call (49 times a step for a
#: 24-block model), and walking every group for it took 2.5-2.7 % of an eager step on the
#: CPU (docs/benchmarks.md, session 61). Weak both ways: a model that is dropped is not kept.
_GROUP_OF = torch.utils.weak.WeakIdKeyDictionary()


def _fsdp_groups_of(params: Sequence[Tensor]) -> dict[int, object]:
    """id(sharded parameter) -> the FSDP2 parameter group holding it, for ``params``."""
    found = {}
    for p in params:
        ref = _GROUP_OF.get(p)
        group = ref() if ref is not None else None
        if group is None:
            break
        found[id(p)] = group
    else:
        return found
    found = _walk_fsdp_groups(params)
    for p in params:
        if id(p) in found:
            _GROUP_OF[p] = weakref.ref(found[id(p)])
    return found


def _walk_fsdp_groups(params: Sequence[Tensor]) -> dict[int, object]:
    """:func:`_fsdp_groups_of` from FSDP2's states, every group's parameters walked."""
    wanted = {id(p) for p in params}
    found = {}
    for state in _fsdp_states():
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch versions with one group per state
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                sharded = getattr(fsdp_param, "sharded_param", None)
                if id(sharded) in wanted:
                    found[id(sharded)] = group
    return found


def _gather_plan(group, param: Tensor, shares_over_tp: bool = False) -> GatherPlan | None:
    """``param``'s :class:`GatherPlan` in FSDP2's parameter group ``group``, or None where
    the group cannot be read or :func:`gathered` cannot gather the parameter. It takes FSDP2's
    layouts of a routing parameter: sharded on its first dimension over a 1-D mesh, or HSDP's
    (replicated over the mesh's first dimension, sharded over its second); either with tensor
    parallelism over one more dimension, the last, over which ``parallelize_routing``
    replicated the routing parameters."""
    if group is None:
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = param.device_mesh, tuple(param.placements)
    hsdp = type(getattr(group, "mesh_info", None)).__name__ == "HSDPMeshInfo"
    data_parallel_placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
    with_tp = placements == data_parallel_placements + (Replicate(),)
    if not with_tp and placements != data_parallel_placements:
        return None
    shards = mesh.get_group(1 if hsdp else 0)
    factor = getattr(group, "gradient_divide_factor", None)
    # FSDP2's default divisor: the average over its data-parallel ranks (each replica's
    # shards too), not the tensor-parallel ones
    data_parallel = mesh.size() // mesh.size(mesh.ndim - 1) if with_tp else mesh.size()
    divisor = float(data_parallel) if factor is None else float(factor)
    return GatherPlan(shards.group_name, param.shape[0], shards.size(), divisor, hsdp,
                      mesh.ndim - 1 if with_tp and shares_over_tp else None)
