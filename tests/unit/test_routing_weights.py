"""The recorded routing weights are the ones each site mixes with: for every scheme that
has them, the weights per token times the sources they name (taken from the depth state
here, by docs/spec.md's definitions, not by the library's naming code) give back the
site's routed input, in float64, with the routing parameters away from their init."""

from __future__ import annotations

import math

import pytest
import torch

import depthrewrite
from depthrewrite.models import GPT, GPTConfig
from depthrewrite.passes.attnres import BlockRouter, FullRouter
from depthrewrite.passes.baselines import DepthWeightedAverage
from depthrewrite.passes.dar import DualRoute
from depthrewrite.passes.wav import WavReadout, WavRouter
from tests.conftest import hf_model, perturb_routing

IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))

CASES = [
    ("attnres", {"group_size": None}),
    ("attnres", {}),  # grouped: the recorder switches the plan off
    ("block_attnres", {"block_size": 2}),
    ("block_attnres", {"block_size": 3, "two_phase": False}),
    ("mhar", {"heads": 4}),
    ("mhar", {"heads": 2, "block_size": 2}),
    ("wav", {"block_size": 2}),
    ("wav", {"block_size": 3, "two_phase": True}),
    ("dar", {}),
    ("dar", {"layers_per_block": 2}),
    ("dar", {"variant": "crossv", "two_phase": False}),
    ("dar", {"variant": "fixedkv", "layers_per_block": 2}),
    ("dar", {"variant": "selfkv"}),
    ("denseformer", {}),
]


def _model(scheme: str, options: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_head=4, n_layer=4, max_seq_len=32)).double()
    depthrewrite.rewrite(model, scheme, **options)
    with torch.no_grad():  # away from the init, where most weights are uniform or one-hot
        for name, p in model.named_parameters():
            if any(part in name for part in ("query", "mix", "beta", "transport", "detail_bias")):
                p.normal_()
            elif "key_norm_weight" in name:
                p.uniform_(0.5, 1.5)
            elif "depth_route" in name and "weights" in name:  # DenseFormer's DWA
                p.normal_(0.0, 0.7)
    return model


def _hf_model(family: str, scheme: str, options: dict) -> torch.nn.Module:
    model = hf_model(family, layers=3).double()
    depthrewrite.rewrite(model, scheme, **options)
    perturb_routing(model)
    return model


def _routers(model) -> list[tuple[str, torch.nn.Module]]:
    """The routers in the order the spec numbers the sites (the blocks', in the order of
    the stack, each block's sites in order), the readout (on the final norm) last."""
    tables = [m.depth_route for m in model.modules() if hasattr(m, "depth_route")]
    sites = [r for table in tables for name, r in table.items() if name != "readout"]
    readout = [table["readout"] for table in tables if "readout" in table]
    return [(str(i + 1), r) for i, r in enumerate(sites)] + [("F", r) for r in readout]


def _rms(t):
    return t.square().mean(-1).sqrt()


def _source(router, state, h, name: str) -> torch.Tensor:
    """The tensor the spec calls ``name`` at this router's site."""
    if isinstance(router, DualRoute):  # (history, partial, ...): H^k_i, P^k
        history, partial = state[:2]
        if name == "e":
            return history[0][0]
        if name.startswith("P"):
            return partial[int(name[1:])]
        stream, entry = name[1:].split("_")
        return history[int(stream)][int(entry)]
    if isinstance(router, DepthWeightedAverage):  # X_0 = e, .., X_{b-1} in the state, X_b = h
        j = 0 if name == "e" else int(name[1:])
        return state[j] if j < len(state) else h
    if isinstance(router, (WavRouter, WavReadout)):  # (e, completed, partial, ...)
        e, completed, partial = state[:3]
        if name == "e":
            return e
        if name.startswith("P"):
            P, detail = partial[0], partial[("P", "Pphase", "Psplit").index(name)]
            if name == "P":
                return P
            factor = torch.clamp(_rms(P) / (_rms(detail) + router.eps), max=router.rho)  # ~D, spec section 5
            return detail * factor.unsqueeze(-1)
        kind = name.rstrip("0123456789")
        return completed[int(name[len(kind):])][("C", "Dphase", "Dsplit").index(kind)]
    if isinstance(router, BlockRouter):  # (blocks, partial, ...)
        return state[1] if name == "partial" else state[0][int(name[1:])]
    sources = state[0] if router._plan is not None else state  # full: (e, u_1, ..) or (that, phase 1)
    return sources[0 if name == "e" else int(name[1:])]


@pytest.fixture
def seen_reads(monkeypatch):
    """Every router's (state, h, routed input) of the forward pass, by router."""
    seen = {}
    for cls in (FullRouter, BlockRouter, WavRouter, WavReadout, DualRoute, DepthWeightedAverage):
        def read(self, state, h, _read=cls.read):
            out = _read(self, state, h)
            seen[id(self)] = (state, h, out)
            return out
        monkeypatch.setattr(cls, "read", read)
    return seen


HF_CASES = [  # a parallel block (GPT-NeoX: one site a layer, WAV's phase detail from its parts), GPT-2, Llama
    ("gpt_neox", "wav", {"block_size": 2}),
    ("gpt2", "mhar", {"heads": 2, "block_size": 2}),
    ("llama", "dar", {}),
]


@pytest.mark.parametrize("scheme,options", CASES, ids=[f"{s}-{o}" for s, o in CASES])
def test_weights_times_named_sources_give_the_routed_input(scheme, options, seen_reads):
    _check_rebuilt(_model(scheme, options), scheme, options, seen_reads, IDS)


@pytest.mark.parametrize("family,scheme,options", HF_CASES, ids=[f"{f}-{s}" for f, s, _ in HF_CASES])
def test_the_same_on_hugging_face_models(family, scheme, options, seen_reads):
    pytest.importorskip("transformers")
    ids = IDS % 97
    _check_rebuilt(_hf_model(family, scheme, options), scheme, options, seen_reads, ids,
                   attention_mask=torch.ones_like(ids))


def _check_rebuilt(model, scheme: str, options: dict, seen_reads: dict, ids: torch.Tensor, **kwargs) -> None:
    with torch.no_grad():
        before = model(ids, **kwargs)
    weights = depthrewrite.record_routing_weights(model, ids, per_token=True, **kwargs)
    assert weights.scheme == scheme and weights.static == (scheme == "denseformer")
    routers = [(label, r) for label, r in _routers(model) if id(r) in seen_reads]
    assert weights.labels == [label for label, _ in routers]
    for (label, router), names, per_token, mean in zip(routers, weights.source_labels, weights.per_token,
                                                       weights.weights):
        state, h, routed = seen_reads[id(router)]
        heads = per_token.shape[-1]
        assert per_token.shape == (len(names), *ids.shape, heads)
        sources = torch.stack([_source(router, state, h, name) for name in names]).unflatten(-1, (heads, -1))
        rebuilt = (per_token.unsqueeze(-1) * sources).sum(0).flatten(-2)
        torch.testing.assert_close(rebuilt, routed, rtol=1e-10, atol=1e-10, msg=f"site {label} ({names})")
        torch.testing.assert_close(mean, per_token.flatten(1).mean(1))
        if scheme != "denseformer":  # a softmax (DAR: two, mixed by the gate)
            torch.testing.assert_close(per_token.sum(0), torch.ones_like(per_token[0]))
    assert weights.columns()[0] == ("b0" if "block_size" in options and scheme != "wav" else "e")
    # the forward is the model's own, the plans are back on and the shadows gone
    with torch.no_grad():
        after = model(ids, **kwargs)
    assert torch.equal(getattr(after, "logits", after), getattr(before, "logits", before))
    for _, router in routers:
        assert not {"read", "route", "_route"} & router.__dict__.keys()
        assert getattr(router, "_plan", None) is None or router._plan.enabled


def test_weights_are_not_uniform_away_from_init():
    """The property above would hold for any weights if every source were equal: the
    sources differ, and so do the weights."""
    weights = depthrewrite.record_routing_weights(_model("wav", {"block_size": 2}), IDS)
    last = weights.weights[-2]
    assert last.max() - last.min() > 0.05 and len(set(weights.source_labels[-2])) == len(weights.source_labels[-2])


def test_names_and_columns_follow_the_spec():
    weights = depthrewrite.record_routing_weights(_model("wav", {"block_size": 2}), IDS)
    assert weights.source_labels[3] == ["e", "C0", "Dphase0", "Dsplit0", "P", "Pphase", "Psplit"]
    assert weights.source_labels[-1] == ["e", "C0", "C1", "C2", "C3"]  # conservative readout: no details
    assert weights.columns() == ["e", "C0", "Dphase0", "Dsplit0", "C1", "Dphase1", "Dsplit1", "C2", "Dphase2",
                                 "Dsplit2", "C3", "P", "Pphase", "Psplit"]
    dar = depthrewrite.record_routing_weights(_model("dar", {"layers_per_block": 2}), IDS)
    assert dar.source_labels[2] == ["e", "P0", "P1"]  # layer 2's attention site: block 0 partial
    assert dar.source_labels[4] == ["e", "H0_1", "H1_1"]  # the first site after block 0 closed
    assert dar.columns() == ["e", "H0_1", "H1_1", "H0_2", "H1_2", "P0", "P1"]
    matrix = dar.matrix()
    assert matrix.shape == (len(dar.labels), 7) and math.isnan(matrix[0, 1])


def test_the_compiled_wrapper_records_its_module():
    model = _model("block_attnres", {"block_size": 2})
    compiled = torch.compile(model, backend="eager")
    assert depthrewrite.has_routing_weights(compiled)
    got = depthrewrite.record_routing_weights(compiled, IDS)
    want = depthrewrite.record_routing_weights(model, IDS)
    assert got.labels == want.labels
    for a, b in zip(got.weights, want.weights):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scheme,found", [
    ("residual", r"found only routers that keep the plain residual stream \(PassThrough\)"),
    ("rezero", r"found only routers that keep the plain residual stream \(PassThrough\)"),
    ("mhc", r"found MHCRouter, StreamReadout"),
    ("hyperconn", r"found HyperConnRouter, StreamReadout"),
])
def test_schemes_without_depth_weights_are_refused(scheme, found):
    model = _model(scheme, {})
    assert not depthrewrite.has_routing_weights(model)
    with pytest.raises(ValueError, match=r"record_routing_weights: GPT's scheme has no depth-routing weights \("
                                         + found + r"\); they are recorded for attnres, block_attnres, mhar, wav, "
                                         r"dar and denseformer"):
        depthrewrite.record_routing_weights(model, IDS)


def test_a_model_not_rewritten_is_refused():
    plain = GPT(GPTConfig(d_model=32, n_head=4, n_layer=2, max_seq_len=32))
    assert not depthrewrite.has_routing_weights(plain)
    with pytest.raises(ValueError, match=r"record_routing_weights: GPT has no depth routers: rewrite it first "
                                         r"\(depthrewrite.rewrite\)"):
        depthrewrite.record_routing_weights(plain, IDS)
