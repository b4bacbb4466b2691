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

Where the stream is not the one docs/spec.md section 1 describes, the capture says what it
found, with the error class that is true of it: blocks run several times per forward, a
stream rescaled between blocks, several streams or a built-in depth routing before the head
(``NotAdditiveStreamError``); blocks that return a norm's output with no final norm after
them (post-LN, ``NotPreNormError``); a norm of the stream at the start of block 0 only
(RWKV, ``UnsupportedStructureError``). Those refusals live in ``capture_refusals``.

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

from .capture_refusals import (
    refuse_block0_stream_norm, refuse_broken_chain, refuse_repeated_blocks, refuse_unchained_stack,
    refuse_unregistered_blocks, refuse_without_final_reader, refuse_meta_tensors,
)
# re-exported: ModuleCall and StreamArg are the types of Capture's fields, and the rewrite
# and the benchmarks import first_tensor from here
from .capture_types import (
    ModuleCall, StreamArg, calls_after_stack, children_in_call_order, first_tensor, first_tensor_arg,
)
from .errors import CaptureError, NoResidualStreamError

log = logging.getLogger(__name__)

#: Sequence length of the example input built for models with a vocabulary. Two tokens
#: are the least that lets the analysis tell token-mixing branches from per-token ones.
EXAMPLE_SEQ_LEN = 8


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


def find_stream_arg(call: ModuleCall, stream: torch.Tensor) -> StreamArg | None:
    for i, a in enumerate(call.args):
        if a is stream:
            return StreamArg(position=i)
    for k, v in call.kwargs.items():
        if v is stream:
            return StreamArg(keyword=k)
    return None


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
        children = children_in_call_order(module, first_call)
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
        refuse_unregistered_blocks(model)
        refuse_unchained_stack(model, calls, first_call)
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


def _refuse_empty_tensors(args: tuple, kwargs: dict) -> None:
    """A batch of 0 (or 0 tokens) runs no token through the model: the capture would fail in
    whatever op first reduces over it, in that op's words."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"keyword {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            raise CaptureError(f"example_inputs: {name} is an empty tensor (shape {tuple(value.shape)}); the capture "
                               "runs the model once and needs at least one sequence of one token")


def capture(model: nn.Module, example_inputs: Any = None) -> Capture:
    """Run the model once and locate its block stack, stream argument and final norm."""
    refuse_meta_tensors(model)
    if example_inputs is None:
        args, kwargs = default_example_inputs(model)
    else:
        args, kwargs = normalize_example_inputs(example_inputs)
        _refuse_empty_tensors(args, kwargs)
    with eval_mode(model):
        calls = record_calls(model, args, kwargs)
    names = {m: n for n, m in model.named_modules()}
    stack_path, children = find_block_stack(model, calls)
    blocks = [c for _, c in children]
    block_calls = [next(c for c in calls if c.module is b) for b in blocks]
    refuse_repeated_blocks(calls, blocks, names)
    stream_arg = _stream_arg_of_stack(block_calls, names)
    refuse_broken_chain(model, stack_path, block_calls, calls, stream_arg, names)
    embedding = stream_arg.get(block_calls[0].args, block_calls[0].kwargs)
    if not isinstance(embedding, torch.Tensor) or not embedding.is_floating_point():
        raise NoResidualStreamError(
            f"block {names[blocks[0]]!r} receives no floating-point stream tensor as its "
            f"{stream_arg.describe()}; found {type(embedding).__name__}"
        )
    final_path, final_module, final_call = _find_final_reader(calls, block_calls, names)
    refuse_block0_stream_norm(calls, block_calls, stream_arg, names)
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
        arg = first_tensor_arg(block_calls[0])
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
    for c in calls_after_stack(calls, block_calls):
        if c.args and c.args[0] is stream_out:
            return names[c.module], c.module, c
    refuse_without_final_reader(calls, block_calls, names)
    raise NoResidualStreamError(
        f"no module reads the output of the last block {names[last.module]!r}; depthrewrite "
        "expects a final norm module (norm_final in docs/spec.md section 1) before the head"
    )
