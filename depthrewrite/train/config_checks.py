"""Checks of a training run's settings that need more than a range: the scheme and its
options, the device, the compile settings and the output folder. ``TrainConfig.validate``
runs them before any data is read or model built, so that a mistake costs nothing (the
``compare`` command checks every scheme's run before it trains the first)."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import torch


def check_scheme(scheme: str, options: dict) -> None:
    """The scheme's name and options, as ``depthrewrite.rewrite`` checks them."""
    from ..passes import scheme_class, scheme_options
    from .model import NO_REWRITE

    if scheme == NO_REWRITE:
        if options:
            raise ValueError(f"scheme 'none' (no rewrite) takes no options, found {sorted(options)}")
        return
    scheme_options(scheme_class(scheme), dict(options))


def check_finite(name: str, value: Any, *, positive: bool) -> None:
    """A finite number, > 0 or >= 0 (inf passes a range check, then ends the run as NaN)."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, found {value!r}")


def check_device(device: str) -> None:
    """A device torch knows, and one this machine has."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', found {device!r}") from exc
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here (torch {torch.__version__}, "
                         f"{torch.cuda.device_count()} GPUs visible); use device 'cpu'")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices "
                         f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def check_compile(compile: bool, backend: str, mode: str, options: dict) -> None:
    """The backend, mode and options apply to torch.compile only, and the options must be
    the chosen backend's."""
    if not compile:
        given = [f"{name}={value!r}" for name, value, default in
                 (("backend", backend, "inductor"), ("compile_mode", mode, "default"), ("compile_options", options, {}))
                 if value != default]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{', '.join(given)} {verb} to torch.compile, which this run does not use "
                             "(compile=False): add compile=True (--compile on), or leave them out")
        return
    _check_backend_name(backend)
    if backend == "depthrewrite":
        from ..backend import check_options

        check_options(options)  # a typo refused now, not after the model is built
    elif backend == "inductor":
        from ..backend import BACKEND_OPTIONS, check_inductor_settings

        ours = sorted(set(options) & set(BACKEND_OPTIONS))
        if ours:
            raise ValueError(f"compile_options {ours} belong to backend 'depthrewrite' (--backend depthrewrite); "
                             f"found backend {backend!r}")
        check_inductor_settings(options, "compile_options")


def _check_backend_name(backend: str) -> None:
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(backend)
    except InvalidBackend as exc:
        raise ValueError(f"backend must be a torch.compile backend ({', '.join(list_backends())}, ...), "
                         f"found {backend!r}") from exc


def check_out(out: str | None, save_every: int, overwrite: bool) -> None:
    """Checkpoint settings need an output folder, and ``out`` must be a folder."""
    if out is None:
        given = [name for name, value in (("save_every", save_every), ("overwrite", overwrite)) if value]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{' and '.join(given)} {verb} out, the folder checkpoints go to (--out); found none")
        return
    if pathlib.Path(out).exists() and not pathlib.Path(out).is_dir():
        raise ValueError(f"out must be a folder (metrics.jsonl and checkpoints/ go into it), found the file {out!r}")
