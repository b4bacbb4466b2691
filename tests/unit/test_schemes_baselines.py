"""The baselines of docs/spec.md section 8 as rewrites: denseformer, rezero, layerscale, hyperconn,
mhc. Each against a hand-written oracle (a loop over ``model.blocks`` calling the block's
norms and branches directly, the scheme done by hand from docs/spec.md), its init property, and a
short real training run."""

from __future__ import annotations

import functools
import io
import math
import types

import pytest
import torch
from hypothesis import Phase, example, given, settings, strategies as st

import depthrewrite
from depthrewrite.models.gpt import gpt_from_preset
from depthrewrite.passes.baselines import LayerScaleScheme, ScaleOptions
from depthrewrite.passes.runtime import original_class
from tests.conftest import corpus_bytes, hf_model
from tests.toy_models import ToyLM

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
#: a failing example is reported as found: shrinking it re-runs whole rewrites for minutes
NO_SHRINK = settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def tiny(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    return gpt_from_preset("tiny", n_layer=3, **overrides).to(dtype).eval()


def rewrite(model, scheme, **options):
    return depthrewrite.rewrite(model, scheme, example_inputs=(IDS,), **options)


def new_params(model):
    return {n: p for n, p in model.named_parameters() if "depth_route" in n}


def route(block, position):
    return block.depth_route[f"site{position}"]


def readout(model):
    return model.norm_final.depth_route["readout"]


@torch.no_grad()
def randomize(model, seed, scale=0.5):
    """Every new parameter to a random value away from zero (and from its init)."""
    gen = torch.Generator().manual_seed(seed)
    for p in new_params(model).values():
        sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
        p.copy_(sign * scale * (0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype)))


# ----------------------------------------------------------------------------- oracle
def sites_of(block, rope):
    """The (norm, branch) pairs of a bundled GPT block, in order."""
    return [(block.norm_attn, lambda n: block.attn(n, rope)), (block.norm_mlp, block.mlp)]


def final_logits(model, y):
    norm = model.norm_final  # its routed __call__ would route again: call the plain forward
    return model.lm_head(original_class(norm).forward(norm, y))


def embed_and_rope(model, ids):
    T = ids.shape[1]
    return model.embed(ids), (model.rope_cos[:T], model.rope_sin[:T])


def oracle_denseformer(model, ids):
    e, rope = embed_and_rope(model, ids)
    outputs, y = [e], e  # X_0 = e; block 0 reads e itself
    for b, block in enumerate(model.blocks):
        if b > 0:
            w = route(block, 1).weights
            y = sum(w[j] * outputs[j] for j in range(b + 1))
        for norm, branch in sites_of(block, rope):
            y = y + branch(norm(y))
        outputs.append(y)
    w = readout(model).weights
    return final_logits(model, sum(w[j] * outputs[j] for j in range(len(outputs))))


def oracle_scaled(model, ids):
    """ReZero and LayerScale: ``h + scale * u``."""
    h, rope = embed_and_rope(model, ids)
    for block in model.blocks:
        for p, (norm, branch) in enumerate(sites_of(block, rope), start=1):
            h = h + route(block, p).scale * branch(norm(h))
    return final_logits(model, h)


def rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def oracle_hyperconn(model, ids, n, eps=1e-6):
    """Zhu et al.: H' = A_r^T H + B^T u with u = f(A_m^T H); A and B per token when dynamic."""
    e, rope = embed_and_rope(model, ids)
    H = [e] * n
    for block in model.blocks:
        for p, (norm, branch) in enumerate(sites_of(block, rope), start=1):
            r = route(block, p)
            A_m = [r.pre[j].expand(e.shape[:-1]) for j in range(n)]
            A_r = [[r.res[j, k].expand(e.shape[:-1]) for k in range(n)] for j in range(n)]
            B = [r.post[j].expand(e.shape[:-1]) for j in range(n)]
            if r.dynamic:
                for j in range(n):
                    hn = rms(H[j], eps)
                    A_m[j] = A_m[j] + r.scale_pre_res * torch.tanh(hn @ r.dynamic_pre_res[:, 0])
                    A_r[j] = [A_r[j][k] + r.scale_pre_res * torch.tanh(hn @ r.dynamic_pre_res[:, 1 + k])
                              for k in range(n)]
                    B[j] = B[j] + r.scale_post * torch.tanh(hn @ r.dynamic_post)
            x = sum(A_m[j][..., None] * H[j] for j in range(n))
            u = branch(norm(x))
            H = [sum(A_r[j][i][..., None] * H[j] for j in range(n)) + B[i][..., None] * u for i in range(n)]
    w = readout(model).weights
    return final_logits(model, sum(w[j] * H[j] for j in range(n)))


def oracle_sinkhorn(logits, iters):
    m = torch.exp(logits)
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)  # rows
        m = m / m.sum(-2, keepdim=True)  # columns
    return m


def oracle_mhc(model, ids, n, iters=20, eps=1e-6):
    """x_{l+1} = H_res x_l + H_post^T f(H_pre x_l), coefficients from the flattened streams."""
    e, rope = embed_and_rope(model, ids)
    H = [e] * n
    for block in model.blocks:
        for p, (norm, branch) in enumerate(sites_of(block, rope), start=1):
            r = route(block, p)
            dyn = rms(torch.cat(H, dim=-1), eps) @ r.phi
            pre = torch.sigmoid(r.pre + r.alpha_pre * dyn[..., :n])
            post = 2 * torch.sigmoid(r.post + r.alpha_post * dyn[..., n:2 * n])
            res = oracle_sinkhorn(r.res + r.alpha_res * dyn[..., 2 * n:].reshape(*dyn.shape[:-1], n, n), iters)
            u = branch(norm(sum(pre[..., j:j + 1] * H[j] for j in range(n))))
            H = [sum(res[..., i, j:j + 1] * H[j] for j in range(n)) + post[..., i:i + 1] * u for i in range(n)]
    w = readout(model).weights
    return final_logits(model, sum(w[j] * H[j] for j in range(n)))


ORACLES = {
    "denseformer": ({}, oracle_denseformer),
    "rezero": ({}, oracle_scaled),
    "layerscale": ({}, oracle_scaled),
    "hyperconn": ({"streams": 3}, functools.partial(oracle_hyperconn, n=3)),
    "hyperconn_static": ({"streams": 2, "dynamic": False}, functools.partial(oracle_hyperconn, n=2)),
    "mhc": ({"streams": 3}, functools.partial(oracle_mhc, n=3)),
}


@functools.lru_cache(maxsize=None)
def rewritten_double(key):
    options, _ = ORACLES[key]
    return rewrite(tiny(dtype=torch.float64), key.split("_")[0], **options)


@pytest.mark.parametrize("key", list(ORACLES))
@NO_SHRINK
@given(seed=st.integers(0, 2**16))
def test_rewritten_model_matches_hand_written_oracle(key, seed):
    model = rewritten_double(key)  # float64: the oracle sums in another order
    randomize(model, seed)
    with torch.no_grad():
        got, want = model(IDS), ORACLES[key][1](model, IDS)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-10), (got - want).abs().max()
    # and the new parameters matter: away from their init the model is not the original
    with torch.no_grad():
        assert not torch.allclose(tiny(dtype=torch.float64)(IDS), got, atol=1e-3)


# ----------------------------------------------------------------------- init properties
def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("parallel", [False, True])
def test_denseformer_is_the_original_bit_for_bit_at_init(dtype, parallel):
    model = tiny(dtype=dtype, parallel_block=parallel)
    ref = logits(model)
    rewrite(model, "denseformer")
    assert torch.equal(logits(model), ref)


@pytest.mark.parametrize("shape", ["plain", "parallel_two_adds", "reversed"])
def test_denseformer_identity_on_toy_shapes(shape):
    model = ToyLM(vocab=256, d=16, n_layer=3, shape=shape).eval()
    ref = logits(model)
    rewrite(model, "denseformer")
    assert torch.equal(logits(model), ref)


@pytest.mark.parametrize("scheme", ["rezero", "layerscale"])
def test_scale_zero_makes_every_layer_the_identity_map(scheme):
    """alpha = 0 (ReZero's default) or lambda = 0: h + 0 * u is h exactly, so the model is
    head(norm_final(e)) bit for bit. This is *not* the original model's output."""
    model = tiny()
    ref = logits(model)
    rewrite(model, scheme, init=0.0)
    with torch.no_grad():
        branch_free = final_logits(model, model.embed(IDS))
    out = logits(model)
    assert torch.equal(out, branch_free)
    assert not torch.allclose(out, ref)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("scheme", ["rezero", "layerscale", "denseformer"])
def test_preserve_identity_gives_the_original_bit_for_bit(scheme, parallel):
    model = tiny(parallel_block=parallel)
    ref = logits(model)
    rewrite(model, scheme, preserve_identity=True)  # verify=True checks it too
    assert torch.equal(logits(model), ref)
    assert not any("gate" in n for n in new_params(model))  # an initial value, not the docs/spec.md section 7 gate


def test_rezero_default_init_is_zero():
    model = rewrite(tiny(), "rezero")
    assert all(torch.equal(p, torch.zeros(1)) for p in new_params(model).values())


def test_layerscale_default_init_follows_depth():
    def init_for(blocks):
        stream = types.SimpleNamespace(d_model=8, block_paths=tuple(f"b{i}" for i in range(blocks)))
        return LayerScaleScheme(ScaleOptions(), stream, torch.float32, torch.device("cpu")).init

    assert init_for(3) == init_for(18) == 0.1
    assert init_for(19) == 1e-4
    model = rewrite(tiny(), "layerscale", init=1e-4)
    assert all(torch.equal(p, torch.full((64,), 1e-4)) for p in new_params(model).values())


@pytest.mark.parametrize("options, word", [
    ({"scheme": "rezero", "preserve_identity": True, "init": 0.0}, "init"),
    ({"scheme": "layerscale", "init": "small"}, "init"),
    ({"scheme": "hyperconn", "streams": 0}, "streams"),
    ({"scheme": "hyperconn", "dynamic": 1}, "dynamic"),
    ({"scheme": "hyperconn", "readout": "max"}, "readout"),
    ({"scheme": "mhc", "streams": 1}, "streams"),
    ({"scheme": "mhc", "sinkhorn_iters": 0}, "sinkhorn_iters"),
    ({"scheme": "mhc", "res_offdiag": float("-inf")}, "res_offdiag"),
])
def test_bad_options_are_clear_errors(options, word):
    options = dict(options)
    scheme = options.pop("scheme")
    with pytest.raises(ValueError, match=word):
        rewrite(ToyLM(vocab=256), scheme, **options)


@pytest.mark.parametrize("scheme", ["hyperconn", "mhc"])
def test_multistream_preserve_identity_wraps_in_the_spec7_gate(scheme):
    model = tiny()
    ref = logits(model)
    rewrite(model, scheme, preserve_identity=True)
    assert torch.equal(logits(model), ref)
    gates = [p for n, p in new_params(model).items() if n.endswith(".gate")]
    assert len(gates) == 6 + 1  # every site and the readout
    randomize(model, seed=0)
    assert not torch.allclose(logits(model), ref, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("scheme", ["denseformer", "hyperconn"])
def test_identity_at_init_on_hugging_face_models(family, scheme):
    model = hf_model(family)
    ids = IDS % 97
    with torch.no_grad():
        ref = model(ids).logits
        depthrewrite.rewrite(model, scheme, example_inputs=(ids,))
        assert torch.equal(model(ids).logits, ref)


def capture_norm_inputs(model):
    seen = []
    for block in model.blocks:
        for norm in (block.norm_attn, block.norm_mlp):
            norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen


def capture_readout_state(model):
    router, seen = readout(model), []
    inner = router.read

    def read(state, h):
        seen.append(state)
        return inner(state, h)

    router.read = read
    return seen


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("streams", [4, 3, 1])
def test_hyperconn_mimics_prenorm_at_init(dynamic, streams):
    """With the streams started as copies of e, A_m one-hot, A_r = I, B = 1 (dynamic parts
    at 0): every branch reads the original branch input bit for bit and every stream ends
    equal to the original final stream bit for bit. The learned readout (1/n each, summed
    pairwise) is then exact for n a power of two; for n = 3 it is equal up to rounding."""
    original = tiny()
    want_inputs = capture_norm_inputs(original)
    want_final = []
    original.norm_final.register_forward_pre_hook(lambda m, args: want_final.append(args[0]))
    ref = logits(original)

    model = rewrite(tiny(), "hyperconn", streams=streams, dynamic=dynamic)
    got_inputs, state = capture_norm_inputs(model), capture_readout_state(model)
    out = logits(model)
    assert len(got_inputs) == len(want_inputs) == 6
    assert all(torch.equal(g, w) for g, w in zip(got_inputs, want_inputs))
    assert len(state[0]) == streams and all(torch.equal(s, want_final[0]) for s in state[0])
    if streams & (streams - 1) == 0:
        assert torch.equal(out, ref)
    else:
        assert torch.allclose(out, ref, rtol=0, atol=1e-5)


def test_mhc_starts_close_to_the_original():
    """Equal streams stay equal under a doubly stochastic H_res and H_pre = 1/n reads their
    mean: the original model, up to rounding (not bit for bit: 0.95 h + 3 * 0.017 h != h)."""
    ref = logits(tiny())
    out = logits(rewrite(tiny(), "mhc"))
    assert torch.allclose(out, ref, rtol=0, atol=1e-5)


def capture_weights(model):
    """Record what every site's router computes on a forward pass: ``("read", H_pre)`` and
    ``("write", (H_res, H_post))``."""
    seen = []
    for block in model.blocks:
        for router in block.depth_route.values():
            for kind in ("read", "write"):
                inner = getattr(router, f"{kind}_weights")
                setattr(router, f"{kind}_weights",
                        lambda hs, inner=inner, kind=kind: seen.append((kind, inner(hs))) or seen[-1][1])
    return seen


def assert_doubly_stochastic(model, streams, ids=IDS, varies=1e-3, rows_atol=1e-3):
    """The sites' weights are in range and their ``H_res`` doubly stochastic (rows within
    ``rows_atol``; None: the caller checks them); returns the ``("write", ...)`` weights."""
    seen = capture_weights(model)
    logits(model, ids)
    reads = [w for kind, w in seen if kind == "read"]
    writes = [w for kind, w in seen if kind == "write"]
    assert len(reads) == len(writes) == 6  # every site, once each
    for pre in reads:
        assert pre.shape == (*ids.shape, streams) and ((pre > 0) & (pre < 1)).all()
    for res, post in writes:
        assert res.shape == (*ids.shape, streams, streams)
        assert (res >= 0).all()
        ones = torch.ones(res.shape[:-1], dtype=res.dtype)
        if rows_atol is not None:
            assert torch.allclose(res.sum(-1), ones, rtol=0, atol=rows_atol)
        assert torch.allclose(res.sum(-2), ones, rtol=0, atol=1e-3)  # columns
        assert ((post > 0) & (post < 2)).all()
    # dynamic: the matrices really depend on the token
    res = writes[-1][0]
    assert (res - res[0, 0]).abs().max() > varies
    return writes


@torch.no_grad()
def randomize_mhc(model, seed):
    """Static logits uniform in [-2, 2], phi N(0, 1/(n d)) (dynamic logits of order 1), alphas in [0.5, 1]."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in new_params(model).items():
        if name.endswith("phi"):
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[0]))
        elif "alpha" in name:
            p.uniform_(0.5, 1.0, generator=gen)
        else:
            p.uniform_(-2.0, 2.0, generator=gen)


@NO_SHRINK
@given(streams=st.integers(2, 4), seed=st.integers(0, 2**16))
@example(streams=2, seed=2086)  # the draw whose rows 100 rounds left 1.9e-3 off
def test_mhc_mixing_matrices_are_doubly_stochastic_on_random_parameters(streams, seed):
    """``H_res`` is Sinkhorn's projection of the site's logits, to float32 rounding. Its
    rows then converge at Sinkhorn's own rate, set by the logits' spread: with these random
    parameters 100 rounds bring most draws within 1e-3, but not all (a 2 x 2 whose log cross
    ratio was 10.7 was 1.9e-3 off at 100 rounds and 1e-6 at 500, in float64 as in float32:
    found by hypothesis). So the rows are held to 1e-3 where float64 Sinkhorn of the same
    logits converged that far in the same rounds, and to its own residual elsewhere."""
    import depthrewrite.passes.hyperconn as hyperconn

    logits_seen = []
    sinkhorn = hyperconn.sinkhorn
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hyperconn, "sinkhorn", lambda lg, iters: (logits_seen.append(lg.detach()), sinkhorn(lg, iters))[1])
        model = rewrite(tiny(), "mhc", streams=streams, sinkhorn_iters=100)
        randomize_mhc(model, seed)
        logits_seen.clear()  # the rewrite's own verification run
        writes = assert_doubly_stochastic(model, streams, rows_atol=None)
    assert len(logits_seen) == len(writes) == 6
    for lg, (res, _) in zip(logits_seen, writes):
        exact = sinkhorn(lg.double(), 100)
        torch.testing.assert_close(res.double(), exact, rtol=0, atol=1e-5)
        residual = (exact.sum(-1) - 1).abs()
        assert ((res.sum(-1) - 1).abs() <= torch.clamp(residual, min=1e-3) + 1e-5).all()


# ---------------------------------------------------------------------------- training
TRAIN = {
    "denseformer": {},
    "rezero": {},
    "layerscale": {},
    "hyperconn": {},
    "mhc": {},  # 4 streams
}


def batches(seq=64, batch=8, steps=50, seed=0):
    data = torch.frombuffer(bytearray(corpus_bytes("tinyshakespeare.txt", limit=200_000)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]




@pytest.mark.parametrize("scheme", list(TRAIN))
def test_scheme_trains_and_round_trips_through_state_dict(scheme):
    model = rewrite(tiny(), scheme, **TRAIN[scheme]).train()
    held_out = next(batches(steps=1, seed=123))
    with torch.no_grad():
        before = model(*held_out)[1].item()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()
    # every new parameter is trained: a non-zero gradient at the last step
    routed = new_params(model)
    assert routed
    zero = [n for n, p in routed.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not zero, zero
    with torch.no_grad():
        after = model(*held_out)[1].item()
    assert after < before - 0.1, (before, after)

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other = rewrite(tiny(seed=7), scheme, **TRAIN[scheme])
    other.load_state_dict(torch.load(buf))
    model.eval()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(logits(model), logits(other))
    if scheme == "mhc":  # the trained mixing matrices, default 20 Sinkhorn rounds
        assert_doubly_stochastic(model, 4, ids=held_out[0], varies=0.0)


@pytest.mark.parametrize("scheme, options, count", [
    ("denseformer", {}, 3 * (3 + 3) // 2),
    ("rezero", {}, 6),
    ("layerscale", {}, 6 * 64),
    ("hyperconn", {"dynamic": False}, 6 * (16 + 8) + 4),
    ("hyperconn", {}, 6 * (16 + 8) + 6 * (64 * 6 + 2) + 4),
    ("hyperconn", {"readout": "sum", "streams": 2, "dynamic": False}, 6 * (4 + 4)),
    ("mhc", {}, 6 * (16 + 8) + 6 * (4 * 64 * 24 + 3) + 4),
    ("mhc", {"streams": 2, "dynamic": False}, 6 * (4 + 4) + 2),
])
def test_new_parameter_counts(scheme, options, count):
    model = rewrite(tiny(), scheme, **options)
    assert sum(p.numel() for p in new_params(model).values()) == count
