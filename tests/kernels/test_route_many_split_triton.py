"""The split backward of ``route_many`` (``backward="split"``: a stats kernel, then a
gradient kernel) against float64: every gradient (sources, keys, queries, key-norm weights)
on awkward shapes, in fp32, bf16 and fp16, with its launch variants; its limits refused
with clear errors. It forms ``sum_j a_j <v_j, g>`` from the sources, so its gradients are
compared with the exact float64 ones (not the saved-output oracle of the one-pass kernels)
in every dtype. Without a GPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

triton = pytest.importorskip("triton")

from depthrewrite.kernels import route_many_split_triton, route_many_triton  # noqa: E402
from tests.kernels.test_route_many_triton import DEVICE, TOL, _make, _oracle_f64, _rel, _run  # noqa: E402

SPLIT = {"backward": "split"}

#: n sources, s queries, batch (odd token counts), d (not powers of two: 100, 1000, 7186)
SHAPES = [
    (1, 1, (3,), 24),
    (2, 3, (2, 3), 40),
    (9, 6, (5,), 100),  # Block AttnRes's phase 1 at its last block
    (32, 2, (3,), 48),  # SPLIT_MAX_SOURCES
    (5, 16, (3,), 64),  # SPLIT_MAX_QUERIES
    (3, 8, (7,), 1000),
    (2, 3, (1,), 7186),
]


def _check_against_float64(inp, n, dtype, config, seed):
    """The split backward's gradients against the exact float64 ones: activation gradients
    at the returned dtype's tolerance, the fp32 parameter gradients at fp32's."""
    _, _, grads, grad_out, grad_lse = _run(inp, dtype, seed, config=config, fwd_config={})
    _, _, exact = _oracle_f64(inp, grad_out, grad_lse)
    assert len(grads) == len(exact)
    for k, (got, want) in enumerate(zip(grads, exact)):
        limit = 2e-5 if dtype == torch.float32 or k in (n, n + 1) else TOL[dtype]
        assert got.dtype == (torch.float32 if k in (n, n + 1) else dtype)
        assert _rel(got, want) < limit, (k, _rel(got, want))
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("keys", [False, True])
@pytest.mark.parametrize("n,s,batch,d", SHAPES)
def test_split_backward_matches_float64(n, s, batch, d, keys, dtype):
    inp = _make(n, s, batch, d, 1, dtype, n * 100 + s, keys)
    _check_against_float64(inp, n, dtype, SPLIT, n * 100 + s)


VARIANTS = [
    {"split_t": 1},  # one token per stats program
    {"split_t": 4, "num_warps": 2},
    {"stages": 3},  # the gradient kernel's sources through Triton's software pipeline
    {"split_per_sm": 1},  # few gradient programs: each sums many tiles of tokens
    {"split_grads": "dot"},  # the gradient kernel's key and parameter terms through tl.dot
    {"split_grads": "dot", "split_per_sm": 1},
    {"split_stats": "per_source", "split_t": 2},  # the stats kernel one source at a time
    {"split_stats": "per_source", "split_t": 8, "split_grads": "dot", "split_grads_t": 32, "split_grads_c": 32},
]


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: "-".join(f"{k}_{v}" for k, v in c.items()))
@pytest.mark.parametrize("n,keys", [(9, False), (3, True), (1, False)])
def test_split_launch_variants_match_float64(n, keys, config):
    inp = _make(n, 6, (13,), 100, 1, torch.bfloat16, 5, keys)
    _check_against_float64(inp, n, torch.bfloat16, {**SPLIT, **config}, 5)


def test_split_backward_is_deterministic_and_its_loads_change_no_bit():
    """Fixed summation orders and no atomics: the same bits run after run, and with the
    gradient kernel's sources pipelined (loads move, not sums)."""
    inp = _make(9, 6, (37,), 64, 1, torch.bfloat16, 3, True)
    runs = [_run(inp, torch.bfloat16, 3, config={**SPLIT, **extra}, fwd_config={})[2]
            for extra in ({}, {}, {"stages": 3})]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_split_is_taken_by_default_only_where_switched_on_and_supported(monkeypatch):
    """``SPLIT_BACKWARD`` sends the calls the split kernel takes to it, and only those."""
    monkeypatch.setattr(route_many_triton, "SPLIT_BACKWARD", True)
    cfg = {"backward": None}
    assert route_many_triton._backward_kernel(1, cfg, False, 9, 6) == "split"
    assert route_many_triton._backward_kernel(1, cfg, True, 9, 6) == "split"
    assert route_many_triton._backward_kernel(16, cfg, False, 9, 6) == "tiled"
    assert route_many_triton._backward_kernel(1, cfg, False, 33, 6) == "per_token"
    monkeypatch.setattr(route_many_triton, "SPLIT_BACKWARD", False)
    assert route_many_triton._backward_kernel(1, cfg, False, 9, 6) == "per_token"


@pytest.mark.parametrize("n,s,heads,message", [
    (3, 2, 2, "it takes one head; found heads=2"),
    (route_many_split_triton.SPLIT_MAX_SOURCES + 1, 2, 1, "it takes at most 32 sources; found 33"),
    (2, route_many_split_triton.SPLIT_MAX_QUERIES + 1, 1, "it takes at most 16 queries; found 17"),
])
def test_split_refuses_calls_it_does_not_take(n, s, heads, message):
    inp = _make(n, s, (3,), 16 * heads, heads, torch.float32, 1)
    with pytest.raises(ValueError, match=r"route_many \(Triton\): config backward='split' does not take this call: "
                                         + message):
        _run(inp, torch.float32, 1, config=SPLIT, fwd_config={})


@pytest.mark.parametrize("entry,value,message", [
    ("split_t", 3, "config split_t must be a power of two; found 3"),
    ("split_t", True, "config split_t must be a power of two; found True"),
    ("split_per_sm", 0, "config split_per_sm must be a positive int; found 0"),
    ("split_grads", "mma", "config split_grads must be one of ('sum', 'dot'); found 'mma'"),
    ("split_stats", "all", "config split_stats must be one of ('select', 'per_source'); found 'all'"),
])
def test_bad_split_launch_config_is_refused(entry, value, message):
    inp = _make(2, 2, (3,), 16, 1, torch.float32, 1)
    with pytest.raises(ValueError, match=r"route_many \(Triton\): " + re.escape(message)):
        _run(inp, torch.float32, 1, config={**SPLIT, entry: value}, fwd_config={})


@pytest.mark.parametrize("keys", [False, True])
def test_split_with_no_tokens_gives_empty_gradients_and_zero_parameter_gradients(keys):
    empty = [torch.randn(0, 16, device=DEVICE) for _ in range(3)]
    key_list = [torch.randn(0, 16, device=DEVICE) for _ in range(3)] if keys else None
    queries, weights = torch.randn(2, 16, device=DEVICE), torch.ones(2, 16, device=DEVICE)
    out, lse = route_many_triton.route_many_forward(empty, queries, weights, 1, 1e-6, keys=key_list)
    grad_v, grad_k, grad_q, grad_w = route_many_triton.route_many_backward(
        [torch.zeros_like(o) for o in out], [torch.zeros_like(t) for t in lse], out, lse, empty, queries, weights,
        1, 1e-6, SPLIT, keys=key_list)
    assert [t.shape for t in grad_v] == [(0, 16)] * 3 and [t.shape for t in grad_k] == [(0, 16)] * (3 if keys else 0)
    assert not grad_q.any() and not grad_w.any() and grad_q.shape == grad_w.shape == (2, 16)
