"""The routed schemes of docs/spec.md sections 4-6 (mhar, wav, dar): their equivalences, identity
mode, hand-written oracles, and training."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings, strategies as st

import depthrewrite
from depthrewrite.models import gpt_from_preset
from tests.conftest import corpus_bytes, hf_model
from tests.unit.scheme_oracles import DAR_ROLES, Params, dar_logits, mhar_logits, wav_logits

FEW = settings(max_examples=3, deadline=None, derandomize=True)




def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return gpt_from_preset("tiny", **{"n_layer": 3, **overrides}).eval()


def ids_for(seed=1, batch=2, length=12):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def randomize_routing(model, seed=0):
    """Non-zero routing parameters, so that every weight of every softmax matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" not in name:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            centre = {"key_norm_weight": 1.0, "detail_bias": -1.0, "transport": 2.0, "beta": 0.75}
            p.copy_(centre.get(name.rsplit(".", 1)[-1], 0.0) + 0.5 * noise)


def routing_names(model):
    return sorted(n for n, _ in model.named_parameters() if "depth_route" in n)


def rewrite(model, scheme, **options):
    # verify=False: every test here checks the outputs itself (and the identity tests keep it)
    return depthrewrite.rewrite(model, scheme, **{"verify": False, **options})


models = st.builds(
    dict,
    n_layer=st.integers(1, 3),
    parallel_block=st.booleans(),
    d_model=st.sampled_from([32, 64]),
    seed=st.integers(0, 100),
)


# ---------------------------------------------------------------- equivalences
@FEW
@given(cfg=models, block_size=st.sampled_from([None, 1, 2, 3]), two_phase=st.booleans())
def test_mhar_one_head_equals_attnres(cfg, block_size, two_phase):
    seed = cfg.pop("seed")
    base = "attnres" if block_size is None else "block_attnres"
    # the full form's two-phase computation is grouped routing (attnres groups 4 sites by
    # default, mhar none): the same options for both
    options = ({"group_size": 2 if two_phase else None} if block_size is None
               else {"block_size": block_size, "two_phase": two_phase})
    reference = rewrite(tiny(seed, **cfg), base, **options)
    model = rewrite(tiny(seed, **cfg), "mhar", heads=1, **options)
    randomize_routing(reference)
    model.load_state_dict(reference.state_dict())  # strict: the same parameter names, none added
    ids = ids_for(seed)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


@FEW
@given(cfg=models, block_size=st.sampled_from([1, 2, 3]), two_phase=st.booleans())
def test_wav_without_details_equals_block_attnres(cfg, block_size, two_phase):
    seed = cfg.pop("seed")
    # bit-identical to Block AttnRes computed the same way (site by site, or two-phase)
    reference = rewrite(tiny(seed, **cfg), "block_attnres", block_size=block_size, two_phase=two_phase)
    model = rewrite(tiny(seed, **cfg), "wav", block_size=block_size, details=False, two_phase=two_phase)
    randomize_routing(reference)
    model.load_state_dict(reference.state_dict())
    ids = ids_for(seed)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


@pytest.mark.parametrize("two_phase", [False, True])
def test_wav_with_detail_biases_at_minus_infinity_equals_block_attnres(two_phase):
    # two-phase once gave NaN here: its first site added 0 * -inf from the detail biases
    reference = rewrite(tiny(), "block_attnres", block_size=2, two_phase=two_phase)
    model = rewrite(tiny(), "wav", block_size=2, detail_bias_init=float("-inf"), two_phase=two_phase)
    randomize_routing(reference)
    model.load_state_dict(reference.state_dict(), strict=False)
    missing = set(routing_names(model)) - set(routing_names(reference))
    assert missing and all(n.endswith("detail_bias") for n in missing)
    ids = ids_for()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-6, atol=1e-6)
        finite = rewrite(tiny(), "wav", block_size=2)
        finite.load_state_dict(reference.state_dict(), strict=False)  # details at bias -2: routed in
        assert not torch.allclose(finite(ids), reference(ids), rtol=1e-4, atol=1e-4)
    model(ids).float().square().mean().backward()  # a training step's gradients stay finite
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())


TWO_PHASE_CASES = [("block_attnres", {}), ("block_attnres", {"block_size": 1}), ("block_attnres", {"block_size": 3}),
                   ("mhar", {"heads": 4, "block_size": 2}), ("mhar", {"heads": 1, "block_size": 4})]



def _logits_and_grads(scheme, options, dtype, two_phase, recompute=False, **model_options):
    model = rewrite(tiny(**model_options).to(dtype), scheme, two_phase=two_phase, recompute=recompute, **options)
    randomize_routing(model)
    logits = model(ids_for())
    loss = (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=dtype)).sum()
    # a parameter that never reaches the output (WAV's first site: only e, no detail) gets zeros
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True, materialize_grads=True)
    return [logits, *grads], model


@pytest.mark.parametrize("scheme,options", TWO_PHASE_CASES)
def test_two_phase_equals_routing_site_by_site(scheme, options, monkeypatch):
    """Block AttnRes's two-phase computation (route_many per block + merge per site) is the
    same function as one route per site: logits and every parameter gradient in float64,
    on a model whose blocks do not divide the sites evenly for block_size 4 (an unfinished
    block reaches the readout). In float32 both are as close to the float64 result
    (relative L2 error per tensor; measured ~3e-6 site by site, ~4e-6 two-phase)."""
    from depthrewrite.passes import attnres, two_phase

    calls = {"route_many": 0, "merge_partial": 0}
    for module, name in ((two_phase, "route_many"), (attnres, "merge_partial")):  # phase 1, phase 2
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a, **k))
    truth, one_phase = _logits_and_grads(scheme, options, torch.float64, two_phase=False)
    exact, two_phase = _logits_and_grads(scheme, options, torch.float64, two_phase=True)
    assert list(two_phase.state_dict()) == list(one_phase.state_dict())  # no parameter added or renamed
    size = options.get("block_size") or attnres.default_block_size(6)
    assert calls["route_many"] == 6 // size + 1  # the first block, then one per closed block
    assert calls["merge_partial"] == sum(1 for i in range(7) if i % size)  # sites and readout with a partial
    for a, b in zip(exact, truth):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    single, _ = _logits_and_grads(scheme, options, torch.float32, two_phase=True)
    for a, b in zip(single, truth):
        # a query that only ever sees one source has exactly zero gradient (weight 1 always)
        assert ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() < 2e-5


@pytest.mark.parametrize("block_size,parallel,phase_one_sources", [
    # (sources of each route_many call in the forward: group 0 routes e; each closed block
    # adds a call per list, summaries / phase details / split details; a group holding only
    # the readout routes the summaries alone, the readout reading no details)
    (2, False, [1, 2, 1, 1, 3, 2, 2, 4]),
    (4, False, [1, 2, 1, 1]),  # the last block is unfinished and holds the readout
    (1, True, [1, 2, 1, 1, 3, 2, 2, 4]),  # parallel blocks: one site per layer
])
def test_wav_two_phase_equals_routing_site_by_site(block_size, parallel, phase_one_sources, monkeypatch):
    """WAV's two-phase computation (three route_many lists per block, detail biases and the
    partial block merged per site by merge_routes) is the same function as one route per
    site over every source: logits and every parameter gradient, detail biases included,
    in float64; in float32 both are equally close to the float64 result."""
    from depthrewrite.passes import two_phase

    calls = []
    real = two_phase.route_many
    monkeypatch.setattr(two_phase, "route_many",
                        lambda values, keys=None, **k: calls.append(len(values)) or real(values, keys, **k))
    options = {"block_size": block_size}
    truth, one_phase = _logits_and_grads("wav", options, torch.float64, False, parallel_block=parallel)
    assert calls == []
    exact, two_phase = _logits_and_grads("wav", options, torch.float64, True, parallel_block=parallel)
    assert calls == phase_one_sources
    assert list(two_phase.state_dict()) == list(one_phase.state_dict())  # no parameter added or renamed
    names = [n for n, _ in two_phase.named_parameters()]
    bias_grads = [g for n, g in zip(names, exact[1:]) if n.endswith("detail_bias")]
    # the biases are trained through phase 2: every site's but the first's (it routes e alone)
    assert len(bias_grads) == 6 // (2 if parallel else 1) and all(g.abs().min() > 0 for g in bias_grads[1:])
    for a, b in zip(exact, truth):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    single, _ = _logits_and_grads("wav", options, torch.float32, True, parallel_block=parallel)
    for a, b in zip(single, truth):
        assert ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() < 2e-5


@pytest.mark.parametrize("variant", ["dar", "selfkv", "crossv", "fixedkv"])
@pytest.mark.parametrize("layers_per_block,parallel", [(1, False), (2, False), (2, True)])
def test_dar_two_phase_equals_routing_site_by_site(variant, layers_per_block, parallel, monkeypatch):
    """DAR's two-phase computation (per DAR block, one route_many per stream with the
    variant's keys; each site merges the partial entries) is the same function as routing
    every site over all entries: logits and every parameter gradient in float64; float32
    as close to it as site by site."""
    from depthrewrite.passes import two_phase
    from depthrewrite.passes.dar import VARIANTS

    calls = []
    real = two_phase.route_many
    monkeypatch.setattr(two_phase, "route_many", lambda values, keys=None, **k: calls.append(
        (len(values), keys is not None)) or real(values, keys, **k))
    options = {"variant": variant, "layers_per_block": layers_per_block}
    truth, one_phase = _logits_and_grads("dar", options, torch.float64, False, parallel_block=parallel)
    assert calls == []
    exact, two_phase = _logits_and_grads("dar", options, torch.float64, True, parallel_block=parallel)
    # 3 layers: phase 1 for each DAR block (its first: e alone), the readout's group last
    # (its own when the last block closed); both streams each time, keys where they differ
    blocks = -(-3 // layers_per_block) + (3 % layers_per_block == 0)
    keyed = [VARIANTS[variant](j)[0] != VARIANTS[variant](j)[1] for j in (0, 1)]
    assert calls == [(b + 1, keyed[j]) for b in range(blocks) for j in (0, 1)]
    assert list(two_phase.state_dict()) == list(one_phase.state_dict())
    for a, b in zip(exact, truth):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # float32: DAR's scalar gradients (mix, transport) cancel heavily, so site by site is
    # itself up to ~3e-5 off (relative L2 per tensor, measured); two-phase rounds in other
    # places (its phase-1 result is stored): its worst tensor within 4x of site by site's
    errors = {}
    for two in (False, True):
        single, _ = _logits_and_grads("dar", options, torch.float32, two, parallel_block=parallel)
        errors[two] = max(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(single, truth))
    assert errors[True] <= 4 * errors[False] and errors[True] < 1e-4, errors


def _saved_bytes(fn):
    """Bytes of the distinct tensors autograd saves for the backward while ``fn`` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


@pytest.mark.parametrize("scheme,options", [("block_attnres", {}), ("mhar", {"heads": 4, "block_size": 2})])
def test_two_phase_recompute_gives_the_same_gradients_from_fewer_saved_tensors(scheme, options, monkeypatch):
    """``recompute=True`` (activation checkpointing of phase 1) is the same computation, bit
    for bit, as keeping its outputs; the forward saves fewer bytes for the backward, and the
    backward runs phase 1 again, once per block but for the last site's and the readout's
    (``two_phase.KEEP_LAST_PHASE_ONE``)."""
    from depthrewrite.passes import two_phase

    calls = []
    real = two_phase.route_many
    monkeypatch.setattr(two_phase, "route_many", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = {}
    for recompute in (False, True):
        model = rewrite(tiny(n_layer=3), scheme, two_phase=True, recompute=recompute, **options)
        randomize_routing(model)
        calls.clear()
        logits, saved = _saved_bytes(lambda: model(ids_for()))
        forward_calls = len(calls)
        grads = torch.autograd.grad((logits * torch.linspace(-1, 1, logits.shape[-1])).sum(), list(model.parameters()))
        results[recompute] = ([logits, *grads], saved, forward_calls, len(calls) - forward_calls)
    (kept, kept_bytes, kept_fwd, kept_bwd), (redone, redone_bytes, fwd, bwd) = results[False], results[True]
    for a, b in zip(redone, kept):
        assert torch.equal(a, b)
    assert redone_bytes < kept_bytes
    # 6 sites in blocks of 2 or 3, the readout in a group of its own: 2 groups keep phase 1
    assert (kept_fwd, kept_bwd) == (fwd, 0) and bwd == fwd - 2


@pytest.mark.parametrize("scheme,options", [("block_attnres", {"block_size": 2}), ("dar", {"layers_per_block": 2}),
                                            ("wav", {"block_size": 2})])
def test_two_phase_is_skipped_for_shards_it_cannot_gather(scheme, options, monkeypatch, caplog):
    """Phase 1 for block k + 1 runs inside block k, where FSDP2 holds the next block's
    queries as shards. It gathers FSDP2's own (tests/e2e/test_distributed.py); a shard that
    FSDP2 does not hold (here: every parameter taken for one) makes the plan route site by
    site (same result), and says so once."""
    from depthrewrite.passes import two_phase

    model = rewrite(tiny(), scheme, two_phase=True, **options)
    reference = rewrite(tiny(), scheme, two_phase=False, **options)
    randomize_routing(model)
    reference.load_state_dict(model.state_dict())
    monkeypatch.setattr(two_phase, "_is_sharded", lambda p: True)
    monkeypatch.setattr(two_phase, "route_many", lambda *a, **k: pytest.fail("phase 1 ran on sharded parameters"))
    ids = ids_for()
    with torch.no_grad(), caplog.at_level("INFO", logger="depthrewrite.passes.two_phase"):
        assert torch.equal(model(ids), reference(ids))
        model(ids)
    told = [r for r in caplog.records if "are sharded, and not as plain FSDP2" in r.getMessage()]
    assert len(told) == 1  # said once, not at every block of every step


@pytest.mark.parametrize("heads", [1, 4])
def test_mhar_block_size_one_equals_full(heads):
    reference = rewrite(tiny(), "mhar", heads=heads)
    # bit-identical when routed site by site (the two-phase form rounds its phase-1 result)
    model = rewrite(tiny(), "mhar", heads=heads, block_size=1, two_phase=False)
    randomize_routing(reference)
    model.load_state_dict(reference.state_dict())
    ids = ids_for()
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_mhar_heads_default_to_the_models_kv_heads_and_are_checked():
    model = rewrite(tiny(n_head=4, n_kv_head=2), "mhar")
    router = model.blocks[0].depth_route["site1"]
    assert router.heads == 2
    llama = rewrite(hf_model("llama", num_attention_heads=4, num_key_value_heads=2), "mhar")
    assert llama.model.layers[0].depth_route["site1"].heads == 2
    with pytest.raises(ValueError, match=r"d=64.*heads=3"):
        rewrite(tiny(), "mhar", heads=3)


def test_mhar_without_a_config_asks_for_heads():
    from tests.toy_models import ToyLM

    with pytest.raises(ValueError, match="heads="):
        rewrite(ToyLM(), "mhar", example_inputs=(torch.randint(0, 50, (2, 8)),))


@pytest.mark.parametrize("scheme, options, message", [
    ("mhar", {"heads": 0}, "heads must be a positive int"),
    ("mhar", {"heads": 2, "block_size": 0}, "block_size"),
    ("wav", {"rho": 0.0}, "rho must be a positive finite number"),
    ("wav", {"details": 1}, "details must be True or False"),
    ("dar", {"variant": "dual"}, "variant must be one of dar, selfkv, crossv, fixedkv, found 'dual'"),
    ("dar", {"layers_per_block": 0}, "layers_per_block must be a positive int"),
    ("dar", {"beta_init": (1.0,)}, "beta_init must be a pair"),
])
def test_bad_options_are_value_errors_naming_them(scheme, options, message):
    with pytest.raises(ValueError, match=message):
        rewrite(tiny(n_layer=1), scheme, **options)


@pytest.mark.parametrize("scheme, options", [
    ("mhar", {}), ("mhar", {"block_size": 2, "heads": 2}), ("wav", {"block_size": 2}),
    ("dar", {}), ("dar", {"variant": "fixedkv", "layers_per_block": 2}),
])
@pytest.mark.parametrize("parallel, dtype", [(False, torch.float32), (True, torch.float64)])
def test_preserve_identity_is_bit_identical_at_init(scheme, options, parallel, dtype):
    original = tiny(parallel_block=parallel).to(dtype)
    ids = ids_for(7, length=20)  # not the capture input
    with torch.no_grad():
        want = original(ids)
        model = rewrite(original, scheme, inplace=False, verify=True, preserve_identity=True, **options)
        assert torch.equal(model(ids), want)


# ---------------------------------------------------------------- oracles
def oracle_case(scheme, parallel, seed=0, **options):
    model = rewrite(tiny(parallel_block=parallel), scheme, **options)
    randomize_routing(model, seed)
    return model, ids_for()


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("heads, block_size", [(4, None), (2, 2), (4, 3)])
def test_mhar_matches_hand_written_oracle(parallel, heads, block_size):
    model, ids = oracle_case("mhar", parallel, heads=heads, block_size=block_size)
    params = Params(model)
    with torch.no_grad():
        got = model(ids)
        torch.testing.assert_close(got, mhar_logits(model, params, ids, heads, block_size), rtol=1e-5, atol=1e-5)
        assert not close(got, mhar_logits(model, params, ids, 1, block_size))  # the oracle sees the heads


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("block_size, rho", [(1, 2.0), (3, 0.5)])
def test_wav_matches_hand_written_oracle(parallel, block_size, rho):
    model, ids = oracle_case("wav", parallel, block_size=block_size, rho=rho)
    params = Params(model)
    with torch.no_grad():
        got = model(ids)
        torch.testing.assert_close(got, wav_logits(model, params, ids, block_size, rho=rho), rtol=1e-5, atol=1e-5)
        assert not close(got, wav_logits(model, params, ids, block_size, rho=2.5 - rho))  # the cap matters
        if parallel:  # the parts of a parallel site reach the phase basis
            assert not close(got, wav_logits(model, params, ids, block_size, phase_of_parts=False))


@pytest.mark.parametrize("scheme, options, oracle", [
    ("wav", {"block_size": 2}, lambda m, p, ids: wav_logits(m, p, ids, 2)),
    ("dar", {"layers_per_block": 2}, lambda m, p, ids: dar_logits(m, p, ids, "dar", 2)),
    ("mhar", {"heads": 2}, lambda m, p, ids: mhar_logits(m, p, ids, 2)),
])
def test_preserve_identity_matches_oracle_once_the_gates_open(scheme, options, oracle):
    """Delta mode on parallel blocks: WAV must still see the parts through the wrapper."""
    model, ids = oracle_case(scheme, True, preserve_identity=True, **options)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), oracle(model, Params(model, delta=True), ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parallel, layers_per_block", [(False, 1), (True, 2)])
def test_dar_variants_route_the_streams_spec_names(parallel, layers_per_block):
    """Each variant matches its oracle and no other: a wrong key/value assignment shows."""
    torch.manual_seed(0)
    for variant in DAR_ROLES:
        model, ids = oracle_case("dar", parallel, variant=variant, layers_per_block=layers_per_block)
        params = Params(model)
        with torch.no_grad():
            got = model(ids)
            want = dar_logits(model, params, ids, variant, layers_per_block)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for other in DAR_ROLES:
                if other != variant:
                    assert not close(got, dar_logits(model, params, ids, other, layers_per_block)), other
            # the block boundaries matter too
            assert not close(got, dar_logits(model, params, ids, variant, layers_per_block + 1))


def test_dar_streams_differ_after_one_forward_at_init():
    model = rewrite(tiny(), "dar")
    readout = model.norm_final.depth_route["readout"]
    seen = []
    inner_read = readout.read
    readout.read = lambda state, h: (seen.append(state), inner_read(state, h))[1]
    ids = ids_for()
    with torch.no_grad():
        got = model(ids)
        (h0, h1), partial = seen[0][:2]  # (a third entry: the two-phase plan's phase-1 result)
        assert partial is None and len(h0) == len(h1) == 4  # e + one entry per layer
        assert torch.equal(h0[0], h1[0])  # both start from e
        for a, b in zip(h0[1:], h1[1:]):
            assert not torch.allclose(a, b, rtol=1e-3, atol=1e-3)
        recorded = []
        torch.testing.assert_close(got, dar_logits(model, Params(model), ids, record=recorded), rtol=1e-5, atol=1e-5)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(recorded[0] + recorded[1], h0 + h1))


def test_dar_beta_breaks_the_symmetry_as_spec_says():
    model = rewrite(tiny(), "dar")
    betas = [r.beta.tolist() for b in model.blocks for r in b.depth_route.values()]
    assert betas == [[0.5, 1.0], [1.0, 0.5]] * 3  # 1 where site index + j is even, else 0.5
    site = model.blocks[0].depth_route["site1"]
    assert site.mix.item() == 0.0 and site.transport.item() == 2.0


# ---------------------------------------------------------------- training
def new_parameter_count(model):
    return sum(p.numel() for n, p in model.named_parameters() if "depth_route" in n)


def structurally_dead(scheme, options):
    """Parameters whose gradient is exactly zero by construction: site 1 routes over the
    single source ``e`` (softmax over one source, no WAV details; DAR mixes e with e), and a
    DAR site that opens a block has no partial entry to transport."""
    dead = {"blocks.0.depth_route.site1.query", "blocks.0.depth_route.site1.key_norm_weight"}
    if scheme == "wav":
        dead.add("blocks.0.depth_route.site1.detail_bias")
    if scheme == "dar":
        dead.add("blocks.0.depth_route.site1.mix")
        k = options.get("layers_per_block", 1)
        dead |= {f"blocks.{b}.depth_route.site1.transport" for b in range(0, 3, k)}
    return dead


@pytest.mark.parametrize("scheme, options", [
    ("dar", {}), ("dar", {"layers_per_block": 2, "two_phase": False}), ("dar", {"fused_merge": True}),
    ("wav", {}), ("wav", {"two_phase": True, "block_size": 2}), ("attnres", {}), ("block_attnres", {}),
    ("mhar", {"heads": 2}), ("hyperconn", {"dynamic": True}), ("mhc", {}), ("denseformer", {}),
])
def test_every_parameter_takes_part_in_the_backward(scheme, options):
    """DistributedDataParallel needs a gradient, zero or not, for every parameter that
    requires one; a parameter the graph never reads fails its second step. The structurally
    dead ones (above) are read and get exact zeros."""
    model = rewrite(tiny(), scheme, **options).train()
    ids = ids_for()
    model(ids, ids)[1].backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    zero = {n for n, p in model.named_parameters() if "depth_route" in n and not p.grad.abs().sum() > 0}
    assert {n for n in structurally_dead(scheme, options) if "query" not in n and "key_norm" not in n} <= zero


@pytest.mark.parametrize("scheme, options, count", [
    ("mhar", {"heads": 2}, 2 * 64 * 7),
    ("wav", {"block_size": 2}, 2 * 64 * 7 + 2 * 6),
    ("dar", {"layers_per_block": 2}, (4 * 64 + 4) * 6 + 4 * 64 + 1),
])
def test_scheme_trains_and_round_trips(scheme, options, count):
    torch.manual_seed(0)
    model = rewrite(tiny(), scheme, **options).train()
    assert new_parameter_count(model) == count
    data = torch.frombuffer(bytearray(corpus_bytes("tinyshakespeare.txt", limit=200_000)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)

    def batch():
        start = torch.randint(0, len(data) - 65, (8,), generator=gen)
        chunk = torch.stack([data[s:s + 65] for s in start.tolist()])
        return chunk[:, :-1], chunk[:, 1:]

    fixed = batch()
    with torch.no_grad():
        before = model(*fixed)[1].item()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(50):
        opt.zero_grad(set_to_none=True)
        loss = model(*batch())[1]
        loss.backward()
        if step == 1:  # at step 0 the zero queries hide the key norms (and DAR's transports)
            grads = {n: p.grad for n, p in model.named_parameters() if "depth_route" in n}
            zero = {n for n, g in grads.items() if g is None or not g.abs().sum() > 0}
            assert zero == structurally_dead(scheme, options)
        opt.step()
    with torch.no_grad():
        after = model(*fixed)[1].item()
    assert after < before - 2.0, (before, after)  # 5.57 -> about 2.65 for each scheme

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = rewrite(tiny(seed=5), scheme, **options).eval()
    loaded.load_state_dict(torch.load(buffer))
    model.eval()
    ids = ids_for()
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize("scheme,options", [("block_attnres", {}), ("mhar", {"heads": 4, "block_size": 2}),
                                            ("wav", {}), ("dar", {})])
def test_two_phase_must_be_a_bool(scheme, options):
    with pytest.raises(ValueError, match=rf"^{scheme}: two_phase must be True or False, found 'yes'"):
        rewrite(tiny(), scheme, two_phase="yes", **options)
    with pytest.raises(ValueError, match=rf"^{scheme}: recompute must be True or False, found 'all'"):
        rewrite(tiny(), scheme, recompute="all", **options)


FUSED_MERGE_CASES = [("block_attnres", {"block_size": 4}), ("mhar", {"heads": 4, "block_size": 2}),
                     ("wav", {"block_size": 4, "two_phase": True}),  # its readout merges the unfinished block
                     *[("dar", {"variant": v, "layers_per_block": 2}) for v in ("dar", "selfkv", "crossv", "fixedkv")]]


@pytest.mark.parametrize("scheme,options", FUSED_MERGE_CASES)
def test_fused_merge_is_the_same_function(scheme, options, monkeypatch):
    """``two_phase.FUSED_MERGE``: phase 2 through ``route_merge`` (one op) gives the logits
    and every parameter gradient of ``merge_partial``'s torch ops, in float64; and the op
    is what ran (once per site with a partial entry)."""
    from depthrewrite.passes import attnres, dar, two_phase

    options = dict(options)
    use_two_phase = options.pop("two_phase", True)
    truth, _ = _logits_and_grads(scheme, options, torch.float64, two_phase=use_two_phase)
    calls = []
    for module in (attnres, dar):
        real = module.route_merge
        monkeypatch.setattr(module, "route_merge", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    fused, _ = _logits_and_grads(scheme, options, torch.float64, two_phase=use_two_phase)
    assert calls
    for a, b in zip(fused, truth):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scheme,options", [FUSED_MERGE_CASES[0], FUSED_MERGE_CASES[1], FUSED_MERGE_CASES[3]])
def test_fused_merge_option_overrides_the_module_default(scheme, options, monkeypatch):
    """The scheme option ``fused_merge`` chooses per model what ``two_phase.FUSED_MERGE``
    chooses for every model: True runs ``route_merge`` with the flag off and computes what
    the flag computes, bit for bit; False keeps the torch ops with the flag on."""
    from depthrewrite.passes import attnres, dar, two_phase

    calls = []
    for module in (attnres, dar):
        real = module.route_merge
        monkeypatch.setattr(module, "route_merge", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    by_option, _ = _logits_and_grads(scheme, dict(options, fused_merge=True), torch.float64, two_phase=True)
    option_calls = len(calls)
    assert option_calls > 0
    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    by_flag, _ = _logits_and_grads(scheme, options, torch.float64, two_phase=True)
    assert len(calls) == 2 * option_calls
    for a, b in zip(by_option, by_flag):
        assert torch.equal(a, b)
    _logits_and_grads(scheme, dict(options, fused_merge=False), torch.float64, two_phase=True)
    assert len(calls) == 2 * option_calls


@pytest.mark.parametrize("scheme,options", [("block_attnres", {}), ("dar", {}), ("mhar", {"block_size": 2}),
                                            ("attnres", {"group_size": 2})])
def test_fused_merge_option_is_checked(scheme, options):
    with pytest.raises(ValueError, match=rf"^{scheme}: fused_merge must be True, False or None .*found 'yes'"):
        rewrite(tiny(), scheme, fused_merge="yes", **options)
    off = {"group_size": None} if scheme == "attnres" else {"two_phase": False}
    with pytest.raises(ValueError, match=rf"^{scheme}: fused_merge=True applies only to two-phase or grouped routing"):
        rewrite(tiny(), scheme, fused_merge=True, **dict(options, **off))
