"""The ``depthrewrite`` torch.compile backend on CPU: rewritten bundled GPTs compiled with
``fullgraph=True`` match eager (loss and every gradient), and the lowering report counts
one routing op per site plus the readout.

Most tests use the backend's ``inner="aot_eager"`` option (AOTAutograd, no code
generation) because Inductor builds C++ on CPU (about 90 s cold for the tiny GPT on two
cores); one test runs the default Inductor path end to end.
"""

from __future__ import annotations

from contextlib import nullcontext
from importlib.metadata import entry_points

import pytest
import torch

import depthrewrite
from depthrewrite import backend
from depthrewrite.models.gpt import gpt_from_preset
from depthrewrite.passes.attnres import FullAttnResOptions

ROUTE = "depthrewrite::route"
ROUTE_MANY = "depthrewrite::route_many"


def _model(scheme: str, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=layers), scheme)
    # routing parameters start at zero queries (uniform weights): move them off that point
    # so that the gradients through the softmax are not trivially symmetric
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0.0, 0.5)
    return model.train()


def _loss_and_grads(model, fn, idx):
    model.zero_grad(set_to_none=True)
    _, loss = fn(idx, idx)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_aot_eager_matches_eager(model, idx) -> None:
    """Compile ``model`` with the backend (AOTAutograd, fullgraph) and compare its loss and
    every gradient with eager's."""
    eager_loss, eager_grads = _loss_and_grads(model, model, idx)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager"})
    loss, grads = _loss_and_grads(model, compiled, idx)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _compile_and_compare(scheme: str, options: dict, rtol: float, atol: float, batch: tuple[int, int] = (2, 16)):
    model = _model(scheme)
    idx = torch.randint(0, model.config.vocab_size, batch, generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = _loss_and_grads(model, model, idx)
    backend.clear_reports()
    torch._dynamo.reset()  # each comparison compiles afresh (the recompile limit is per code object)
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options=options)
    loss, grads = _loss_and_grads(model, compiled, idx)

    torch.testing.assert_close(loss, eager_loss, rtol=rtol, atol=atol)
    assert grads.keys() == eager_grads.keys()
    routing = [n for n in grads if n.endswith("query") or n.endswith("key_norm_weight")]
    assert routing, "the rewritten model has routing parameters with gradients"
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=rtol, atol=atol, msg=name)
    return model, backend.reports()


def _expected_routing_calls(scheme: str, model) -> tuple[str, int]:
    sites = 2 * model.config.n_layer  # attention + MLP site per layer
    if scheme == "block_attnres":  # two-phase: one route_many per block (block_size 2), the readout's included
        return ROUTE_MANY, sites // 2 + 1
    if scheme == "dar":  # two-phase: per DAR block (one layer) and the readout's, one route_many per stream
        return ROUTE_MANY, 2 * (model.config.n_layer + 1)
    if scheme == "attnres":  # grouped: phase 1 per group of G routers, then one route_many per
        routers, g = sites + 1, FullAttnResOptions().group_size  # router adding 2+ of its group's entries
        return ROUTE_MANY, -(-routers // g) + sum(i % g >= 2 for i in range(routers))
    return ROUTE, sites + 1  # one route per site and the readout


@pytest.mark.parametrize("scheme", ["attnres", "block_attnres", "dar"])
def test_aot_eager_matches_eager_and_reports_every_routing_call(scheme):
    model, reports = _compile_and_compare(scheme, {"inner": "aot_eager"}, rtol=1e-6, atol=1e-7)
    assert len(reports) == 1  # fullgraph: one graph
    report = reports[0]
    op, expected = _expected_routing_calls(scheme, model)
    assert report.ops == {op: expected}
    assert report.implementation == {op: "reference"}  # CPU
    assert report.device == "cpu" and report.inner == "aot_eager"
    assert report.aot_graphs["forward"] == {op: expected}
    # the block two-phase forms recompute phase 1 in the backward (recompute=True, their
    # default) but for the last site's group and the readout's (its own here: one call
    # each for Block AttnRes, one per stream for DAR); grouped full AttnRes keeps it
    # (recompute=False)
    kept = {"block_attnres": 2, "dar": 4}.get(scheme)
    recomputed = {op: expected - kept} if kept else {}
    assert report.aot_graphs["backward"] == {f"{op}_backward": expected, **recomputed}
    assert backend.lowered_ops() == {f"{op} (reference)": expected}  # summed over graphs, by implementation


@pytest.mark.parametrize("scheme", ["block_attnres", "dar"])
@pytest.mark.parametrize("recompute", [True, False])
def test_fused_merge_compiles_fullgraph_and_is_reported(scheme, recompute, monkeypatch):
    """``two_phase.FUSED_MERGE`` with the branch norms left unfused: the second phase's
    ``route_merge`` calls compile with ``fullgraph=True`` (its fake implementation, its
    backward op) and match eager; the report counts one call per site with a partial entry
    in the forward and as many backwards. With ``recompute_partial_sums`` (the default) the
    backward makes each merged result again (one more forward per call) rather than keeping
    it for the branch's RMSNorm. (With the norms fused, the default, nothing is made again:
    tests/compile/test_norm_fusion.py.)"""
    from depthrewrite.passes import two_phase

    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    options = {"inner": "aot_eager", "recompute_partial_sums": recompute, "fuse_output_norms": False}
    model, reports = _compile_and_compare(scheme, options, rtol=1e-6, atol=1e-7)
    # 2 layers: Block AttnRes in blocks of 2 sites, DAR in blocks of one layer (2 sites):
    # the second site of each block merges its partial entry, the readout none
    merges = model.config.n_layer
    assert reports[0].aot_graphs["forward"]["depthrewrite::route_merge"] == merges
    assert reports[0].fused_norms is None
    backward = reports[0].aot_graphs["backward"]
    assert backward["depthrewrite::route_merge_backward"] == merges
    assert backward.get("depthrewrite::route_merge", 0) == (merges if recompute else 0)


def test_dar_fused_merge_matches_eager_through_inductor(monkeypatch):
    """DAR's second phase through ``route_merge`` (``two_phase.FUSED_MERGE``) compiled as
    training compiles it: Inductor, with the backend's defaults (partial sums recomputed,
    branch norms fused into the merges). With the mix weights made by
    ``torch.cat([s, 1 - s])`` (until session 22) Inductor overwrote the last site's ``mix``
    gradient by reusing the cat's buffer (0.1x eager's, fp32); passes/dar.py says how.
    Also the fused norms through Inductor's lowering (tests/compile/test_norm_fusion.py has
    the other schemes, through AOTAutograd): every merged site's branch norm is fused,
    and the backward makes no merge again."""
    from depthrewrite.passes import two_phase

    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    # (4, 64) tokens: the failure did not show at (2, 16). No caches: a graph served from
    # them is not compiled, so its graphs would not be reported
    model, reports = _compile_and_compare("dar", {"force_disable_caches": True}, rtol=1e-5, atol=1e-6,
                                          batch=(4, 64))
    report = reports[-1]
    assert report.inner == "inductor"
    merges = model.config.n_layer  # blocks of one layer: the second site of each merges, the readout none
    assert report.fused_norms == merges
    assert report.aot_graphs["forward"]["depthrewrite::route_merge"] == merges
    assert "depthrewrite::route_merge" not in report.aot_graphs["backward"]


@pytest.mark.parametrize("scheme", ["block_attnres", "dar", "wav", "mhar"])
def test_routed_schemes_match_eager_through_inductor(scheme):
    """The path training takes on the CPU (Inductor around the reference routing ops, with
    the backend's default passes: partial sums recomputed, gradient sums accumulated and
    fenced, running sums in place) at 4 x 64 tokens, where session 22 found an Inductor
    buffer-reuse bug in DAR's fused merge that 2 x 16 tokens did not show."""
    model, reports = _compile_and_compare(scheme, {}, rtol=1e-5, atol=1e-6, batch=(4, 64))
    assert reports[-1].inner == "inductor"
    op, expected = _expected_routing_calls(scheme, model)
    assert reports[-1].ops == {op: expected}


def test_inductor_matches_eager():
    """Full AttnRes through Inductor, with an Inductor setting scoped to the compilation, at
    the batch of the tests above. Its C++ kernels are Inductor's default vector code, which
    the other tests leave out to save its build time (tests/conftest.py)."""
    before = torch._inductor.config.fallback_random
    # None: the CPU's widest vectors. (Not monkeypatch.setattr: its undo deletes the setting,
    # and Inductor then finds none)
    with torch._inductor.config.patch({"cpp.simdlen": None}):
        model, reports = _compile_and_compare("attnres", {"fallback_random": not before}, rtol=1e-5, atol=1e-6,
                                              batch=(4, 64))
    report = reports[-1]
    assert report.inner == "inductor"
    op, expected = _expected_routing_calls("attnres", model)
    assert report.ops == {op: expected}
    assert report.config_patches == {"fallback_random": not before}
    # the patch was scoped to the compilation
    assert torch._inductor.config.fallback_random == before


@pytest.mark.parametrize("scheme, options, expected", [
    ("dar", {}, {"max_fusion_size": 16}),  # graph_hints.INDUCTOR_DEFAULTS["dar_transport"]
    ("dar", {"max_fusion_size": 64}, {"max_fusion_size": 64}),  # the caller's setting wins
    ("block_attnres", {}, {}),  # no hint: Inductor's own defaults
])
def test_hinted_graphs_get_their_inductor_defaults(scheme, options, expected):
    """DAR's transport is traced inside graph_hints.hinted, so its graph compiles with
    max_fusion_size=16 unless the caller chose a value."""
    _, reports = _compile_and_compare(scheme, {"inner": "aot_eager", **options}, rtol=1e-6, atol=1e-7)
    assert reports[-1].config_patches == expected


def test_unknown_hint_is_a_value_error():
    from depthrewrite.graph_hints import hinted

    with pytest.raises(ValueError, match="unknown hint 'dar'; expected one of \\['dar_transport'\\]"):
        hinted("dar")


def test_backend_is_registered_by_entry_point():
    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("depthrewrite") == "depthrewrite.backend:depthrewrite_backend"
    from torch._dynamo import lookup_backend

    assert lookup_backend("depthrewrite") is backend.depthrewrite_backend


def test_bad_options_are_value_errors():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="options\\['inner'\\]"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"inner": "tvm"})
    with pytest.raises(ValueError, match="unexpected arguments"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], fast=True)
    with pytest.raises(ValueError, match="options\\['fuse_output_norms'\\] must be True or False; found 'yes'"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"fuse_output_norms": "yes"})


def test_unknown_option_names_the_one_meant_before_inductor_runs():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="found 'max_sum_term' \\(did you mean 'max_sum_terms'\\?\\)"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"max_sum_term": 4})
    with pytest.raises(ValueError, match="found 'triton.cudagraph' \\(did you mean 'triton.cudagraphs'\\?\\)"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"triton.cudagraph": True})
    # an Inductor setting passes the check and reaches the report's patches
    backend.clear_reports()
    x = torch.randn(3)
    compiled = torch.compile(lambda t: t * 2, backend="depthrewrite",
                             options={"inner": "aot_eager", "max_fusion_size": 8, "force_disable_caches": True})
    assert torch.equal(compiled(x), x * 2)
    patches = backend.last_report().config_patches
    assert patches["max_fusion_size"] == 8 and patches["force_disable_caches"] is True  # one the config's copy omits


def test_report_reads_device_and_dtype_of_each_call():
    def f(a, b, q, w):
        return torch.ops.depthrewrite.route([a, b], None, q, w, None, None, 1, 1e-6)

    gm = torch.fx.symbolic_trace(f)
    counts, impls = backend.count_routing_ops(gm.graph)
    assert counts == {ROUTE: 1}
    # no recorded values: nothing says CUDA, so the reference is reported
    assert impls == {ROUTE: "reference"}


@pytest.mark.parametrize("scheme", sorted(depthrewrite.SCHEMES))
def test_every_scheme_compiles_fullgraph_and_matches_eager(scheme):
    """The README's promise: every scheme compiles with fullgraph=True (AOTAutograd behind
    the backend; Inductor is covered above) and computes what eager computes."""
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), scheme).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    assert_aot_eager_matches_eager(model, idx)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_hf_model_compiles_fullgraph_as_called_by_users(mode):
    """A rewritten HF model called with a KV cache (``use_cache=True``, also HF's default in
    some configurations) and, under compile, an explicit attention mask, needs no call spec
    traced inside the compiled region: the rewrite prepared them."""
    from tests.conftest import hf_model

    model = depthrewrite.rewrite(hf_model("llama", layers=2, vocab_size=128), "block_attnres")
    model.train(mode == "train")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager"})
    loss = compiled(input_ids=ids, use_cache=True).logits  # first: nothing traced eagerly before
    eager = model(input_ids=ids, use_cache=True).logits
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    # two-phase Block AttnRes, blocks of 2 sites: one route_many per block of 4 sites, and the readout's
    assert backend.last_report().ops == {ROUTE_MANY: 3}


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_under_compile_matches_eager(reentrant):
    """transformers' activation checkpointing with the model compiled (the Trainer's
    ``gradient_checkpointing=True`` with ``torch_compile=True``): the checkpoint replays each
    layer's ``forward`` with the depth state it was called with. Not ``fullgraph``: Dynamo
    refuses HF's checkpoint even in the plain model (its side effects inside the HOP)."""
    from tests.conftest import hf_model, perturb_routing

    model = depthrewrite.rewrite(hf_model("llama", layers=3), "dar")
    perturb_routing(model)
    model.train()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))

    def step(run):
        model.zero_grad()
        loss = run(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_loss, eager_grads = step(model)
    with pytest.warns(FutureWarning) if hasattr(model, "activation_checkpointing_enable") else nullcontext():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="depthrewrite", options={"inner": "aot_eager"})
    loss, grads = step(compiled)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("scheme", ["dar", "wav"])
def test_compiled_autograd_compiles_the_routing_backward_and_matches_eager(scheme):
    """Compiled autograd (``torch._dynamo.config.compiled_autograd = True``, which DDP's
    ``python_reducer`` needs) as its documentation has it: the training step compiled,
    ``loss.backward()`` inside. The backward is traced as a graph of its own and handed to
    the backend, which finds the routing backwards in it (as ops of that graph's forward).
    Loss and gradients equal eager's."""
    model = _model(scheme)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = _loss_and_grads(model, model, idx)
    torch._dynamo.reset()
    backend.clear_reports()

    def step(ids):
        _, loss = model(ids, ids)
        loss.backward()
        return loss.detach()

    model.zero_grad(set_to_none=True)
    with torch._dynamo.config.patch(compiled_autograd=True):
        loss = torch.compile(step, backend="depthrewrite", options={"inner": "aot_eager"})(idx)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    backward_op = {"dar": "depthrewrite::route_many_backward", "wav": "depthrewrite::route_backward"}[scheme]
    reports = backend.reports()  # the model's graph, then the backward compiled autograd traced
    assert backward_op not in reports[0].ops
    assert any(r.ops.get(backward_op, 0) > 0 for r in reports[1:])
