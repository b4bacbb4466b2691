"""The backend option ``accumulate_grads`` (:mod:`depthrewrite.grad_accumulation`): source
gradients summed inside ``route_backward``. Rewritten tiny GPTs compiled with it compute
what eager computes, and the rewrite happened."""

from __future__ import annotations

import pytest
import torch

import depthrewrite
from depthrewrite import backend, sum_fences
from depthrewrite.models.gpt import gpt_from_preset
from tests.benchmark_scripts import load_benchmark


def _model(scheme: str, n_layer: int = 2, **options):
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=n_layer), scheme, **options).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _loss_and_grads(model, fn, idx):
    model.zero_grad(set_to_none=True)
    _, loss = fn(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(scheme: str, options: dict, n_layer: int = 2, **scheme_options):
    model = _model(scheme, n_layer, **scheme_options)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = _loss_and_grads(model, model, idx)
    torch._dynamo.reset()
    backend.clear_reports()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options=options)
    loss, grads = _loss_and_grads(model, compiled, idx)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    return backend.last_report()


# route_backward's running sums (site by site), and since session 36 route_many_backward's
# (the two-phase and grouped forms: grouped full AttnRes, Block AttnRes, and two-phase DAR
# with its separate keys, whose calls get them only with ROUTE_MANY_MAX_QUERIES None)
@pytest.mark.parametrize("scheme,scheme_options", [("attnres", {"group_size": None}), ("wav", {"two_phase": False}),
                                                   ("dar", {"variant": "dar", "two_phase": False}),
                                                   ("attnres", {"group_size": 2}), ("block_attnres", {"block_size": 1}),
                                                   ("dar", {"variant": "dar", "layers_per_block": 1})])
def test_aot_eager_with_accumulation_matches_eager(monkeypatch, scheme, scheme_options):
    from depthrewrite import grad_accumulation

    if scheme_options.get("layers_per_block"):
        monkeypatch.setattr(grad_accumulation, "ROUTE_MANY_MAX_QUERIES", None)
    report = _compare(scheme, {"inner": "aot_eager", "accumulate_grads": True}, **scheme_options)
    assert report.accumulate_grads and report.accumulated["backward"] > 0
    assert report.accumulated["forward"] == 0  # no routing backward in a forward graph


def test_route_many_running_sums_can_be_left_to_inductor(monkeypatch):
    """``grad_accumulation.ACCUMULATED_OPS`` without ``route_many_backward`` (the form before
    session 36): grouped full AttnRes, which calls only route_many, gets no running sums and
    the same result."""
    from depthrewrite import grad_accumulation

    report = _compare("attnres", {"inner": "aot_eager"}, group_size=2)
    assert report.accumulated["backward"] > 0
    monkeypatch.setattr(grad_accumulation, "ACCUMULATED_OPS", ("route_backward",))
    report = _compare("attnres", {"inner": "aot_eager"}, group_size=2)
    assert report.accumulated["backward"] == 0


def test_route_many_calls_of_many_queries_or_keys_keep_their_sums_outside(monkeypatch):
    """``ROUTE_MANY_MAX_QUERIES``: grouped full AttnRes over 8 sites in groups of 5 makes a
    5-query group call (group 0's sites) besides calls of 1 to 4 queries; at the default 4 it
    alone keeps its sums outside, at 5 or None it gets running sums too; DAR's keyed calls
    get none at the default. Each form computes what eager computes (``_compare``)."""
    from depthrewrite import grad_accumulation

    def accumulated(limit, scheme="attnres", **options):
        monkeypatch.setattr(grad_accumulation, "ROUTE_MANY_MAX_QUERIES", limit)
        return _compare(scheme, {"inner": "aot_eager"}, **options).accumulated["backward"]

    few, every = accumulated(4, n_layer=4, group_size=5), accumulated(None, n_layer=4, group_size=5)
    assert 0 < few < every
    assert accumulated(5, n_layer=4, group_size=5) == every
    assert accumulated(4, "dar", variant="dar", layers_per_block=1) == 0


def test_multi_head_route_many_calls_take_running_sums_when_asked(monkeypatch):
    """``ROUTE_MANY_MULTI_HEAD``: grouped full MHAR (4 heads, pairs of sites) keeps its
    route_many calls' sums outside by default, as before session 40; with the flag its
    calls get running sums (only route_many's: the scheme calls no route), and the result
    is still eager's."""
    from depthrewrite import grad_accumulation

    def accumulated(flag):
        monkeypatch.setattr(grad_accumulation, "ROUTE_MANY_MULTI_HEAD", flag)
        return _compare("mhar", {"inner": "aot_eager"}, heads=4, group_size=2, recompute=False).accumulated["backward"]

    assert accumulated(False) == 0
    assert accumulated(True) > 0


# Inductor: DAR with the running sums as new tensors, WAV (fewer calls to compile) with
# them written in place (the default) (Inductor's fallback kernel for a custom op that
# mutates lists of tensors). One layer: its 3 routed sites (attention, MLP, readout) have
# running sums and sums long enough to fence, in about a quarter less compile time than two.
@pytest.mark.parametrize("scheme,in_place", [("dar", False), ("wav", True)])
def test_inductor_with_accumulation_and_fences_matches_eager(monkeypatch, scheme, in_place):
    monkeypatch.setattr(sum_fences, "MIN_NUMEL", 0)
    report = _compare(scheme, {"accumulate_grads": True, "max_sum_terms": 2, "force_disable_caches": True,
                               "accumulate_in_place": in_place}, n_layer=1, two_phase=False)
    assert report.accumulated["backward"] > 0 and report.fences["backward"] > 0
    assert (report.in_place["backward"] > 0) if in_place else report.in_place == {}


@pytest.mark.parametrize("scheme,scheme_options", [("wav", {"two_phase": False}),
                                                   ("dar", {"variant": "dar", "two_phase": False})])
def test_running_sums_written_in_place_give_the_same_gradients(scheme, scheme_options):
    """``accumulate_in_place`` (on by default: the option not given): route_backward_into_
    writes the running sums in place; the float32 loss and every gradient are bit for bit
    those of the new-tensor form (``False``)."""
    model = _model(scheme, **scheme_options)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for in_place, option in ((False, {"accumulate_in_place": False}), (True, {})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager", **option})
        results[in_place] = _loss_and_grads(model, compiled, idx), backend.last_report()
    ((loss, grads), new_sums), ((loss_i, grads_i), in_place) = results[False], results[True]
    assert in_place.accumulate_in_place and in_place.in_place["backward"] > 0 and new_sums.in_place == {}
    assert in_place.accumulated == new_sums.accumulated
    assert torch.equal(loss_i, loss) and grads_i.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_i[name], grads[name]), name
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"options\['accumulate_in_place'\] must be True or False; found 1"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"accumulate_in_place": 1})


def test_route_many_running_sums_written_in_place_give_the_same_gradients():
    """``route_many_backward``'s running sums are written in place too (session 48): full
    AttnRes's calls with running sums run as ``route_many_backward_into_``, and the float32
    loss and every gradient are bit for bit those of the new-tensor form."""
    routing_calls = load_benchmark("routing_floor").RoutingCalls  # depthrewrite calls by op name
    model = _model("attnres", n_layer=3)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for in_place in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="depthrewrite", fullgraph=True,
                                 options={"inner": "aot_eager", "accumulate_in_place": in_place})
        model.zero_grad(set_to_none=True)
        _, loss = compiled(idx, idx)
        with routing_calls() as calls:
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[in_place] = loss.detach(), grads, calls.calls
    (loss, grads, new_sums), (loss_i, grads_i, in_place) = results[False], results[True]
    assert in_place["route_many_backward_into_"] > 0 and "route_many_backward_into_" not in new_sums
    assert sum(in_place.values()) == sum(new_sums.values())
    assert torch.equal(loss_i, loss) and grads_i.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_i[name], grads[name]), name


def test_accumulation_is_on_by_default_can_be_turned_off_and_is_checked():
    report = _compare("attnres", {"inner": "aot_eager"}, group_size=None)
    assert report.accumulate_grads and report.accumulated["backward"] > 0
    report = _compare("attnres", {"inner": "aot_eager", "accumulate_grads": False}, group_size=None)
    assert not report.accumulate_grads and report.accumulated == {}
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="accumulate_grads"):
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"accumulate_grads": 1})


def test_running_sums_limited_by_head_count_when_asked():
    """By default (``accumulate_max_heads`` None) multi-head calls get running sums too;
    with the option at 1, the same 2-head model's calls keep their sums outside, with the
    same result; a bad value is refused."""
    report = _compare("mhar", {"inner": "aot_eager"}, heads=2)
    assert report.accumulate_grads and report.accumulate_max_heads is None and report.accumulated["backward"] > 0
    report = _compare("mhar", {"inner": "aot_eager", "accumulate_max_heads": 1}, heads=2)
    assert report.accumulated["backward"] == 0
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"options\['accumulate_max_heads'\] must be a positive int"):
            backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={"accumulate_max_heads": bad})


def test_a_running_sum_is_overwritten_only_when_no_later_reader_sees_it():
    """``grad_accumulation._overwritable`` on hand-made graphs: a new sum that a
    route_backward call reads only as a running sum may be written in place; not when a node
    after the call reads it, directly or through a view taken before it, nor when the call
    also reads it as another input, nor when it is a graph input or not contiguous."""
    from depthrewrite.grad_accumulation import _overwritable

    def graph_with(reader_after=False, view_before=False, as_input=False, contiguous=True, also_grad_out=False):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(4, 4)
        r = x if as_input else g.call_function(torch.ops.aten.add.Tensor, (x, x))
        r.meta["val"] = torch.empty(4, 4) if contiguous else torch.empty(4, 4).t()
        view = g.call_function(torch.ops.aten.view.default, (r, [16])) if view_before else None
        call = g.call_function(torch.ops.depthrewrite.route_backward.default,
                               (r if also_grad_out else x, x, x, [x, x], None, x, x, None, None, 1, 1e-6),
                               {"grad_values_acc": [r, None]})
        later = [g.call_function(torch.ops.aten.neg.default, (view if view is not None else r,))] \
            if reader_after or view_before else []
        g.output([call] + later)
        return [r], call, {n: k for k, n in enumerate(g.nodes)}

    assert _overwritable(*graph_with())
    assert not _overwritable(*graph_with(reader_after=True))
    assert not _overwritable(*graph_with(view_before=True))
    assert not _overwritable(*graph_with(also_grad_out=True))
    assert not _overwritable(*graph_with(as_input=True))
    assert not _overwritable(*graph_with(contiguous=False))
