"""Capture: run the model once on an example input with hooks on every module, and find
where its residual stream lives.

What is found here is found by watching tensors, not by reading class names:

- the *block stack* is the container (``ModuleList``, ``ModuleDict``, ``Sequential``) whose
  children are called one after another with the stream tensor that the previous child
  returned (tensor identity, so anything that touches the stream between blocks shows);
- the *stream argument* of a block is the argument that carries that tensor;
- the *final norm* is the module that reads the last block's stream output next.

Each block's own call (its arguments and keyword arguments) is recorded, so that the
analysis can trace the block with torch.fx exactly as the model calls it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import CaptureError, NoResidualStreamError

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
    if _accepts_keyword(model, "use_cache"):
        kwargs["use_cache"] = False
    return (ids,), kwargs


def _accepts_keyword(model: nn.Module, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


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
        log.warning("block stack %r holds a single block; its stream argument is taken to be "
                    "its first floating-point tensor argument", path)
    return path, children


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
    for b, call in zip(blocks, block_calls):
        repeats = sum(1 for c in calls if c.module is b)
        if repeats > 1:
            raise CaptureError(
                f"block {names[b]!r} was called {repeats} times in one forward pass; depthrewrite "
                "expects each block of the stack to run once per forward"
            )
    stream_arg = _stream_arg_of_stack(block_calls, names)
    embedding = stream_arg.get(block_calls[0].args, block_calls[0].kwargs)
    if not isinstance(embedding, torch.Tensor) or not embedding.is_floating_point():
        raise NoResidualStreamError(
            f"block {names[blocks[0]]!r} receives no floating-point stream tensor as its "
            f"{stream_arg.describe()}; found {type(embedding).__name__}"
        )
    final_path, final_module, final_call = _find_final_reader(calls, block_calls, names)
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
    block_modules = {c.module for c in block_calls}
    inside_blocks = set()
    for b in block_modules:
        inside_blocks.update(b.modules())
    for c in calls:
        if c.order <= last.order or c.module in inside_blocks:
            continue
        if c.args and c.args[0] is stream_out:
            return names[c.module], c.module, c
    raise NoResidualStreamError(
        f"no module reads the output of the last block {names[last.module]!r}; depthrewrite "
        "expects a final norm module (norm_final in SPEC section 1) before the head"
    )
