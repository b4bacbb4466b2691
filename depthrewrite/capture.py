"""Capture: run the model once on an example input with hooks on every module, and find
where its residual stream lives.

What is found here is found by watching tensors, not by reading class names:

- the *block stack* is the container (``ModuleList``, ``ModuleDict``, ``Sequential``) whose
  children are called one after another with the stream tensor that the previous child
  returned (tensor identity, so anything that touches the stream between blocks shows);
- the *stream argument* of a block is the argument that carries that tensor;
- the *final norm* is the module that reads the last block's stream output next (a model
  may call that module elsewhere too, as nanochat does on the embedding: only the call
  after the last block is the readout).

Where the stream is not the one SPEC section 1 describes, the capture says what it found,
with the error class that is true of it: blocks run several times per forward, a stream
rescaled between blocks, several streams or a built-in depth routing before the head
(``NotAdditiveStreamError``); blocks that return a norm's output with no final norm after
them (post-LN, ``NotPreNormError``); a norm of the stream at the start of block 0 only
(RWKV, ``UnsupportedStructureError``).

Each block's own call (its arguments and keyword arguments) is recorded, so that the
analysis can trace the block with torch.fx exactly as the model calls it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import (
    CaptureError, NoResidualStreamError, NotAdditiveStreamError, NotPreNormError, UnsupportedStructureError,
)

log = logging.getLogger(__name__)

#: Sequence length of the example input built for models with a vocabulary. Two tokens
#: are the least that lets the analysis tell token-mixing branches from per-token ones.
EXAMPLE_SEQ_LEN = 8


@dataclass
class ModuleCall:
    """One recorded call of a module during the capture run."""

    order: int
    module: nn.Module
    args: tuple
    kwargs: dict
    output: Any = None


@dataclass
class StreamArg:
    """Where a block receives the stream: a positional index or a keyword name."""

    position: int | None = None
    keyword: str | None = None

    def get(self, args: tuple, kwargs: dict) -> Any:
        if self.keyword is not None:
            return kwargs[self.keyword]
        return args[self.position]

    def describe(self) -> str:
        return f"keyword '{self.keyword}'" if self.keyword is not None else f"argument {self.position}"


@dataclass
class Capture:
    """What the capture run saw. ``blocks`` are in call order."""

    stack_path: str
    block_paths: list[str]
    blocks: list[nn.Module]
    block_calls: list[ModuleCall]
    stream_arg: StreamArg
    final_norm_path: str
    final_norm: nn.Module
    final_norm_call: ModuleCall
    embedding: torch.Tensor  # h_0: the stream as the first block receives it
    d_model: int
    # calls of the final norm module other than the readout (nanochat also normalises the
    # embedding with it before the blocks): they run unrouted
    final_norm_other_calls: int = 0
    example: tuple | None = field(repr=False, default=None)  # (args, kwargs) the capture ran with
    model_output: Any = field(repr=False, default=None)  # the model's own output on the example
    named_modules: dict[nn.Module, str] = field(repr=False, default_factory=dict)


def default_example_inputs(model: nn.Module) -> tuple[tuple, dict]:
    """A small example call for models that declare a vocabulary (HF and bundled models)."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and config is not None and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab is None:
        raise CaptureError(
            f"depthrewrite needs an example input to capture {type(model).__name__}: pass "
            "example_inputs=(args...) or a dict of keyword arguments; found no "
            "model.config.vocab_size to build one"
        )
    device = _model_device(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(vocab), (1, EXAMPLE_SEQ_LEN), generator=generator).to(device)
    kwargs: dict[str, Any] = {}
    # no KV cache during the capture: the blocks would append to it, and the analysis,
    # which replays each block on its recorded arguments, would then see a longer cache
    # than the recorded mask (granitemoe_swa takes use_cache only through **kwargs)
    if _accepts_keyword(model, "use_cache") or (_accepts_var_keywords(model) and hasattr(config, "use_cache")):
        kwargs["use_cache"] = False
    return (ids,), kwargs


def _forward_parameters(model: nn.Module):
    import inspect

    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _accepts_keyword(model: nn.Module, name: str) -> bool:
    return name in _forward_parameters(model)


def _accepts_var_keywords(model: nn.Module) -> bool:
    import inspect

    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _forward_parameters(model).values())


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def normalize_example_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[1], dict):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def record_calls(model: nn.Module, args: tuple, kwargs: dict) -> list[ModuleCall]:
    """Run ``model(*args, **kwargs)`` once in eval mode without gradients and record every
    module call with its inputs and output."""
    calls: list[ModuleCall] = []
    pending: dict[int, list[ModuleCall]] = {}

    def pre_hook(module, hook_args, hook_kwargs):
        call = ModuleCall(len(calls), module, hook_args, dict(hook_kwargs))
        calls.append(call)
        pending.setdefault(id(module), []).append(call)

    def post_hook(module, hook_args, hook_kwargs, output):
        stack = pending.get(id(module))
        if stack:
            stack.pop().output = output

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with eval_mode(model), torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:  # the user's model raised: say where we were
        raise CaptureError(
            f"running {type(model).__name__} on the example input failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return calls


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Eval mode for the duration (dropout off, so probes are deterministic), each module's
    own mode restored afterwards."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes.items():
            m.training = mode


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (possibly nested) output, in pytree order."""
    return next((leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)), None)


def find_stream_arg(call: ModuleCall, stream: torch.Tensor) -> StreamArg | None:
    for i, a in enumerate(call.args):
        if a is stream:
            return StreamArg(position=i)
    for k, v in call.kwargs.items():
        if v is stream:
            return StreamArg(keyword=k)
    return None


def _first_tensor_arg(call: ModuleCall) -> StreamArg | None:
    for i, a in enumerate(call.args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return StreamArg(position=i)
    for k, v in call.kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return StreamArg(keyword=k)
    return None


def _children_in_call_order(container: nn.Module, first_call: dict[nn.Module, ModuleCall]) -> list[tuple[str, nn.Module]]:
    called = [(name, child) for name, child in container.named_children() if child in first_call]
    return sorted(called, key=lambda nc: first_call[nc[1]].order)


def _chain_length(children: list[tuple[str, nn.Module]], first_call: dict[nn.Module, ModuleCall]) -> int:
    """How many consecutive children pass the stream on: child i+1 receives, as one of its
    arguments, the very tensor child i returned first."""
    n = 1
    for (_, prev), (_, nxt) in zip(children, children[1:]):
        out = first_tensor(first_call[prev].output)
        arg = None if out is None else find_stream_arg(first_call[nxt], out)
        if arg is None or not _keeps_stream_shape(first_call[nxt], arg):
            break
        n += 1
    return n


def _keeps_stream_shape(call: ModuleCall, arg: StreamArg) -> bool:
    """A block returns a stream of the shape it received and is more than one leaf module
    (this keeps chains such as ``Sequential(Linear, GELU, Linear)`` out)."""
    if len(list(call.module.children())) < 2:
        return False
    out = first_tensor(call.output)
    return out is not None and out.shape == arg.get(call.args, call.kwargs).shape


def find_block_stack(model: nn.Module, calls: list[ModuleCall]) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The container whose children carry the stream from one to the next, longest chain
    first. A model with a single block is accepted when its container holds one called child."""
    first_call: dict[nn.Module, ModuleCall] = {}
    for c in calls:
        first_call.setdefault(c.module, c)
    best: tuple[int, str, list] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = _children_in_call_order(module, first_call)
        if not children:
            continue
        length = _chain_length(children, first_call)
        if length != len(children) and length < 2:
            continue
        if len({type(c) for _, c in children}) > 1 and length < 2:
            continue
        if best is None or length > best[0]:
            best = (length, path, children[:length])
    if best is None:
        raise NoResidualStreamError(
            f"{type(model).__name__} has no stack of blocks carrying a residual stream: no "
            "ModuleList/ModuleDict/Sequential was found whose children are called one after "
            "another, each with the tensor the previous one returned"
        )
    _, path, children = best
    if len(children) == 1:
        _warn_single_block(type(model).__name__, path)
    return path, children


@functools.lru_cache(maxsize=None)
def _warn_single_block(model_name: str, path: str) -> None:
    # once per model class and stack: every inspect/rewrite captures again, and a warning
    # repeated for each of them says nothing new
    log.warning("block stack %r of %s holds a single block; its stream argument is taken to be "
                "its first floating-point tensor argument", path, model_name)


def capture(model: nn.Module, example_inputs: Any = None) -> Capture:
    """Run the model once and locate its block stack, stream argument and final norm."""
    if example_inputs is None:
        args, kwargs = default_example_inputs(model)
    else:
        args, kwargs = normalize_example_inputs(example_inputs)
    with eval_mode(model):
        calls = record_calls(model, args, kwargs)
    names = {m: n for n, m in model.named_modules()}
    stack_path, children = find_block_stack(model, calls)
    blocks = [c for _, c in children]
    block_calls = [next(c for c in calls if c.module is b) for b in blocks]
    _refuse_repeated_blocks(calls, blocks, names)
    stream_arg = _stream_arg_of_stack(block_calls, names)
    _refuse_broken_chain(model, stack_path, block_calls, calls, stream_arg, names)
    embedding = stream_arg.get(block_calls[0].args, block_calls[0].kwargs)
    if not isinstance(embedding, torch.Tensor) or not embedding.is_floating_point():
        raise NoResidualStreamError(
            f"block {names[blocks[0]]!r} receives no floating-point stream tensor as its "
            f"{stream_arg.describe()}; found {type(embedding).__name__}"
        )
    final_path, final_module, final_call = _find_final_reader(calls, block_calls, names)
    _refuse_block0_stream_norm(calls, block_calls, stream_arg, names)
    return Capture(
        stack_path=stack_path,
        block_paths=[names[b] for b in blocks],
        blocks=blocks,
        block_calls=block_calls,
        stream_arg=stream_arg,
        final_norm_path=final_path,
        final_norm=final_module,
        final_norm_call=final_call,
        embedding=embedding,
        final_norm_other_calls=sum(1 for c in calls if c.module is final_module) - 1,
        d_model=int(embedding.shape[-1]),
        example=(args, kwargs),
        model_output=next((c.output for c in calls if c.module is model), None),
        named_modules=names,
    )


def _stream_arg_of_stack(block_calls: list[ModuleCall], names: dict) -> StreamArg:
    if len(block_calls) == 1:
        arg = _first_tensor_arg(block_calls[0])
        if arg is None:
            raise NoResidualStreamError(f"block {names[block_calls[0].module]!r} takes no tensor argument")
        return arg
    found: StreamArg | None = None
    for prev, nxt in zip(block_calls, block_calls[1:]):
        arg = find_stream_arg(nxt, first_tensor(prev.output))
        if found is not None and arg != found:
            raise CaptureError(
                f"blocks receive the stream in different places: {found.describe()} and "
                f"{arg.describe()} (block {names[nxt.module]!r})"
            )
        found = arg
    # the first block must receive h_0 in the same place
    if found.keyword is None and found.position >= len(block_calls[0].args):
        raise CaptureError(f"block {names[block_calls[0].module]!r} has no {found.describe()}")
    return found


def _find_final_reader(calls: list[ModuleCall], block_calls: list[ModuleCall], names: dict):
    """The first module called after the last block whose input is the last block's stream."""
    last = block_calls[-1]
    stream_out = first_tensor(last.output)
    for c in _calls_after_stack(calls, block_calls):
        if c.args and c.args[0] is stream_out:
            return names[c.module], c.module, c
    _refuse_without_final_reader(calls, block_calls, names)
    raise NoResidualStreamError(
        f"no module reads the output of the last block {names[last.module]!r}; depthrewrite "
        "expects a final norm module (norm_final in SPEC section 1) before the head"
    )


def _calls_after_stack(calls: list[ModuleCall], block_calls: list[ModuleCall]) -> list[ModuleCall]:
    """The module calls after the last block starts, outside every block."""
    inside_blocks = set()
    for c in block_calls:
        inside_blocks.update(c.module.modules())
    last = block_calls[-1].order
    return [c for c in calls if c.order > last and c.module not in inside_blocks]


# Refusals. When the capture cannot find the stream it expects, these say what it found
# instead, with the error class that is true of it (the zoo survey classifies by class).


def _refuse_repeated_blocks(calls: list[ModuleCall], blocks: list[nn.Module], names: dict) -> None:
    for b in blocks:
        repeats = sum(1 for c in calls if c.module is b)
        if repeats > 1:
            raise NotAdditiveStreamError(
                f"block {names[b]!r} runs {repeats} times per forward (recurrent or looped depth); "
                "SPEC section 1 numbers one source per sublayer, each branch run once, which a "
                "block that runs several times does not have"
            )


def _refuse_broken_chain(model: nn.Module, stack_path: str, block_calls: list[ModuleCall], calls: list[ModuleCall],
                         stream_arg: StreamArg, names: dict) -> None:
    """The stack's chain stops at a block of the same class as the others, which receives
    another tensor than the one its predecessor returned: the stream is changed between
    blocks (RWKV halves it every few layers in eval mode)."""
    first_call: dict[nn.Module, ModuleCall] = {}
    for c in calls:
        first_call.setdefault(c.module, c)
    called = _children_in_call_order(model.get_submodule(stack_path), first_call)
    last = block_calls[-1]
    if len(called) <= len(block_calls) or type(called[len(block_calls)][1]) is not type(last.module):
        return
    nxt = first_call[called[len(block_calls)][1]]
    try:
        received = stream_arg.get(nxt.args, nxt.kwargs)
    except (IndexError, KeyError):
        return
    returned = first_tensor(last.output)
    if not isinstance(received, torch.Tensor) or returned is None or received.shape != returned.shape:
        return
    where = f"between blocks {names[last.module]!r} and {names[nxt.module]!r}"
    a, b = received.to(returned.device).double(), returned.double()
    if torch.equal(a, b):  # a copy: moved to another device (pipelined layers) or dtype
        raise UnsupportedStructureError(
            f"the stream is copied {where} (from {returned.dtype} on {returned.device} to "
            f"{received.dtype} on {received.device}); depthrewrite needs the blocks to pass the "
            "stream tensor on as it is"
        )
    scale = float((a * b).sum() / b.pow(2).sum().clamp_min(1e-300))
    if torch.allclose(a, scale * b, rtol=1e-6, atol=0.0):
        raise NotAdditiveStreamError(
            f"the stream is rescaled {where}: the next block receives {scale:.4g} times what the "
            "previous one returned; SPEC section 1 needs h_l = h_{l-1} + u_l from block to block"
        )
    raise UnsupportedStructureError(
        f"the stream is changed {where}: the next block does not receive the tensor the previous "
        "one returned, nor a multiple of it; depthrewrite needs the blocks to pass the stream on"
    )


def _is_norm(module: nn.Module, d_model: int) -> bool:
    """The behavioural norm probe, on leaf modules only (a composite module called with one
    tensor is not called the way the model calls it)."""
    from .analysis.probes import norm_type  # the analysis package imports this module

    return not list(module.children()) and norm_type(module, d_model) is not None


def _calls_inside(calls: list[ModuleCall], block_call: ModuleCall) -> list[ModuleCall]:
    """The calls of the block's descendants during its (single) call."""
    inside = set(block_call.module.modules()) - {block_call.module}
    return [c for c in calls if c.order > block_call.order and c.module in inside]


def _refuse_without_final_reader(calls: list[ModuleCall], block_calls: list[ModuleCall], names: dict) -> None:
    """Nothing reads the last block's output as a final norm would: say what the model does."""
    _refuse_post_ln(calls, block_calls, names)
    stream_out = first_tensor(block_calls[-1].output)
    after = _calls_after_stack(calls, block_calls)
    _refuse_stream_mixing_reader(after, stream_out, names)
    _refuse_sliced_stream(after, stream_out, names)


def _norm_returned(calls: list[ModuleCall], block_call: ModuleCall) -> ModuleCall | None:
    """The norm inside the block whose output the block returns as its stream, if any."""
    out = first_tensor(block_call.output)
    d_model = int(out.shape[-1])
    return next((c for c in _calls_inside(calls, block_call)
                 if first_tensor(c.output) is out and _is_norm(c.module, d_model)), None)


def _refuse_post_ln(calls: list[ModuleCall], block_calls: list[ModuleCall], names: dict) -> None:
    norms = [_norm_returned(calls, b) for b in block_calls]
    last, norm = block_calls[-1], norms[-1]
    if norm is None:
        return
    what = (f"block {names[last.module]!r} returns the output of its norm {names[norm.module]!r} "
            f"({type(norm.module).__name__})")
    if all(n is not None for n in norms):
        raise NotPreNormError(
            f"{what}, and so does every block of the stack: the stream is post-LN, norm(h + f(h)), "
            "with no final norm after the last block; depthrewrite needs PreNorm h + f(norm(h)) "
            "(SPEC section 1)"
        )
    raise UnsupportedStructureError(
        f"{what}, and the other blocks do not: the final norm runs inside the last block; "
        "depthrewrite expects it as a module called on the last block's output"
    )


def _tensor_arguments(call: ModuleCall) -> list[tuple[str, torch.Tensor]]:
    named = [(f"argument {i}", a) for i, a in enumerate(call.args)] + [
        (f"keyword '{k}'", v) for k, v in call.kwargs.items()]
    return [(where, t) for where, t in named if isinstance(t, torch.Tensor)]


def _refuse_stream_mixing_reader(after: list[ModuleCall], stream_out: torch.Tensor, names: dict) -> None:
    """A module reads the last block's output in another place than its first argument."""
    for c in after:
        tensors = _tensor_arguments(c)
        where = next((w for w, t in tensors if t is stream_out), None)
        if where is None:
            continue
        module = f"{names[c.module]!r} ({type(c.module).__name__})"
        others = [f"{w} of shape {list(t.shape)}" for w, t in tensors
                  if t is not stream_out and t.is_floating_point() and t.shape[-1:] == stream_out.shape[-1:]]
        if others:
            raise NotAdditiveStreamError(
                f"the last block's output is read by {module} as its {where}, together with "
                f"{', '.join(others)}: the model combines its stream with other tensors of its width "
                "before the head (built-in depth routing such as block attention residuals, or "
                "several streams), not the single h + u stream that a final norm reads (SPEC section 1)"
            )
        raise UnsupportedStructureError(
            f"the last block's output is read by {module} as its {where}; depthrewrite expects a "
            "final norm that takes the stream as its first argument"
        )


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, subclasses)
        return False


def _refuse_sliced_stream(after: list[ModuleCall], stream_out: torch.Tensor, names: dict) -> None:
    """The last block's output is read only through views of it (slices, reshapes)."""
    for c in after:
        view = next((t for _, t in _tensor_arguments(c)
                     if t is not stream_out and _shares_storage(t, stream_out)), None)
        if view is None:
            continue
        module = f"{names[c.module]!r} ({type(c.module).__name__})"
        if view.dim() + 1 == stream_out.dim() and view.shape == stream_out.shape[1:]:
            raise NotAdditiveStreamError(
                f"the last block's output, of shape {list(stream_out.shape)}, is read in slices of "
                f"shape {list(view.shape)} (first by {module}): the blocks carry {stream_out.shape[0]} "
                "streams stacked on the first dimension (as AltUp does), not one h + u stream "
                "(SPEC section 1)"
            )
        raise UnsupportedStructureError(
            f"the last block's output, of shape {list(stream_out.shape)}, is read only through a view "
            f"of shape {list(view.shape)} (first by {module}); depthrewrite expects a final norm "
            "called on the stream itself"
        )


def _refuse_block0_stream_norm(calls: list[ModuleCall], block_calls: list[ModuleCall], stream_arg: StreamArg,
                               names: dict) -> None:
    """Block 0 alone normalises its stream argument before its first site (RWKV's ``pre_ln``):
    the stream then starts inside block 0, at that norm's output."""
    if len(block_calls) < 2:  # nothing to compare with: a norm of a norm may be the branch's own
        return
    found = _renormed_stream_norm(calls, block_calls[0], stream_arg)
    if found is None or _renormed_stream_norm(calls, block_calls[1], stream_arg):
        return
    raise UnsupportedStructureError(
        f"block {names[block_calls[0].module]!r} normalises its stream ({stream_arg.describe()}) with "
        f"{names[found.module]!r} ({type(found.module).__name__}) before its first site, and the other "
        f"blocks do not: the residual stream starts inside block 0, at h_0 = {names[found.module]}(e); "
        "depthrewrite does not yet take a norm of block 0 as part of the embedding"
    )


def _renormed_stream_norm(calls: list[ModuleCall], block_call: ModuleCall, stream_arg: StreamArg) -> ModuleCall | None:
    """A norm that reads the block's stream argument and whose output another norm reads."""
    stream = stream_arg.get(block_call.args, block_call.kwargs)
    if not isinstance(stream, torch.Tensor):
        return None
    inside = _calls_inside(calls, block_call)
    d_model = int(stream.shape[-1])
    for c in inside:
        if not (c.args and c.args[0] is stream) or list(c.module.children()):
            continue
        out = first_tensor(c.output)
        readers = [r.module for r in inside if r.order > c.order and r.args and r.args[0] is out]
        if readers and any(_is_norm(r, d_model) for r in readers) and _is_norm(c.module, d_model):
            return c
    return None
