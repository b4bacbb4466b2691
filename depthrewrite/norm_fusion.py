"""The branch's RMSNorm fused into the merge that makes its input (backend option
``fuse_output_norms``, on by default; it acts only where the second phase runs through
``depthrewrite::route_merge``: ``two_phase.FUSED_MERGE``).

In a PreNorm block the routed input ``x`` of a site is read by the branch's norm and by
nothing else once the old residual adds are dead. Where a ``route_merge`` call's result is
read only by an RMSNorm, the pass replaces the pair by one ``route_merge`` that takes the
norm's weight and eps and returns the normed row: ``x`` is never written, and the
backward makes it again on chip (docs/design.md "The branch norm in the merge"; at 350M
that is what brings Block AttnRes's floor inside its goal's budget, docs/benchmarks.md
session 20).

Recognised norms, as Dynamo records them (the casts may be absent in a float32 model):

- ``torch.nn.functional.rms_norm(x, (d,), weight, eps)`` (``torch.nn.RMSNorm``);
- ``xf = x.float()`` or ``x.to(torch.float32)``, ``xf * rsqrt(xf.pow(2).mean(-1,
  keepdim=True) + eps)``, cast back to ``x``'s dtype (``type_as(x)`` / ``.to(dtype)``), times
  the weight (the bundled GPT's, Llama's and most Hugging Face RMSNorms).

Anything else (a ``1 + weight`` scale, a bias, an intermediate read elsewhere) is left
alone. The fused result is the norm of ``x`` in float32 before rounding, times the weight,
rounded once to the activation dtype, where the model's norm reads ``x`` rounded and
rounds its normalized row before the weight: the two differ by those roundings (none in
float32). A norm whose result has another dtype (a float32 weight times a bfloat16 row,
under autocast) gets the fused row cast to it.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

__all__ = ["fuse_output_norms"]

log = logging.getLogger(__name__)

_MUL = (operator.mul, torch.mul, "mul")
_ADD = (operator.add, torch.add, "add")
_RMS_NORM = (torch.nn.functional.rms_norm, torch.rms_norm)


def _is(node: object, targets: tuple) -> bool:
    """A call of one of ``targets`` (functions, or method names as strings)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and node.target in targets


def _value(node: object):
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def _only_users(node: fx.Node, allowed: set) -> bool:
    return set(node.users) <= allowed


def _is_merge(node: fx.Node) -> bool:
    merge = torch.ops.depthrewrite.route_merge  # registered by depthrewrite.ops, which the backend imports
    return node.op == "call_function" and node.target in (merge, merge.default)


def _float_cast(node: fx.Node, x: fx.Node) -> bool:
    """``x.float()`` or ``x.to(torch.float32)``."""
    if node.op != "call_method" or node.args[:1] != (x,):
        return False
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    if node.target == "to":
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return dtype is torch.float32 and len(node.args) <= 2
    return False


def _cast_back(node: fx.Node, value: fx.Node, x: fx.Node) -> bool:
    """``value.type_as(x)`` or ``value.to(x's dtype)``."""
    if node.op != "call_method" or node.args[:1] != (value,):
        return False
    if node.target == "type_as":
        return node.args[1:] == (x,)
    if node.target == "to":
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return len(node.args) <= 2 and dtype is getattr(_value(x), "dtype", None)
    return False


def _other(node: fx.Node, one: fx.Node):
    """The other operand of a binary call that reads ``one``."""
    a, b = (list(node.args) + [None, None])[:2]
    return b if a is one else a if b is one else None


def _functional_norm(x: fx.Node, d: int):
    """``(end, weight, eps, pattern nodes)`` for ``F.rms_norm(x, (d,), weight, eps)``, or None."""
    (user,) = x.users
    if not _is(user, _RMS_NORM) or user.args[:1] != (x,):
        return None
    args = list(user.args) + [None] * (4 - len(user.args))
    shape = user.kwargs.get("normalized_shape", args[1])
    weight = user.kwargs.get("weight", args[2])
    eps = user.kwargs.get("eps", args[3])
    if tuple(shape if isinstance(shape, (list, tuple)) else (shape,)) != (d,) or not isinstance(eps, float):
        return None
    return user, weight, eps, {user}


def _manual_norm(x: fx.Node):
    """``(end, weight, eps, pattern nodes)`` for the written-out RMSNorm of the module
    docstring, or None."""
    casts = [u for u in x.users if _float_cast(u, x)]
    xf = casts[0] if len(casts) == 1 else x
    square = [u for u in xf.users if _is(u, ("pow", torch.pow, operator.pow)) and u.args[1:] == (2,)]
    if len(square) != 1 or len(square[0].users) != 1:
        return None
    mean = next(iter(square[0].users))
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    last = len(_value(x).shape) - 1
    if not _is(mean, ("mean", torch.mean)) or dims not in (-1, last, (-1,), (last,), [-1], [last]) \
            or mean.kwargs.get("keepdim") is not True or len(mean.users) != 1:
        return None
    add = next(iter(mean.users))
    eps = _other(add, mean) if _is(add, _ADD) and not add.kwargs else None
    if not isinstance(eps, float) or len(add.users) != 1:
        return None
    rsqrt = next(iter(add.users))
    if not _is(rsqrt, ("rsqrt", torch.rsqrt)) or len(rsqrt.users) != 1:
        return None
    normed = next(iter(rsqrt.users))
    if not _is(normed, _MUL) or _other(normed, rsqrt) is not xf or len(normed.users) != 1:
        return None
    nodes = {square[0], mean, add, rsqrt, normed} | ({xf} if xf is not x else set())
    cast = next(iter(normed.users))
    if _cast_back(cast, normed, x):
        nodes.add(cast)
    else:
        cast = normed
    if len(cast.users) != 1:
        return None
    end = next(iter(cast.users))
    if not _is(end, _MUL):
        return None
    nodes.add(end)
    if not _only_users(xf, nodes) or not _only_users(x, nodes):
        return None
    return end, _other(end, cast), eps, nodes


def _norm_of(x: fx.Node):
    """The RMSNorm reading the merge result ``x`` and nothing else: ``(end, weight, eps,
    pattern nodes)``, or None."""
    value = _value(x)
    if not isinstance(value, torch.Tensor) or not x.users:
        return None
    d = value.shape[-1]
    found = _functional_norm(x, d) if len(x.users) == 1 else None
    found = found or _manual_norm(x)
    if found is None:
        return None
    end, weight, eps, nodes = found
    weight_value, end_value = _value(weight), _value(end)
    if not isinstance(weight, fx.Node) or not isinstance(weight_value, torch.Tensor) \
            or tuple(weight_value.shape) != (d,) or not isinstance(end_value, torch.Tensor) \
            or not end_value.is_floating_point() or tuple(end_value.shape) != tuple(value.shape):
        return None
    return end, weight, eps, nodes


def _drop_dead_users(graph: fx.Graph, node: fx.Node) -> None:
    """Erase the pure calls that read ``node`` and whose result nobody reads: the old
    residual adds ``x + u`` of a routed scheme, which Dynamo hands over undeleted."""
    for user in list(node.users):
        if user.op in ("call_function", "call_method") and not user.users and not user.is_impure():
            graph.erase_node(user)


def fuse_output_norms(graph: fx.Graph) -> int:
    """Fuse every RMSNorm that alone reads a ``route_merge`` result into that call (module
    docstring); returns how many were fused. The new call carries no recomputation tag: its
    normed result is what the branch's first matmul keeps for its backward anyway."""
    fused = 0
    for merge in [n for n in graph.nodes if _is_merge(n)]:
        args = list(merge.args) + [None] * (11 - len(merge.args))
        if merge.kwargs or args[9] is not None:
            continue
        _drop_dead_users(graph, merge)
        found = _norm_of(merge)
        if found is None:
            continue
        end, weight, eps, nodes = found
        with graph.inserting_after(end):
            new = graph.call_function(merge.target, tuple(args[:9]) + (weight, float(eps)))
        result = new
        if _value(end).dtype != _value(merge).dtype:  # a float32 weight times the row (autocast)
            with graph.inserting_after(new):
                result = graph.call_method("to", (new, _value(end).dtype))
        new.meta = {k: v for k, v in merge.meta.items() if k != "custom"}
        result.meta.setdefault("example_value", _value(end))
        end.replace_all_uses_with(result)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted(nodes | {merge}, key=order.__getitem__, reverse=True):
            graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        log.info("depthrewrite backend: %d branch norms fused into route_merge", fused)
    return fused
