"""The harness's weight decay: on the model's own matrices and embeddings, never on the
parameters the rewrite adds (DAR's and Hyper-Connections' are matrices too), and a run
resumed from a checkpoint grouped the older way goes on as it started."""

from __future__ import annotations

import logging

import pytest
import torch

import depthrewrite
from depthrewrite.models import gpt_from_preset
from depthrewrite.train import DataConfig, TrainConfig, train
from depthrewrite.train import optimizer as optimizer_groups


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("scheme", ["dar", "hyperconn", "mhc", "attnres"])
def test_no_routing_parameter_is_decayed_and_every_model_matrix_is(scheme):
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), scheme)
    decay, other = optimizer_groups.decay_groups(model)
    routing = {name for name, _ in model.named_parameters() if ".depth_route." in name}
    own = {name: p for name, p in model.named_parameters() if ".depth_route." not in name}
    assert routing and not routing & _names(model, decay)
    assert _names(model, decay) == {name for name, p in own.items() if p.dim() >= 2}
    assert _names(model, other) == routing | {name for name, p in own.items() if p.dim() < 2}
    legacy, _ = optimizer_groups.decay_groups(model, optimizer_groups.LEGACY_RULE)
    matrices = {name for name in routing if model.get_parameter(name).dim() >= 2}
    assert _names(model, legacy) == _names(model, decay) | matrices
    if scheme != "attnres":  # these schemes store routing parameters as matrices
        assert matrices


def _legacy_make_optimizer(model, lr, weight_decay):
    """The optimizer as checkpoints before the rule made it: every 2+-D parameter decayed,
    and no ``decay_rule`` in its groups."""
    groups = optimizer_groups.decay_groups(model, optimizer_groups.LEGACY_RULE)
    return torch.optim.AdamW([{"params": params, "weight_decay": wd}
                              for params, wd in zip(groups, optimizer_groups.weight_decays(weight_decay))],
                             lr=lr, betas=optimizer_groups.BETAS)


def test_a_run_resumed_from_a_checkpoint_grouped_the_older_way_goes_on_as_it_started(
        tmp_path, shakespeare, monkeypatch, caplog):
    config = dict(model="gpt:tiny", layers=2, steps=6, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0,
                  eval_batches=2, progress=False, scheme="dar", data=DataConfig(source=str(shakespeare)))
    with monkeypatch.context() as legacy:
        legacy.setattr(optimizer_groups, "make_optimizer", _legacy_make_optimizer)
        straight = train(TrainConfig(**config, out=str(tmp_path / "a")))
        first = train(TrainConfig(**config, out=str(tmp_path / "b"), stop_after=3))
    with caplog.at_level(logging.WARNING, logger="depthrewrite.train.optimizer"):
        second = train(TrainConfig(**config, out=str(tmp_path / "b"), resume=True))
    assert "this run keeps that grouping" in caplog.text and "10 routing matrices" in caplog.text
    assert torch.equal(torch.tensor(straight.losses), torch.tensor(first.losses + second.losses))
    for (name, p), q in zip(straight.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_new_run_trains_its_routing_matrices_without_decay(tmp_path, shakespeare):
    """One step beside the older grouping: only DAR's routing matrices come out different
    (the older grouping decayed them), every other parameter bit for bit the same."""
    config = TrainConfig(model="gpt:tiny", layers=2, steps=1, batch_size=4, seq_len=32, warmup_steps=0,
                         eval_every=0, eval_batches=2, progress=False, scheme="dar", weight_decay=0.5,
                         data=DataConfig(source=str(shakespeare)))
    new = train(config).model.state_dict()
    with pytest.MonkeyPatch.context() as legacy:
        legacy.setattr(optimizer_groups, "make_optimizer", _legacy_make_optimizer)
        old = train(config).model.state_dict()
    differ = {name for name in new if not torch.equal(new[name], old[name])}
    assert differ and all(".depth_route." in name and new[name].dim() >= 2 for name in differ)
