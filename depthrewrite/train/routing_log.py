"""The depth-routing weights at every evaluation of a training run.

A run whose scheme weighs depth sources (``depthrewrite.has_routing_weights``) records, at
each evaluation, the routing weights of every site averaged over the tokens of the first
validation batch, and writes them into that evaluation's record of ``metrics.jsonl``
(``"routing"``, :meth:`RoutingWeights.to_record`). So a long run shows how its routing
develops, and a live run can be looked at: ``depthrewrite routing RUN_DIR`` prints and
draws an evaluation's weights, :func:`read_routing` reads them all.

The batch is the whole global batch: each rank records its share, as :func:`evaluate`
splits it, and the ranks' means are averaged, so a DDP or FSDP2 run records what one
process would (every rank runs the forward pass: FSDP2 gathers its parameters in it). The
forward pass is the model's own, eager (a compiled model's original module), in eval mode;
it changes no state the training reads, so the run trains as it would without it.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from torch import nn

from ..routing_weights import RoutingWeights, has_routing_weights, record_routing_weights
from . import distributed
from .data import VAL_STREAM, batch_at
from .metrics import ROUTING_FIELD, metrics_file, read_metrics


def routing_at_evaluation(model: nn.Module, tokens: torch.Tensor, config, info: distributed.DistInfo,
                          device: torch.device) -> RoutingWeights | None:
    """The token-averaged routing weights over the first validation batch (module docstring);
    None for a scheme without them. ``config``: the run's ``TrainConfig``. Call it under the
    run's autocast, as evaluation runs."""
    if not has_routing_weights(model):
        return None
    x, _ = batch_at(tokens, seed=config.seed, step=0, batch_size=config.batch_size, seq_len=config.seq_len,
                    rank=info.rank, world_size=info.world_size, stream=VAL_STREAM)
    return _mean_across_ranks(record_routing_weights(model, x.to(device)), info, device)


def _mean_across_ranks(weights: RoutingWeights, info: distributed.DistInfo, device: torch.device) -> RoutingWeights:
    if info.mode == "none":
        return weights
    sizes = [len(w) for w in weights.weights]
    flat = distributed.mean_across_ranks(torch.cat(weights.weights).to(device), info).cpu()
    return dataclasses.replace(weights, weights=list(flat.split(sizes)))


def read_routing(path: str | pathlib.Path) -> list[tuple[int, RoutingWeights]]:
    """``(step, weights)`` of every evaluation that recorded routing weights, in the file's
    order; ``path``: a metrics file or the run's folder holding one."""
    return [(r["step"], RoutingWeights.from_record(r[ROUTING_FIELD]))
            for r in read_metrics(metrics_file(path, "read_routing")) if ROUTING_FIELD in r]
