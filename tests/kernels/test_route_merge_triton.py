"""The fused ``route_merge`` kernels against float64: the output and every gradient (the
results, their log-sum-exps, the values, the keys, the queries, the key-norm weights, the
mix weights and the fused output norm's weight) on awkward shapes, in fp32, bf16 and fp16,
with and without the output norm. Without a GPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

triton = pytest.importorskip("triton")

from depthrewrite.kernels import route_merge_triton  # noqa: E402
from depthrewrite.kernels.route_triton import MAX_ROW  # noqa: E402
from depthrewrite.ops import route_merge, route_merge_reference  # noqa: E402
from tests.kernels.test_route_triton import DEVICE, TOL, _on, _rel  # noqa: E402
from tests.conftest import skip_widest_row_in_half_precision  # noqa: E402


def _make(j, batch, d, heads, keys, dtype, seed, shared_keys=False, norm=False):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(*batch, d, generator=gen).to(dtype) for _ in range(j)]
    if shared_keys:  # DAR: each stream's key is the other stream's entry
        key_list = values[::-1]
    elif keys:
        key_list = [3.0 * torch.randn(*batch, d, generator=gen).to(dtype) for _ in range(j)]
    else:
        key_list = None
    return dict(
        outs=[torch.randn(*batch, d, generator=gen).to(dtype) for _ in range(j)],
        # log-sum-exps near the logits' scale, so that the weights are spread over (0, 1)
        lses=[torch.randn(*batch, heads, generator=gen) for _ in range(j)],
        values=values,
        keys=key_list,
        queries=torch.randn(j, d, generator=gen) * 2.0 / d**0.5 * heads**0.5,
        key_norm_weights=torch.rand(j, d, generator=gen) + 0.5,
        mix=torch.rand(j, generator=gen) + 0.25,
        heads=heads,
        out_norm_weight=torch.rand(d, generator=gen) + 0.5 if norm else None,
    )


def _tensors(inp):
    norm = [inp["out_norm_weight"]] if inp["out_norm_weight"] is not None else []
    return [*inp["outs"], *inp["lses"], *inp["values"], *(inp["keys"] or []), inp["queries"],
            inp["key_norm_weights"], inp["mix"], *norm]


def _args(dev, heads):
    """The kernels' positional arguments for the inputs ``dev``."""
    return (dev["outs"], dev["lses"], dev["values"], dev["keys"], dev["queries"], dev["key_norm_weights"],
            dev["mix"], heads, 1e-6, dev["out_norm_weight"], 1e-5)


def _flat(got):
    """The backward's gradients as one list, each list entry its own (the norm weight's
    left out when it is the empty placeholder)."""
    return [*got[0], *got[1], *got[2], *got[3], *got[4:7], *([got[7]] if got[7].numel() else [])]


def _oracle_f64(inp, grad):
    """The output and the gradients of every tensor argument (each list entry its own) in float64."""
    leaves = [t.detach().double().requires_grad_() for t in _tensors(inp)]
    j, k = len(inp["outs"]), len(inp["keys"] or [])
    outs, lses, values = leaves[:j], leaves[j:2 * j], leaves[2 * j:3 * j]
    keys = leaves[3 * j:3 * j + k] or None
    queries, weights, mix = leaves[3 * j + k:3 * j + k + 3]
    x = route_merge_reference(outs, lses, values, keys, queries=queries, key_norm_weights=weights, mix=mix,
                              heads=inp["heads"])
    if inp["out_norm_weight"] is not None:  # the norm of x itself, not of x rounded
        x = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight=leaves[3 * j + k + 3], eps=1e-5)
    return x.detach(), torch.autograd.grad(x, leaves, grad.double())


def _on_device(inp):
    moved = _on(inp, DEVICE)
    if inp["keys"] is not None and inp["keys"][0] is inp["values"][-1]:
        moved["keys"] = moved["values"][::-1]  # keep the shared tensors shared
    return moved


CASES = [
    # j, batch, d, heads, keys, shared keys
    (1, (3, 5), 1000, 1, False, False),  # Block AttnRes: one result, width not a power of two
    (1, (7,), 64, 4, False, False),  # block MHAR: several heads
    (2, (3, 5), 1000, 1, True, True),  # DAR: two streams, each keyed by the other
    (2, (9,), 96, 1, True, False),
    (2, (2, 3), 48, 3, False, False),  # heads of 16 channels, 3 heads padded to 4
    (1, (5,), 7186, 1, False, False),  # a padded row of 8192
    (2, (3,), 32768, 16, True, True),  # the widest row the kernels take (MAX_ROW)
]


@pytest.mark.parametrize("norm", [False, True], ids=["x", "normed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"j{c[0]}-{'x'.join(map(str, c[1]))}-d{c[2]}-h{c[3]}"
                         f"{'-keys' if c[4] else ''}{'-shared' if c[5] else ''}")
def test_kernels_match_float64_output_and_every_gradient(case, dtype, norm):
    j, batch, d, heads, keys, shared = case
    skip_widest_row_in_half_precision(d, dtype, MAX_ROW)
    inp = _make(j, batch, d, heads, keys, dtype, seed=j * 100 + d, shared_keys=shared, norm=norm)
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(*batch, d, generator=gen).to(dtype)
    x64, grads64 = _oracle_f64(inp, grad)

    dev = _on_device(inp)
    x = route_merge_triton.route_merge_forward(*_args(dev, heads))
    assert x.dtype == dtype and x.shape == x64.shape
    assert _rel(x, x64) < TOL[dtype]
    got = route_merge_triton.route_merge_backward(grad.to(DEVICE), *_args(dev, heads))
    assert got[7].numel() == (d if norm else 0)
    got = _flat(got)
    assert len(got) == len(grads64)
    names = ([f"outs[{i}]" for i in range(j)] + [f"lses[{i}]" for i in range(j)] + [f"values[{i}]" for i in range(j)]
             + [f"keys[{i}]" for i in range(len(inp["keys"] or []))] + ["queries", "key_norm_weights", "mix"]
             + (["out_norm_weight"] if norm else []))
    for name, g, ref, like in zip(names, got, grads64, _tensors(inp), strict=True):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        # the gradients are computed in float32 and returned in the argument's dtype
        tol = TOL[like.dtype] * (1 if like.dtype == torch.float32 else 2)
        if name == "mix" and norm:
            # rms_norm(x) is invariant to x's scale, so <g_x, r_j> nearly cancels (exactly, but
            # for eps, at J = 1): the error is measured against the size of its terms
            assert ((g.double().cpu() - ref).abs() <= tol * _mix_terms(inp, grad)).all(), name
        else:
            assert _rel(g, ref) < tol, name


def _mix_terms(inp, grad):
    """Per result j, ``|g_x| |r_j|`` in float64 (``g_x``: the gradient reaching the merged
    ``x`` through the output norm; ``r_j``: the merged result j): a bound on the sum of the
    absolute terms of the mix weight's gradient ``<g_x, r_j>``."""
    import torch.nn.functional as F

    double = {k: ([t.double() for t in v] if isinstance(v, list) else v.double() if isinstance(v, torch.Tensor)
                  else v) for k, v in inp.items()}
    one = torch.ones(1, dtype=torch.float64)
    results = [route_merge_reference([double["outs"][j]], [double["lses"][j]], [double["values"][j]],
                                     None if inp["keys"] is None else [double["keys"][j]],
                                     queries=double["queries"][j:j + 1], key_norm_weights=double["key_norm_weights"][j:j + 1],
                                     mix=one, heads=inp["heads"]) for j in range(len(inp["outs"]))]
    x = sum(m * r for m, r in zip(double["mix"], results)).requires_grad_()
    normed = F.rms_norm(x, (x.shape[-1],), weight=double["out_norm_weight"], eps=1e-5)
    (g_x,) = torch.autograd.grad(normed, x, grad.double())
    return torch.stack([g_x.norm() * r.norm() for r in results])


def test_one_result_with_unit_mix_is_merge_partial():
    """J = 1, m = 1: the op is merge_partial (Block AttnRes's second phase), forward and backward."""
    from depthrewrite.ops import merge_partial

    inp = _make(1, (5,), 40, 1, False, torch.float32, seed=3)
    leaves = [t.detach().requires_grad_() for t in (inp["outs"][0], inp["lses"][0], inp["values"][0],
                                                     inp["queries"][0], inp["key_norm_weights"][0])]
    expected = merge_partial(leaves[0], leaves[1], leaves[2], query=leaves[3], key_norm_weight=leaves[4])
    expected_grads = torch.autograd.grad(expected.square().sum(), leaves)
    fused = [t.detach().requires_grad_() for t in leaves]
    x = route_merge([fused[0]], [fused[1]], [fused[2]], queries=fused[3][None], key_norm_weights=fused[4][None],
                    mix=torch.ones(1))
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    for g, e in zip(torch.autograd.grad(x.square().sum(), fused), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", [False, True], ids=["x", "normed"])
def test_op_gradients_match_finite_differences(norm):
    inp = _make(2, (3,), 12, 2, True, torch.float64, seed=5, norm=norm)
    leaves = [t.detach().double().requires_grad_() for t in _tensors(inp)]

    def fn(*ts):
        outs, lses, values, keys = ts[0:2], ts[2:4], ts[4:6], ts[6:8]
        return route_merge(list(outs), list(lses), list(values), list(keys), queries=ts[8], key_norm_weights=ts[9],
                           mix=ts[10], heads=2, out_norm_weight=ts[11] if norm else None)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_normed_output_is_the_norm_of_the_merge():
    """``out_norm_weight``: the op returns ``rms_norm(x) * w`` of the ``x`` it would return
    without it, and its gradients are autograd's through that composition."""
    import torch.nn.functional as F

    inp = _make(2, (4, 3), 24, 2, True, torch.float32, seed=9, shared_keys=True)
    weight = (torch.rand(24, generator=torch.Generator().manual_seed(3)) + 0.5).requires_grad_()
    leaves = [t.detach().requires_grad_() for t in (*inp["outs"], *inp["values"])]
    kwargs = dict(queries=inp["queries"], key_norm_weights=inp["key_norm_weights"], mix=inp["mix"], heads=2)
    x = route_merge(leaves[:2], inp["lses"], leaves[2:], leaves[2:][::-1], **kwargs)
    expected = F.rms_norm(x, (24,), weight=weight, eps=1e-5)
    normed = route_merge(leaves[:2], inp["lses"], leaves[2:], leaves[2:][::-1], out_norm_weight=weight,
                         out_norm_eps=1e-5, **kwargs)
    torch.testing.assert_close(normed, expected, rtol=1e-6, atol=1e-6)
    probe = torch.randn(normed.shape, generator=torch.Generator().manual_seed(4))
    for got, want in zip(torch.autograd.grad(normed, [*leaves, weight], probe),
                         torch.autograd.grad(expected, [*leaves, weight], probe), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(lses=a["lses"][:1]), "`lses` must be a list of 2 tensors"),
    (lambda a: a.update(mix=torch.ones(3)), r"`mix` must be a floating-point tensor of shape \(2,\)"),
    (lambda a: a.update(heads=5), "`heads` must be a positive int dividing the width d=12"),
    (lambda a: a.update(values=a["values"][:1]), r"`values` must be 2 tensors \(one per entry of `outs`\)"),
    (lambda a: a.update(queries=torch.ones(2, 11)), r"`queries` must be a floating-point tensor of shape \(2, 12\)"),
    (lambda a: a.update(out_norm_weight=torch.ones(11)),
     r"`out_norm_weight` must be None or a floating-point tensor of shape \(12,\)"),
    (lambda a: a.update(out_norm_eps=-1.0), "`out_norm_eps` must be a finite positive float"),
])
def test_bad_input_is_refused_with_the_argument_named(change, message):
    inp = _make(2, (3,), 12, 1, False, torch.float32, seed=1)
    inp["out_norm_eps"] = 1e-6
    change(inp)
    with pytest.raises(ValueError, match=message):
        route_merge(inp["outs"], inp["lses"], inp["values"], inp["keys"], queries=inp["queries"],
                    key_norm_weights=inp["key_norm_weights"], mix=inp["mix"], heads=inp["heads"],
                    out_norm_weight=inp["out_norm_weight"], out_norm_eps=inp["out_norm_eps"])


def test_kernel_refuses_too_wide_a_row_naming_the_op():
    d = 2 * MAX_ROW
    inp = {"outs": [torch.zeros(1, d)], "lses": [torch.zeros(1, 1)], "values": [torch.zeros(1, d)],
           "keys": None, "queries": torch.zeros(1, d), "key_norm_weights": torch.ones(1, d), "mix": torch.ones(1)}
    inp = _on_device(inp)
    with pytest.raises(ValueError, match=rf"route_merge \(Triton\): width d={d} with heads=1 pads to a row of"):
        route_merge_triton.route_merge_forward(inp["outs"], inp["lses"], inp["values"], None, inp["queries"],
                                               inp["key_norm_weights"], inp["mix"], 1, 1e-6)


def test_kernel_refuses_more_results_than_it_takes():
    inp = _make(3, (3,), 16, 1, False, torch.float32, seed=2)
    with pytest.raises(ValueError, match="at most 2 results a launch; found 3"):
        route_merge_triton.route_merge_forward(inp["outs"], inp["lses"], inp["values"], None, inp["queries"],
                                               inp["key_norm_weights"], inp["mix"], 1, 1e-6)


@pytest.mark.parametrize("config", [{"block_t": 1, "num_warps": 1}, {"block_t": 4, "num_warps": 2, "per_sm": 1},
                                    {"block_t": 1, "per_sm": 1, "stages": 3}],
                         ids=["one-token", "four-tokens", "pipelined"])
def test_launch_choices_give_the_same_function(config):
    """A tuning run's launch choices (``config``) change how the tokens are split among
    programs, not the result: output and every gradient against float64 as by default."""
    inp = _make(2, (3, 5), 96, 2, True, torch.float32, seed=11, shared_keys=True, norm=True)
    grad = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(5))
    x64, grads64 = _oracle_f64(inp, grad)
    args = _args(_on_device(inp), 2)
    assert _rel(route_merge_triton.route_merge_forward(*args, config=config), x64) < TOL[torch.float32]
    got = route_merge_triton.route_merge_backward(grad.to(DEVICE), *args, config=config)
    for g, ref in zip(_flat(got), grads64, strict=True):
        assert _rel(g, ref) < TOL[torch.float32]


@pytest.mark.parametrize("config,message", [
    ({"block_t": 3}, "config block_t must be a power of two"),
    ({"num_warps": 3}, "config num_warps must be a power of two"),
    ({"per_sm": 0}, "config per_sm must be a positive int"),
    ({"stages": -1}, "config stages must be an int >= 0; found -1"),
    ({"unroll": 2}, "unknown config entries \\['unroll'\\]"),
])
def test_bad_launch_choices_are_named(config, message):
    inp = _on_device(_make(1, (4,), 32, 1, False, torch.float32, seed=1))
    with pytest.raises(ValueError, match=r"route_merge \(Triton\): " + message):
        route_merge_triton.route_merge_forward(inp["outs"], inp["lses"], inp["values"], None, inp["queries"],
                                               inp["key_norm_weights"], inp["mix"], 1, 1e-6, config=config)
