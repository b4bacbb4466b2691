"""``metrics.jsonl``, a training run's log: one JSON record per step (``loss``, ``lr``,
``tokens_per_s``, ``grad_norm``) and per evaluation (``val_loss``, and ``routing``:
``routing_log.py``). Written by rank 0 only; a resumed run drops what a killed run logged
after its checkpoint, and a reader may read a live run's file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from dataclasses import dataclass

from ..routing_weights import RoutingWeights

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
#: the field of an evaluation's record that holds its routing weights (``routing_log.py``)
ROUTING_FIELD = "routing"


class Metrics:
    """The JSONL metrics file (rank 0 only): one record per step and per evaluation."""

    def __init__(self, out: str | None, enabled: bool, resume_step: int | None):
        self.path = pathlib.Path(out) / METRICS_FILE if out is not None else None
        self.enabled = enabled and self.path is not None
        self._val_steps: set[int] = set()  # steps whose validation loss the file holds
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            # drop what a killed run logged after its last checkpoint: those steps run again
            kept = [(line, r) for line, r in self._read_resumed() if r["step"] <= resume_step]
            self._val_steps = {r["step"] for _, r in kept if "val_loss" in r}
            # the whole history or none of it: a kill while rewriting must not cut it short
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line, _ in kept))
            os.replace(tmp, self.path)

    def _read_resumed(self) -> list[tuple[str, dict]]:
        """The lines of the file with their records; a last line cut short (the run killed
        while writing it) is dropped, said."""
        records, cut = _metric_records(self.path)
        if cut is not None:
            log.warning("resume: the last line of %s was cut short (the run was killed while writing it); "
                        "dropped: %r", self.path, cut[:80])
        return records

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def write_val(self, step: int, loss: float, routing: RoutingWeights | None) -> None:
        """The validation loss of ``step`` and its routing weights (``routing_log``), unless
        the file has them (a finished run resumed)."""
        if step not in self._val_steps:
            self._val_steps.add(step)
            record = {"step": step, "val_loss": loss}
            if routing is not None:
                record[ROUTING_FIELD] = routing.to_record()
            self.write(record)


def metrics_file(path: str | pathlib.Path, caller: str) -> pathlib.Path:
    """The metrics file ``path`` names: itself, or the one in the run's folder it names."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{caller}: no metrics file at {str(path)!r} (a run's --out folder holds "
                                f"{METRICS_FILE})")
    return path


def final_train_loss(losses: list[float]) -> float:
    """Mean of the last 10 steps' losses (one step's is noisy); NaN with none."""
    tail = losses[-10:]
    return sum(tail) / len(tail) if tail else math.nan


@dataclass
class RunHistory:
    """What a run's metrics file holds of its losses, in step order."""

    steps: list[int]  # the training steps logged
    losses: list[float]  # their training losses
    val: list[tuple[int, float]]  # (step, validation loss) of each evaluation

    def final_train_loss(self) -> float:
        """:func:`final_train_loss` of the run's logged losses."""
        return final_train_loss(self.losses)

    def best_val(self) -> tuple[int, float] | None:
        """The evaluation with the lowest validation loss (the earliest of equals)."""
        return min(self.val, key=lambda sv: sv[1]) if self.val else None


def read_history(path: str | pathlib.Path) -> RunHistory:
    """The losses of a run (its folder or its metrics file; a live run too)."""
    records = read_metrics(metrics_file(path, "read_history"))
    steps = [(r["step"], r["loss"]) for r in records if "loss" in r]
    return RunHistory([s for s, _ in steps], [v for _, v in steps],
                      [(r["step"], r["val_loss"]) for r in records if "val_loss" in r])


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The records of a metrics file; a last line cut short (a run killed, or one still
    writing it: this may read a live run) is left out."""
    return [record for _, record in _metric_records(pathlib.Path(path))[0]]


def _metric_records(path: pathlib.Path) -> tuple[list[tuple[str, dict]], str | None]:
    """The ``(line, record)`` pairs of a metrics file, and its last line where that is cut
    short; a line elsewhere that is not JSON is a ValueError naming the file and line."""
    lines = [line for line in path.read_text().splitlines() if line]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                return records, line
            raise ValueError(f"{path} line {number} is not JSON ({exc}): {line[:80]!r}") from exc
    return records, None
