"""The merges' source logit with its sum over the tokens as a matrix product
(depthrewrite/ops/source_logit.py): its sum, its gradients against autograd through the
plain ops, where it applies, and that a compiled backward takes the product."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.ops import merge_partial, source_logit as sl


#: the CUDA product (torch.mm with out_dtype) where a GPU is present; the CPU's float32 form always
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def plain_ops(monkeypatch):
    """Switch the matrix-product backward off (the form before session 68)."""
    monkeypatch.setattr(sl, "MATMUL_TOKEN_SUM", False)


def _count_products(monkeypatch) -> list:
    """A list that gets one entry for each source logit taking the matrix product."""
    calls = []
    apply = sl._SourceLogit.apply
    monkeypatch.setattr(sl._SourceLogit, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls


def _stored(batch, d, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*batch, d, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)


def _float64_sum(weights, stored, heads):
    d = stored.shape[-1]
    w = weights.double().reshape(-1, heads).repeat_interleave(d // heads, dim=1)
    return (w * stored.double().reshape(-1, d)).sum(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
def test_token_weighted_sum_keeps_the_weights_float32(heads, device):
    """Three bf16 parts keep each float32 weight: the sum is the float64 one to within the
    float32 additions' rounding (at most T unit roundoffs of the sum of the terms' sizes).
    With each weight one bf16 (8 significant bits) it is not: the test fails if the parts
    after the first are dropped."""
    stored = _stored((3, 37), 48, device=device)
    weights = torch.randn(3, 37, heads, generator=torch.Generator().manual_seed(1)).to(device)
    exact = _float64_sum(weights, stored, heads)
    bound = 111 * 2.0 ** -24 * _float64_sum(weights.abs(), stored.abs(), heads)
    got = sl.token_weighted_sum(weights, stored, heads)
    assert got.dtype == torch.float32 and got.shape == (48,)
    assert got.device == stored.device
    assert ((got.double() - exact).abs() <= bound).all()
    one_part = _float64_sum(weights.bfloat16().float(), stored, heads)
    assert ((one_part - exact).abs() > bound).any()


def test_the_parts_add_up_to_each_weight():
    weights = torch.randn(500, 3, generator=torch.Generator().manual_seed(8)) * 1e3
    parts = sl.split_into_parts(weights, torch.bfloat16, sl.WEIGHT_PARTS)
    assert parts.dtype == torch.bfloat16 and parts.shape == (500, 3 * sl.WEIGHT_PARTS)
    rebuilt = parts.double().view(500, sl.WEIGHT_PARTS, 3).sum(1)
    assert ((rebuilt - weights.double()).abs() <= 2.0 ** -26 * weights.double().abs()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("batch", [(29,), (2, 17)])
def test_gradients_match_autograd_through_the_plain_ops(heads, batch, device):
    """Forward and every gradient (the float32 value, query, key-norm weight) of the
    matrix-product form against autograd through the reference, all in float32 from the
    same bf16 source: equal to float32 rounding."""
    d = 40
    stored = _stored(batch, d, device=device)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(d, generator=g).to(device).requires_grad_()
    weight = (1 + 0.2 * torch.randn(d, generator=g)).to(device).requires_grad_()
    grad_z = torch.randn(*batch, heads, generator=g).to(device)
    results = []
    for form in (sl.source_logit, lambda v, s, *a: sl.source_logit_reference(v, *a)):
        value = stored.float().requires_grad_()
        z = form(value, stored, query, weight, heads, 1e-6)
        results.append((z, *torch.autograd.grad(z, (value, query, weight), grad_z)))
    assert results[0][0].grad_fn is not None and "SourceLogit" in type(results[0][0].grad_fn).__name__
    for name, got, expected in zip(("z", "value", "query", "key_norm_weight"), *results):
        assert got.dtype == expected.dtype, name
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6 * expected.abs().max().item(), msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
def test_a_per_token_scale_joins_the_token_weights(heads, device):
    """A source scaled per token (two-phase WAV's RMS-matched partial details: the factor
    takes no gradient) takes the product too; forward and every gradient equal autograd
    through the plain ops on the same scaled float32 value."""
    batch, d = (3, 13), 40
    stored = _stored(batch, d, device=device)
    g = torch.Generator().manual_seed(11)
    scale = (0.25 + 2 * torch.rand(*batch, generator=g)).to(device)  # RMS matching: min(rho, ...) > 0
    query = torch.randn(d, generator=g).to(device).requires_grad_()
    weight = (1 + 0.2 * torch.randn(d, generator=g)).to(device).requires_grad_()
    grad_z = torch.randn(*batch, heads, generator=g).to(device)
    results = []
    for matmul in (True, False):
        value = stored.float().requires_grad_()
        scaled = value * scale.unsqueeze(-1)
        if matmul:
            z = sl.source_logit(scaled, stored, query, weight, heads, 1e-6, scale=scale)
            assert "SourceLogit" in type(z.grad_fn).__name__
        else:
            z = sl.source_logit_reference(scaled, query, weight, heads, 1e-6)
        results.append((z, *torch.autograd.grad(z, (value, query, weight), grad_z)))
    for name, got, expected in zip(("z", "value", "query", "key_norm_weight"), *results):
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6 * expected.abs().max().item(), msg=name)


def test_a_scale_that_needs_a_gradient_takes_the_plain_ops():
    """The product gives the scale no gradient: a scale that needs one keeps the plain ops,
    through which autograd gives it its gradient."""
    stored = _stored((5,), 8)
    scale = torch.full((5,), 0.5, requires_grad=True)
    value = stored.float() * scale.unsqueeze(-1)
    z = sl.source_logit(value, stored, torch.randn(8), torch.ones(8), 1, 1e-6, scale=scale)
    assert "SourceLogit" not in type(z.grad_fn).__name__
    (grad_scale,) = torch.autograd.grad(z.sum(), (scale,))
    assert grad_scale.abs().sum() > 0


def test_the_query_gradient_alone_is_the_plain_ops():
    """The backward's branch where neither the value nor the key-norm weight needs a
    gradient still gives the query's."""
    d, stored = 16, _stored((9,), 16)
    query = torch.randn(d, requires_grad=True)
    weight = torch.ones(d)
    value = stored.float()  # no gradient for the value
    z = sl.source_logit(value, stored, query, weight, 1, 1e-6)
    (grad_query,) = torch.autograd.grad(z.sum(), (query,))
    expected = torch.autograd.grad(sl.source_logit_reference(value, query, weight, 1, 1e-6).sum(), (query,))[0]
    torch.testing.assert_close(grad_query, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_stored_dtypes_take_the_plain_ops(dtype):
    """fp16's exponent range cannot hold every float32 weight, and float32 sources need no
    split: both are differentiated through the plain ops."""
    stored = _stored((5,), 8, dtype)
    z = sl.source_logit(stored.float().requires_grad_(), stored, torch.randn(8), torch.ones(8), 1, 1e-6)
    assert "SourceLogit" not in type(z.grad_fn).__name__


def test_the_switch_restores_the_plain_ops(plain_ops):
    stored = _stored((5,), 8)
    z = sl.source_logit(stored.float().requires_grad_(), stored, torch.randn(8), torch.ones(8), 1, 1e-6)
    assert "SourceLogit" not in type(z.grad_fn).__name__


@pytest.mark.parametrize("heads", [1, 2])
def test_merge_partial_in_bf16_gives_the_plain_ops_gradients(heads, monkeypatch):
    """merge_partial with bf16 activations: every gradient with the matrix product equals
    the plain ops' to within one bf16 rounding of the result."""
    g = torch.Generator().manual_seed(3)
    batch, d = (3, 11), 32
    out, partial = _stored(batch, d, seed=4), _stored(batch, d, seed=5)
    lse = torch.randn(*batch, heads, generator=g)
    query, weight = torch.randn(d, generator=g) * 0.3, 1 + 0.1 * torch.randn(d, generator=g)
    grad = torch.randn(*batch, d, generator=g).bfloat16()
    results = []
    for matmul in (True, False):
        monkeypatch.setattr(sl, "MATMUL_TOKEN_SUM", matmul)
        leaves = [t.clone().requires_grad_() for t in (out, lse, partial, query, weight)]
        merged = merge_partial(leaves[0], leaves[1], leaves[2], query=leaves[3], key_norm_weight=leaves[4],
                               heads=heads)
        results.append((merged, *torch.autograd.grad(merged, leaves, grad)))
    names = ("merged", "out", "lse", "partial", "query", "key_norm_weight")
    for name, got, expected in zip(names, *results):
        ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 1e-5  # bf16: 8 significant bits
        torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=ulp * expected.abs().max().item(),
                                   msg=name)


def test_merge_routes_scaled_sources_in_bf16_give_the_plain_ops_gradients(monkeypatch):
    """merge_routes as two-phase WAV calls it (three results, three partial sources, two of
    them biased and scaled per token) with bf16 activations: every gradient with the matrix
    products equals the plain ops' to within one bf16 rounding, and all three sources took
    the product."""
    from depthrewrite.ops import merge_routes

    g = torch.Generator().manual_seed(12)
    batch, d = (2, 9), 24
    outs = [_stored(batch, d, seed=20 + k) for k in range(3)]
    sources = [_stored(batch, d, seed=30 + k) for k in range(3)]
    lses = [torch.randn(*batch, 1, generator=g) for _ in range(3)]
    scales = [0.5 + torch.rand(*batch, generator=g) for _ in range(2)]
    biases = [torch.tensor(-1.5), torch.tensor(-2.5)]
    query, weight = torch.randn(d, generator=g) * 0.3, 1 + 0.1 * torch.randn(d, generator=g)
    grad = torch.randn(*batch, d, generator=g).bfloat16()
    calls = _count_products(monkeypatch)
    results = []
    for matmul in (True, False):
        monkeypatch.setattr(sl, "MATMUL_TOKEN_SUM", matmul)
        leaves = [t.clone().requires_grad_() for t in (*outs, *lses, *sources, *biases, query, weight)]
        o, l_, v, b = leaves[:3], leaves[3:6], leaves[6:9], leaves[9:11]
        merged = merge_routes([(o[0], l_[0], None), (o[1], l_[1], b[0]), (o[2], l_[2], b[1])],
                              [(v[0], None, None), (v[1], b[0], scales[0]), (v[2], b[1], scales[1])],
                              query=leaves[11], key_norm_weight=leaves[12])
        results.append((merged, *torch.autograd.grad(merged, leaves, grad)))
    assert len(calls) == 3
    for k, (got, expected) in enumerate(zip(*results)):
        ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 1e-5  # bf16: 8 significant bits
        torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=ulp * expected.abs().max().item(),
                                   msg=f"output {k}")


def _backward_targets(monkeypatch, matmul: bool, triton_sum: bool = False) -> dict:
    """Matrix products and ``depthrewrite::token_weighted_sum`` calls in the backward graph
    AOTAutograd makes of merge_partial (bf16), and the gradients it gave."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(sl, "MATMUL_TOKEN_SUM", matmul)
    monkeypatch.setattr(sl, "TRITON_TOKEN_SUM", triton_sum)
    counts = {}

    def count_backward(gm, _inputs):
        targets = [n.target for n in gm.graph.nodes]
        counts["mm"] = sum(t in (torch.ops.aten.mm.default, torch.ops.aten.mm.dtype) for t in targets)
        counts["token_sum"] = targets.count(torch.ops.depthrewrite.token_weighted_sum.default)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=count_backward)
    out, partial = _stored((4, 6), 16, seed=6), _stored((4, 6), 16, seed=7)
    lse = torch.randn(4, 6, 1, generator=torch.Generator().manual_seed(8))
    query = torch.randn(16, generator=torch.Generator().manual_seed(9), requires_grad=True)
    weight = torch.ones(16, requires_grad=True)

    def merge(o, p, q, w):
        return merge_partial(o, lse, p, query=q, key_norm_weight=w).float().sum()

    torch._dynamo.reset()
    loss = torch.compile(merge, backend=backend, fullgraph=True)(out.requires_grad_(), partial.requires_grad_(),
                                                                  query, weight)
    counts["grads"] = torch.autograd.grad(loss, (query, weight))
    torch._dynamo.reset()
    return counts


def test_a_compiled_backward_forms_the_token_sum_as_one_product(monkeypatch):
    """Traced by Dynamo and AOTAutograd (fullgraph), the backward holds one matrix product
    (the query and key-norm-weight gradients' sum over the tokens); the plain ops' holds none."""
    assert _backward_targets(monkeypatch, True)["mm"] == 1
    assert _backward_targets(monkeypatch, False)["mm"] == 0


def test_with_triton_token_sum_a_compiled_backward_calls_the_op(monkeypatch):
    """With ``TRITON_TOKEN_SUM`` the backward's sum over the tokens is one call of
    ``depthrewrite::token_weighted_sum`` (its fake gives AOTAutograd the shape), no product;
    off the GPU the op is the product, so the gradients are the product's bit for bit."""
    product = _backward_targets(monkeypatch, True)
    op = _backward_targets(monkeypatch, True, triton_sum=True)
    assert (op["mm"], op["token_sum"]) == (0, 1) and product["token_sum"] == 0
    for got, expected in zip(op["grads"], product["grads"]):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("scheme, options", [("block_attnres", {}), ("mhar", {"block_size": 2}),
                                             ("dar", {"layers_per_block": 2})])
def test_a_bf16_model_trains_as_with_the_plain_ops(scheme, options, monkeypatch):
    """A rewritten bf16 GPT's every parameter gradient (eager) with the matrix products
    equals the plain ops' to within one bf16 rounding, and the products did run."""
    calls = _count_products(monkeypatch)
    grads = []
    for matmul in (True, False):
        monkeypatch.setattr(sl, "MATMUL_TOKEN_SUM", matmul)
        model, tokens = _bf16_gpt(scheme, **options)
        model(tokens, tokens)[1].backward()
        grads.append(_float_grads(model))
        if matmul:
            assert calls, f"{scheme}: no merge took the matrix product"
    _assert_within_one_bf16_rounding(grads[0], grads[1])


def _bf16_gpt(scheme: str, **options):
    """The tiny GPT rewritten with ``scheme``, in bf16, its queries away from zero (so that
    the merges' weights differ per token), and a batch of tokens for it."""
    import depthrewrite
    from depthrewrite.models.gpt import gpt_from_preset

    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny"), scheme, **options).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _float_grads(model) -> dict:
    return {name: p.grad.float() for name, p in model.named_parameters()}


def _assert_within_one_bf16_rounding(grads: dict, expected_grads: dict) -> None:
    """Every gradient within one bf16 rounding of the largest of its expected values."""
    assert grads.keys() == expected_grads.keys()
    for name, expected in expected_grads.items():
        ulp = 2.0 ** -7 * expected.abs().max().item()
        torch.testing.assert_close(grads[name], expected, rtol=0, atol=ulp, msg=name)


def test_a_bf16_model_compiled_with_the_triton_token_sum_trains_as_with_the_products(monkeypatch):
    """Block AttnRes's bf16 GPT compiled whole through the backend (fullgraph) with
    ``TRITON_TOKEN_SUM``: the op passes the backend's graph passes and Inductor, and the
    loss and every gradient are the products' (off the GPU the op is the product; Inductor
    fuses the step around it differently, so the gradients to within one bf16 rounding)."""
    results = []
    for triton_sum in (False, True):
        monkeypatch.setattr(sl, "TRITON_TOKEN_SUM", triton_sum)
        torch._dynamo.reset()
        model, tokens = _bf16_gpt("block_attnres")
        loss = torch.compile(model, backend="depthrewrite", fullgraph=True)(tokens, tokens)[1]
        loss.backward()
        results.append((loss.detach(), _float_grads(model)))
    torch._dynamo.reset()
    (loss, grads), (expected_loss, expected_grads) = results[1], results[0]
    assert torch.equal(loss, expected_loss)
    _assert_within_one_bf16_rounding(grads, expected_grads)
