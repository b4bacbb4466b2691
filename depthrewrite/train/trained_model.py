"""A trained model back from a run's folder, for evaluation, sampling or a loop of one's own.

:func:`load_trained` rebuilds the model a ``depthrewrite train`` (or ``compare``) run
trained from what its checkpoint records: the preset and its overrides, the scheme and
every scheme option as the run used it (defaults and automatic choices filled in, so that a
later version with other defaults rebuilds the same computation), then loads the weights.
The folder is only read. The checkpoint is unpickled (``torch.load(weights_only=False)``,
as a resume reads it: it holds the run's config): load only runs you trust.
"""

from __future__ import annotations

import logging
import os
import pathlib
from dataclasses import dataclass

import torch
from torch import nn

from . import checkpoint, config_checks
from .model import build_model, model_overrides

log = logging.getLogger(__name__)


@dataclass
class TrainedModel:
    model: nn.Module  # in eval mode, on the device asked for
    step: int  # the training steps behind its weights
    config: dict  # the run's TrainConfig as its checkpoint records it (dataclasses.asdict)
    checkpoint: pathlib.Path

    @property
    def seq_len(self) -> int:
        """The window the run trained on: positions past it were never trained."""
        return self.config["seq_len"]


def load_trained(run_dir: str | os.PathLike, *, step: int | None = None, device: str = "cpu") -> TrainedModel:
    """The model of the checkpoint of ``step`` in ``run_dir`` (a run's ``--out`` folder), or
    of its newest readable checkpoint, on ``device`` in eval mode; its logits are the
    trained model's bit for bit on the same device (``tests/e2e/test_trained_model.py``).
    The global RNG is left as it was."""
    config_checks.check_device(device)
    path, payload = checkpoint.read_checkpoint(run_dir, step)
    config = payload["config"]
    target = torch.device(device)
    # build_model seeds the generators (the weights it draws are then overwritten)
    gpus = [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        built = build_model(config["model"], model_overrides(config["model_options"], config["layers"],
                                                             config["d_model"]),
                            config["scheme"], _scheme_options(payload, path), config["seq_len"], config["seed"], target)
    built.model.load_state_dict(payload["model"])
    log.info("loaded %s/%s at step %d from %s", config["model"], config["scheme"], payload["step"], path)
    return TrainedModel(built.model.eval(), payload["step"], config, path)


def _scheme_options(payload: dict, path: pathlib.Path) -> dict:
    """The scheme options as the run used them; a checkpoint written before they were
    recorded gives the options the run was started with, under today's defaults (said)."""
    if "scheme_options" in payload:
        return payload["scheme_options"] or {}
    log.warning("%s does not record its scheme options with their defaults (written before they were recorded): "
                "defaults changed since then apply", path)
    return payload["config"]["options"]
