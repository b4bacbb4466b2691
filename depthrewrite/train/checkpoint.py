"""Checkpoints that resume bit-exactly: model, optimizer, LR scheduler, RNG state and the
step (the data position: batches are a function of ``(seed, step)``, see ``data.batch_at``).

Files are ``<out>/checkpoints/step_XXXXXXXX.pt``, written by rank 0 to a temporary name
and renamed, so a run killed while saving leaves the previous checkpoint intact. Under
FSDP2 every rank takes part in gathering the full (unsharded) state, and every rank reads
the full state back on resume.

All ranks of a run are seeded alike and draw the same random numbers, so rank 0's RNG
state is everyone's; it is restored on every rank.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from collections.abc import Callable

import torch
from torch import nn

from .distributed import DistInfo, barrier

log = logging.getLogger(__name__)

_NAME = re.compile(r"step_(\d{8})\.pt$")


def checkpoint_dir(out: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(out) / "checkpoints"


def checkpoint_path(out: str | os.PathLike, step: int) -> pathlib.Path:
    return checkpoint_dir(out) / f"step_{step:08d}.pt"


def list_checkpoints(out: str | os.PathLike) -> list[pathlib.Path]:
    """Checkpoints under ``out``, oldest step first."""
    folder = checkpoint_dir(out)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.search(p.name))


def latest_checkpoint(out: str | os.PathLike) -> pathlib.Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_state(model: nn.Module, optimizer, info: DistInfo) -> tuple[dict, dict]:
    if info.mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # a collective: every rank calls it, rank 0 keeps the gathered tensors
        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return model.state_dict(), optimizer.state_dict()


def save(out: str | os.PathLike, step: int, model: nn.Module, optimizer, scheduler, info: DistInfo,
         extra: dict, keep: int) -> pathlib.Path:
    """Write the checkpoint of ``step``; keep the newest ``keep`` checkpoints (0 keeps all).
    ``model`` is the unwrapped module (not DDP's wrapper or torch.compile's)."""
    model_state, optim_state = _full_state(model, optimizer, info)
    path = checkpoint_path(out, step)
    if info.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"step": step, "model": model_state, "optimizer": optim_state,
                   "scheduler": scheduler.state_dict(), "rng": _rng_state(), **extra}
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
        if keep > 0:
            for old in list_checkpoints(out)[:-keep]:
                old.unlink()
        log.info("saved checkpoint %s", path)
    barrier(info)
    return path


def load(path: str | os.PathLike, model: nn.Module, optimizer, scheduler, info: DistInfo,
         check: Callable[[dict], None] | None = None) -> dict:
    """Restore everything :func:`save` wrote; returns the payload (``step``, ``config``, ...).
    ``check(payload)`` runs before anything is restored (to refuse a mismatched run)."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if check is not None:
        check(payload)
    if info.mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    _set_rng_state(payload["rng"])
    log.info("resumed from %s at step %d", path, payload["step"])
    return payload
