"""depthrewrite::route_many, route_many_backward, merge_partial and merge_routes against
route, the reference and autograd (the two-phase Block AttnRes computation, docs/spec.md section 3,
and WAV's, section 5)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch

from depthrewrite.ops import merge_partial, merge_routes, route, route_many, route_many_reference
from depthrewrite.ops.route import route_logits_reference

route_many_module = importlib.import_module("depthrewrite.ops.route_many")  # the module (the package exports a function)


@dataclass
class Case:
    n: int  # sources
    s: int  # queries
    batch: tuple[int, ...]
    d: int
    heads: int = 1


@dataclass
class Inputs:
    values: list[torch.Tensor]
    queries: torch.Tensor  # (S, d)
    key_norm_weights: torch.Tensor  # (S, d)
    heads: int

    def kwargs(self) -> dict:
        return dict(queries=self.queries, key_norm_weights=self.key_norm_weights, heads=self.heads)

    def leaves(self) -> list[torch.Tensor]:
        """Every input that should receive a gradient, in a fixed order."""
        return [*self.values, self.queries, self.key_norm_weights]

    def cast(self, act_dtype: torch.dtype, param_dtype: torch.dtype, requires_grad: bool) -> "Inputs":
        def conv(t, dtype):
            return t.detach().to(dtype).requires_grad_(requires_grad)

        return Inputs([conv(v, act_dtype) for v in self.values], conv(self.queries, param_dtype),
                      conv(self.key_norm_weights, param_dtype), self.heads)


def make_inputs(case: Case, dtype=torch.float64, seed=0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return Inputs(
        values=[randn(*case.batch, case.d) for _ in range(case.n)],
        # scaled so that the softmaxes are neither uniform nor one-hot
        queries=0.5 * randn(case.s, case.d),
        key_norm_weights=1.0 + 0.3 * randn(case.s, case.d),
        heads=case.heads,
    )


def random_like(tensors: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in tensors]


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max-norm relative error: max|a - e| <= rel * max|e| (exact when e is all zeros)."""
    assert actual.shape == expected.shape
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * scale, f"max error {err:.3e} > {rel:.1e} * {scale:.3e}"


def assert_all_rel(actual, expected, rel: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        assert_rel(a, e, rel)


# ------------------------------------------------------------------------ opcheck

OPCHECK_CASES = [
    Case(1, 1, (2, 3), 8, heads=1),
    Case(1, 3, (4,), 8, heads=2),
    Case(3, 1, (5,), 8, heads=2),
    Case(2, 3, (), 8, heads=2),
    Case(4, 2, (2, 3), 12, heads=1),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=repr)
def test_opcheck_route_many(case):
    inp = make_inputs(case, torch.float32).cast(torch.float32, torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.depthrewrite.route_many.default,
                          (inp.values, inp.queries, inp.key_norm_weights, case.heads, 1e-6, None))


@pytest.mark.parametrize("case", [OPCHECK_CASES[1], OPCHECK_CASES[3], OPCHECK_CASES[4]], ids=repr)
def test_opcheck_route_many_backward(case):
    inp = make_inputs(case, torch.float32)
    fwd = (inp.values, inp.queries, inp.key_norm_weights, case.heads, 1e-6, None)
    out, lse, stats = torch.ops.depthrewrite.route_many(*fwd)
    grad_out, grad_lse = random_like(out, seed=1), random_like(lse, seed=2)
    torch.library.opcheck(torch.ops.depthrewrite.route_many_backward.default,
                          (grad_out, grad_lse, out, lse, stats, *fwd))


# ------------------------------------------------------------ separate keys (DAR)

KEY_CASES = [Case(1, 2, (3,), 8, heads=1), Case(3, 3, (2, 3), 8, heads=2), Case(4, 2, (), 12, heads=3)]


def _keys(case: Case, dtype, seed) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*case.batch, case.d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(case.n)]


@pytest.mark.parametrize("case", KEY_CASES, ids=repr)
def test_keys_each_row_is_route_with_those_keys(case):
    """With keys, row s is ``route(values, keys, query_s)``: outputs and every gradient
    (values, keys, queries, key-norm weights; lse's gradient included), float64; the
    value and key gradients come back separately."""
    base = make_inputs(case, torch.float64, seed=30)
    keys = _keys(case, torch.float64, seed=31)
    results = []
    for many in (True, False):
        inp = base.cast(torch.float64, torch.float64, True)
        k = [t.clone().requires_grad_() for t in keys]
        if many:
            out, lse = route_many(inp.values, k, **inp.kwargs())
            used = out + lse
        else:
            used = [route(inp.values, k, query=inp.queries[s], key_norm_weight=inp.key_norm_weights[s],
                          heads=case.heads) for s in range(case.s)]
            # route's lse is a saved statistic: the real log-sum-exp from the logits
            used += [torch.logsumexp(route_logits_reference(inp.values, k, query=inp.queries[s],
                                                            key_norm_weight=inp.key_norm_weights[s],
                                                            heads=case.heads), dim=0) for s in range(case.s)]
        grads_out = random_like(used, seed=32)
        results.append((used, torch.autograd.grad(used, inp.leaves() + k, grads_out)))
    (many_out, many_grads), (route_out, route_grads) = results
    assert_all_rel([t.detach() for t in many_out], [t.detach() for t in route_out], 1e-12)
    assert_all_rel(list(many_grads), list(route_grads), 1e-12)
    # the keys really give the logits: routing the values alone differs
    alone, _ = route_many(base.values, **base.kwargs())
    if case.n > 1:
        assert all((a - m).abs().max() > 1e-3 for a, m in zip(alone, many_out))


@pytest.mark.parametrize("case", KEY_CASES[1:], ids=repr)
def test_keys_opcheck_and_gradcheck(case):
    inp = make_inputs(case, torch.float64, seed=33).cast(torch.float64, torch.float64, requires_grad=True)
    keys = [k.requires_grad_() for k in _keys(case, torch.float64, seed=34)]
    fwd = (inp.values, inp.queries, inp.key_norm_weights, case.heads, 1e-6, keys)
    torch.library.opcheck(torch.ops.depthrewrite.route_many.default, fwd)
    out, lse, stats = torch.ops.depthrewrite.route_many(*fwd)
    grads = (random_like(out, seed=35), random_like(lse, seed=36))
    plain = (inp.values, inp.queries, inp.key_norm_weights, keys)
    values, queries, weights, plain_keys = ([t.detach() for t in x] if isinstance(x, list) else x.detach()
                                            for x in plain)
    torch.library.opcheck(torch.ops.depthrewrite.route_many_backward.default,
                          (*grads, [o.detach() for o in out], [t.detach() for t in lse], stats.detach(), values,
                           queries, weights, case.heads, 1e-6, plain_keys))
    n = case.n

    def f(*flat):
        out, lse = route_many(list(flat[:n]), list(flat[n + 2:]), queries=flat[n], key_norm_weights=flat[n + 1],
                              heads=case.heads)
        return (*out, *lse)

    assert torch.autograd.gradcheck(f, tuple(inp.leaves() + keys), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("case", KEY_CASES, ids=repr)
def test_merge_partial_with_a_key_is_route_with_keys(case):
    """DAR's second phase: the partial's logit from its own key."""
    base = make_inputs(case, torch.float64, seed=37)
    keys = _keys(case, torch.float64, seed=38)
    partial, partial_key = _partial(case, torch.float64, 39), _partial(case, torch.float64, 40)
    out, lse = route_many(base.values, keys, **base.kwargs())
    for s in range(case.s):
        kw = dict(query=base.queries[s], key_norm_weight=base.key_norm_weights[s], heads=case.heads)
        merged = merge_partial(out[s], lse[s], partial, partial_key=partial_key, **kw)
        assert_rel(merged, route(base.values + [partial], keys + [partial_key], **kw), 1e-12)
        assert (merged - merge_partial(out[s], lse[s], partial, **kw)).abs().max() > 1e-3  # the key is used
    with pytest.raises(ValueError, match=r"^merge_partial: `partial_key` must be shaped like out"):
        merge_partial(out[0], lse[0], partial, partial_key=partial_key[..., :4], query=base.queries[0],
                      key_norm_weight=base.key_norm_weights[0], heads=case.heads)


def test_keys_must_match_the_values():
    inp = make_inputs(Case(3, 2, (2, 5), 8), torch.float32)
    for keys, found in ((inp.values[:2], r"`keys` must be 3 tensors"), ([v.double() for v in inp.values],
                                                                      r"`keys\[0\]` must be like values\[0\]")):
        with pytest.raises(ValueError, match=rf"^route_many: {found}"):
            route_many(inp.values, keys, **inp.kwargs())


# ---------------------------------------------------------------------- gradcheck

GRADCHECK_CASES = [
    Case(n, s, batch, 4, heads)
    for n in (1, 2, 5)
    for s in (1, 3)
    for heads in (1, 2)
    for batch in ((), (2, 3))
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=repr)
def test_gradcheck_float64(case):
    inp = make_inputs(case, torch.float64, seed=3).cast(torch.float64, torch.float64, requires_grad=True)
    n = case.n

    def f(*flat):
        out, lse = route_many(list(flat[:n]), queries=flat[n], key_norm_weights=flat[n + 1], heads=case.heads)
        return (*out, *lse)  # every output, lse included: it is differentiable

    assert torch.autograd.gradcheck(f, tuple(inp.leaves()), eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------ one row per query

ROW_CASES = [
    Case(1, 3, (3, 7), 8, heads=2),
    Case(2, 3, (3, 7), 8, heads=1),
    Case(2, 1, (3, 7), 8, heads=4),
    Case(5, 3, (3, 7), 8, heads=2),
    Case(9, 2, (3, 7), 12, heads=3),
    Case(5, 2, (), 8, heads=4),
]


def _rows(inp: Inputs):
    """route_many's results and, per query, route's output and route's logits."""
    out, lse = route_many(inp.values, **inp.kwargs())
    routes, logits = [], []
    for s in range(inp.queries.shape[0]):
        kw = dict(query=inp.queries[s], key_norm_weight=inp.key_norm_weights[s], heads=inp.heads)
        routes.append(route(inp.values, **kw))
        logits.append(route_logits_reference(inp.values, **kw))
    return out, lse, routes, logits


@pytest.mark.parametrize("case", ROW_CASES, ids=repr)
def test_each_row_is_route_with_that_query_float64(case):
    inp = make_inputs(case, torch.float64, seed=4)
    out, lse, routes, logits = _rows(inp)
    assert len(out) == len(lse) == case.s
    for o, l, r, z in zip(out, lse, routes, logits):
        assert o.dtype == l.dtype == torch.float64
        assert o.shape == (*case.batch, case.d) and l.shape == (*case.batch, case.heads)
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
        if case.n == 1:
            # the real logit, not route's 0: merge_partial needs it
            torch.testing.assert_close(l, z[0], rtol=1e-12, atol=1e-12)
            assert (l.abs() > 1e-3).any()  # so that the check above could tell the logit from 0
        else:
            torch.testing.assert_close(l, torch.logsumexp(z, 0), rtol=1e-12, atol=1e-12)
    # outputs are separate allocations (custom-op outputs may not alias)
    ptrs = {t.untyped_storage().data_ptr() for t in out + lse}
    assert len(ptrs) == 2 * case.s


@pytest.mark.parametrize("case", ROW_CASES, ids=repr)
def test_each_row_is_route_with_that_query_float32(case):
    inp = make_inputs(case, torch.float32, seed=5)
    out, lse, routes, logits = _rows(inp)
    for o, l, r, z in zip(out, lse, routes, logits):
        assert o.dtype == l.dtype == torch.float32
        # Same fp32 math in a different order (one softmax over (S, N) vs one over N, the
        # weight folded into the query): measured up to ~3 fp32 ulps of outputs of size ~4
        # (3.6e-7); 1e-6 relative to the tensor's scale is a few ulps, nothing looser.
        assert_rel(o, r, 1e-6)
        expected = z[0] if case.n == 1 else torch.logsumexp(z, 0)
        # lse values are O(1-3); measured differences up to 4.8e-7 (2-4 fp32 ulps)
        torch.testing.assert_close(l, expected, rtol=1e-6, atol=1e-6)


def _bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable bf16 values between a and b (0: equal; 1: neighbours), via
    the sign-magnitude bit patterns mapped onto a monotone integer line."""
    def line(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROW_CASES, ids=repr)
def test_each_row_is_route_with_that_query_bf16(case, param_dtype):
    inp = make_inputs(case, torch.float32, seed=6).cast(torch.bfloat16, param_dtype, False)
    out, lse, routes, logits = _rows(inp)
    for o, l, r, z in zip(out, lse, routes, logits):
        assert o.dtype == torch.bfloat16 and l.dtype == torch.float32
        if case.n == 1:
            assert torch.equal(o, r)  # the softmax weight is exactly 1: the source itself
        # Both compute in fp32 and round once to bf16; their fp32 results differ by a few
        # fp32 ulps (see the float32 test), i.e. ~2^-14 of a bf16 ulp, so the roundings
        # agree except when the fp32 value sits at a rounding boundary: then they are
        # neighbours. (Measured: identical on all these cases.)
        dist = _bf16_ulp_distance(o, r)
        assert dist.max() <= 1, f"{dist.max()} bf16 ulps apart"
        assert (dist == 0).float().mean() >= 0.99  # boundary cases are rare, not the rule
        expected = z[0] if case.n == 1 else torch.logsumexp(z, 0)
        torch.testing.assert_close(l, expected, rtol=1e-6, atol=1e-6)  # fp32 math, as above


# -------------------------------------------- the op and its backward vs the reference

REFERENCE_CASES = [
    Case(1, 3, (3, 5), 8, heads=2),
    Case(2, 1, (3, 5), 8, heads=1),
    Case(4, 3, (3, 5), 12, heads=3),
    Case(5, 2, (), 8, heads=4),
    Case(7, 4, (2, 3), 8, heads=1),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=repr)
def test_backward_op_matches_autograd_through_reference_float64(case):
    base = make_inputs(case, torch.float64, seed=7)
    inp = base.cast(torch.float64, torch.float64, True)
    ref_out, ref_lse = route_many_reference(inp.values, **inp.kwargs())
    grad_out, grad_lse = random_like(ref_out, seed=8), random_like(ref_lse, seed=9)  # lse's gradient is nonzero
    ref_grads = torch.autograd.grad(ref_out + ref_lse, inp.leaves(), grad_out + grad_lse)

    # the backward op called directly
    out, lse, stats = torch.ops.depthrewrite.route_many(base.values, base.queries, base.key_norm_weights, case.heads,
                                                        1e-6, None)
    grad_values, grad_keys, grad_queries, grad_weights = torch.ops.depthrewrite.route_many_backward(
        grad_out, grad_lse, out, lse, stats, base.values, base.queries, base.key_norm_weights, case.heads, 1e-6, None)
    assert grad_keys == []  # no keys: the key gradient is in the values' gradient
    assert_all_rel([*grad_values, grad_queries, grad_weights], list(ref_grads), 1e-12)

    # and through route_many's autograd
    inp = base.cast(torch.float64, torch.float64, True)
    out, lse = route_many(inp.values, **inp.kwargs())
    grads = torch.autograd.grad(out + lse, inp.leaves(), grad_out + grad_lse)
    assert_all_rel(list(grads), list(ref_grads), 1e-12)
    # lse's gradient takes part: without it the op's gradients differ
    _, _, grad_q_no_lse, _ = torch.ops.depthrewrite.route_many_backward(
        grad_out, [torch.zeros_like(t) for t in lse], out, lse, stats, base.values, base.queries,
        base.key_norm_weights, case.heads, 1e-6, None)
    assert (grad_q_no_lse - ref_grads[-2]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["f64", "f32"])
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=repr)
def test_forward_op_matches_reference(case, dtype, rel):
    inp = make_inputs(case, dtype, seed=10)
    out, lse = route_many(inp.values, **inp.kwargs())
    ref_out, ref_lse = route_many_reference(inp.values, **inp.kwargs())
    assert_all_rel(out, ref_out, rel)
    assert_all_rel(lse, ref_lse, rel)


# ----------------------------------------------------------------- merge_partial

MERGE_CASES = [
    Case(1, 2, (3, 5), 8, heads=1),
    Case(1, 2, (3, 5), 8, heads=4),
    Case(3, 3, (3, 5), 8, heads=1),
    Case(3, 3, (3, 5), 8, heads=4),
    Case(6, 2, (), 12, heads=4),
]


def _partial(case: Case, dtype, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*case.batch, case.d, generator=gen, dtype=torch.float64).to(dtype)


def _merged(inp: Inputs, partial: torch.Tensor) -> list[torch.Tensor]:
    out, lse = route_many(inp.values, **inp.kwargs())
    return [merge_partial(o, l, partial, query=inp.queries[s], key_norm_weight=inp.key_norm_weights[s],
                          heads=inp.heads) for s, (o, l) in enumerate(zip(out, lse))]


def _routed_with_partial(inp: Inputs, partial: torch.Tensor) -> list[torch.Tensor]:
    return [route(inp.values + [partial], query=inp.queries[s], key_norm_weight=inp.key_norm_weights[s],
                  heads=inp.heads) for s in range(inp.queries.shape[0])]


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["f64", "f32"])
@pytest.mark.parametrize("case", MERGE_CASES, ids=repr)
def test_merge_partial_is_route_over_sources_and_partial(case, dtype, rel):
    inp = make_inputs(case, dtype, seed=11)
    partial = _partial(case, dtype, seed=12)
    merged, expected = _merged(inp, partial), _routed_with_partial(inp, partial)
    for m, e in zip(merged, expected):
        assert m.dtype == dtype and m.shape == e.shape
        # float32: a few fp32 roundings of O(1) values, measured ~2e-7 relative
        assert_rel(m, e, rel)
    # the partial really takes part: without it the result is different
    out, _ = route_many(inp.values, **inp.kwargs())
    assert all((m - o).abs().max() > 1e-3 for m, o in zip(merged, out))


@pytest.mark.parametrize("case", MERGE_CASES, ids=repr)
def test_merge_partial_gradients_match_route_over_sources_and_partial(case):
    base = make_inputs(case, torch.float64, seed=13)
    partial = _partial(case, torch.float64, seed=14)
    grads_out = random_like([partial] * case.s, seed=15)
    results = []
    for fn in (_merged, _routed_with_partial):
        inp = base.cast(torch.float64, torch.float64, True)
        p = partial.clone().requires_grad_()
        res = fn(inp, p)
        results.append(torch.autograd.grad(res, inp.leaves() + [p], grads_out))
    grads, ref_grads = results
    assert_all_rel(list(grads), list(ref_grads), 1e-12)


# ------------------------------------------------------------------ merge_routes

#: (sources per group, groups with a bias, extra sources: (has bias, has scale))
MERGE_ROUTES_CASES = [
    (Case(4, 3, (3, 5), 8, heads=1), (1, 2, 1), (False, True, True), ((False, False), (True, True), (True, True))),
    (Case(5, 2, (3, 5), 8, heads=4), (3, 2), (False, True), ((True, False),)),
    (Case(1, 2, (7,), 12, heads=2), (1,), (False,), ((False, False), (True, True))),
    (Case(3, 2, (2, 3), 8, heads=1), (1, 1, 1), (True, True, False), ()),
]


def _merge_routes_inputs(case, groups, group_bias, extras, dtype, requires_grad):
    """(inp, the extra sources, per-group biases, per-extra (bias, scale)), all leaves."""
    inp = make_inputs(case, dtype, seed=21).cast(dtype, dtype, requires_grad)
    gen = torch.Generator().manual_seed(22)
    extra = [torch.randn(*case.batch, case.d, generator=gen, dtype=dtype).requires_grad_(requires_grad)
             for _ in extras]
    biases = [torch.randn((), generator=gen, dtype=dtype).requires_grad_(requires_grad) if b else None
              for b in group_bias]
    extra_args = [(torch.randn((), generator=gen, dtype=dtype).requires_grad_(requires_grad) if b else None,
                   torch.rand(case.batch, generator=gen, dtype=dtype) * 2 + 0.1 if sc else None) for b, sc in extras]
    return inp, extra, biases, extra_args


def _merge_routes_both(case, groups, group_bias, extras, dtype, requires_grad=False):
    """merge_routes over route_many results per group, and route over all sources with
    ``logit_bias`` and ``source_scale``, for every query; and the leaves."""
    inp, extra, biases, extra_args = _merge_routes_inputs(case, groups, group_bias, extras, dtype, requires_grad)
    starts = [sum(groups[:k]) for k in range(len(groups))]
    per_group = [route_many(inp.values[a:a + n], **inp.kwargs()) for a, n in zip(starts, groups)]
    zero = torch.zeros((), dtype=dtype)
    bias = torch.stack([b if b is not None else zero for b, n in zip(biases, groups) for _ in range(n)]
                       + [b if b is not None else zero for b, _ in extra_args])
    one = torch.ones(case.batch, dtype=dtype)
    scale = torch.stack([one] * case.n + [sc if sc is not None else one for _, sc in extra_args])
    merged, routed = [], []
    for s in range(case.s):
        results = [(outs[s], lses[s], b) for (outs, lses), b in zip(per_group, biases)]
        sources = [(v, b, sc) for v, (b, sc) in zip(extra, extra_args)]
        q, w = inp.queries[s], inp.key_norm_weights[s]
        merged.append(merge_routes(results, sources, query=q, key_norm_weight=w, heads=case.heads))
        routed.append(route(inp.values + extra, query=q, key_norm_weight=w, logit_bias=bias, source_scale=scale,
                            heads=case.heads))
    leaves = inp.leaves() + extra + [b for b in biases if b is not None] + [b for b, _ in extra_args if b is not None]
    return merged, routed, leaves, per_group[0][0]


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["f64", "f32"])
@pytest.mark.parametrize("case, groups, group_bias, extras", MERGE_ROUTES_CASES, ids=repr)
def test_merge_routes_is_route_over_every_source(case, groups, group_bias, extras, dtype, rel):
    """Groups routed apart (each with a bias common to the group) and extra sources (with
    a bias and a per-token scale) merged by softmax give route over all of them."""
    merged, routed, _, first = _merge_routes_both(case, groups, group_bias, extras, dtype)
    for m, r in zip(merged, routed):
        assert m.dtype == dtype
        assert_rel(m, r, rel)
    # the other groups and sources take part: the result is not the first group's own
    assert all((m - f).abs().max() > 1e-3 for m, f in zip(merged, first))


@pytest.mark.parametrize("case, groups, group_bias, extras", MERGE_ROUTES_CASES, ids=repr)
def test_merge_routes_gradients_match_route(case, groups, group_bias, extras):
    merged, routed, leaves, _ = _merge_routes_both(case, groups, group_bias, extras, torch.float64, True)
    grads_out = random_like(merged, seed=23)
    got = torch.autograd.grad(merged, leaves, grads_out)
    want = torch.autograd.grad(routed, leaves, grads_out)
    assert_all_rel(list(got), list(want), 1e-11)


@pytest.mark.parametrize("case, groups, group_bias, extras", MERGE_ROUTES_CASES, ids=repr)
def test_merge_routes_softmax_by_terms_is_the_stacked_softmax(case, groups, group_bias, extras, monkeypatch):
    """The softmax written term by term (the default, route_many.MERGE_SOFTMAX_BY_TERMS) and
    torch.softmax over the stacked logits: the same result and gradients in float64."""
    results = []
    for by_terms in (True, False):
        monkeypatch.setattr(route_many_module, "MERGE_SOFTMAX_BY_TERMS", by_terms)
        merged, _, leaves, _ = _merge_routes_both(case, groups, group_bias, extras, torch.float64, True)
        grads = torch.autograd.grad(merged, leaves, random_like(merged, seed=24))
        results.append(list(merged) + list(grads))
    assert_all_rel(results[0], results[1], 1e-13)


@pytest.mark.parametrize("by_terms", [True, False], ids=["by_terms", "stacked"])
def test_merge_routes_softmax_far_logits_and_a_minus_inf_bias(by_terms, monkeypatch):
    """Logits hundreds apart (exp of them unshifted overflows float32) and a term whose bias
    is -inf (WAV's detail_bias_init=-inf): finite weights, the -inf term weighs nothing and
    its bias gets a zero gradient, not NaN."""
    monkeypatch.setattr(route_many_module, "MERGE_SOFTMAX_BY_TERMS", by_terms)
    gen = torch.Generator().manual_seed(25)
    outs = [torch.randn(5, 8, generator=gen, requires_grad=True) for _ in range(3)]
    lse = torch.tensor([400.0, 0.0, 399.0]).view(3, 1, 1).expand(3, 5, 1)
    minus_inf = torch.tensor(float("-inf"), requires_grad=True)
    results = [(outs[0], lse[0], None), (outs[1], lse[1], None), (outs[2], lse[2], minus_inf)]
    sources = [(torch.randn(5, 8, generator=gen), torch.tensor(350.0), None)]
    merged = merge_routes(results, sources, query=torch.randn(8, generator=gen), key_norm_weight=torch.ones(8))
    assert torch.isfinite(merged).all()
    # only outs[0] has weight: outs[1] is 400 below it, outs[2] and the source -inf and about 50 below
    assert_rel(merged, outs[0], 1e-6)
    grads = torch.autograd.grad(merged.sum(), [*outs, minus_inf])
    assert grads[3].item() == 0.0
    assert torch.equal(grads[2], torch.zeros_like(outs[2]))
    assert torch.isfinite(grads[0]).all() and torch.isfinite(grads[1]).all()


@pytest.mark.parametrize("arg, change", [
    (r"results\[1\] out", lambda r, s: r.__setitem__(1, (r[1][0][..., :4], r[1][1], None))),
    ("lse", lambda r, s: r.__setitem__(0, (r[0][0], r[0][1][..., :1], None))),
    (r"sources\[0\] value", lambda r, s: s.__setitem__(0, (s[0][0][:1], None, None))),
    ("scale", lambda r, s: s.__setitem__(0, (s[0][0], None, torch.ones(3)))),
    ("results", lambda r, s: r.clear()),
    (None, lambda r, s: r.__setitem__(1, (r[1][0], r[1][1], 0.5))),  # a bias that is not a scalar tensor
    (None, lambda r, s: s.__setitem__(0, (s[0][0], torch.zeros(1), None))),
])
def test_merge_routes_bad_inputs_name_the_argument(arg, change):
    out, lse = torch.randn(2, 3, 8), torch.randn(2, 3, 2)
    results = [(out, lse, None), (out.clone(), lse.clone(), torch.zeros(()))]
    sources = [(torch.randn(2, 3, 8), None, torch.ones(2, 3))]
    change(results, sources)
    pattern = rf"^merge_routes: (a source's )?`{arg}` must" if arg else r"^merge_routes: the bias of \w+\[\d\] must"
    with pytest.raises(ValueError, match=pattern):
        merge_routes(results, sources, query=torch.randn(8), key_norm_weight=torch.ones(8), heads=2)


# ------------------------------------------------------------------ input checks


def _bad_inputs():
    base = make_inputs(Case(3, 2, (2, 5), 8), torch.float32)
    v, q, w = base.values, base.queries, base.key_norm_weights
    cases = {
        "queries": [dict(queries=q[0]), dict(queries=q[None]), dict(queries=q[:, :4], key_norm_weights=w[:, :4]),
                    dict(queries=torch.zeros(0, 8), key_norm_weights=torch.zeros(0, 8))],
        "key_norm_weights": [dict(key_norm_weights=w[:1]), dict(key_norm_weights=w[:, :4]),
                             dict(key_norm_weights=w[0])],
        "heads": [dict(heads=3), dict(heads=0), dict(heads=True)],
        "eps": [dict(eps=-1e-6), dict(eps=0.0), dict(eps=float("nan"))],
        "values": [dict(values=[]), dict(values=[v[0], v[1][..., :4], v[2]]), dict(values=[v[0], v[1][:1], v[2]]),
                   dict(values=[v[0], v[1].double(), v[2]])],
    }
    for arg, overrides in cases.items():
        for i, o in enumerate(overrides):
            kw = dict(values=v, queries=q, key_norm_weights=w, heads=2, eps=1e-6)
            kw.update(o)
            yield pytest.param(arg, kw, id=f"{arg}-{i}")


@pytest.mark.parametrize("fn", [route_many, route_many_reference], ids=["op", "reference"])
@pytest.mark.parametrize("arg, kwargs", list(_bad_inputs()))
def test_bad_inputs_raise_value_error_naming_the_argument(fn, arg, kwargs):
    kwargs = dict(kwargs)
    values = kwargs.pop("values")
    # `values` or `values[1]`; the message names the op called
    with pytest.raises(ValueError, match=rf"^route_many: `{arg}(\[\d+\])?` must be .*; found"):
        fn(values, **kwargs)


# ---------------------------------------------------------------- unused outputs


@pytest.mark.parametrize("use", ["out0", "lse1"])
@pytest.mark.parametrize("case", [Case(3, 2, (3, 5), 8, heads=2), Case(1, 3, (4,), 8, heads=1)], ids=repr)
def test_unused_outputs_get_zero_gradients(case, use):
    base = make_inputs(case, torch.float64, seed=16)
    results = []
    for fn in (route_many, route_many_reference):
        inp = base.cast(torch.float64, torch.float64, True)
        out, lse = fn(inp.values, **inp.kwargs())
        used = out[0] if use == "out0" else lse[1]
        loss = (used * random_like([used], seed=17)[0]).sum()  # every other output unused
        results.append(torch.autograd.grad(loss, inp.leaves()))
    grads, ref_grads = results
    assert all(g is not None for g in grads)
    assert_all_rel(list(grads), list(ref_grads), 1e-12)
    # the query rows that did not take part get exactly zero gradient
    row = 0 if use == "out0" else 1
    for g in grads[-2:]:
        others = torch.cat([g[:row], g[row + 1:]])
        assert not others.any()
        if case.n > 1 or use == "lse1":
            # (with one source out[0] is the source itself, whatever the query: no gradient)
            assert g[row].abs().max() > 1e-6


@pytest.mark.parametrize("op", ["route_many", "route"])
def test_non_contiguous_sources_get_the_layout_the_op_declares(op):
    """The ops return contiguous tensors whatever the sources' strides; their fake
    (compile-time) implementations must declare the same layout."""
    values = [torch.randn(8, 3).t() for _ in range(2)]  # (3, 8), strides (1, 3)
    if op == "route_many":
        args = (values, torch.randn(2, 8), torch.rand(2, 8) + 0.5, 1, 1e-6, None)
    else:
        args = (values, None, torch.randn(8), torch.rand(8) + 0.5, None, None, 1, 1e-6)
    torch.library.opcheck(getattr(torch.ops.depthrewrite, op).default, args)


@pytest.mark.parametrize("arg, change", [
    ("partial", lambda kw: kw.update(partial=kw["partial"][..., :4])),
    ("lse", lambda kw: kw.update(lse=kw["lse"][..., :1])),
    ("query", lambda kw: kw.update(query=kw["query"][:4])),
    ("key_norm_weight", lambda kw: kw.update(key_norm_weight=kw["key_norm_weight"][None])),
    ("heads", lambda kw: kw.update(heads=3)),
    ("eps", lambda kw: kw.update(eps=-1.0)),
    ("eps", lambda kw: kw.update(eps=0.0)),  # an all-zero partial's key norm would be NaN
    ("out", lambda kw: kw.update(out=[1.0])),
    ("lse", lambda kw: kw.update(lse=kw["lse"].to("meta"))),
    ("query", lambda kw: kw.update(query=kw["query"].to("meta"))),
    ("key_norm_weight", lambda kw: kw.update(key_norm_weight=kw["key_norm_weight"].to("meta"))),
])
def test_merge_partial_bad_inputs_name_the_argument(arg, change):
    kw = dict(out=torch.randn(2, 3, 8), lse=torch.randn(2, 3, 2), partial=torch.randn(2, 3, 8),
              query=torch.randn(8), key_norm_weight=torch.ones(8), heads=2, eps=1e-6)
    change(kw)
    out, lse, partial = kw.pop("out"), kw.pop("lse"), kw.pop("partial")
    with pytest.raises(ValueError, match=rf"^merge_partial: `{arg}` must be"):
        merge_partial(out, lse, partial, **kw)


def test_merge_routes_bad_entries_and_scales_name_the_argument():
    out, lse, query, weight = torch.randn(2, 8), torch.randn(2, 1), torch.randn(8), torch.ones(8)
    with pytest.raises(ValueError, match=r"^merge_routes: `results\[0\]` must be a triple \(out, lse, bias\); "
                                         r"found 2 items"):
        merge_routes([(out, lse)], query=query, key_norm_weight=weight)
    with pytest.raises(ValueError, match=r"^merge_routes: `sources\[0\]` must be a triple"):
        merge_routes([(out, lse, None)], [out], query=query, key_norm_weight=weight)
    with pytest.raises(ValueError, match=r"^merge_routes: a source's `scale` must be None or of shape \(2,\) on cpu"):
        merge_routes([(out, lse, None)], [(out, None, torch.ones(2, device="meta"))], query=query,
                     key_norm_weight=weight)
    with pytest.raises(ValueError, match=r"^merge_routes: `query` must be on out's device cpu"):
        merge_routes([(out, lse, None)], query=query.to("meta"), key_norm_weight=weight)


# ------------------------------------------------------------ the saved statistics


@pytest.mark.parametrize("case", [Case(n=5, s=3, batch=(2, 3), d=8), Case(n=1, s=2, batch=(4,), d=6)], ids=repr)
def test_stats_hold_each_sources_logits_and_rstd_per_token(case):
    """The op's third output, for the fused backward: per token and source the S logits,
    then the key's rstd (float64 here, as the op's compute dtype)."""
    inp = make_inputs(case, seed=3)
    _, _, stats = torch.ops.depthrewrite.route_many(inp.values, inp.queries, inp.key_norm_weights, 1, 1e-6, None)
    tokens = inp.values[0].numel() // case.d
    assert stats.shape == (tokens, case.n, case.s + 1) and stats.dtype == torch.float64
    for q in range(case.s):
        z = route_logits_reference(inp.values, query=inp.queries[q], key_norm_weight=inp.key_norm_weights[q])
        assert torch.allclose(stats[..., q], z.reshape(case.n, tokens).T, rtol=1e-12, atol=1e-12)
    rstd = torch.stack(inp.values).reshape(case.n, tokens, case.d).square().mean(-1).add(1e-6).rsqrt()
    assert torch.allclose(stats[..., case.s], rstd.T, rtol=1e-12, atol=0)


def test_no_stats_where_the_fused_backward_reads_none():
    """Several heads or separate keys (the tiled backward's calls), or more queries than
    STATS_MAX_QUERIES (not measured with the table): an empty table."""
    from depthrewrite.ops.route_many import STATS_MAX_QUERIES

    many = make_inputs(Case(n=3, s=STATS_MAX_QUERIES + 1, batch=(4,), d=8), seed=6)
    assert torch.ops.depthrewrite.route_many(many.values, many.queries, many.key_norm_weights, 1, 1e-6,
                                             None)[2].shape == (0,)
    case = Case(n=3, s=2, batch=(4,), d=8, heads=2)
    inp = make_inputs(case, seed=4)
    assert torch.ops.depthrewrite.route_many(inp.values, inp.queries, inp.key_norm_weights, 2, 1e-6,
                                             None)[2].shape == (0,)
    keys = _keys(Case(n=3, s=2, batch=(4,), d=8), torch.float64, seed=5)
    assert torch.ops.depthrewrite.route_many(inp.values, inp.queries, inp.key_norm_weights, 1, 1e-6,
                                             keys)[2].shape == (0,)
