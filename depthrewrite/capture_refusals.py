"""Why a captured model cannot be rewritten.

When the capture (``depthrewrite.capture``) cannot find the residual stream it expects,
these refusals say what it found instead, with the error class that is true of it (the zoo
survey classifies by class): ``NotAdditiveStreamError`` where the stream is not one
additive stream (blocks run several times per forward, a stream rescaled between blocks,
several streams or a built-in depth routing before the head), ``NotPreNormError`` for
post-LN blocks with no final norm after them, ``UnsupportedStructureError`` for the rest
(a stream copied or changed between blocks, a final norm inside the last block, a last
stream read other than as a module's first argument or only through a view, a norm of the
stream at the start of block 0 only).

Each public ``refuse_*`` function returns when its case does not apply and raises when it
does; the capture calls them at the points where it has what they need.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .capture_types import (
    ModuleCall, StreamArg, calls_after_stack, children_in_call_order, first_tensor, first_tensor_arg,
)
from .errors import CaptureError, NoResidualStreamError, NotAdditiveStreamError, NotPreNormError, UnsupportedStructureError


def refuse_repeated_blocks(calls: list[ModuleCall], blocks: list[nn.Module], names: dict) -> None:
    for b in blocks:
        repeats = sum(1 for c in calls if c.module is b)
        if repeats > 1:
            raise NotAdditiveStreamError(
                f"block {names[b]!r} runs {repeats} times per forward (recurrent or looped depth); "
                "docs/spec.md section 1 numbers one source per sublayer, each branch run once, which a "
                "block that runs several times does not have"
            )


def refuse_broken_chain(model: nn.Module, stack_path: str, block_calls: list[ModuleCall], calls: list[ModuleCall],
                         stream_arg: StreamArg, names: dict) -> None:
    """The stack's chain stops at a block of the same class as the others, which receives
    another tensor than the one its predecessor returned: the stream is changed between
    blocks (RWKV halves it every few layers in eval mode)."""
    first_call: dict[nn.Module, ModuleCall] = {}
    for c in calls:
        first_call.setdefault(c.module, c)
    called = children_in_call_order(model.get_submodule(stack_path), first_call)
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
            "previous one returned; docs/spec.md section 1 needs h_l = h_{l-1} + u_l from block to block"
        )
    raise UnsupportedStructureError(
        f"the stream is changed {where}: the next block does not receive the tensor the previous "
        "one returned, nor a multiple of it; depthrewrite needs the blocks to pass the stream on"
    )


def _is_norm(module: nn.Module, d_model: int) -> bool:
    """The behavioural norm probe, on leaf modules only (a composite module called with one
    tensor is not called the way the model calls it)."""
    from .analysis.probes import norm_type  # the analysis package imports the capture, and so this module

    return not list(module.children()) and norm_type(module, d_model) is not None


def _calls_inside(calls: list[ModuleCall], block_call: ModuleCall) -> list[ModuleCall]:
    """The calls of the block's descendants during its (single) call."""
    inside = set(block_call.module.modules()) - {block_call.module}
    return [c for c in calls if c.order > block_call.order and c.module in inside]


def refuse_without_final_reader(calls: list[ModuleCall], block_calls: list[ModuleCall], names: dict) -> None:
    """Nothing reads the last block's output as a final norm would: say what the model does."""
    _refuse_post_ln(calls, block_calls, names)
    stream_out = first_tensor(block_calls[-1].output)
    after = calls_after_stack(calls, block_calls)
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
            "(docs/spec.md section 1)"
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
                "several streams), not the single h + u stream that a final norm reads (docs/spec.md section 1)"
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
                "(docs/spec.md section 1)"
            )
        raise UnsupportedStructureError(
            f"the last block's output, of shape {list(stream_out.shape)}, is read only through a view "
            f"of shape {list(view.shape)} (first by {module}); depthrewrite expects a final norm "
            "called on the stream itself"
        )


def refuse_block0_stream_norm(calls: list[ModuleCall], block_calls: list[ModuleCall], stream_arg: StreamArg,
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


def refuse_unregistered_blocks(model: nn.Module) -> None:
    """Blocks held in a plain Python list or tuple: nn.Module registers neither them nor
    their parameters, so the capture never sees them called (a common slip for
    ``nn.ModuleList``). Called where no block stack was found, to say why."""
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if not (isinstance(value, (list, tuple)) and len(value) > 1
                    and all(isinstance(v, nn.Module) for v in value)):
                continue
            owner = type(model).__name__ + (f".{path}" if path else "")
            kinds = sorted({type(v).__name__ for v in value})
            raise NoResidualStreamError(
                f"{owner}.{attr} is a Python {type(value).__name__} of {len(value)} {', '.join(kinds)} "
                "modules, which PyTorch does not register as submodules (their parameters are not "
                "in model.parameters() either); depthrewrite looks for the block stack among "
                "registered containers: hold the blocks in an nn.ModuleList"
            )


def refuse_unchained_stack(model: nn.Module, calls: list[ModuleCall],
                           first_call: dict[nn.Module, ModuleCall]) -> None:
    """Where no chain was found: a container of blocks of one class, called in order, whose
    first link is broken (``block(x + a * x0)`` in the model's loop) is named, with what
    passes between its first two blocks, as where a chain breaks later (refuse_broken_chain).
    Not where other modules run between the two (XLM's ``attentions`` list, its norms and
    MLPs in other lists): those children are parts of blocks, not blocks."""
    names = {m: n for n, m in model.named_modules()}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = children_in_call_order(module, first_call)
        if len(children) < 2 or len({type(c) for _, c in children}) > 1:
            continue
        first, second = (first_call[c] for _, c in children[:2])
        inside_first = set(children[0][1].modules())
        if any(first.order < c.order < second.order and c.module not in inside_first for c in calls):
            continue
        first_arg, stream_arg = first_tensor_arg(first), first_tensor_arg(second)
        if first_arg is None or stream_arg is None:
            continue
        # both given the same tensor: applied side by side (experts, heads), not one after the other
        if stream_arg.get(second.args, second.kwargs) is not first_arg.get(first.args, first.kwargs):
            refuse_broken_chain(model, path, [first], calls, stream_arg, names)


def refuse_meta_tensors(model: nn.Module) -> None:
    """A model whose weights are on the meta device (built under ``torch.device("meta")``, as
    torchtitan and FSDP2 set-ups do before ``to_empty``): the capture runs the model, and the
    analysis probes its modules' outputs, which need values. ``rewrite`` and ``inspect``
    materialize such a model first (``depthrewrite.meta``); a direct capture does not."""
    found = first_meta_tensor(model)
    if found is not None:
        kind, name = found
        raise CaptureError(
            f"{type(model).__name__}'s {kind} '{name}' is on the meta device: depthrewrite finds the "
            "residual stream by running the model and probing its modules, which needs real values. "
            "depthrewrite.rewrite and depthrewrite.inspect materialize such a model on the CPU themselves "
            "(with its init_weights() or meta_init=...); call one of them, or capture it once its weights exist")


def named_tensors(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` of the model's parameters, then its buffers; ``kind`` is
    "parameter" or "buffer", for messages."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            yield kind, name, tensor


def first_meta_tensor(model: nn.Module) -> tuple[str, str] | None:
    """The kind ("parameter" or "buffer") and name of the model's first tensor on the meta
    device; None where it has none."""
    return next(((kind, name) for kind, name, tensor in named_tensors(model) if tensor.is_meta), None)
