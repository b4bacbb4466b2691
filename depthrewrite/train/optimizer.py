"""The training harness's AdamW and which parameters it gives weight decay.

Two parameter groups: weight decay on the model's own matrices and embeddings (every
parameter of two or more dimensions), none on its vectors (norm weights, biases) and none on
the parameters the rewrite adds (under ``depth_route``). Most routing parameters are vectors,
but some are stored as matrices: DAR's per-stream queries and key-norm weights (``(2, d)``),
Hyper-Connections' and mHC's mixing matrices and dynamic projections. Decay would pull them
from their initial values (a norm weight of 1, an identity mix) where the vectors of the other
schemes keep theirs, so a comparison of schemes would train their routing differently.

Each group records its rule (``decay_rule``) in the optimizer's state, and so in every
checkpoint. Checkpoints written before the rule existed (before 2026-12-07) decayed every
parameter of two or more dimensions, routing matrices included: a run resumed from one keeps
that grouping, with a warning, so that it continues as it started.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..passes.runtime import routing_parameters  # lenient: [] for a model not rewritten (a run with no scheme)

log = logging.getLogger(__name__)

#: the current rule: no decay on vectors or on the rewrite's parameters
DECAY_RULE = "model matrices"
#: checkpoints' groups without a ``decay_rule``: every parameter of 2+ dimensions decayed
LEGACY_RULE = "all matrices"
RULES = (DECAY_RULE, LEGACY_RULE)
#: AdamW's betas for every run
BETAS = (0.9, 0.95)


def decay_groups(model: nn.Module, rule: str = DECAY_RULE) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters with weight decay and those without, each in the model's order."""
    if rule not in RULES:
        raise ValueError(f"decay_groups: rule must be one of {RULES}, found {rule!r}")
    routing = {id(p) for p in routing_parameters(model)} if rule == DECAY_RULE else set()
    decay, other = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in routing else other).append(p)
    return decay, other


def weight_decays(weight_decay: float) -> tuple[float, float]:
    """Of the two groups, in :func:`decay_groups`' order."""
    return weight_decay, 0.0


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    groups = [{"params": params, "weight_decay": wd, "decay_rule": DECAY_RULE}
              for params, wd in zip(decay_groups(model), weight_decays(weight_decay))]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def saved_rule(optimizer_state: dict) -> str:
    """The rule a checkpoint's optimizer state was grouped by."""
    rules = {group.get("decay_rule", LEGACY_RULE) for group in optimizer_state["param_groups"]}
    if len(rules) != 1 or not rules <= set(RULES):
        raise ValueError(f"resume: the checkpoint's optimizer groups record the weight-decay rules {sorted(rules)}; "
                         f"this version knows {RULES}, one for every group")
    return rules.pop()


def match_checkpoint(optimizer: torch.optim.Optimizer, model: nn.Module, optimizer_state: dict) -> None:
    """Before loading ``optimizer_state`` into a new ``optimizer``: group the parameters by the
    rule the checkpoint's run was grouped by, so that the run goes on as it started."""
    rule = saved_rule(optimizer_state)
    if rule == DECAY_RULE:
        return
    legacy = decay_groups(model, rule)
    moved = len(legacy[0]) - len(optimizer.param_groups[0]["params"])
    for group, params in zip(optimizer.param_groups, legacy, strict=True):
        group["params"] = params  # the rest of each group comes from the checkpoint's
    if moved:
        log.warning("resume: the checkpoint's run gave weight decay to every parameter of two or more dimensions, "
                    "%d routing matrices included; this run keeps that grouping to go on as it started (a new "
                    "run decays no routing parameter)", moved)
