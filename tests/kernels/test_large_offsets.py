"""Sources of more than 2**31 elements: the kernels' 64-bit offsets (GPU only).

A token's row starts at ``token * d``, past 2**31 for the last tokens here; an offset
formed in 32 bits would wrap and read or write another token's row (or fault). Every
routing op is per token in its output and its source gradients, so the last rows of a
call on the whole sources must equal the same call on those rows alone, whose offsets
are small. The tolerance is a few bf16 roundings (the two launches may split the tokens
among their programs differently); a wrapped offset gives errors of the data's own size.

Each op holds about 30 GiB on the GPU at once; without a GPU the module is skipped (the
interpreter on CPU tensors would take hours at this size)."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels import implementation_for
from depthrewrite.ops import route, route_many, route_merge

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with 40 GiB free")

D = 1024
TOKENS = 2**31 // D + 3  # the last three rows start at or past element 2**31
TAIL = 5
DTYPE = torch.bfloat16


def _rnd(*shape, dtype=DTYPE):
    return torch.randn(*shape, device="cuda").to(dtype)


def _tail(tensors):
    return [t[-TAIL:].detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _assert_tail_close(big, small, what):
    got, want = big[-TAIL:].float(), small.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


def _sources(n):
    return [_rnd(TOKENS, D).requires_grad_() for _ in range(n)]


def test_the_fused_kernels_run_here():
    assert implementation_for("cuda", DTYPE) == "triton"


def test_route_past_two_to_the_31():
    values = _sources(2)
    query, weight = _rnd(D, dtype=torch.float32), _rnd(D, dtype=torch.float32).abs() + 0.5
    small_values = _tail(values)
    out = route(values, query=query, key_norm_weight=weight)
    small = route(small_values, query=query, key_norm_weight=weight)
    _assert_tail_close(out, small, "route output")
    grad = _rnd(TOKENS, D)
    grads = torch.autograd.grad(out, values, grad)
    del out
    small_grads = torch.autograd.grad(small, small_values, grad[-TAIL:])
    for i, (g, s) in enumerate(zip(grads, small_grads)):
        _assert_tail_close(g, s, f"route gradient of source {i}")


def test_route_many_past_two_to_the_31():
    values = _sources(2)
    queries, weights = _rnd(2, D, dtype=torch.float32), _rnd(2, D, dtype=torch.float32).abs() + 0.5
    small_values = _tail(values)
    outs, _lses = route_many(values, queries=queries, key_norm_weights=weights)
    small_outs, _ = route_many(small_values, queries=queries, key_norm_weights=weights)
    for s, (o, so) in enumerate(zip(outs, small_outs)):
        _assert_tail_close(o, so, f"route_many output {s}")
    grads_out = [_rnd(TOKENS, D) for _ in outs]
    grads = torch.autograd.grad(outs, values, grads_out)
    del outs
    small_grads = torch.autograd.grad(small_outs, small_values, [g[-TAIL:] for g in grads_out])
    for i, (g, s) in enumerate(zip(grads, small_grads)):
        _assert_tail_close(g, s, f"route_many gradient of source {i}")


def test_route_merge_past_two_to_the_31():
    with torch.no_grad():
        outs, values = [_rnd(TOKENS, D)], [_rnd(TOKENS, D)]
        lses = [torch.randn(TOKENS, 1, device="cuda")]
    leaves = [*outs, *values]
    for t in leaves:
        t.requires_grad_()
    queries, weights = _rnd(1, D, dtype=torch.float32), _rnd(1, D, dtype=torch.float32).abs() + 0.5
    mix = torch.ones(1, device="cuda")
    small_leaves = _tail(leaves)
    x = route_merge(outs, lses, values, queries=queries, key_norm_weights=weights, mix=mix)
    small = route_merge(small_leaves[:1], [lses[0][-TAIL:]], small_leaves[1:], queries=queries,
                        key_norm_weights=weights, mix=mix)
    _assert_tail_close(x, small, "route_merge output")
    grad = _rnd(TOKENS, D)
    grads = torch.autograd.grad(x, leaves, grad)
    del x
    small_grads = torch.autograd.grad(small, small_leaves, grad[-TAIL:])
    for name, g, s in zip(("outs[0]", "values[0]"), grads, small_grads):
        _assert_tail_close(g, s, f"route_merge gradient of {name}")
