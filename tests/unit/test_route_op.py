"""depthrewrite::route and route_backward against the reference and docs/spec.md (sections 2-4)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from depthrewrite.ops import route, route_reference
from depthrewrite.ops.route import (
    ROUTE_BACKWARD_SCHEMA,
    ROUTE_SCHEMA,
    route_and_norm,
    route_and_norm_reference,
    route_logits_reference,
)


@dataclass
class Case:
    n: int
    batch: tuple[int, ...]
    d: int
    heads: int = 1
    keys: bool = False
    bias: bool = False
    scale: bool = False


@dataclass
class Inputs:
    values: list[torch.Tensor]
    keys: list[torch.Tensor] | None
    query: torch.Tensor
    key_norm_weight: torch.Tensor
    logit_bias: torch.Tensor | None
    source_scale: torch.Tensor | None
    heads: int

    def kwargs(self) -> dict:
        return dict(
            query=self.query,
            key_norm_weight=self.key_norm_weight,
            logit_bias=self.logit_bias,
            source_scale=self.source_scale,
            heads=self.heads,
        )

    def grad_leaves(self) -> list[torch.Tensor]:
        """Every input that should receive a gradient, in a fixed order."""
        leaves = [*self.values, *(self.keys or []), self.query, self.key_norm_weight]
        return leaves + ([self.logit_bias] if self.logit_bias is not None else [])

    def cast(self, act_dtype: torch.dtype, param_dtype: torch.dtype, requires_grad: bool) -> "Inputs":
        def conv(t, dtype):
            return None if t is None else t.detach().to(dtype).requires_grad_(requires_grad)

        return Inputs(
            values=[conv(v, act_dtype) for v in self.values],
            keys=None if self.keys is None else [conv(k, act_dtype) for k in self.keys],
            query=conv(self.query, param_dtype),
            key_norm_weight=conv(self.key_norm_weight, param_dtype),
            logit_bias=conv(self.logit_bias, param_dtype),
            # a constant of the routing: never a gradient leaf
            source_scale=None if self.source_scale is None else self.source_scale.to(act_dtype),
            heads=self.heads,
        )


def make_inputs(case: Case, dtype=torch.float64, seed=0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    n, shape = case.n, (*case.batch, case.d)
    return Inputs(
        values=[randn(*shape) for _ in range(n)],
        keys=[randn(*shape) for _ in range(n)] if case.keys else None,
        # scaled so that the softmax is neither uniform nor one-hot
        query=0.5 * randn(case.d),
        key_norm_weight=1.0 + 0.3 * randn(case.d),
        logit_bias=randn(n) if case.bias else None,
        source_scale=(0.5 + torch.rand(n, *case.batch, generator=gen, dtype=dtype)) if case.scale else None,
        heads=case.heads,
    )


def run_with_grads(fn, inp: Inputs, grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = fn(inp.values, inp.keys, **inp.kwargs())
    grads = torch.autograd.grad(out, inp.grad_leaves(), grad_out)
    return out, list(grads)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max-norm relative error: max|a - e| <= rel * max|e| (exact when e is all zeros)."""
    assert actual.shape == expected.shape
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * scale, f"max error {err:.3e} > {rel:.1e} * {scale:.3e}"


def assert_close_bf16(actual: torch.Tensor, expected64: torch.Tensor) -> None:
    # a bf16 result is an fp32 result rounded once: half an ulp (2^-9) relative, with
    # 2x slack, plus the fp32 arithmetic's own error relative to the tensor's scale
    torch.testing.assert_close(
        actual.double(), expected64, rtol=2.0**-8, atol=1e-5 * expected64.abs().max().item()
    )


# ------------------------------------------------------------------- registration


def test_registered_schemas_are_the_kernel_contract():
    # compared as parsed schemas: the registry prints a default 1e-06 as 9.9999999999999995e-07
    parse = torch._C.parse_schema
    assert torch.ops.depthrewrite.route.default._schema == parse("depthrewrite::route" + ROUTE_SCHEMA)
    assert torch.ops.depthrewrite.route_backward.default._schema == parse(
        "depthrewrite::route_backward" + ROUTE_BACKWARD_SCHEMA
    )


OPCHECK_CASES = [
    Case(3, (2, 3), 12, heads=1),
    Case(3, (2, 3), 12, heads=4, keys=True),
    Case(4, (5,), 8, heads=4, bias=True, scale=True),
    Case(2, (1, 3), 12, heads=1, keys=True, bias=True, scale=True),
    Case(1, (3,), 8, heads=4, keys=True, bias=True),
]


def _norm_args(case: Case, with_norm: bool) -> tuple:
    """The optional fused output norm arguments: none, or a weight and its eps."""
    if not with_norm:
        return ()
    return (1.0 + 0.3 * torch.randn(case.d, generator=torch.Generator().manual_seed(case.d)), 1e-5)


@pytest.mark.parametrize("with_norm", [False, True], ids=["route", "route_and_norm"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=repr)
def test_opcheck_route(case, with_norm):
    inp = make_inputs(case, torch.float32).cast(torch.float32, torch.float32, requires_grad=True)
    args = (inp.values, inp.keys, inp.query, inp.key_norm_weight, inp.logit_bias, inp.source_scale, case.heads, 1e-6)
    norm = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in _norm_args(case, with_norm))
    torch.library.opcheck(torch.ops.depthrewrite.route.default, args + norm)


@pytest.mark.parametrize("with_norm", [False, True], ids=["route", "route_and_norm"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=repr)
def test_opcheck_route_backward(case, with_norm):
    inp = make_inputs(case, torch.float32)
    grad_out = torch.randn(*case.batch, case.d)
    fwd = (inp.values, inp.keys, inp.query, inp.key_norm_weight, inp.logit_bias, inp.source_scale, case.heads, 1e-6)
    norm = _norm_args(case, with_norm)
    out, lse, _normed = torch.ops.depthrewrite.route(*fwd, *norm)
    grad_normed = (torch.randn(*case.batch, case.d),) if with_norm else ()
    torch.library.opcheck(torch.ops.depthrewrite.route_backward.default, (grad_out, out, lse, *fwd, *grad_normed, *norm))


@pytest.mark.parametrize("case", [Case(1, (2, 3), 8, heads=2), *OPCHECK_CASES[:4]], ids=repr)
def test_lse_is_the_log_sum_exp_of_the_logits_and_not_differentiable(case):
    inp = make_inputs(case, torch.float64, seed=11).cast(torch.float64, torch.float64, requires_grad=True)
    out, lse, normed = torch.ops.depthrewrite.route(inp.values, inp.keys, inp.query, inp.key_norm_weight,
                                                    inp.logit_bias, inp.source_scale, case.heads, 1e-6)
    assert normed.numel() == 0  # no output norm asked for
    assert lse.dtype == torch.float32 and lse.shape == (*case.batch, case.heads)
    assert out.requires_grad and not lse.requires_grad
    z = route_logits_reference(inp.values, inp.keys, **inp.kwargs())
    if case.n == 1:
        assert not lse.any()  # defined as 0: the single weight is exp(0 - 0) = 1
    else:
        # fp32 storage of a float64 computation: one rounding
        torch.testing.assert_close(lse.double(), torch.logsumexp(z, 0).detach(), rtol=2.0**-23, atol=1e-7)
        # the weights the backward rebuilds from lse are the softmax
        torch.testing.assert_close(torch.exp(z - lse.double()), torch.softmax(z, 0), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- gradcheck

GRADCHECK_CASES = [
    Case(1, (3,), 6, heads=1),
    Case(1, (1, 3), 6, heads=2, keys=True, bias=True, scale=True),
    Case(2, (5,), 6, heads=3, keys=True, bias=True),
    Case(2, (), 6, heads=2, bias=True, scale=True),
    Case(2, (1, 3), 12, heads=4, bias=True, scale=True),
    Case(5, (3,), 6, heads=2, keys=True, bias=True, scale=True),
    Case(5, (1, 3), 12, heads=4),
    Case(5, (3, 1), 12, heads=1, keys=True, bias=True),
]


def _split_leaves(flat, case):
    """values, keys, query, key-norm weight, bias and what follows, from the flat leaves of
    ``grad_leaves()`` (in that order; keys and bias only where the case has them)."""
    n = case.n
    values, rest = list(flat[:n]), flat[n:]
    keys = list(rest[:n]) if case.keys else None
    rest = rest[n:] if case.keys else rest
    bias = rest[2] if case.bias else None
    return values, keys, rest[0], rest[1], bias, rest


@pytest.mark.parametrize("fn", [route, route_reference], ids=["op", "reference"])
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=repr)
def test_gradcheck_float64(fn, case):
    inp = make_inputs(case, torch.float64, seed=1).cast(torch.float64, torch.float64, requires_grad=True)
    leaves = inp.grad_leaves()

    def f(*flat):
        values, keys, query, weight, bias, _ = _split_leaves(flat, case)
        return fn(values, keys, query=query, key_norm_weight=weight, logit_bias=bias,
                  source_scale=inp.source_scale, heads=case.heads)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("fn", [route_and_norm, route_and_norm_reference], ids=["op", "reference"])
@pytest.mark.parametrize("case", GRADCHECK_CASES[1::2], ids=repr)
def test_gradcheck_route_and_norm_float64(fn, case):
    inp = make_inputs(case, torch.float64, seed=12).cast(torch.float64, torch.float64, requires_grad=True)
    norm_weight = (1.0 + 0.3 * torch.randn(case.d, dtype=torch.float64)).requires_grad_()
    leaves = inp.grad_leaves() + [norm_weight]

    def f(*flat):
        values, keys, query, weight, bias, rest = _split_leaves(flat, case)
        return fn(values, keys, query=query, key_norm_weight=weight, logit_bias=bias, out_norm_weight=rest[-1],
                  source_scale=inp.source_scale, heads=case.heads, out_norm_eps=1e-5)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("case", MATCH_CASES_NORM := [
    Case(1, (3, 7), 24, heads=3, keys=True, bias=True, scale=True),
    Case(9, (3, 7), 40, heads=1, bias=True, scale=True),
    Case(33, (3, 7), 40, heads=5, keys=True, bias=True, scale=True),
], ids=repr)
def test_route_and_norm_matches_reference_float32(case):
    base = make_inputs(case, torch.float32, seed=13)
    norm_weight = 1.0 + 0.3 * torch.randn(case.d, generator=torch.Generator().manual_seed(14))
    gen = torch.Generator().manual_seed(15)
    grad_out, grad_normed = (torch.randn(*case.batch, case.d, generator=gen) for _ in range(2))
    results = []
    for fn in (route_and_norm, route_and_norm_reference):
        inp = base.cast(torch.float32, torch.float32, True)
        w = norm_weight.clone().requires_grad_()
        out, normed = fn(inp.values, inp.keys, out_norm_weight=w, **inp.kwargs())
        grads = torch.autograd.grad((out * grad_out).sum() + (normed * grad_normed).sum(), inp.grad_leaves() + [w])
        results.append((out, normed, grads))
    (out, normed, grads), (ref, ref_normed, ref_grads) = results
    assert out.dtype == normed.dtype == torch.float32
    assert_rel(out, ref, 1e-5)
    assert_rel(normed, ref_normed, 1e-5)
    assert len(grads) == len(ref_grads)
    for g, rg in zip(grads, ref_grads):
        assert_rel(g, rg, 1e-5)
    # the routed output is route's, bit for bit: the norm is an extra output
    plain = route(base.values, base.keys, **base.kwargs())
    assert torch.equal(out.detach(), plain)


# ------------------------------------------------------- op against the reference

MATCH_CASES = [
    Case(1, (3, 7), 24, heads=1),
    Case(1, (3, 7), 24, heads=3, keys=True, bias=True, scale=True),
    Case(2, (3, 7), 24, heads=3, keys=True, bias=True),
    Case(2, (3, 7), 40, heads=1, scale=True),
    Case(9, (3, 7), 40, heads=1, bias=True, scale=True),
    Case(9, (3, 7), 24, heads=4, keys=True, scale=True),
    Case(33, (3, 7), 40, heads=5, keys=True, bias=True, scale=True),
    Case(33, (3, 7), 24, heads=1),
]


@pytest.mark.parametrize("case", MATCH_CASES, ids=repr)
def test_op_matches_reference_float32(case):
    base = make_inputs(case, torch.float32, seed=2)
    grad_out = torch.randn(*case.batch, case.d, generator=torch.Generator().manual_seed(3))
    out, grads = run_with_grads(route, base.cast(torch.float32, torch.float32, True), grad_out)
    ref, ref_grads = run_with_grads(route_reference, base.cast(torch.float32, torch.float32, True), grad_out)
    assert out.dtype == torch.float32
    assert_rel(out, ref, 1e-5)
    assert len(grads) == len(ref_grads)
    for g, rg in zip(grads, ref_grads):
        assert g.dtype == rg.dtype
        assert_rel(g, rg, 1e-5)


@pytest.mark.parametrize(
    "case, param_dtype",
    [
        (Case(2, (3, 7), 24, heads=3, keys=True, bias=True), torch.float32),
        (Case(9, (3, 7), 40, heads=5, bias=True, scale=True), torch.float32),
        (Case(33, (3, 7), 24, heads=1, keys=True, scale=True), torch.float32),
        (Case(9, (3, 7), 24, heads=4, keys=True, bias=True, scale=True), torch.bfloat16),
    ],
    ids=repr,
)
def test_bf16_matches_float64_reference(case, param_dtype):
    # bf16-exact inputs, so the float64 reference sees exactly what the op sees
    base = make_inputs(case, torch.float32, seed=4).cast(torch.bfloat16, param_dtype, False)
    grad_out = torch.randn(*case.batch, case.d, generator=torch.Generator().manual_seed(5)).bfloat16()
    out, grads = run_with_grads(route, base.cast(torch.bfloat16, param_dtype, True), grad_out)
    ref, ref_grads = run_with_grads(route_reference, base.cast(torch.float64, torch.float64, True), grad_out.double())
    assert out.dtype == torch.bfloat16
    assert_close_bf16(out, ref)
    for leaf, g, rg in zip(base.cast(torch.bfloat16, param_dtype, True).grad_leaves(), grads, ref_grads):
        assert g.dtype == leaf.dtype  # each gradient in its input's own dtype
        if g.dtype == torch.bfloat16:
            assert_close_bf16(g, rg)
        else:
            assert_rel(g, rg, 1e-5)  # fp32 parameter gradients carry only fp32 rounding


# ------------------------------------------------------------- spec's properties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("with_extras", [False, True])
def test_single_source_is_bit_identical(dtype, with_extras):
    v = torch.randn(3, 5, 12).to(dtype)
    v[0, 0, :4] = torch.tensor([-0.0, 0.0, 1e-30, -3e4]).to(dtype)
    kwargs = dict(query=torch.randn(12), key_norm_weight=torch.randn(12), heads=4)
    if with_extras:  # keys and bias must not matter: softmax over one source is 1
        kwargs.update(logit_bias=torch.tensor([7.0]))
        out = route([v], [torch.randn(3, 5, 12).to(dtype)], **kwargs)
    else:
        out = route((v,), **kwargs)
    assert out.dtype == v.dtype and out.shape == v.shape
    assert out.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[v.element_size()]
    assert torch.equal(out.view(bits), v.view(bits))


def _split_heads_by_magnitude(keys: list[torch.Tensor], heads: int, seed: int) -> list[torch.Tensor]:
    """Rescale each head's channels by a per-source factor, so per-head and full-width
    RMS statistics give different logits (they coincide when heads have equal energy)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in keys:
        factors = torch.exp(1.5 * torch.randn(heads, generator=gen, dtype=k.dtype))
        out.append((k.unflatten(-1, (heads, -1)) * factors[:, None]).flatten(-2))
    return out


def test_heads_share_the_full_width_rms_statistic():
    n, heads, d = 4, 3, 12
    dh = d // heads
    inp = make_inputs(Case(n, (2, 5), d, heads=heads, keys=True, bias=True), torch.float64, seed=6)
    keys = _split_heads_by_magnitude(inp.keys, heads, seed=7)
    q, w, b = inp.query, inp.key_norm_weight, inp.logit_bias
    out = route(inp.values, keys, query=q, key_norm_weight=w, logit_bias=b, heads=heads)

    # independent oracle: normalise over the full width, then slice into heads
    key = torch.stack(keys)
    khat = key * torch.rsqrt(key.square().mean(-1, keepdim=True) + 1e-6) * w
    for h in range(heads):
        sl = slice(h * dh, (h + 1) * dh)
        a = torch.softmax((khat[..., sl] * q[sl]).sum(-1) + b[:, None, None], dim=0)
        expected = (a[..., None] * torch.stack(inp.values)[..., sl]).sum(0)
        torch.testing.assert_close(out[..., sl], expected, rtol=1e-12, atol=1e-12)

        # heads=1 on full-width keys with the query restricted to head h is head h
        masked_q = torch.zeros_like(q)
        masked_q[sl] = q[sl]
        single = route(inp.values, keys, query=masked_q, key_norm_weight=w, logit_bias=b, heads=1)
        torch.testing.assert_close(out[..., sl], single[..., sl], rtol=1e-12, atol=1e-12)

        # a per-head statistic (heads=1 on the slices alone) is a different computation:
        # this is what makes the two checks above sensitive to where the RMS is taken
        per_head = route([v[..., sl] for v in inp.values], [k[..., sl] for k in keys],
                         query=q[sl], key_norm_weight=w[sl], logit_bias=b, heads=1)
        assert (per_head - out[..., sl]).abs().max() > 1e-2


@pytest.mark.parametrize("fn", [route, route_reference], ids=["op", "reference"])
def test_zero_query_gives_uniform_average_and_bias_shifts_it(fn):
    n, d = 5, 12
    inp = make_inputs(Case(n, (3, 4), d, heads=4, keys=True, scale=True), torch.float64, seed=8)
    zero = torch.zeros(d, dtype=torch.float64)
    src = torch.stack(inp.values) * inp.source_scale[..., None]
    kw = dict(query=zero, key_norm_weight=inp.key_norm_weight, source_scale=inp.source_scale, heads=4)

    out = fn(inp.values, inp.keys, **kw)
    torch.testing.assert_close(out, src.mean(0), rtol=1e-12, atol=1e-12)

    bias = torch.tensor([0.5, -1.0, 2.0, 0.0, -float("inf")], dtype=torch.float64)
    out = fn(inp.values, inp.keys, logit_bias=bias, **kw)
    torch.testing.assert_close(out, torch.einsum("n,n...->...", torch.softmax(bias, 0), src), rtol=1e-12, atol=1e-12)
    # -inf bias removes the source entirely (the WAV "details off" limit)
    kept = fn(inp.values[:4], inp.keys[:4], **{**kw, "source_scale": inp.source_scale[:4]}, logit_bias=bias[:4])
    torch.testing.assert_close(out, kept, rtol=1e-12, atol=1e-12)


def test_source_scale_scales_values_and_keys_and_gets_no_gradient():
    case = Case(4, (2, 3), 12, heads=2, keys=True, bias=True, scale=True)
    inp = make_inputs(case, torch.float64, seed=9).cast(torch.float64, torch.float64, True)
    scale = inp.source_scale.clone().requires_grad_(True)
    out = route(inp.values, inp.keys, **{**inp.kwargs(), "source_scale": scale})
    pre = [(v * s[..., None]).detach() for v, s in zip(inp.values, scale.detach())]
    pre_k = [(k * s[..., None]).detach() for k, s in zip(inp.keys, scale.detach())]
    plain = route(pre, pre_k, **{**inp.kwargs(), "source_scale": None})
    torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12)

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert scale.grad is None
    # chain rule through the constant multiplier
    pre = [p.requires_grad_(True) for p in pre]
    route(pre, pre_k, **{**inp.kwargs(), "source_scale": None}).backward(grad_out)
    for v, p, s in zip(inp.values, pre, scale.detach()):
        torch.testing.assert_close(v.grad, p.grad * s[..., None], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ input checks


def _bad_inputs():
    n, batch, d = 3, (2, 5), 12
    base = make_inputs(Case(n, batch, d, keys=True, bias=True, scale=True), torch.float32)
    v, k = base.values, base.keys
    cases = {
        "values": [
            dict(values=[]),
            dict(values=v[0]),
            dict(values=[v[0], v[1][..., :8], v[2]]),
            dict(values=[v[0], v[1].double(), v[2]]),
            dict(values=[v[0], v[1].to("meta"), v[2]]),
            dict(values=[v[0], v[1].long(), v[2]]),
        ],
        "keys": [dict(keys=k[:2]), dict(keys=[k[0], k[1][:1], k[2]]), dict(keys=[k[0], k[1].half(), k[2]])],
        "query": [dict(query=torch.zeros(d + 1)), dict(query=torch.zeros(1, d)), dict(query=None)],
        "key_norm_weight": [dict(key_norm_weight=torch.ones(d - 1)), dict(key_norm_weight=torch.ones(d, dtype=torch.int64))],
        "logit_bias": [dict(logit_bias=torch.zeros(n + 1)), dict(logit_bias=torch.zeros(n, 1))],
        "source_scale": [dict(source_scale=torch.ones(n, 2)), dict(source_scale=torch.ones(n, *batch, 1))],
        "heads": [dict(heads=0), dict(heads=5), dict(heads=True), dict(heads=2.0)],
        "eps": [dict(eps=-1e-6), dict(eps=0.0), dict(eps=float("nan"))],
    }
    for arg, overrides in cases.items():
        for i, o in enumerate(overrides):
            kw = dict(values=v, keys=k, query=base.query, key_norm_weight=base.key_norm_weight,
                      logit_bias=base.logit_bias, source_scale=base.source_scale, heads=3, eps=1e-6)
            kw.update(o)
            yield pytest.param(arg, kw, id=f"{arg}-{i}")


@pytest.mark.parametrize("fn", [route, route_reference], ids=["op", "reference"])
@pytest.mark.parametrize("arg, kwargs", list(_bad_inputs()))
def test_bad_inputs_raise_value_error_naming_the_argument(fn, arg, kwargs):
    kwargs = dict(kwargs)  # shared between the two parametrized functions
    values, keys = kwargs.pop("values"), kwargs.pop("keys")
    with pytest.raises(ValueError) as info:
        fn(values, keys, **kwargs)
    msg = str(info.value)
    assert f"`{arg}" in msg, msg  # `values` or `values[1]`
    assert "must be" in msg and "found" in msg, msg


@pytest.mark.parametrize("fn", [route_and_norm, route_and_norm_reference], ids=["op", "reference"])
@pytest.mark.parametrize("arg, value", [
    ("out_norm_weight", torch.ones(11)),
    ("out_norm_weight", torch.ones(12, dtype=torch.int64)),
    ("out_norm_weight", None),
    ("out_norm_weight", torch.ones(1, 12)),
    ("out_norm_eps", -1.0),
    ("out_norm_eps", float("inf")),
    ("out_norm_eps", True),
], ids=lambda x: repr(x) if not isinstance(x, torch.Tensor) else f"shape{tuple(x.shape)}-{x.dtype}")
def test_route_and_norm_bad_inputs_raise_value_error_naming_the_argument(fn, arg, value):
    base = make_inputs(Case(3, (2, 5), 12, heads=3), torch.float32)
    kwargs = dict(out_norm_weight=torch.ones(12), out_norm_eps=1e-6, **base.kwargs())
    kwargs[arg] = value
    with pytest.raises(ValueError) as info:
        fn(base.values, base.keys, **kwargs)
    msg = str(info.value)
    assert f"`{arg}`" in msg and "must be" in msg and "found" in msg, msg


def test_wrapper_traces_under_torch_compile_fullgraph():
    # the wrapper's checks must not graph-break, and the op must keep its autograd
    case = Case(3, (2, 5), 12, heads=4, keys=True, bias=True, scale=True)
    base = make_inputs(case, torch.float32, seed=10)
    grad_out = torch.randn(*case.batch, case.d)
    compiled = torch.compile(route, backend="aot_eager", fullgraph=True, dynamic=False)
    out, grads = run_with_grads(compiled, base.cast(torch.float32, torch.float32, True), grad_out)
    ref, ref_grads = run_with_grads(route, base.cast(torch.float32, torch.float32, True), grad_out)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=0, atol=0)


@pytest.mark.parametrize("op, call", [
    ("route", lambda v: torch.ops.depthrewrite.route(v, None, torch.randn(10), torch.ones(10), None, None, 3, 1e-6)),
    ("route_many", lambda v: torch.ops.depthrewrite.route_many(v, torch.randn(2, 10), torch.ones(2, 10), 3, 1e-6,
                                                               None)),
    ("route_merge", lambda v: torch.ops.depthrewrite.route_merge(v[:1], [torch.randn(4, 3)], v[1:2], None,
                                                                 torch.randn(1, 10), torch.ones(1, 10),
                                                                 torch.ones(1), 3, 1e-6)),
])
def test_the_ops_called_directly_check_their_inputs(op, call):
    """A caller of ``torch.ops.depthrewrite.*`` skips the Python wrappers: the ops check the
    same things (on the CPU they failed in a reshape, naming nothing)."""
    values = [torch.randn(4, 10) for _ in range(3)]
    with pytest.raises(ValueError, match=rf"^{op}: `heads` must be a positive int dividing the width d=10; found 3"):
        call(values)
