"""The backward kernels' last reduction step (:mod:`depthrewrite.kernels.param_grads`): the
sums over rows of partial sums and the two parameter products, in one launch, against
float64 sums of the same rows, on widths and row counts that are not multiples of the
kernel's tile, with strided rows (the rows a program leaves unwritten are never read), and
every output dtype. Without a GPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

triton = pytest.importorskip("triton")

from depthrewrite.kernels import param_grads  # noqa: E402
from depthrewrite.kernels.param_grads import PartialSums, finish, query_and_weight_grads  # noqa: E402
from tests.kernels.test_route_triton import DEVICE  # noqa: E402


def _rows(rows, width, seed, stride=None):
    """float32 partial sums, ``stride`` elements apart (padding filled with NaN: never read)."""
    stride = stride or width
    gen = torch.Generator().manual_seed(seed)
    part = torch.full((rows, stride), float("nan"))
    part[:, :width] = torch.randn(rows, width, generator=gen)
    return part.to(DEVICE), PartialSums(part.to(DEVICE), rows, stride, width)


def _expected(part, width, *factors):
    total = part[:, :width].double().sum(0)
    return [total * f.double().reshape(-1).cpu() for f in factors] if factors else [total]


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch_ops"])
@pytest.mark.parametrize("rows,width,stride", [(1, 7, None), (65, 130, None), (200, 1000, 1024), (3, 64, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_and_sums_match_float64(rows, width, stride, dtype, fused, monkeypatch):
    """The kernel, and the torch ops that ``FUSED = False`` takes (the e2e ``_tfin`` A/B)."""
    monkeypatch.setattr(param_grads, "FUSED", fused)
    part, sums = _rows(rows, width, seed=rows + width, stride=stride)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(width, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype).to(DEVICE)
    part_m, sums_m = _rows(rows, 2, seed=2)
    part_n, sums_n = _rows(rows, 33, seed=3)
    mix = torch.empty(2, dtype=dtype, device=DEVICE)
    norm = torch.empty(33, dtype=torch.float32, device=DEVICE)
    got = finish(sums, query, weight, (sums_m, mix), (sums_n, norm))
    part = part.cpu()
    expected = [*_expected(part, width, weight, query), *_expected(part_m.cpu(), 2), *_expected(part_n.cpu(), 33)]
    likes = (query, weight, mix, norm)
    for out, exp, like in zip(got, expected, likes):
        assert out.dtype == like.dtype and out.shape == like.shape
        # one rounding of a float32 sum: the output dtype's half ulp, plus float32's sum error
        tol = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}[out.dtype]
        assert torch.allclose(out.double().cpu(), exp, rtol=tol, atol=tol * exp.abs().max().item())


@pytest.mark.parametrize("extra", [0, 1])
def test_fewer_extra_sums_and_two_dimensional_parameters(extra):
    part, sums = _rows(9, 2 * 48, seed=4)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 48, generator=gen).to(DEVICE)
    weight = torch.randn(2, 48, generator=gen).to(DEVICE)
    part_n, sums_n = _rows(9, 48, seed=6)
    extras = [(sums_n, torch.empty(48, device=DEVICE))][:extra]
    got = finish(sums, query, weight, *extras)
    assert len(got) == 2 + extra and got[0].shape == (2, 48)
    exp_q, exp_w = _expected(part.cpu(), 96, weight, query)
    assert torch.allclose(got[0].double().cpu().reshape(-1), exp_q, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[1].double().cpu().reshape(-1), exp_w, rtol=1e-5, atol=1e-5)
    if extra:
        assert torch.allclose(got[2].double().cpu(), _expected(part_n.cpu(), 48)[0], rtol=1e-5, atol=1e-5)


def test_deterministic_and_agrees_with_the_torch_path(monkeypatch):
    """The kernel gives the same bits twice, and it and the torch ops (float32 sums in
    other orders) are both within float32's error bound of the float64 products: a sum of n
    terms in any order is off by at most (n - 1) unit roundoffs of the sum of the terms'
    magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 4.2), then the
    product rounds once. A fixed tolerance failed on the GPU (session 48) where a column's
    terms cancel, with inputs that had not been seeded."""
    rows, width = 300, 200
    part, sums = _rows(rows, width, seed=7)
    gen = torch.Generator().manual_seed(8)
    query = torch.randn(width, generator=gen).to(DEVICE)
    weight = torch.randn(width, generator=gen).to(DEVICE)
    first = finish(sums, query, weight)
    again = finish(sums, query, weight)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    monkeypatch.setattr(param_grads, "FUSED", False)
    torch_path = finish(sums, query, weight)
    unit = torch.finfo(torch.float32).eps / 2
    magnitude = part.cpu()[:, :width].double().abs().sum(0)
    # output 0: the sums times the key-norm weight; output 1: times the query
    for out, (factor, exact) in enumerate(zip((weight, query), _expected(part.cpu(), width, weight, query))):
        bound = (rows - 1) * unit * magnitude * factor.double().cpu().abs() + unit * exact.abs()
        for path in (first, torch_path):
            assert ((path[out].double().cpu() - exact).abs() <= bound).all(), out


def test_mismatched_width_is_refused():
    _, sums = _rows(4, 10, seed=8)
    with pytest.raises(ValueError, match="width 10 for a gradient of 12 entries"):
        finish(sums, torch.zeros(12, device=DEVICE), torch.zeros(12, device=DEVICE))
    with pytest.raises(ValueError, match="at most 2 extra sums"):
        extra = (sums, torch.zeros(10, device=DEVICE))
        finish(sums, torch.zeros(10, device=DEVICE), torch.zeros(10, device=DEVICE), extra, extra, extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_form_matches_float64(dtype):
    """``route``'s backward finishes with torch ops (``query_and_weight_grads``): the same two
    products, from strided rows, in the parameters' dtypes and shapes."""
    part, sums = _rows(37, 2 * 50, seed=9, stride=128)
    gen = torch.Generator().manual_seed(10)
    query = torch.randn(2, 50, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.rand(2, 50, generator=gen) + 0.5).to(dtype).to(DEVICE)
    grad_query, grad_weight = query_and_weight_grads(sums, query, weight)
    exp_q, exp_w = _expected(part.cpu(), 100, weight, query)
    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-3}[dtype]
    for out, exp, like in ((grad_query, exp_q, query), (grad_weight, exp_w, weight)):
        assert out.dtype == like.dtype and out.shape == like.shape
        assert torch.allclose(out.double().cpu().reshape(-1), exp, rtol=tol, atol=tol * exp.abs().max().item())
    with pytest.raises(ValueError, match="width 100 for a gradient of 12 entries"):
        query_and_weight_grads(sums, torch.zeros(12, device=DEVICE), torch.zeros(12, device=DEVICE))
