"""The fused Triton route kernels against a float64 reference: the output and every
gradient (values, keys, query, key-norm weight, logit bias), on awkward shapes.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below
before Triton is first imported), on CPU tensors: same kernel code, numpy arithmetic.
On the device machine ``benchmarks/gpu_suite.py`` runs the same comparison compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # must precede the first import of triton.jit-decorated code
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from depthrewrite.kernels import implementation_for  # noqa: E402
from depthrewrite.kernels import route_triton  # noqa: E402
from depthrewrite.ops.route import route_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# relative L2 error allowed against float64, by the dtype a tensor is returned in
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _make(n, batch, d, heads, keys, bias, scale, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(
        values=[rnd(*batch, d).to(dtype) for _ in range(n)],
        keys=[rnd(*batch, d).to(dtype) for _ in range(n)] if keys else None,
        # large enough query that the softmax is far from uniform
        query=rnd(d) * 2.0 / d**0.5 * heads**0.5,
        key_norm_weight=torch.rand(d, generator=gen) + 0.5,
        logit_bias=rnd(n) if bias else None,
        source_scale=(torch.rand(n, *batch, generator=gen) + 0.5) if scale else None,
        heads=heads,
    )


def _leaves(inp):
    out = [*inp["values"], *(inp["keys"] or []), inp["query"], inp["key_norm_weight"]]
    return out + ([inp["logit_bias"]] if inp["logit_bias"] is not None else [])


def _reference_f64(inp, grad_out):
    """Output and gradients (in ``_leaves`` order) computed in float64."""
    leaves = [t.detach().double().requires_grad_() for t in _leaves(inp)]
    n = len(inp["values"])
    values, rest = leaves[:n], leaves[n:]
    keys = None
    if inp["keys"] is not None:
        keys, rest = rest[:n], rest[n:]
    bias = rest[2] if len(rest) > 2 else None
    scale = None if inp["source_scale"] is None else inp["source_scale"].double()
    out = route_reference(values, keys, query=rest[0], key_norm_weight=rest[1], logit_bias=bias,
                          source_scale=scale, heads=inp["heads"])
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return out.detach(), list(grads)


def _on(inp, device):
    moved = {}
    for key, val in inp.items():
        if isinstance(val, list):
            moved[key] = [t.to(device) for t in val]
        elif isinstance(val, torch.Tensor):
            moved[key] = val.to(device)
        else:
            moved[key] = val
    return moved


def _run_fused(inp, grad_out):
    args = (inp["values"], inp["keys"], inp["query"], inp["key_norm_weight"], inp["logit_bias"],
            inp["source_scale"], inp["heads"], 1e-6)
    out = route_triton.route_forward(*args)
    gv, gk, gq, gw, gb = route_triton.route_backward(grad_out, *args)
    grads = [*gv, *gk, gq, gw] + ([gb] if inp["logit_bias"] is not None else [])
    return out, grads


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = [
    # n, batch, d, heads, keys, bias, scale
    (1, (5,), 16, 1, True, True, True),
    (2, (7,), 24, 1, False, False, False),
    (2, (3, 3), 40, 4, False, True, True),
    (9, (7,), 1000, 1, False, True, False),
    (9, (5,), 48, 3, True, True, True),
    (33, (3,), 24, 2, False, True, True),
    (33, (5,), 40, 1, True, False, False),
    (65, (3,), 8, 1, False, True, False),
    (65, (3,), 12, 2, True, True, True),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}_b{}_d{}_h{}{}{}{}".format(
    c[0], "x".join(map(str, c[1])), c[2], c[3], "_keys" if c[4] else "", "_bias" if c[5] else "",
    "_scale" if c[6] else ""))
def test_fused_matches_reference(case, dtype):
    n, batch, d, heads, keys, bias, scale = case
    inp = _make(n, batch, d, heads, keys, bias, scale, dtype, seed=n * 1000 + d)
    grad_out = torch.randn(*batch, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    ref_out, ref_grads = _reference_f64(inp, grad_out)
    dev_inp = _on(inp, DEVICE)
    out, grads = _run_fused(dev_inp, grad_out.to(DEVICE))

    assert out.dtype == dtype and out.shape == ref_out.shape
    assert _rel(out, ref_out) < TOL[dtype]
    assert len(grads) == len(ref_grads)
    for got, want, leaf in zip(grads, ref_grads, _leaves(inp)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert torch.isfinite(got).all()
        # parameter gradients are fp32 sums over tokens; activation gradients round to dtype
        assert _rel(got, want) < TOL[got.dtype], (got.shape, _rel(got, want))


def test_one_source_is_the_scaled_source_bit_for_bit():
    inp = _on(_make(1, (6,), 20, 2, False, True, True, torch.float32, seed=3), DEVICE)
    out, grads = _run_fused(inp, torch.ones(6, 20, device=DEVICE))
    expected = inp["values"][0] * inp["source_scale"][0].unsqueeze(-1)
    assert torch.equal(out, expected)
    assert torch.equal(grads[0], inp["source_scale"][0].unsqueeze(-1).expand(6, 20))
    assert not grads[1].any() and not grads[2].any() and not grads[3].any()


def test_backward_is_deterministic():
    inp = _on(_make(9, (37,), 24, 2, True, True, True, torch.float32, seed=11), DEVICE)
    grad_out = torch.randn(37, 24).to(DEVICE)
    _, first = _run_fused(inp, grad_out)
    _, second = _run_fused(inp, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_width_limit_is_a_value_error():
    d = route_triton.MAX_ROW * 2
    values = [torch.zeros(1, d, device=DEVICE)] * 2
    with pytest.raises(ValueError, match="at most 32768"):
        route_triton.route_forward(values, None, torch.zeros(d, device=DEVICE), torch.ones(d, device=DEVICE),
                                   None, None, 1, 1e-6)


@pytest.mark.parametrize("fwd_cfg,bwd_cfg", [
    (dict(prefetch=False, block_t=1), dict(block_t=1, per_sm=1, prefetch=True)),
    (dict(prefetch=True, block_t=4), dict(block_t=2, per_sm=2, prefetch=False)),
    (dict(prefetch=False, block_t=2), dict(block_t=4, per_sm=3, prefetch=True)),
])
@pytest.mark.parametrize("keys", [False, True], ids=["values_as_keys", "keys"])
def test_launch_variants_match_reference(fwd_cfg, bwd_cfg, keys):
    """The tuning knobs (benchmarks/gpu_suite.py times them) change the schedule, not the math."""
    inp = _make(5, (11,), 24, 2, keys, True, True, torch.float32, seed=5)
    grad_out = torch.randn(11, 24, generator=torch.Generator().manual_seed(2))
    ref_out, ref_grads = _reference_f64(inp, grad_out)
    d = _on(inp, DEVICE)
    args = (d["values"], d["keys"], d["query"], d["key_norm_weight"], d["logit_bias"], d["source_scale"], 2, 1e-6)
    out = route_triton.route_forward(*args, config=fwd_cfg)
    gv, gk, gq, gw, gb = route_triton.route_backward(grad_out.to(DEVICE), *args, config=bwd_cfg)
    assert _rel(out, ref_out) < TOL[torch.float32]
    for got, want in zip([*gv, *gk, gq, gw, gb], ref_grads):
        assert _rel(got, want) < TOL[torch.float32]


def test_float64_is_rejected_by_the_kernel_and_reported_as_reference():
    values = [torch.randn(2, 8, dtype=torch.float64, device=DEVICE)] * 2
    with pytest.raises(ValueError, match="float64"):
        route_triton.route_forward(values, None, torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE),
                                   None, None, 1, 1e-6)
    assert implementation_for("cuda", torch.float64) == "reference"
    assert implementation_for("cpu", torch.bfloat16) == "reference"
    assert implementation_for("cuda", torch.bfloat16, torch.float32) == "triton"
