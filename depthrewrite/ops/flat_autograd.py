"""A leaner autograd kernel for the routing custom ops that take lists of tensors.

``torch.library.custom_op``'s ``register_autograd`` wraps each call of an op with
``Tensor[]`` arguments in pytree flattening and unflattening of its arguments, results,
gradients and ``needs_input_grad`` (``torch._library.autograd.supports_tensorlist``). In
eager training that is much of the op's host time: a 9-source ``route`` forward and
backward through ``torch.autograd.grad`` took 19-25 % less host time with this module's
kernel on two H200 machines (docs/benchmarks.md, session 52; the CPU: 267 against 360 us).

:func:`register_autograd` registers, in the op's place, an Autograd kernel that does the
same with the op's schema read once: list arguments are spliced into the
``autograd.Function``'s arguments and cut out again by their recorded lengths. The
``setup_context`` and ``backward`` functions are the ones ``register_autograd`` takes, with
the same contract: ``inputs`` with the defaults filled in, gradients shaped like the
results (a list for a ``Tensor[]`` result), ``ctx.needs_input_grad`` shaped like the
arguments the caller passed, and one gradient (or list of gradients) per argument.

The op stays a dispatcher op, so ``torch.compile`` sees it as before: AOTAutograd traces
this kernel's forward and backward as it traced the generated one.

Replacing a kernel makes the dispatcher warn once per process ("Overriding a previously
registered kernel"); that one warning is silenced here, so a later override elsewhere in
the process is not announced either. ``DEPTHREWRITE_AUTOGRAD=custom_op`` (read at import)
keeps ``custom_op``'s own kernel, for A/B timing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import _C

from ..environment import environment_choice

__all__ = ["register_autograd", "AUTOGRAD_ENV", "AUTOGRAD_CHOICES", "autograd_choice"]

#: environment variable choosing the ops' autograd kernel (read once, at import)
AUTOGRAD_ENV = "DEPTHREWRITE_AUTOGRAD"
#: its values: "flat" (the default: this module's) or "custom_op" (``register_autograd``'s)
AUTOGRAD_CHOICES = ("flat", "custom_op")

#: the library holding the kernels registered here (kept: dropping it unregisters them)
_library: torch.library.Library | None = None


def autograd_choice() -> str:
    return environment_choice(AUTOGRAD_ENV, AUTOGRAD_CHOICES, "depthrewrite.ops")


def _is_list(schema_type) -> bool:
    return isinstance(schema_type, torch.ListType) or (
        isinstance(schema_type, torch.OptionalType) and isinstance(schema_type.getElementType(), torch.ListType))


def _splice(args, is_list) -> tuple[list, list[int]]:
    """The arguments with each list replaced by its items, and each list's length (-1 for
    None, where a list was optional)."""
    flat, lengths = [], []
    for arg, listed in zip(args, is_list):
        if not listed:
            flat.append(arg)
        elif arg is None:
            lengths.append(-1)
        else:
            flat.extend(arg)
            lengths.append(len(arg))
    return flat, lengths


def _unsplice(flat, is_list, lengths) -> list:
    """:func:`_splice`'s inverse."""
    args, at, lists = [], 0, iter(lengths)
    for listed in is_list:
        if not listed:
            args.append(flat[at])
            at += 1
            continue
        n = next(lists)
        if n < 0:
            args.append(None)
        else:
            args.append(list(flat[at : at + n]))
            at += n
    return args


def _spliced_grads(grads, is_list, lengths) -> list:
    """The gradients ``backward`` returned, one per argument passed (a list, or None, for a
    list argument), spliced as :func:`_splice` spliced the arguments."""
    flat, lists = [], iter(lengths)
    for grad, listed in zip(grads, is_list):
        if not listed:
            flat.append(grad)
            continue
        n = next(lists)
        if n > 0:
            flat.extend([None] * n if grad is None else grad)
    return flat


class _Call:
    """What one call's forward hands its backward besides ``ctx``'s own."""

    __slots__ = ("keyset", "lengths", "passed", "result_lengths")

    def __init__(self, keyset, lengths, passed):
        self.keyset, self.lengths, self.passed, self.result_lengths = keyset, lengths, passed, None


def register_autograd(op_def, backward: Callable, setup_context: Callable) -> None:
    """``op_def.register_autograd(backward, setup_context=setup_context)``, with this
    module's kernel unless ``DEPTHREWRITE_AUTOGRAD=custom_op`` (module docstring)."""
    global _library
    if autograd_choice() == "custom_op":
        op_def.register_autograd(backward, setup_context=setup_context)
        return
    op = op_def._opoverload
    schema = op._schema
    arg_is_list = tuple(_is_list(a.type) for a in schema.arguments)
    result_is_list = tuple(_is_list(r.type) for r in schema.returns)
    defaults = tuple(a.default_value if a.has_default_value() else None for a in schema.arguments)
    below = _C._after_autograd_keyset
    single = len(schema.returns) == 1  # the op returns it as itself, not in a tuple

    def forward(ctx, call, *flat):
        passed = call.passed
        args = _unsplice(flat, arg_is_list[:passed], call.lengths)
        with _C._AutoDispatchBelowAutograd():
            result = op.redispatch(call.keyset & below, *args)
        # setup_context sees every argument, the defaults the dispatcher dropped filled in
        setup_context(ctx, tuple(args) + defaults[passed:], result)
        flat_result, call.result_lengths = _splice((result,) if single else result, result_is_list)
        ctx.call = call
        return tuple(flat_result)

    def backward_flat(ctx, *flat_grads):
        call = ctx.call
        needs = ctx.needs_input_grad
        grads_in = _unsplice(flat_grads, result_is_list, call.result_lengths)
        try:
            ctx.needs_input_grad = tuple(_unsplice(needs[1:], arg_is_list[: call.passed], call.lengths))
            grads = backward(ctx, *grads_in)
        finally:
            ctx.needs_input_grad = needs
        return (None, *_spliced_grads(grads, arg_is_list, call.lengths))

    # made with type(): the name is given at creation, and grad_fn's (``...Backward``) with it
    Function = type(f"FlatBackwardFor_{op._namespace}_{op._opname}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_flat)})

    def autograd_kernel(keyset, *args):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            flat, lengths = _splice(args, arg_is_list)
            call = _Call(keyset, lengths, len(args))
            flat_result = Function.apply(call, *flat)
            result = _unsplice(flat_result, result_is_list, call.result_lengths)
            return result[0] if single else tuple(result)
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below, *args)

    if _library is None:
        _library = torch.library.Library(op._namespace, "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        # the dispatcher's own registration: torch 2.11's Library.impl refuses a second Python
        # kernel for a key (2.13's takes allow_override); this is the call it makes after its checks
        _library.m.impl(op._opname, "Autograd", autograd_kernel, True)
