"""The fused Triton route kernels against a float64 reference: the output, its log-sum-exp,
the fused output norm and every gradient (values, keys, query, key-norm weight, logit bias,
output-norm weight), on awkward shapes.

The one-pass backward takes ``sum_j a_j da_j`` as ``<g, out>`` from the output saved in the
activation dtype (the documented rounding, module docstring of route_triton). Its gradients
are compared with a float64 oracle that makes the same use of the kernel's saved output
(``_oracle_f64(..., saved_out=out)``), at the tolerances of the returned dtypes; the saved
output itself is compared with the exact float64 output, and in float32 every gradient is
also compared with the exact float64 gradients. Note that the interpreter rounds fp32 ->
bf16 toward zero (the GPU rounds to nearest), doubling bf16 rounding errors here.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below
before Triton is first imported), on CPU tensors: same kernel code, numpy arithmetic.
On the device machine ``benchmarks/gpu_suite.py`` runs the same comparison compiled.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # must precede the first import of triton.jit-decorated code
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from depthrewrite.kernels import implementation_for  # noqa: E402
from depthrewrite.kernels import route_triton  # noqa: E402
from depthrewrite.ops.route import route_logits_reference, route_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# relative L2 error allowed against float64, by the dtype a tensor is returned in
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _make(n, batch, d, heads, keys, bias, scale, dtype, seed, out_norm=False):
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
        out_norm_weight=(torch.rand(d, generator=gen) + 0.5) if out_norm else None,
    )


def _leaves(inp):
    out = [*inp["values"], *(inp["keys"] or []), inp["query"], inp["key_norm_weight"]]
    out += [inp["logit_bias"]] if inp["logit_bias"] is not None else []
    return out + ([inp["out_norm_weight"]] if inp["out_norm_weight"] is not None else [])


def _oracle_f64(inp, grad_out, saved_out=None, grad_normed=None):
    """Output, lse, normed output (None without an output norm) and gradients (in
    ``_leaves`` order) computed in float64; the loss is ``<grad_out, out>`` plus
    ``<grad_normed, normed>`` with an output norm.

    With ``saved_out``, the gradients are those of the one-pass backward given that saved
    output: the output norm is taken of ``saved_out`` (as the kernel's, of its rounded
    output), and ``dz_i = a_i (da_i - <G, saved_out>)`` instead of ``a_i (da_i - <G, out>)``
    (G: the total gradient reaching ``out``), obtained by adding ``sum_i c_i z_i`` with the
    constant ``c_i = -a_i <G, saved_out - out>`` to the loss (its gradient on the logits is
    exactly that shift)."""
    leaves = [t.detach().double().requires_grad_() for t in _leaves(inp)]
    n, heads = len(inp["values"]), inp["heads"]
    values, rest = leaves[:n], leaves[n:]
    keys = None
    if inp["keys"] is not None:
        keys, rest = rest[:n], rest[n:]
    bias = rest[2] if inp["logit_bias"] is not None else None
    norm_weight = rest[-1] if inp["out_norm_weight"] is not None else None
    scale = None if inp["source_scale"] is None else inp["source_scale"].double()
    kw = dict(query=rest[0], key_norm_weight=rest[1], logit_bias=bias, source_scale=scale, heads=heads)
    out = route_reference(values, keys, **kw)
    z = route_logits_reference(values, keys, **kw)
    saved = None if saved_out is None else saved_out.detach().double().cpu()
    loss = (out * grad_out.double()).sum()
    normed = None
    if norm_weight is not None:
        # value of saved_out where given, gradient of out: the kernel's norm of its saved output
        x = out if saved is None else saved + (out - out.detach())
        normed = F.rms_norm(x, (x.shape[-1],), weight=norm_weight, eps=1e-6)
        loss = loss + (normed * grad_normed.double().cpu()).sum()
    if n == 1:
        lse = torch.zeros_like(z[0])  # the op's definition: one source has weight exp(0 - 0)
    else:
        lse = torch.logsumexp(z, 0)
        if saved is not None:
            total = torch.autograd.grad(loss, out, retain_graph=True)[0]
            delta = ((saved - out.detach()) * total).unflatten(-1, (heads, -1)).sum(-1)
            loss = loss - (torch.softmax(z, 0).detach() * delta * z).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out.detach(), lse.detach(), None if normed is None else normed.detach(), list(grads)


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


def _args(inp):
    return (inp["values"], inp["keys"], inp["query"], inp["key_norm_weight"], inp["logit_bias"],
            inp["source_scale"], inp["heads"], 1e-6)


def _run_fused(inp, grad_out, grad_normed=None, fwd_cfg=None, bwd_cfg=None):
    norm = inp["out_norm_weight"]
    out, lse, normed = route_triton.route_forward(*_args(inp), norm, 1e-6, config=fwd_cfg)
    gv, gk, gq, gw, gb, gn = route_triton.route_backward(grad_out, out, lse, *_args(inp), grad_normed, norm, 1e-6,
                                                         config=bwd_cfg)
    grads = [*gv, *gk, gq, gw] + ([gb] if inp["logit_bias"] is not None else []) + ([gn] if norm is not None else [])
    return out, lse, normed, grads


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = [
    # n, batch, d, heads, keys, bias, scale
    (1, (5,), 16, 1, True, True, True),
    (2, (7,), 24, 1, False, False, False),
    (2, (3, 3), 40, 4, False, True, True),
    (9, (7,), 1000, 1, False, True, False),
    # one head, row padded to 2048, no keys: the register caps (launch options the interpreter
    # ignores; on the GPU the backward at 96 registers, 5 programs per SM, the forward at 72)
    (9, (5,), 1500, 1, False, True, True),
    # one head, row padded to 4096: the wide launches (2 tokens per program; 5 leave a tail)
    (9, (5,), 2500, 1, True, True, True),
    (9, (5,), 48, 3, True, True, True),
    (33, (3,), 24, 2, False, True, True),
    (33, (5,), 40, 1, True, False, False),
    (65, (3,), 8, 1, False, True, False),
    (65, (3,), 12, 2, True, True, True),
    (129, (3,), 8, 1, True, True, True),  # more sources than the DESIGN.md shapes
    (2, (3,), 7186, 1, False, True, True),  # the widest DESIGN-like width (a padded row of 8192)
    (3, (3,), 7186, 2, True, False, False),
    (2, (3,), 32768, 1, True, True, True),  # the widest row the kernels take (MAX_ROW)
    (3, (2,), 32768, 16, False, False, False),
    # 16 heads on a row of 1024 (full MHAR's sites at 350M): on the GPU the backward's sources
    # through the pipeline at 128 registers (route_triton.MULTI_HEAD_BACKWARD_MAXNREG); with
    # keys the launch before (KEYED_MULTI_HEAD_BACKWARD_PER_SM). ACC_CASES takes the last
    (9, (5,), 1024, 16, True, True, True),
    (9, (5,), 1024, 16, False, False, False),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case_id(c):
    return "n{}_b{}_d{}_h{}{}{}{}".format(c[0], "x".join(map(str, c[1])), c[2], c[3], "_keys" if c[4] else "",
                                          "_bias" if c[5] else "", "_scale" if c[6] else "")


def _check_against_oracle(case, dtype, out_norm, cfg=None):
    n, batch, d, heads, keys, bias, scale = case
    inp = _make(n, batch, d, heads, keys, bias, scale, dtype, seed=n * 1000 + d, out_norm=out_norm)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(*batch, d, generator=gen).to(dtype)
    grad_normed = torch.randn(*batch, d, generator=gen).to(dtype) if out_norm else None
    dev_inp = _on(inp, DEVICE)
    out, lse, normed, grads = _run_fused(dev_inp, grad_out.to(DEVICE),
                                         None if grad_normed is None else grad_normed.to(DEVICE), cfg, cfg)
    ref_out, ref_lse, ref_normed, exact_grads = _oracle_f64(inp, grad_out, grad_normed=grad_normed)
    _, _, _, ref_grads = _oracle_f64(inp, grad_out, saved_out=out, grad_normed=grad_normed)

    assert out.dtype == dtype and out.shape == ref_out.shape
    assert _rel(out, ref_out) < TOL[dtype]
    assert lse.dtype == torch.float32 and lse.shape == (*batch, heads)
    if n > 1:
        assert _rel(lse, ref_lse) < TOL[torch.float32]
    else:
        assert not lse.any()  # defined as 0 for one source
    if out_norm:
        assert normed.dtype == dtype and normed.shape == ref_out.shape
        assert _rel(normed, ref_normed) < TOL[dtype]
    else:
        assert normed.numel() == 0
    assert len(grads) == len(ref_grads)
    for got, want, exact, leaf in zip(grads, ref_grads, exact_grads, _leaves(inp)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert torch.isfinite(got).all()
        # parameter gradients are fp32 sums over tokens; activation gradients round to dtype
        assert _rel(got, want) < TOL[got.dtype], (got.shape, _rel(got, want))
        if dtype == torch.float32:  # the saved output's rounding is negligible: exact math
            assert _rel(got, exact) < TOL[torch.float32], (got.shape, _rel(got, exact))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_matches_reference(case, dtype):
    _check_against_oracle(case, dtype, out_norm=False)


NORM_CASES = [
    (1, (5,), 16, 2, True, True, True),
    (2, (7,), 24, 1, False, False, False),
    (9, (3,), 1000, 4, False, True, True),
    (3, (5,), 2500, 1, False, True, False),  # the wide launches (2 tokens per program)
    (2, (3,), 7186, 1, False, False, True),
    (33, (5,), 40, 1, True, False, False),
    (2, (3,), 32768, 1, True, False, False),  # the widest row (MAX_ROW): both norm forms at it
    (65, (3,), 12, 2, True, True, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORM_CASES, ids=_case_id)
def test_fused_output_norm_matches_reference(case, dtype):
    """The fused output RMSNorm: its result and every gradient, the norm weight's included."""
    _check_against_oracle(case, dtype, out_norm=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORM_CASES[::2], ids=_case_id)
def test_output_norm_other_implementation_matches_reference(case, dtype):
    """The output norm's implementation that is not the default (config ``fuse_norm``:
    inside the routing kernels, or in passes of their own) gives the same results."""
    _check_against_oracle(case, dtype, out_norm=True, cfg=dict(fuse_norm=not route_triton.FUSE_NORM))


def test_unused_output_norm_changes_no_bit_and_gets_zero_gradient():
    inp = _on(_make(9, (13,), 40, 2, True, True, True, torch.bfloat16, seed=4, out_norm=True), DEVICE)
    grad_out = torch.randn(13, 40).to(DEVICE, torch.bfloat16)
    out, lse, normed, grads = _run_fused(inp, grad_out, grad_normed=None)
    plain = _on({**inp, "out_norm_weight": None}, DEVICE)
    out0, lse0, normed0, grads0 = _run_fused(plain, grad_out)
    assert torch.equal(out, out0) and torch.equal(lse, lse0) and normed0.numel() == 0 and normed.numel() > 0
    for a, b in zip(grads[:-1], grads0):
        assert torch.equal(a, b)
    assert grads[-1].shape == (40,) and not grads[-1].any()


def test_one_source_is_the_scaled_source_bit_for_bit():
    inp = _on(_make(1, (6,), 20, 2, False, True, True, torch.float32, seed=3), DEVICE)
    out, lse, _, grads = _run_fused(inp, torch.ones(6, 20, device=DEVICE))
    assert lse.shape == (6, 2) and not lse.any()  # defined as 0 for one source
    expected = inp["values"][0] * inp["source_scale"][0].unsqueeze(-1)
    assert torch.equal(out, expected)
    assert torch.equal(grads[0], inp["source_scale"][0].unsqueeze(-1).expand(6, 20))
    assert not grads[1].any() and not grads[2].any() and not grads[3].any()


@pytest.mark.parametrize("keys", [False, True], ids=["values_as_keys", "keys_and_out_norm"])
def test_backward_is_deterministic_and_prefetch_changes_no_bit(keys):
    inp = _on(_make(9, (37,), 24, 2, keys, True, True, torch.bfloat16, seed=11, out_norm=keys), DEVICE)
    grad_out = torch.randn(37, 24).to(DEVICE, torch.bfloat16)
    grad_normed = torch.randn(37, 24).to(DEVICE, torch.bfloat16) if keys else None
    _, _, _, first = _run_fused(inp, grad_out, grad_normed)
    _, _, _, second = _run_fused(inp, grad_out, grad_normed)
    _, _, _, third = _run_fused(inp, grad_out, grad_normed, bwd_cfg=dict(prefetch=False))
    assert len(first) == len(third) == 9 * (2 if keys else 1) + 3 + (1 if keys else 0)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b)
        assert torch.equal(a, c)  # prefetching moves loads, not arithmetic


@pytest.mark.parametrize("n,keys", [(9, False), (9, True), (1, True)], ids=["values_as_keys", "keys", "one_source"])
def test_pipeline_changes_no_bit(n, keys):
    """Forward and backward with the sources through Triton's software pipeline (2 and 3
    stages) give the same bits as with the register prefetch: the loads move, not the
    arithmetic (bias, source scale and, with keys, the output norm; one source: the
    pipeline is not used)."""
    inp = _on(_make(n, (37,), 24, 2, keys, True, True, torch.bfloat16, seed=13, out_norm=keys), DEVICE)
    grad_out = torch.randn(37, 24).to(DEVICE, torch.bfloat16)
    grad_normed = torch.randn(37, 24).to(DEVICE, torch.bfloat16) if keys else None
    runs = [_run_fused(inp, grad_out, grad_normed, fwd_cfg=dict(stages=stages), bwd_cfg=dict(stages=stages))
            for stages in (0, 2, 3)]
    for other in runs[1:]:
        for a, b in zip(runs[0][:3], other[:3]):  # out, lse, normed
            assert torch.equal(a, b)
        assert len(other[3]) == len(runs[0][3]) == n * (2 if keys else 1) + 3 + (1 if keys else 0)
        assert all(torch.equal(a, b) for a, b in zip(runs[0][3], other[3]))


#: n = 2 with heads, bias and scale; n = 9 at a width not a power of two; keys with several
#: heads; n = 33; one source (dz is d lse either way)
EXACT_CASES = [CASES[2], CASES[3], CASES[6], CASES[7], CASES[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("stages", [0, 2])
@pytest.mark.parametrize("case", EXACT_CASES, ids=_case_id)
def test_exact_softmax_grad_gives_the_exact_gradients_in_half_precision(case, stages, dtype):
    """With ``exact_softmax_grad`` the backward forms ``sum_j a_j <v_j, g>`` from the bf16
    (fp16) sources, not from the output saved in that dtype: the fp32 parameter gradients
    are the exact float64 ones (not the saved-output oracle's) to fp32 rounding, the others
    to the dtype's. The shortcut's parameter gradients are further off than that (several
    sources)."""
    n, batch, d, heads, keys, bias, scale = case
    inp = _make(n, batch, d, heads, keys, bias, scale, dtype, seed=n * 1000 + d)
    grad_out = torch.randn(*batch, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    dev_inp = _on(inp, DEVICE)
    _, _, _, grads = _run_fused(dev_inp, grad_out.to(DEVICE), bwd_cfg={"stages": stages, "exact_softmax_grad": True})
    _, _, _, exact = _oracle_f64(inp, grad_out)
    assert len(grads) == len(exact)
    for got, want in zip(grads, exact):
        assert _rel(got, want) < TOL[got.dtype], (got.shape, _rel(got, want))
    _, _, _, shortcut = _run_fused(dev_inp, grad_out.to(DEVICE), bwd_cfg={"stages": stages})
    params = [i for i, leaf in enumerate(_leaves(inp)) if leaf.dtype == torch.float32]
    if n > 1:
        assert min(_rel(shortcut[i], exact[i]) for i in params) > TOL[torch.float32]
    else:
        assert all(torch.equal(a, b) for a, b in zip(shortcut, grads))


def test_exact_softmax_grad_with_the_fused_output_norm_matches_float64():
    """fp32, the output norm fused into the backward (its gradient joins g before the sum)."""
    inp = _make(9, (5,), 48, 3, True, True, True, torch.float32, seed=4, out_norm=True)
    gen = torch.Generator().manual_seed(8)
    grad_out, grad_normed = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    dev_inp = _on(inp, DEVICE)
    norm = dev_inp["out_norm_weight"]
    out, lse, _ = route_triton.route_forward(*_args(dev_inp), norm, 1e-6)
    grads = route_triton.route_backward(grad_out.to(DEVICE), out, lse, *_args(dev_inp), grad_normed.to(DEVICE), norm,
                                        1e-6, config={"exact_softmax_grad": True, "fuse_norm": True})
    flat = [*grads[0], *grads[1], *grads[2:]]
    _, _, _, exact = _oracle_f64(inp, grad_out, grad_normed=grad_normed)
    assert len(flat) == len(exact)
    assert all(_rel(got, want) < TOL[torch.float32] for got, want in zip(flat, exact))


BAD_CONFIGS = [("prefetch", v, r"prefetch must be one of \(False, True\)") for v in (2, 1.0, "1")] + [
    ("maxnreg", v, "maxnreg must be an int from 16 to 255 or None") for v in (8, 256, 64.0, True, "64")] + [
    ("stages", v, "stages must be an int >= 0") for v in (-1, True, 2.0)]


@pytest.mark.parametrize("key,value,expected", BAD_CONFIGS, ids=lambda x: repr(x)[:20])
def test_bad_launch_config_is_a_value_error(key, value, expected):
    """Forward and backward refuse a launch config value they do not take, naming it."""
    inp = _on(_make(2, (3,), 8, 1, False, False, False, torch.float32, seed=1), DEVICE)
    message = rf"route \(Triton\): config {expected}; found {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        route_triton.route_forward(*_args(inp), None, 1e-6, config={key: value})
    out, lse, _ = route_triton.route_forward(*_args(inp), None, 1e-6)
    with pytest.raises(ValueError, match=message):
        route_triton.route_backward(torch.ones_like(out), out, lse, *_args(inp), config={key: value})


@pytest.mark.parametrize("name", ["exact_softmax_grad", "fused_sums"])
@pytest.mark.parametrize("value", [1, None, "yes"])
def test_bad_backward_flag_is_a_value_error(name, value):
    inp = _on(_make(2, (3,), 8, 1, False, False, False, torch.float32, seed=1), DEVICE)
    out, lse, _ = route_triton.route_forward(*_args(inp), None, 1e-6)
    message = rf"route \(Triton\): config {name} must be True or False; found {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        route_triton.route_backward(torch.ones_like(out), out, lse, *_args(inp), config={name: value})


def test_bad_pair_reduce_is_a_value_error():
    """The forward's ``pair_reduce`` (its own knob: the backward has no such choice) takes a bool."""
    inp = _on(_make(2, (3,), 8, 1, False, False, False, torch.float32, seed=1), DEVICE)
    with pytest.raises(ValueError, match=r"route \(Triton\): config pair_reduce must be True or False; found 1"):
        route_triton.route_forward(*_args(inp), None, 1e-6, config={"pair_reduce": 1})


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
    # a register cap (a launch option: ignored by the interpreter, spills on the GPU)
    (dict(block_t=1, maxnreg=40), dict(block_t=1, per_sm=6, maxnreg=64)),
    # the forward's two row sums in one reduction
    (dict(block_t=2, pair_reduce=True), dict(block_t=2)),
    # the sources through Triton's software pipeline
    (dict(block_t=2, stages=3), dict(block_t=2, per_sm=2, stages=2)),
    # the backward's three row sums of a source in one reduction (the GPU's default, off in
    # the interpreter), with the exact softmax gradient's first walk too
    (dict(block_t=2), dict(block_t=2, fused_sums=True)),
    (dict(block_t=1), dict(block_t=1, fused_sums=True, exact_softmax_grad=True, stages=2)),
])
@pytest.mark.parametrize("keys", [False, True], ids=["values_as_keys", "keys"])
def test_launch_variants_match_reference(fwd_cfg, bwd_cfg, keys):
    """The tuning knobs (benchmarks/gpu_suite.py times them) change the schedule, not the math."""
    inp = _make(5, (11,), 24, 2, keys, True, True, torch.float32, seed=5)
    grad_out = torch.randn(11, 24, generator=torch.Generator().manual_seed(2))
    ref_out, _, _, ref_grads = _oracle_f64(inp, grad_out)
    out, _, _, grads = _run_fused(_on(inp, DEVICE), grad_out.to(DEVICE), fwd_cfg=fwd_cfg, bwd_cfg=bwd_cfg)
    assert _rel(out, ref_out) < TOL[torch.float32]
    assert len(grads) == len(ref_grads)
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < TOL[torch.float32]


def test_float64_is_rejected_by_the_kernel_and_reported_as_reference():
    values = [torch.randn(2, 8, dtype=torch.float64, device=DEVICE)] * 2
    with pytest.raises(ValueError, match="float64"):
        route_triton.route_forward(values, None, torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE),
                                   None, None, 1, 1e-6)
    assert implementation_for("cuda", torch.float64) == "reference"
    assert implementation_for("cpu", torch.bfloat16) == "reference"
    assert implementation_for("cuda", torch.bfloat16, torch.float32) == "triton"


# one source with keys, two, nine with keys, 33 with keys, 16 heads on a row of 1024 (full MHAR's calls)
ACC_CASES = [CASES[0], CASES[1], CASES[4], CASES[6], CASES[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ACC_CASES, ids=_case_id)
def test_running_sums_are_added_to_the_gradients(case, dtype):
    """``grad_values_acc`` / ``grad_keys_acc`` (what depthrewrite.grad_accumulation passes):
    each gradient with a running sum comes back as that sum plus the gradient, the others
    bit for bit as without; the reference op does the same."""
    n, batch, d, heads, keys, bias, scale = case
    inp = _on(_make(n, batch, d, heads, keys, bias, scale, dtype, seed=n * 1000 + d), DEVICE)
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(*batch, d, generator=gen).to(dtype).to(DEVICE)

    def running_sums(like):
        picks = torch.rand(len(like), generator=gen) < 0.6
        picks[0] = True  # at least one
        return [torch.randn(*t.shape, generator=gen).to(dtype).to(DEVICE) if p else None for t, p in zip(like, picks)]

    acc_v = running_sums(inp["values"])
    acc_k = running_sums(inp["keys"]) if keys else None
    out, lse, _ = route_triton.route_forward(*_args(inp), None, 1e-6)
    plain = route_triton.route_backward(grad_out, out, lse, *_args(inp))
    summed = route_triton.route_backward(grad_out, out, lse, *_args(inp), grad_values_acc=acc_v, grad_keys_acc=acc_k)
    from depthrewrite.ops.route import _route_backward_op

    ref_plain = _route_backward_op._init_fn(grad_out, out, lse, *_args(inp))
    ref_summed = _route_backward_op._init_fn(grad_out, out, lse, *_args(inp), None, None, 1e-6, acc_v, acc_k)
    for group, accs in ((0, acc_v), (1, acc_k or [])):
        for i, acc in enumerate(accs):
            for got, base in ((summed[group][i], plain[group][i]), (ref_summed[group][i], ref_plain[group][i])):
                assert got.dtype == dtype and got.shape == base.shape
                if acc is None:
                    assert torch.equal(got, base)
                else:  # added in fp32 before the one rounding
                    assert _rel(got, base.double() + acc.double()) < TOL[dtype]
    # parameter gradients do not change
    for j in range(2, 6):
        assert torch.equal(summed[j], plain[j])


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]], ids=_case_id)  # one source with keys, 9, 33
def test_running_sums_written_in_place(case):
    """``route_backward_into_`` (the backend's ``accumulate_in_place``): every gradient is
    written into the tensor given for it (a running sum, added to, or a buffer), bit for bit
    what route_backward returns with the same running sums, and so are the parameter
    gradients: through the op (the kernels on the GPU, the reference on the CPU) and through
    the kernels' launcher called directly (the interpreter on the CPU)."""
    n, batch, d, heads, keys, bias, scale = case
    dtype = torch.bfloat16
    inp = _on(_make(n, batch, d, heads, keys, bias, scale, dtype, seed=n * 7 + d), DEVICE)
    gen = torch.Generator().manual_seed(3)
    grad_out = torch.randn(*batch, d, generator=gen).to(dtype).to(DEVICE)
    out, lse, _ = route_triton.route_forward(*_args(inp), None, 1e-6)
    lists = {"values": inp["values"], "keys": inp["keys"] or []}
    # values: the even sources have running sums; keys: the odd ones (one source: its key's
    # gradient is zero, so the NaN buffer given for it must come back as zeros)
    index = {name: [i for i in range(len(like)) if i % 2 == odd] for odd, (name, like) in enumerate(lists.items())}
    acc = {name: [torch.randn(*t.shape, generator=gen).to(dtype).to(DEVICE) if i in index[name] else None
                  for i, t in enumerate(like)] for name, like in lists.items()}
    acc_args = dict(grad_values_acc=acc["values"], grad_keys_acc=acc["keys"] if keys else None)

    def given():  # the running sums (copies: written in place) and NaN-filled buffers for the rest
        return {name: [a.clone() if a is not None else torch.full_like(t, float("nan"))
                       for a, t in zip(acc[name], like)] for name, like in lists.items()}

    expected = torch.ops.depthrewrite.route_backward(grad_out, out, lse, *_args(inp), **acc_args)
    outputs = given()
    pointers = {name: [t.data_ptr() for t in outs] for name, outs in outputs.items()}
    rest = torch.ops.depthrewrite.route_backward_into_(
        grad_out, out, lse, *_args(inp), None, None, 1e-6, outputs["values"], index["values"], outputs["keys"],
        index["keys"])
    launched = given()
    in_place = {name: [o if i in index[name] else None for i, o in enumerate(outs)] for name, outs in launched.items()}
    direct = route_triton.route_backward(grad_out, out, lse, *_args(inp), grad_values_acc=in_place["values"],
                                         grad_keys_acc=in_place["keys"] if keys else None,
                                         grad_values_out=launched["values"],
                                         grad_keys_out=launched["keys"] if keys else None)
    kernel = route_triton.route_backward(grad_out, out, lse, *_args(inp), **acc_args)
    for group, name in enumerate(("values", "keys")):
        assert [t.data_ptr() for t in outputs[name]] == pointers[name]  # written where given
        for got, want in zip(outputs[name], expected[group]):
            assert torch.equal(got, want)
        for got, returned, want in zip(launched[name], direct[group], kernel[group]):
            assert returned is got and torch.equal(got, want)
    for got, want in zip(rest, expected[2:]):
        assert torch.equal(got, want)


def test_bad_in_place_outputs_are_value_errors():
    inp = _on(_make(3, (4,), 16, 1, False, False, False, torch.float32, seed=0), DEVICE)
    grad_out = torch.randn(4, 16).to(DEVICE)
    out, lse, _ = route_triton.route_forward(*_args(inp), None, 1e-6)
    buffers = [torch.zeros_like(v) for v in inp["values"]]
    into = torch.ops.depthrewrite.route_backward_into_
    with pytest.raises(ValueError, match=r"`grad_values` must have one tensor per source \(3\); found 2"):
        into(grad_out, out, lse, *_args(inp), None, None, 1e-6, buffers[:2], [0], [], [])
    with pytest.raises(ValueError, match="running-sum indices must be distinct sources from 0 to 2"):
        into(grad_out, out, lse, *_args(inp), None, None, 1e-6, buffers, [1, 1], [], [])
    strided = torch.zeros(16, 4, device=DEVICE).t()
    with pytest.raises(ValueError, match=r"`grad_values\[1\]` must be contiguous"):
        into(grad_out, out, lse, *_args(inp), None, None, 1e-6, [buffers[0], strided, buffers[2]], [0], [], [])


def test_bad_running_sums_are_value_errors():
    inp = _on(_make(3, (4,), 16, 1, False, False, False, torch.float32, seed=0), DEVICE)
    grad_out = torch.randn(4, 16).to(DEVICE)
    out, lse, _ = route_triton.route_forward(*_args(inp), None, 1e-6)
    with pytest.raises(ValueError, match="one entry per source"):
        route_triton.route_backward(grad_out, out, lse, *_args(inp), grad_values_acc=[None])
    with pytest.raises(ValueError, match=r"grad_values_acc\[1\]"):
        route_triton.route_backward(grad_out, out, lse, *_args(inp),
                                    grad_values_acc=[None, torch.zeros(4, 8, device=DEVICE), None])
    with pytest.raises(ValueError, match="no keys"):
        route_triton.route_backward(grad_out, out, lse, *_args(inp), grad_keys_acc=[None, None, None])


class _Launch:
    """Stands in for a Triton kernel: records each launch's keyword arguments."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(kw)


def _shifted(t):
    """``t``'s values in a contiguous view one element into a bigger storage: off 16-byte
    alignment (2 bytes in bf16)."""
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


def test_alignment_hint_covers_every_row_read_through_a_table(monkeypatch):
    """The kernels read rows through pointer tables and tell the compiler those rows are
    16-byte aligned only when every tensor behind the tables is: the sources (forward), and
    the sources, the gradients written and the running sums read (backward). A contiguous
    view one element into its storage (2 bytes off in bf16) must turn the hint off."""
    calls = []
    for name in ("_route_fwd_kernel", "_route_bwd_kernel"):
        monkeypatch.setattr(route_triton, name, _Launch(calls))
    inp = _make(3, (4,), 64, 1, False, True, True, torch.bfloat16, 5)
    values = [v.to(DEVICE) for v in inp["values"]]
    query, weight = inp["query"].to(DEVICE), inp["key_norm_weight"].to(DEVICE)
    bias, scale = inp["logit_bias"].to(DEVICE), inp["source_scale"].to(DEVICE)

    out, lse = torch.randn_like(values[0]), torch.zeros(4, 1, device=DEVICE)
    grad = torch.randn_like(values[0])
    sums = [torch.randn_like(v) for v in values]
    for srcs, acc, aligned in ((values, sums, True), ([values[0], _shifted(values[1]), values[2]], sums, False),
                               (values, [sums[0], None, _shifted(sums[2])], False)):
        calls.clear()
        route_triton.route_forward(srcs, None, query, weight, bias, scale, 1, 1e-6)
        route_triton.route_backward(grad, out, lse, srcs, None, query, weight, bias, scale, 1, 1e-6,
                                    grad_values_acc=acc)
        assert [c["ALIGNED"] for c in calls] == [srcs is values, aligned]
