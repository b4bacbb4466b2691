"""The backend option ``accumulate_grads`` (:mod:`depthrewrite.grad_accumulation`): source
gradients summed inside ``route_backward``. Rewritten tiny GPTs compiled with it compute
what eager computes, and the rewrite happened."""

from __future__ import annotations

import pytest
import torch

import depthrewrite
from depthrewrite import backend, sum_fences
from depthrewrite.models.gpt import gpt_from_preset


def _model(scheme: str, **options):
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), scheme, **options).train()
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


def _compare(scheme: str, options: dict, **scheme_options):
    model = _model(scheme, **scheme_options)
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


# (route_many, which the two-phase and grouped forms call, writes each source's gradient once
# per call: it has no running sums, so full AttnRes, WAV and DAR are routed site by site here)
@pytest.mark.parametrize("scheme,scheme_options", [("attnres", {"group_size": None}), ("wav", {"two_phase": False}),
                                                   ("dar", {"variant": "dar", "two_phase": False})])
def test_aot_eager_with_accumulation_matches_eager(scheme, scheme_options):
    report = _compare(scheme, {"inner": "aot_eager", "accumulate_grads": True}, **scheme_options)
    assert report.accumulate_grads and report.accumulated["backward"] > 0
    assert report.accumulated["forward"] == 0  # no route_backward in a forward graph


def test_inductor_with_accumulation_and_fences_matches_eager(monkeypatch):
    monkeypatch.setattr(sum_fences, "MIN_NUMEL", 0)
    report = _compare("dar", {"accumulate_grads": True, "max_sum_terms": 2, "force_disable_caches": True},
                      two_phase=False)
    assert report.accumulated["backward"] > 0 and report.fences["backward"] > 0


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
