"""Checkpoints that resume bit-exactly: model, optimizer, LR scheduler, RNG state and the
step (the data position: batches are a function of ``(seed, step)``, see ``data.batch_at``).

Files are ``<out>/checkpoints/step_XXXXXXXX.pt``, written by rank 0 to a temporary name,
flushed to the disk and renamed, so a run killed while saving leaves the previous
checkpoint intact. A newest checkpoint that cannot be read all the same (a node lost before
the file reached the disk) is passed over on resume for the next older one, with a
warning, and renamed ``step_XXXXXXXX.pt.unreadable`` (:func:`load_latest`). Under
FSDP2 every rank takes part in gathering the full (unsharded) state, and every rank reads
the full state back on resume.

All ranks of a run are seeded alike and draw the same random numbers, so rank 0's RNG
state is everyone's; it is restored on every rank.
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
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
        _write(payload, path)
        if keep > 0:
            for old in list_checkpoints(out)[:-keep]:
                old.unlink()
        log.info("saved checkpoint %s", path)
    barrier(info)
    return path


def _write(payload: dict, path: pathlib.Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        # on the disk before the rename makes it the newest: else a crash can leave the new
        # name on a file whose data never arrived
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_all(out: str | os.PathLike, info: DistInfo) -> None:
    """Delete the checkpoints under ``out`` (a run started over there)."""
    if info.is_main:
        for path in list_checkpoints(out):
            path.unlink()
            log.warning("removed %s: this run starts over in %s", path, out)
    barrier(info)


#: what torch.load raises for a file that is not a whole checkpoint: cut short (RuntimeError
#: from the zip reader), empty (EOFError), zeros or garbage (KeyError, UnpicklingError)
_UNREADABLE = (RuntimeError, EOFError, KeyError, pickle.UnpicklingError)
_PAYLOAD_KEYS = ("step", "model", "optimizer", "scheduler", "rng")


def _try_read(path: pathlib.Path) -> tuple[dict | None, str]:
    """``(payload, "")``, or ``(None, why)`` when the file at ``path`` is not a whole checkpoint."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except _UNREADABLE as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not isinstance(payload, dict) or any(key not in payload for key in _PAYLOAD_KEYS):
        return None, f"not a checkpoint of depthrewrite train: no {', '.join(_PAYLOAD_KEYS)}"
    return payload, ""


def _read(path: pathlib.Path, purpose: str) -> dict | None:
    """The payload at ``path``, or None (said, with ``purpose`` first) when the file is not a
    whole checkpoint and the caller goes on to the next older one."""
    payload, why = _try_read(path)
    if payload is None:
        log.warning("%s: cannot read %s (%s); trying the next older checkpoint", purpose, path, why)
    return payload


def load_latest(out: str | os.PathLike, model: nn.Module, optimizer, scheduler, info: DistInfo,
                check: Callable[[dict], None] | None = None) -> dict:
    """Restore the newest checkpoint under ``out`` that can be read (:func:`_restore`); one
    that cannot is passed over with a warning naming it."""
    found = list_checkpoints(out)
    if not found:
        raise ValueError(f"resume: no checkpoint under {checkpoint_dir(out)}")
    for newer, path in enumerate(reversed(found)):
        payload = _read(path, "resume")
        if payload is None:
            continue
        if newer:
            log.warning("resume: continuing from %s, the newest checkpoint that can be read", path)
        payload = _restore(path, payload, model, optimizer, scheduler, info, check)
        _set_aside(found[len(found) - newer:], info)
        return payload
    raise ValueError(f"resume: no readable checkpoint under {checkpoint_dir(out)}: "
                     f"{', '.join(p.name for p in found)} cannot be read (see the warnings)")


def read_checkpoint(out: str | os.PathLike, step: int | None = None) -> tuple[pathlib.Path, dict]:
    """``(path, payload)`` of the checkpoint of ``step`` under ``out``, or of the newest one
    that can be read (one that cannot is passed over with a warning, and left in place:
    reading changes nothing in the run's folder). For a look at a run; ``load_latest``
    resumes one."""
    found = list_checkpoints(out)
    if not found:
        raise ValueError(f"no checkpoint under {str(checkpoint_dir(out))!r} (a run's --out folder holds "
                         "checkpoints/ once it has saved: at its end, or every --save-every steps)")
    if step is not None:
        path = checkpoint_path(out, step)
        if path not in found:
            steps = ", ".join(str(int(_NAME.search(p.name).group(1))) for p in found)
            raise ValueError(f"step {step}: no checkpoint of that step under {str(checkpoint_dir(out))!r}; it holds "
                             f"steps {steps}")
        payload, why = _try_read(path)
        if payload is None:
            raise ValueError(f"step {step}: cannot read {str(path)!r} ({why})")
        return path, payload
    for path in reversed(found):
        payload = _read(path, "checkpoint")
        if payload is not None:
            return path, payload
    raise ValueError(f"no readable checkpoint under {str(checkpoint_dir(out))!r}: "
                     f"{', '.join(p.name for p in found)} cannot be read (see the warnings)")


def _set_aside(unreadable: list[pathlib.Path], info: DistInfo) -> None:
    """Rename the unreadable checkpoints a resume passed over to ``<name>.unreadable``: kept
    for a look, but no longer taken for the newest ones. Left in place, they would count among
    the ``keep`` newest that ``save`` keeps, and it would delete the readable one this run
    resumed from in their stead."""
    if not unreadable:
        return
    barrier(info)  # every rank has read the checkpoint it resumed from
    if info.is_main:
        for path in unreadable:
            aside = path.with_name(path.name + ".unreadable")
            os.replace(path, aside)
            log.warning("resume: renamed the unreadable %s to %s", path, aside.name)
    barrier(info)


def _restore(path: str | os.PathLike, payload: dict, model: nn.Module, optimizer, scheduler, info: DistInfo,
             check: Callable[[dict], None] | None) -> dict:
    """Restore everything :func:`save` wrote; returns the payload (``step``, ``config``, ...).
    ``check(payload)`` runs before anything is restored (to refuse a mismatched run)."""
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
