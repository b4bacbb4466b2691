"""Per-head sums and spreads over whole rows (depthrewrite/ops/head_sums.py) and the merges
that use them for more than one head: the same numbers as a view per head, results and
every gradient. Whether Inductor fuses them: tests/compile/test_head_sums_fusion.py."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.ops import head_sums, merge_partial, merge_routes, route_many
from depthrewrite.ops import source_logit as sl


def _randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("heads, d", [(1, 8), (2, 6), (4, 16), (16, 64)])
def test_head_sums_are_the_sums_over_each_heads_columns(heads, d):
    x = _randn(3, 5, d, seed=1)
    sums = head_sums.head_sums(x, heads)
    assert len(sums) == heads and all(s.shape == (3, 5, 1) for s in sums)
    expected = x.unflatten(-1, (heads, -1)).sum(-1)
    torch.testing.assert_close(torch.cat(sums, -1), expected, rtol=1e-14, atol=1e-14)


def test_an_infinity_stays_in_its_head():
    """The other heads' columns are selected away, not multiplied by 0 (inf * 0 is NaN)."""
    x = _randn(2, 12, seed=2)
    x[0, 1] = float("inf")
    sums = torch.cat(head_sums.head_sums(x, 3), -1)
    assert sums[0, 0] == float("inf") and torch.isfinite(sums[0, 1:]).all() and torch.isfinite(sums[1]).all()


@pytest.mark.parametrize("heads, d", [(1, 8), (3, 12), (16, 64)])
def test_spread_heads_puts_each_value_on_its_heads_columns_exactly(heads, d):
    values = [_randn(4, 1, seed=10 + h) for h in range(heads)]
    values[0][0, 0] = float("inf")
    spread = head_sums.spread_heads(values, d)
    expected = torch.cat(values, -1).repeat_interleave(d // heads, dim=-1)
    assert torch.equal(spread, expected)


def test_spread_heads_gradient_is_each_heads_column_sum():
    values = [_randn(4, 1, seed=20 + h).requires_grad_() for h in range(4)]
    grad = _randn(4, 16, seed=30)
    got = torch.autograd.grad(head_sums.spread_heads(values, 16), values, grad)
    torch.testing.assert_close(torch.cat(got, -1), grad.unflatten(-1, (4, 4)).sum(-1), rtol=1e-14, atol=1e-14)


def _both_forms(fn, monkeypatch):
    """``fn()``'s tensors with the per-head sums over whole rows and as views."""
    results = []
    for masked in (True, False):
        monkeypatch.setattr(head_sums, "MASKED_HEAD_SUMS", masked)
        results.append(fn())
    return results


def _merge_partial_case(dtype, with_key, heads=4, d=16, batch=(3, 5)):
    """merge_partial over a route_many result and a partial (its key with ``with_key``):
    the result and the gradient of every input."""
    values = [_randn(*batch, d, seed=40 + k, dtype=dtype).requires_grad_() for k in range(3)]
    queries = (_randn(2, d, seed=50, dtype=dtype) * 0.5).requires_grad_()
    weights = (1 + 0.1 * _randn(2, d, seed=51, dtype=dtype)).requires_grad_()
    partial = _randn(*batch, d, seed=52, dtype=dtype).requires_grad_()
    key = _randn(*batch, d, seed=53, dtype=dtype).requires_grad_() if with_key else None
    out, lse = route_many(values, queries=queries, key_norm_weights=weights, heads=heads)
    merged = [merge_partial(out[s], lse[s], partial, query=queries[s], key_norm_weight=weights[s], heads=heads,
                            partial_key=key) for s in range(2)]
    leaves = values + [queries, weights, partial] + ([key] if with_key else [])
    grads = torch.autograd.grad(merged, leaves, [_randn(*batch, d, seed=54 + s, dtype=dtype) for s in range(2)])
    return list(merged) + list(grads)


@pytest.mark.parametrize("with_key", [False, True], ids=["partial", "partial_key"])
def test_merge_partial_by_heads_is_the_view_form_float64(with_key, monkeypatch):
    by_rows, by_views = _both_forms(lambda: _merge_partial_case(torch.float64, with_key), monkeypatch)
    for got, expected in zip(by_rows, by_views):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_merge_partial_by_heads_takes_the_product_in_bf16(monkeypatch):
    """With bf16 activations both forms take the matrix-product backward, and their results
    and gradients agree to float32 rounding (one bf16 rounding for bf16 results)."""
    calls = []
    apply = sl._SourceLogit.apply
    monkeypatch.setattr(sl._SourceLogit, "apply", lambda *args: calls.append(args[-1]) or apply(*args))

    def case():
        gen = torch.Generator().manual_seed(60)
        batch, d, heads = (3, 7), 32, 4
        out, partial = (torch.randn(*batch, d, generator=gen).bfloat16().requires_grad_() for _ in range(2))
        lse = torch.randn(*batch, heads, generator=gen).requires_grad_()
        query, weight = (torch.randn(d, generator=gen) * 0.3).requires_grad_(), torch.ones(d).requires_grad_()
        merged = merge_partial(out, lse, partial, query=query, key_norm_weight=weight, heads=heads)
        grad = torch.randn(*batch, d, generator=gen).bfloat16()
        return [merged, *torch.autograd.grad(merged, [out, lse, partial, query, weight], grad)]

    by_rows, by_views = _both_forms(case, monkeypatch)
    assert calls == [True, False]  # by_heads, then the view form's single tensor
    for got, expected in zip(by_rows, by_views):
        tol = 2.0 ** -7 if got.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


def test_merge_routes_by_heads_is_the_view_form_float64(monkeypatch):
    """Two groups (one biased) and two sources (one biased and scaled per token), 4 heads."""
    def case():
        batch, d, heads = (2, 5), 16, 4
        values = [_randn(*batch, d, seed=70 + k).requires_grad_() for k in range(5)]
        query = (_randn(d, seed=80) * 0.5).requires_grad_()
        weight = (1 + 0.1 * _randn(d, seed=81)).requires_grad_()
        bias = [torch.tensor(-0.7, dtype=torch.float64, requires_grad=True),
                torch.tensor(0.4, dtype=torch.float64, requires_grad=True)]
        scale = 0.5 + torch.rand(*batch, generator=torch.Generator().manual_seed(82), dtype=torch.float64)
        groups = [route_many(values[:2], queries=query[None], key_norm_weights=weight[None], heads=heads),
                  route_many(values[2:3], queries=query[None], key_norm_weights=weight[None], heads=heads)]
        merged = merge_routes([(groups[0][0][0], groups[0][1][0], None), (groups[1][0][0], groups[1][1][0], bias[0])],
                              [(values[3], None, None), (values[4], bias[1], scale)],
                              query=query, key_norm_weight=weight, heads=heads)
        leaves = values + [query, weight] + bias
        return [merged, *torch.autograd.grad(merged, leaves, _randn(*batch, d, seed=83))]

    by_rows, by_views = _both_forms(case, monkeypatch)
    for got, expected in zip(by_rows, by_views):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
