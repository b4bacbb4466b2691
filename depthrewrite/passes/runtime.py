"""How a rewritten model runs.

The rewrite keeps every module object where it was (so parameter names, HF attributes such
as ``attention_type`` and ``isinstance`` checks survive) and swaps the class of each block
and of the final norm for a subclass made here:

- :class:`RoutedBlock` runs the block's rewritten graph. The depth state travels from
  block to block through a :class:`DepthRuntime` shared by the model's routed modules: the
  first block starts it from its stream input ``e``, every block reads it and returns a new
  one, and the final norm reads the final readout from it. Inside ``__call__`` the state
  tensors are passed to ``forward`` as extra positional arguments and come back as extra
  outputs, so ``forward`` is a pure function that gradient checkpointing (Hugging Face's,
  which wraps ``forward``, re-entrant or not) can replay.
- :class:`RoutedReadout` routes the final norm's input.

Each routed block has a class of its own (:func:`block_class`), a subclass of the routed
class shared by its original class, whose call is its own copy of the code. Dynamo keeps
compiled graphs, and counts recompilations against ``recompile_limit`` (8), per code
object. Blocks compiled one at a time (torchtitan: ``torch.compile(block)`` or
``block.compile()`` per layer) each need a graph of their own, because each routes over a
different number of sources; sharing one code object, a model of more than 8 blocks hit
the limit (an error with ``fullgraph=True``, eager blocks without).

One rewritten graph is kept per call spec (constants and train/eval mode, see
``analysis.trace``). The specs a block is likely to meet (:func:`prepare_programs`: train
and eval mode, ``None`` keywords passed as objects such as a KV cache, boolean keywords
flipped) are built at rewrite time; any other spec is traced and rewritten on first use.
"""

from __future__ import annotations

import copy
import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..analysis import BlockPlan, analyze_block_call
from ..analysis.trace import call_spec, forward_param_names, spec_differences, varying_ints
from .. import fsdp2, tensor_parallel
from ..capture import Capture
from ..errors import DepthRewriteError, RuntimeOrderError, UnsupportedStructureError
from .base import Scheme
from .program_source import function_from_source, imports_of
from .route_graph import route_block_graph_pass

log = logging.getLogger(__name__)

ROUTER_ATTR = "depth_route"


@dataclass
class DepthRuntime:
    """Per-model run-time state shared by the routed blocks and the final norm."""

    scheme: Scheme
    capture: Capture = field(repr=False)
    # the blocks' paths in call order, and the path of the one that ran last in this forward
    # (None: none yet). Strings, not indices: under FSDP2 Dynamo makes every int attribute
    # of a module that FSDP2 manages a symbolic input once it has seen two values, and a
    # block storing ``index + 1`` as a side effect broke Inductor's code ("name 's30' is not
    # defined", torch 2.11 and 2.13); a string is a constant it guards on
    block_paths: tuple[str, ...] = ()
    state: Any = None
    last_block: str | None = None
    analysis: Any = field(default=None, repr=False)  # the ResidualStream, for inspect()
    report: dict = field(default_factory=dict)

    def begin(self, e: torch.Tensor) -> None:
        self.state = self.initial_state(e)
        self.last_block = None

    def blocks_run(self) -> int:
        """How many blocks of the stack ran in this forward, in order (for error messages)."""
        return 0 if self.last_block is None else self.block_paths.index(self.last_block) + 1

    def initial_state(self, e: torch.Tensor) -> Any:
        # Under autocast the embedding stays float32 while every branch returns the autocast
        # dtype: store the sources in that dtype, so that routing reads one dtype (and moves
        # half the bytes). The original model's float32 stream is kept by preserve_identity.
        device_type = e.device.type
        if torch.is_autocast_enabled(device_type) and e.is_floating_point():
            e = e.to(torch.get_autocast_dtype(device_type))
        return self.scheme.init_state(e)


@dataclass
class BlockProgram:
    """A block's rewritten graph, compiled to Python, for one call spec. It pickles as its
    source (:mod:`.program_source`); a deep copy shares the code, which is pure."""

    code: Any  # forward(self, *inputs, depth_state) -> (output, state)
    spec: Any
    sites: int
    source: str = field(repr=False, default="")  # the code's text, as fx generated it
    block_path: str = ""  # for errors

    def __reduce__(self):
        imports = imports_of(self.code, self.block_path)
        return _program_from_source, (imports, self.source, self.spec, self.sites, self.block_path)

    def __deepcopy__(self, memo):
        return BlockProgram(self.code, copy.deepcopy(self.spec, memo), self.sites, self.source, self.block_path)


def _program_from_source(imports: str, source: str, spec, sites: int, block_path: str) -> BlockProgram:
    """A pickled :class:`BlockProgram` made again (``BlockProgram.__reduce__``)."""
    return BlockProgram(function_from_source(imports, source), spec, sites, source, block_path)


class DepthCall:
    """What a block's call passes to its ``forward`` beside the depth state's tensors (how
    many there are, and the pytree spec they unflatten with), and what the forward hands
    back (the spec of the new state, and the length of the block's own output where it is a
    tuple).

    It travels as the ``_depth_call`` keyword, not as attributes of the block: gradient
    checkpointing replays ``forward`` with the keywords of its first run, and under
    torch.compile an object made and read inside the compiled call leaves nothing behind,
    where every attribute the call sets on the block is a side effect Dynamo replays after
    the graph on each call (each TreeSpec rebuilt node by node: for a DAR block of a
    24-layer model, 1,600 of the call's 2,039 bytecode instructions)."""

    def __init__(self, n_state: int, state_spec):
        self.n_state = n_state
        self.state_spec = state_spec
        self.out_spec = None
        self.out_len: int | None = None

    def unpack(self, result) -> tuple[Any, list]:
        """The block's own output and the new state's tensors, from ``forward``'s result."""
        n = self.out_len
        if n is None:
            return result[0], list(result[1:])
        return tuple(result[:n]), list(result[n:])


class RoutedBlock(fsdp2.Keyed):
    """Mixin placed in front of a block's own class. See the module docstring."""

    _depth_runtime: DepthRuntime
    _depth_index: int
    _depth_after: str | None  # the path of the block before it in the stack; None: the first

    def __call__(self, *args, **kwargs):
        rt = self._depth_runtime
        if _in_backward():
            return self._depth_replay(args, kwargs)
        if not torch.is_grad_enabled() and _requires_grad(rt.capture.stream_arg.get(args, kwargs)):
            raise DepthRewriteError(
                f"block {self._depth_path!r} is called with gradients off on a stream that needs them "
                "(torch.utils.checkpoint(block, ..., use_reentrant=True) around the block's call): the "
                "depth state it passes to later blocks would get no gradient; use use_reentrant=False, "
                "or checkpoint the block's forward"
            )
        if self._depth_after is None:
            args, kwargs = tensor_parallel.first_block_stream(rt.capture.stream_arg, args, kwargs)
            rt.begin(rt.capture.stream_arg.get(args, kwargs))
        elif rt.last_block != self._depth_after:
            raise RuntimeOrderError(
                f"block {self._depth_path!r} ran as block {rt.blocks_run()} of the stack, but the rewrite "
                f"captured it as block {self._depth_index}; depthrewrite needs every block to run "
                "once per forward, in order (layer dropping or reordering is not supported)"
            )
        leaves, state_spec = pytree.tree_flatten(rt.state)
        self._depth_keep_for_replay(args, kwargs, leaves, state_spec)
        call = DepthCall(len(leaves), state_spec)
        result = super().__call__(*args, *leaves, _depth_call=call, **kwargs)
        out, new_leaves = call.unpack(result)
        out, new_leaves = fsdp2.tie_state_to_output(self, out, new_leaves, leaves)  # FSDP2 sees only `out` leave
        rt.state = pytree.tree_unflatten(new_leaves, call.out_spec)
        rt.last_block = self._depth_path
        return out

    def _depth_keep_for_replay(self, args: tuple, kwargs: dict, leaves: list, state_spec) -> None:
        """Keep the depth state this call receives where a checkpoint around the block's
        call (``torch.utils.checkpoint(block, x, ...)``, torchtitan's ``checkpoint_wrapper``)
        will run the call again in the backward: the state comes from the runtime, not
        from the call's arguments, and the runtime has moved on by then. Only under
        saved-tensor hooks (those checkpoints install them), so plain training keeps no
        state past its own use."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not _saved_tensor_hooks_active():
            return
        stream = self._depth_runtime.capture.stream_arg.get(args, kwargs)
        if not isinstance(stream, torch.Tensor):
            return
        # the stream itself stands as a marker: a reference to it from the kept state would
        # keep it alive, and with it the entry that its finaliser removes. Block 0 made its
        # state inside the checkpointed call: the replay makes it again, as the checkpoint
        # expects every op of the call to run again
        kept = None if self._depth_after is None else [_STREAM if leaf is stream else leaf for leaf in leaves]
        pending = self.__dict__.setdefault("_depth_pending", {})
        pending[id(stream)] = (kept, state_spec)
        weakref.finalize(stream, pending.pop, id(stream), None)

    def _depth_replay(self, args: tuple, kwargs: dict):
        """The block's call run again by a checkpoint in the backward: with the depth state
        its first run received, the runtime left as it is."""
        stream = self._depth_runtime.capture.stream_arg.get(args, kwargs)
        kept = self.__dict__.get("_depth_pending", {}).pop(id(stream), _MISSING)
        if kept is _MISSING:
            raise RuntimeOrderError(
                f"block {self._depth_path!r} is called again during the backward (a checkpoint "
                "recomputing it), but depthrewrite kept no depth state for that call; checkpoint it "
                "with torch.utils.checkpoint(..., use_reentrant=False) around the block or its forward"
            )
        leaves, state_spec = kept
        if leaves is None:
            leaves = pytree.tree_leaves(self._depth_runtime.initial_state(stream))
        leaves = [stream if leaf is _STREAM else leaf for leaf in leaves]
        call = DepthCall(len(leaves), state_spec)
        return call.unpack(super().__call__(*args, *leaves, _depth_call=call, **kwargs))[0]

    def forward(self, *args, _depth_call: DepthCall, **kwargs):
        if not torch.compiler.is_compiling():  # compiled, the backend checks (tensor_parallel)
            tensor_parallel.check_no_sequence_parallel(self, self._depth_path, ROUTER_ATTR)
        split = len(args) - _depth_call.n_state
        args, leaves = args[:split], args[split:]
        state = pytree.tree_unflatten(list(leaves), _depth_call.state_spec)
        program = self._depth_program(args, kwargs)
        out, new_state = program.code(self, *program.spec.input_values(args, kwargs), state)
        new_leaves, _depth_call.out_spec = pytree.tree_flatten(new_state)
        # the block's own output first, so that hooks reading output[0] still see the stream
        if isinstance(out, tuple):
            _depth_call.out_len = len(out)
            return out + tuple(new_leaves)
        _depth_call.out_len = None
        return (out, *new_leaves)

    def __getstate__(self):
        # the depth state kept for a checkpoint's replay belongs to this model's backward,
        # and is meaningless to a copy or a pickle
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k != "_depth_pending"}

    def __reduce_ex__(self, protocol):
        return _reduce_routed(self, RoutedBlock, protocol)

    def _depth_program(self, args: tuple, kwargs: dict) -> BlockProgram:
        spec = call_spec(args, kwargs, self.training, self._depth_int_inputs)
        program = self._depth_programs.get(spec.key)
        if program is None and self._depth_int_inputs:
            # a value traced before its argument became an input (the prompt's start_pos 0)
            program = self._depth_programs.get(call_spec(args, kwargs, self.training).key)
        if program is None:
            if torch.compiler.is_compiling():
                raise _unprepared_call(self, spec)
            program = self._depth_int_program(spec, args, kwargs) or build_program(self, spec)
            self._depth_programs[program.spec.key] = program
        return program

    def _depth_int_program(self, spec, args: tuple, kwargs: dict) -> BlockProgram | None:
        """Where ``spec`` differs from a traced one only in int arguments (a decoding
        position), one graph with those ints as inputs, traced now and used for every later
        value; None where there is no such difference, or the block's own code needs the
        value (it branches on it: then each value keeps a graph of its own)."""
        varying = varying_ints(spec, [p.spec for p in self._depth_programs.values()]) - self._depth_int_constants
        if not varying:
            return None
        int_inputs = self._depth_int_inputs | varying
        try:
            program = build_program(self, call_spec(args, kwargs, self.training, int_inputs))
        except DepthRewriteError as exc:
            self._depth_int_constants |= varying
            log.info("block %r: int arguments %s change between calls but cannot be traced as inputs (%s); "
                     "each value is traced on its own", self._depth_path, sorted(map(str, varying)), exc)
            return None
        self._depth_int_inputs = int_inputs
        log.info("block %r: int arguments %s change between calls; traced once as inputs", self._depth_path,
                 sorted(map(str, varying)))
        return program


class RoutedReadout:
    """Mixin placed in front of the final norm's class: routes its input."""

    _depth_runtime: DepthRuntime

    def __call__(self, hidden_states, *args, **kwargs):
        rt = self._depth_runtime
        if rt.last_block != rt.block_paths[-1] or rt.state is None:
            if rt.capture.final_norm_other_calls:
                # the model also calls its final norm elsewhere (nanochat, on the embedding
                # before the blocks): only the call after the whole stack is the readout
                return super().__call__(hidden_states, *args, **kwargs)
            raise RuntimeOrderError(
                f"the final norm {self._depth_path!r} ran after {rt.blocks_run()} of {len(rt.block_paths)} "
                "blocks; depthrewrite routes the final readout only after the whole stack ran"
            )
        x = getattr(self, ROUTER_ATTR)["readout"].read(rt.state, hidden_states)
        rt.state, rt.last_block = None, None  # release the sources as soon as they are read
        return super().__call__(x, *args, **kwargs)

    def __reduce_ex__(self, protocol):
        return _reduce_routed(self, RoutedReadout, protocol)


#: stands for the block's stream argument in a depth state kept for a replay
_STREAM = object()
_MISSING = object()


def _in_backward() -> bool:
    """Inside autograd's backward: a block called now is a checkpoint's recomputation."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (a non-re-entrant checkpoint's) are installed. The query
    is torch's private one (``torch.utils.checkpoint`` uses it too); it raises while Dynamo
    traces such hooks, which counts as none here."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except RuntimeError:
        return False


def _requires_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


_ROUTED_CLASSES: dict[tuple[type, type], type] = {}


def routed_class(mixin: type, cls: type) -> type:
    """One subclass per original class, so that ``isinstance`` and class attributes hold."""
    key = (mixin, cls)
    if key not in _ROUTED_CLASSES:
        _ROUTED_CLASSES[key] = type(f"Routed{cls.__name__}", (mixin, cls),
                                    {"__module__": cls.__module__, "_depth_original_class": cls,
                                     "_depth_made_here": True})
    return _ROUTED_CLASSES[key]


def block_class(cls: type) -> type:
    """A class for one block: ``routed_class(RoutedBlock, cls)`` with its own copies of the
    frames Dynamo compiles for a block compiled alone: ``__call__`` for ``torch.compile(block)``,
    ``forward`` for ``block.compile()`` (Dynamo steps over ``nn.Module._call_impl``, torch's
    own); see the module docstring. Same name, so that checks by class name hold."""
    shared = routed_class(RoutedBlock, cls)
    return type(shared.__name__, (shared,), {"__module__": shared.__module__, "__qualname__": shared.__qualname__,
                                             "__call__": _own_code(RoutedBlock.__call__),
                                             "forward": _own_code(RoutedBlock.forward),
                                             "_depth_made_here": True})


def _reduce_routed(module: nn.Module, mixin: type, protocol: int):
    """A routed module's ``__reduce_ex__``. Its class was made at run time and cannot be found
    by name, so a copy or a pickle makes it again from the original class (for a block, a
    class of its own: :func:`block_class`). A class made on top of ours by someone else
    (FSDP2's ``FSDPRouted...``) keeps Python's default: a copy refers to the class, and a
    pickle cannot find it, as without depthrewrite."""
    if not type(module).__dict__.get("_depth_made_here"):
        return super(mixin, module).__reduce_ex__(protocol)
    return _new_routed, (mixin, original_class(module)), module.__getstate__()


def _new_routed(mixin: type, cls: type) -> nn.Module:
    """An empty routed module of original class ``cls``, its class made again (a pickled or
    copied routed module's ``__reduce_ex__``); pickle then sets its state."""
    routed = block_class(cls) if mixin is RoutedBlock else routed_class(mixin, cls)
    return routed.__new__(routed)


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (equal to ``fn``'s, not the same object)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return copy


def is_routed(module: nn.Module) -> bool:
    return isinstance(module, (RoutedBlock, RoutedReadout))


def routed_modules(model: nn.Module, caller: str) -> list[nn.Module]:
    """The routed modules of ``model``, for a public function that needs a rewritten model:
    one that is not (a slip such as passing the original after ``rewrite(..., inplace=False)``)
    is refused, naming ``caller``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller}: model must be a torch.nn.Module, found {type(model).__name__}")
    routed = [module for module in model.modules() if is_routed(module)]
    if not routed:
        raise DepthRewriteError(f"{caller}: {type(model).__name__} is not rewritten (no routed block); pass the "
                                "model depthrewrite.rewrite returned")
    return routed


def routing_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the rewrite added: those under each routed module's ``depth_route``."""
    return [p for module in model.modules() if is_routed(module) for p in getattr(module, ROUTER_ATTR).parameters()]


def original_class(module: nn.Module) -> type:
    """The class a routed module had before the rewrite (its own class otherwise)."""
    return type(module)._depth_original_class if is_routed(module) else type(module)


def _unprepared_call(block: nn.Module, spec) -> DepthRewriteError:
    """The error for a call, under torch.compile or torch.export, of a spec that no program
    of ``block`` was built for (tracing cannot run inside Dynamo). It names what differs
    from the nearest prepared call: an argument that the model passes only when compiled
    or exported (GPT-2's attention mask under torch.export, a positional argument) is not
    among the variants :func:`prepare_programs` builds."""
    names = forward_param_names(block._depth_forward)  # the function traced, as the tracer names them
    differences = spec_differences(spec, [p.spec for p in block._depth_programs.values()], names)
    nearest = f"; unlike the nearest prepared call, {'; '.join(differences)}" if differences else ""
    return DepthRewriteError(
        f"block {block._depth_path!r} is called inside torch.compile or torch.export with arguments it was "
        f"not prepared for ({_describe_spec(spec)}){nearest}; run the model once eagerly with the same "
        "arguments (passing yourself any that the model makes only when compiled) before compiling or exporting"
    )


def _describe_spec(spec) -> str:
    parts = [f"{k}={v[1]!r}" if v[0] == "const" else f"{k}: an object" for k, v in spec.keywords]
    return ", ".join(parts + [f"training={spec.training}"])


#: up to this many optional keywords (``None`` or boolean at capture), every combination
#: of them is prepared; past it, each one alone and all at once
_ALL_COMBINATIONS_UP_TO = 4


def prepare_programs(block: nn.Module, spec, plan: BlockPlan | None = None) -> None:
    """Build the programs a block is likely to meet, so that none is traced inside a
    compiled region: train and eval mode, times the ``None`` keywords passed as objects and
    the boolean keywords flipped (HF builds an explicit attention mask only under
    torch.compile, and passes a KV cache with ``use_cache=True`` in training mode)."""
    for variant in _variants(spec):
        for training in (False, True):
            v = variant.with_training(training)
            if v.key not in block._depth_programs:
                own = plan if plan is not None and v == plan.traced.spec else None
                block._depth_programs[v.key] = build_program(block, v, plan=own)


def _variants(spec) -> list:
    optional = [(k, "none") for k in spec.none_keywords()] + [(k, "bool") for k in spec.bool_keywords()]
    if len(optional) <= _ALL_COMBINATIONS_UP_TO:
        subsets = [[o for i, o in enumerate(optional) if mask >> i & 1] for mask in range(2 ** len(optional))]
    else:
        subsets = [[]] + [[o] for o in optional] + [optional]
    return [spec.with_changes({k for k, t in sub if t == "none"}, {k for k, t in sub if t == "bool"})
            for sub in subsets]


def build_program(block: nn.Module, spec, plan: BlockPlan | None = None) -> BlockProgram:
    """Trace (unless the plan for this spec is given), rewrite and compile one block."""
    rt = block._depth_runtime
    if plan is None:
        log.debug("tracing block %r for call spec %s", block._depth_path, _describe_spec(spec))
        plan = analyze_block_call(rt.capture, block._depth_index, block, block._depth_forward, spec, {},
                                  hints=block._depth_hints)
    routers = getattr(block, ROUTER_ATTR)
    if len(plan.sites) != len(routers):
        raise RuntimeOrderError(
            f"block {block._depth_path!r} shows {len(plan.sites)} residual sites for this call but "
            f"{len(routers)} at capture; its structure depends on its arguments"
        )
    targets = {f"{ROUTER_ATTR}.{name}": module for name, module in routers.items()}
    graph = plan.traced.graph
    graph.owning_module = None  # it belonged to the trace root, which has no routers
    result = route_block_graph_pass(graph, plan.sites, targets)
    # the block is the root: the generated code reads ``self.<child>`` and runs with the block as self
    gm = fx.GraphModule(block, result.graph, class_name=f"Routed{original_class(block).__name__}Graph")
    gm.graph.lint()
    return BlockProgram(code=type(gm).forward, spec=plan.traced.spec, sites=result.sites_rewritten, source=gm.code,
                        block_path=block._depth_path)


def drop_instance_forwards(modules: list[tuple[nn.Module, str]]) -> None:
    """Make each module's class's ``forward`` the one its calls run, before its class is
    swapped: an instance attribute ``forward`` would shadow the routed class's and run the
    original block with the depth state's extra arguments (or none of the routing).

    A bound method of the module's own class's ``forward`` is what transformers 4.x leaves
    behind after a call with ``output_hidden_states`` or ``output_attentions`` (it wraps
    ``module.forward`` in an instance attribute and puts the bound method back as one): it
    runs what the class runs, so it is dropped. Anything else (accelerate's hooks of a
    ``device_map`` load, a user's patch) wraps the forward in code the rewrite cannot see
    through, and is refused; every module is checked before any is changed."""
    found = [(module, path, module.__dict__["forward"]) for module, path in modules if "forward" in module.__dict__]
    for module, path, forward in found:
        if not _is_own_forward(module, forward):
            raise UnsupportedStructureError(
                f"module {path!r} ({type(module).__name__}) has an instance attribute 'forward' "
                f"({_callable_name(forward)}) in place of its class's forward: the rewrite replaces the class's "
                f"forward, which this attribute would bypass. Remove it before the rewrite (for accelerate's hooks "
                f"of a device_map load: accelerate.hooks.remove_hook_from_module(model, recurse=True))"
            )
    for module, path, _ in found:
        log.debug("%s: dropped an instance attribute 'forward' bound to its class's own forward", path)
        del module.__dict__["forward"]


def _is_own_forward(module: nn.Module, forward: Any) -> bool:
    return (isinstance(forward, types.MethodType) and forward.__self__ is module
            and forward.__func__ is type(module).forward)


def _callable_name(obj: Any) -> str:
    """``obj``'s kind and the function it calls, without the bound module's repr."""
    func = getattr(obj, "func", None) or getattr(obj, "__func__", None) or obj
    name = getattr(func, "__qualname__", None)
    return type(obj).__name__ + ("" if name is None else f" of {getattr(func, '__module__', '?')}.{name}")


def install_block(block: nn.Module, plan: BlockPlan, runtime: DepthRuntime, routers: dict) -> None:
    block.add_module(ROUTER_ATTR, nn.ModuleDict(routers))
    block._depth_runtime = runtime
    block._depth_index = plan.index
    block._depth_path = plan.path
    block._depth_after = runtime.block_paths[plan.index - 1] if plan.index else None
    fsdp2.register(block)  # the key compiled code asks FSDP2's state about it by
    block._depth_forward = plan.forward
    block._depth_hints = plan.traced.hints  # children traced through..., the same for every call spec
    block._depth_programs = {}
    block._depth_int_inputs = frozenset()  # int arguments traced as inputs (_depth_int_program)
    block._depth_int_constants = frozenset()  # those that could not be
    block.__class__ = block_class(type(block))


def install_readout(norm: nn.Module, path: str, runtime: DepthRuntime, router: nn.Module) -> None:
    norm.add_module(ROUTER_ATTR, nn.ModuleDict({"readout": router}))
    norm._depth_runtime = runtime
    norm._depth_path = path
    norm.__class__ = routed_class(RoutedReadout, type(norm))
