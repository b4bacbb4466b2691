"""The backend option ``recompute_partial_sums`` (:mod:`depthrewrite.recompute`): WAV's and
DAR's partial sums recomputed in the backward instead of saved for it. Compiled with it, a
rewritten GPT computes the same loss and gradients as without it, and its backward takes
fewer tensors from the forward."""

from __future__ import annotations

import contextlib
import functools
import sys

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from torch.utils.checkpoint import CheckpointPolicy

import depthrewrite
from depthrewrite import backend
from depthrewrite.models.gpt import GPT, GPTConfig
from depthrewrite.passes import dar
from depthrewrite.recompute import TAG, branch_output_path, mark_recomputable


def _run(scheme: str, scheme_options: dict, recompute: bool | None, dtype=torch.float32, **backend_options):
    """Compiled with ``recompute`` as the option (None: not given, the default), in
    ``dtype``, through ``aot_eager`` unless ``backend_options`` names another inner compiler."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=64, n_layer=2, n_head=2, max_seq_len=32)), scheme,
                                 **scheme_options).to(dtype).train()
    options = {"inner": "aot_eager", **backend_options} | ({} if recompute is None else
                                                           {"recompute_partial_sums": recompute})
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options=options)
    idx = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    # no cache: a graph Inductor loads from one is not partitioned, so its saved set is not recorded
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _, loss = compiled(idx, idx)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, backend.last_report()


# one block of 4 sites (2 layers): partial sums at 3 sites before it closes. The schemes'
# default forms (WAV site by site, DAR two-phase) and DAR site by site; WAV's two-phase form
# (off by default) keeps as many tensors either way (docs/design.md)
@pytest.mark.parametrize("scheme,scheme_options", [
    ("wav", {"block_size": 4}), ("dar", {"layers_per_block": 2}), ("dar", {"layers_per_block": 2, "two_phase": False}),
])
def test_recomputed_partial_sums_same_gradients_fewer_saved_tensors(scheme, scheme_options):
    loss, grads, kept = _run(scheme, scheme_options, recompute=False)
    loss_r, grads_r, recomputed = _run(scheme, scheme_options, recompute=True)
    assert kept.recompute_marked is None and recomputed.recompute_marked > 0
    # float32: the recomputed sums are the forward's bit for bit, and so is everything after
    assert torch.equal(loss_r, loss)
    assert grads_r.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_r[name], grads[name]), name
    assert recomputed.saved_for_backward["tensors"] < kept.saved_for_backward["tensors"]
    assert recomputed.saved_for_backward["bytes"] < kept.saved_for_backward["bytes"]


def test_recompute_without_partial_sums_marks_nothing_and_bad_value_is_refused(caplog):
    _, _, report = _run("attnres", {"group_size": None}, recompute=True)  # site by site: no sums, no merges
    assert report.recompute_marked == 0
    assert "no partial sums were tagged" in caplog.text
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"options\['recompute_partial_sums'\] must be True or False; found 1"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"recompute_partial_sums": 1})


def test_on_by_default_and_silent_where_nothing_is_tagged(caplog):
    _, _, wav = _run("wav", {"block_size": 4}, recompute=None)
    assert wav.recompute_marked > 0
    _, _, plain = _run("attnres", {"group_size": None}, recompute=None)
    assert plain.recompute_marked == 0
    assert "no partial sums were tagged" not in caplog.text  # only a caller who asked is told


def test_a_policy_already_set_is_kept():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    tagged, chosen = graph.call_function(torch.add, (x, x)), graph.call_function(torch.mul, (x, x))
    graph.output((tagged, chosen))
    for node in (tagged, chosen):
        node.meta["custom"] = dict(TAG)
    chosen.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # e.g. the user's selective checkpointing
    assert mark_recomputable(graph) == (tagged.name,)
    assert tagged.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE
    assert chosen.meta["recompute"] == CheckpointPolicy.MUST_SAVE


@functools.cache
def _sums_recomputed(scheme: str, scheme_options: tuple):
    """``_run`` with the defaults (partial sums recomputed, branch outputs saved): the
    comparison of both options below, compiled once per scheme in a test process."""
    return _run(scheme, dict(scheme_options), recompute=None)


@pytest.mark.parametrize("option,recomputed_outputs", [(True, 3), ("narrow", 2)])
@pytest.mark.parametrize("scheme,scheme_options", [("wav", {"block_size": 4}), ("dar", {"layers_per_block": 2}),
                                                   ("dar", {"layers_per_block": 2, "fused_merge": True})])
def test_branch_outputs_recomputed_same_gradients_fewer_saved(scheme, scheme_options, option, recomputed_outputs):
    """``recompute_branch_outputs``: the branch outputs of the 3 sites with partial sums
    (one block of 4: attention, MLP, attention) are recomputed from their linear layers;
    with ``"narrow"`` only the attention sites' (d -> d; the MLP's down projection is
    2.7 d -> d). Float32 loss and gradients bit for bit those without it, one tensor of
    one activation fewer saved per recomputed output. DAR's fused merge with "narrow" is
    README's form for a DAR run short of memory."""
    loss, grads, sums = _sums_recomputed(scheme, tuple(scheme_options.items()))
    loss_b, grads_b, branch = _run(scheme, scheme_options, recompute=None, recompute_branch_outputs=option)
    assert torch.equal(loss_b, loss) and grads_b.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_b[name], grads[name]), name
    activation = 2 * 32 * 64 * 4  # (batch, sequence, d) float32
    assert sums.saved_for_backward["tensors"] - branch.saved_for_backward["tensors"] == recomputed_outputs
    assert sums.saved_for_backward["bytes"] - branch.saved_for_backward["bytes"] == recomputed_outputs * activation
    assert set(sums.recomputed) < set(branch.recomputed)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_branch_outputs_bad_value_refused(value):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"options\['recompute_branch_outputs'\] must be True, False or 'narrow'; "
                                         rf"found {value!r}"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"recompute_branch_outputs": value})


def test_branch_outputs_need_recomputed_sums():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"options\['recompute_branch_outputs'\] needs recompute_partial_sums .*"
                                         r"found recompute_partial_sums=False"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"recompute_branch_outputs": True,
                                                                        "recompute_partial_sums": False})


def test_branch_output_path_stops_at_random_or_unknown_ops():
    """Followed to a linear layer through casts and a dropout of probability 0; a dropout
    that draws random numbers, or any other producer, gives no path (the output stays saved)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    lin = graph.call_function(torch.nn.functional.linear, (x, w))
    cast = graph.call_method("to", (lin, torch.bfloat16))
    kept = graph.call_function(torch.nn.functional.dropout, (cast,), {"p": 0.0, "training": True})
    random = graph.call_function(torch.nn.functional.dropout, (lin,), {"p": 0.1, "training": True})
    other = graph.call_function(torch.relu, (lin,))
    graph.output((kept, random, other))
    assert branch_output_path(kept) == [kept, cast, lin]
    assert branch_output_path(random) == [] and branch_output_path(other) == []
    assert branch_output_path(kept, max_steps=1) == []  # two pass-through ops before the linear
    # narrow_only: the layer's widths from the example values Dynamo records; none here
    assert branch_output_path(kept, narrow_only=True) == []
    x.meta["example_value"], lin.meta["example_value"] = torch.empty(2, 8), torch.empty(2, 8)
    assert branch_output_path(kept, narrow_only=True) == [kept, cast, lin]
    x.meta["example_value"] = torch.empty(2, 9)  # wider at the input: kept
    assert branch_output_path(kept, narrow_only=True) == [] and branch_output_path(kept) == [kept, cast, lin]


def _saved_by_min_cut(monkeypatch, tag_merges: bool) -> list[torch.Tensor]:
    """What the backward of a bf16 DAR (two-phase, one block of 4 sites) takes from the
    forward under the partitioner Inductor uses (min-cut), the partial sums marked as the
    backend marks them, no code generation; ``tag_merges`` False: ``merge_partial``'s
    float32 copy of the phase-1 output left untagged."""
    if not tag_merges:
        monkeypatch.setattr(sys.modules["depthrewrite.ops.route_many"], "recomputable", contextlib.nullcontext)
    saved = []

    def backward(g, _inputs):
        saved.extend(n.meta["val"] for n in g.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))
        return make_boxed_func(g.forward)

    inner = aot_autograd(fw_compiler=lambda g, _inputs: make_boxed_func(g.forward), bw_compiler=backward,
                         partition_fn=min_cut_rematerialization_partition)

    def compiler(gm, example_inputs):
        mark_recomputable(gm.graph)
        return inner(gm, example_inputs)

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=64, n_layer=4, n_head=2, max_seq_len=32)), "dar",
                                 layers_per_block=2).to(torch.bfloat16).train()
    idx = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.compile(model, backend=compiler, fullgraph=True)(idx, idx)[1].backward()
    return [t for t in saved if isinstance(t, torch.Tensor)]


def test_the_merge_saves_no_float32_copy_of_the_phase_one_output(monkeypatch):
    """``merge_partial`` upcasts the phase-1 output to float32; tagged, the partitioner makes
    that copy again in the backward from the bf16 output instead of saving it (twice the
    bytes): 4 float32 activations fewer here (DAR, 2 blocks, 2 streams)."""
    tagged = _saved_by_min_cut(monkeypatch, tag_merges=True)
    untagged = _saved_by_min_cut(monkeypatch, tag_merges=False)
    activation = 2 * 32 * 64

    def float32_activations(saved):
        return sum(1 for t in saved if t.dtype == torch.float32 and t.numel() >= activation)

    assert float32_activations(untagged) - float32_activations(tagged) == 4
    assert sum(t.nbytes for t in untagged) - sum(t.nbytes for t in tagged) == 4 * activation * 4


def _partition_only(monkeypatch) -> None:
    """Inductor up to its partition and no further: its decompositions, joint-graph passes
    and min-cut partition make the forward and backward graphs (what the backward keeps is
    decided there, and the report records it), which then run as they are, with no code
    generated. On the CPU the C++ build of a graph's kernels takes most of a minute."""
    from torch._inductor import compile_fx

    def run_as_is(gm, _inputs, *args, **kwargs):
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", run_as_is)


def test_dar_closing_transport_tagged_saves_no_float32_copy(monkeypatch):
    """Untagged, the transport at the site that closes the block led the partitioner to keep
    a float32 copy of that site's routed input (for the branch's norm): one (2, 32, 64)
    float32 tensor more than with it tagged, the rest the same."""
    _partition_only(monkeypatch)

    def dar_block_bf16(tag_closing: bool):  # through Inductor's partition, the one training gets
        monkeypatch.setattr(dar, "TAG_CLOSING_TRANSPORT", tag_closing)
        loss, grads, report = _run("dar", {"layers_per_block": 2}, None, torch.bfloat16, inner="inductor")
        return loss, grads, report.saved_for_backward

    loss, grads, saved = dar_block_bf16(True)
    loss_u, grads_u, saved_u = dar_block_bf16(False)
    assert saved_u["tensors"] - saved["tensors"] == 1
    assert saved_u["bytes"] - saved["bytes"] == 2 * 32 * 64 * 4
    assert torch.equal(loss, loss_u)
    assert grads.keys() == grads_u.keys()
    # bf16: the recomputed sums may round differently (recompute.py), a few elements by an
    # ulp or two; each gradient within two bf16 roundings of the other in norm (5.0e-3 seen)
    for name in grads:
        a, b = grads[name].float(), grads_u[name].float()
        assert (a - b).norm() <= 2 * 2.0 ** -8 * b.norm(), name
