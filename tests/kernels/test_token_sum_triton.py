"""The Triton kernel of ``depthrewrite::token_weighted_sum`` (the merges' logit backward's
sum over the tokens, depthrewrite/kernels/token_sum_triton.py) against float64 on awkward
shapes, in every dtype it reads; its determinism, its checks, and its registration as the
op's CUDA kernel. Without a GPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

triton = pytest.importorskip("triton")

from depthrewrite.kernels import token_sum_triton as ts  # noqa: E402
from depthrewrite.ops import source_logit as sl  # noqa: E402
from tests.kernels.test_route_triton import DEVICE  # noqa: E402


def _inputs(batch, d, heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    stored = (torch.randn(*batch, d, generator=g) * 2 + 0.5).to(dtype)
    weights = torch.randn(*batch, heads, generator=g)
    return weights.to(DEVICE), stored.to(DEVICE)


def _float64_sum(weights, stored, heads):
    d = stored.shape[-1]
    w = weights.double().cpu().reshape(-1, heads).repeat_interleave(d // heads, dim=1)
    return (w * stored.double().cpu().reshape(-1, d)).sum(0)


def _bound(weights, stored, heads):
    """The float32 sums' rounding: at most T + log2(runs) unit roundoffs of the sum of the
    terms' sizes (the products are exact: a float32 weight times a value of at most 24
    significant bits is rounded once)."""
    tokens = stored.numel() // stored.shape[-1]
    return (tokens + 2) * 2.0 ** -24 * _float64_sum(weights.abs(), stored.abs(), heads)


CASES = [
    # batch, d, heads: tokens not a multiple of the kernel's 32 rows, widths not of its 256
    # columns (1000, 7186 = 2 x 3593), one token, 16 heads of 64 (block MHAR's)
    ((3, 37), 48, 1),
    ((2, 75), 1000, 1),
    ((1,), 7186, 2),
    ((5, 33), 1024, 16),
    ((129,), 96, 4),
    # heads of 96 columns: blocks of 32, three to a head
    ((2, 41), 384, 4),
]

#: the paths a case can take: as the launcher picks them, and with every program gathering
#: a weight per column (no head width gives the broadcast path a block this wide)
PATHS = {"picked": ts.MIN_ONE_HEAD_BLOCK_D, "gathered": 1 << 30}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("programs_per_sm", [ts.PROGRAMS_PER_SM, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,d,heads", CASES)
def test_matches_float64(batch, d, heads, dtype, programs_per_sm, path, monkeypatch):
    """Within the float32 sums' rounding of the exact sum; 64 programs an SM gives runs of one
    tile, so the larger cases have several runs and a last one cut short."""
    monkeypatch.setattr(ts, "PROGRAMS_PER_SM", programs_per_sm)
    monkeypatch.setattr(ts, "MIN_ONE_HEAD_BLOCK_D", PATHS[path])
    weights, stored = _inputs(batch, d, heads, dtype)
    got = ts.token_weighted_sum_triton(weights, stored, heads)
    assert got.dtype == torch.float32 and got.shape == (d,) and got.device == stored.device
    assert ((got.double().cpu() - _float64_sum(weights, stored, heads)).abs()
            <= _bound(weights, stored, heads)).all()


@pytest.mark.parametrize("d,heads,block", [(96, 4, (256, False)), (384, 4, (32, True)), (1024, 16, (64, True)),
                                           (1024, 2, (256, True))])
def test_each_column_takes_its_heads_weights(d, heads, block):
    """A weight of one head reaches that head's columns only (a wrong head index shows here
    where random weights could hide it in the sums' rounding), on both paths: a weight per
    column, and one a row for blocks within a head (three blocks a head, one, and one of two
    halves); the weighted head is the last."""
    assert ts.column_blocks(d, heads) == block
    stored = torch.ones(7, d, device=DEVICE)
    weights = torch.zeros(7, heads, device=DEVICE)
    weights[:, -1] = 1.0
    got = ts.token_weighted_sum_triton(weights, stored, heads).cpu()
    expected = torch.zeros(d)
    expected[d - d // heads:] = 7.0
    assert torch.equal(got, expected)


@pytest.mark.parametrize("width,heads,block", [
    (1024, 1, (256, True)), (48, 1, (256, True)), (7186, 1, (256, True)),  # one head: any block lies in it
    (1024, 16, (64, True)), (2048, 4, (256, True)), (384, 4, (32, True)),  # the largest power of two, capped
    (7186, 2, (256, False)), (96, 4, (256, False)), (256, 16, (256, False)),  # under 32: a weight per column
])
def test_column_blocks(width, heads, block):
    assert ts.column_blocks(width, heads) == block


def test_is_deterministic_and_matches_the_product_form():
    weights, stored = _inputs((4, 61), 1000, 1, torch.bfloat16, seed=3)
    first = ts.token_weighted_sum_triton(weights, stored, 1)
    assert torch.equal(first, ts.token_weighted_sum_triton(weights, stored, 1))
    product = sl.token_weighted_sum_product(weights, stored, 1)
    bound = _bound(weights, stored, 1)
    assert ((first.double().cpu() - product.double().cpu()).abs() <= 2 * bound).all()


def test_no_tokens_gives_zeros():
    weights, stored = _inputs((0,), 64, 2, torch.bfloat16)
    assert torch.equal(ts.token_weighted_sum_triton(weights, stored, 2).cpu(), torch.zeros(64))


@pytest.mark.parametrize("change,message", [
    (lambda w, s: (w.double(), s), "`weights` must be float32"),
    (lambda w, s: (w, s.to(torch.int32)), "`stored` must be one of"),
    (lambda w, s: (w[:, :1], s), r"`weights` must have shape \(5, 2\)"),
])
def test_bad_inputs_are_named(change, message):
    weights, stored = _inputs((5,), 64, 2, torch.bfloat16)
    weights, stored = change(weights, stored)
    with pytest.raises(ValueError, match=message):
        ts.token_weighted_sum_triton(weights, stored, 2)


def test_heads_must_divide_the_width():
    weights, stored = _inputs((5,), 64, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="`heads` must be a positive int dividing the width 64; found 3"):
        ts.token_weighted_sum_triton(weights, stored, 3)


def test_registered_as_the_ops_cuda_kernel():
    from depthrewrite.kernels import CUDA_KERNELS

    assert "token_weighted_sum" in CUDA_KERNELS
    if torch.cuda.is_available():  # the op on CUDA is the kernel: the same bits
        weights, stored = _inputs((4, 61), 1000, 1, torch.bfloat16, seed=3)
        assert torch.equal(torch.ops.depthrewrite.token_weighted_sum(weights, stored, 1),
                           ts.token_weighted_sum_triton(weights, stored, 1))
