"""benchmarks/query_scale.py: a router's logit scale is ``|query * key_norm_weight|`` over a
head, the largest over its rows (DAR: one per stream) and heads."""

import pytest
import torch

import depthrewrite
from depthrewrite.models.gpt import gpt_from_preset
from tests.benchmark_scripts import load_benchmark


def test_logit_scale_per_router_row_and_head():
    scale = load_benchmark("query_scale")
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "dar")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in state if k.endswith(".query"))
    prefix = name[: -len(".query")]
    d = state[name].shape[-1]
    assert state[name].shape == (2, d)  # one row per DAR stream
    state[name].zero_()
    state[name][1, : d // 2] = 3.0
    state[prefix + ".key_norm_weight"].fill_(0.5)
    scales = scale.logit_scales(state)
    assert scales[prefix] == pytest.approx(1.5 * (d // 2) ** 0.5)  # row 1: |1.5 over d/2 channels|
    assert scale.logit_scales(state, heads=2)[prefix] == pytest.approx(1.5 * (d // 2) ** 0.5)  # all in head 0
    assert scale.logit_scales(state, heads=4)[prefix] == pytest.approx(1.5 * (d // 4) ** 0.5)
    with pytest.raises(ValueError, match="not a multiple of --heads 3"):
        scale.logit_scales(state, heads=3)
    untouched = [k for k in scales if k != prefix]
    assert untouched and all(scales[k] == 0.0 for k in untouched)  # zero-initialised queries: uniform routing


def test_a_query_without_key_norm_weight_counts_as_weight_one():
    scale = load_benchmark("query_scale")
    assert scale.logit_scales({"r.query": torch.tensor([3.0, 4.0])}) == {"r": 5.0}
