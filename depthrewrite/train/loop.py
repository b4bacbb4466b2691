"""``train(config) -> TrainResult``: the training loop the CLI and ``compare`` run.

AdamW (weight decay on the model's own matrices and embeddings only: norms, biases and every
parameter the rewrite adds keep their init scale; ``optimizer.py``), linear warmup (a tenth
of the steps unless given) then cosine decay to ``min_lr_ratio * lr``, gradient clipping,
optional bf16 autocast and torch.compile, periodic evaluation on the validation split
(with the routing weights of schemes that have them: ``routing_log.py``), a JSONL metrics
file and checkpoints that resume bit-exactly (see ``checkpoint.py``).
A non-finite training loss or gradient norm stops the run (``FloatingPointError``) before
anything is saved, so that the checkpoints keep the last finite state. With ``out`` set, a
SIGTERM or SIGINT stops it after the current step, with a checkpoint
(:class:`TrainingInterrupted`, ``stop_signals.py``).

Resume: the model, data and seed must match the checkpoint's (``_RESUME_MUST_MATCH``);
``steps`` may grow, and the optimisation settings (``_RESUME_MAY_CHANGE``) given now apply
from the resumed step on, each change said with the checkpoint's value.

Reported numbers: ``final_train_loss`` is the mean training loss of the last
``min(10, steps run)`` steps (one step's loss is noisy); ``final_val_loss`` is measured at
the end on ``eval_batches`` fixed validation batches; ``tokens_per_s`` counts global
training tokens over training time, evaluation and the first step of the run (compilation,
allocator warm-up) excluded when more than one step ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import pathlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..rewrite import find_runtime
from ..routing_weights import RoutingWeights
from . import checkpoint, config_checks, distributed, routing_log
from .metrics import Metrics, final_train_loss
from . import optimizer as optimizer_groups
from .stop_signals import StopRequests
from .data import TRAIN_STREAM, VAL_STREAM, DataConfig, Splits, batch_at, load_splits
from .model import build_model, model_overrides, parse_model_name

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16")
#: torch.compile modes; "reduce-overhead" (and "max-autotune") record the compiled step as
#: CUDA graphs on a GPU, which the schemes with many routing calls need (docs/benchmarks.md)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
#: config fields that must match a checkpoint for ``resume`` (steps may grow)
_RESUME_MUST_MATCH = ("model", "layers", "d_model", "model_options", "scheme", "options", "batch_size",
                      "seq_len", "seed", "data")
#: settings a resumed run may change (to lower the learning rate after a spike, say): the
#: values given apply from the resumed step on and a change is logged (the warmup has its own
#: message, :func:`_warn_if_warmup_differs`)
_RESUME_MAY_CHANGE = ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "precision", "grad_accum")
#: warmup steps, when not given, are steps // WARMUP_DIVISOR (a tenth of the run, rounded
#: down): a fixed count would be the whole of a short run (no decay at all)
WARMUP_DIVISOR = 10


@dataclass
class TrainConfig:
    model: str = "gpt:tiny"
    layers: int | None = None  # overrides n_layer
    d_model: int | None = None
    model_options: dict = field(default_factory=dict)  # other config fields, e.g. {"dropout": 0.1}
    scheme: str = "residual"  # a depthrewrite scheme, or 'none' for no rewrite at all
    options: dict = field(default_factory=dict)  # the scheme's options
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = 200  # length of the LR schedule and of the run
    stop_after: int | None = None  # end this invocation after this many total steps (schedule unchanged)
    batch_size: int = 16  # global: split across ranks
    #: micro-batches each rank's rows are split into, one forward and backward each, the
    #: gradients summed before the update: the same step in less activation memory
    grad_accum: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: steps // WARMUP_DIVISOR (20 of the default 200)
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables
    precision: str = "fp32"
    compile: bool = False
    backend: str = "inductor"
    compile_mode: str = "default"  # one of COMPILE_MODES
    #: torch.compile's ``options``: the depthrewrite backend's (``recompute_branch_outputs``,
    #: ...) or Inductor settings; torch.compile takes them only with the default mode
    compile_options: dict = field(default_factory=dict)
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None  # torch intra-op CPU threads for this run (None: leave torch's setting)
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8
    out: str | None = None  # metrics.jsonl and checkpoints/ go here
    save_every: int = 0  # 0: only at the end of the run (when out is set)
    keep_checkpoints: int = 2  # 0 keeps all
    resume: bool = False
    overwrite: bool = False  # not resuming: delete the checkpoints already under out (else refused)
    distributed: str = "none"
    progress: bool = True
    #: with out set, SIGTERM or SIGINT stops the run after its step with a checkpoint (a second
    #: one at once); False leaves the signals to the process
    stop_on_signal: bool = True

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_batches", "grad_accum"):
            _positive_int(name, getattr(self, name))
        for name in ("eval_every", "save_every", "keep_checkpoints"):
            _non_negative_int(name, getattr(self, name))
        if self.warmup_steps is not None:
            _non_negative_int("warmup_steps", self.warmup_steps)
            if self.warmup_steps >= self.steps:
                raise ValueError(
                    f"warmup_steps must be less than steps={self.steps} (else the learning rate is still "
                    f"rising when the run ends and never decays), found {self.warmup_steps}; left unset, "
                    f"it is steps // {WARMUP_DIVISOR}")
        if self.stop_after is not None and not (isinstance(self.stop_after, int) and 0 < self.stop_after <= self.steps):
            raise ValueError(f"stop_after must be an int in [1, steps={self.steps}], found {self.stop_after!r}")
        if self.threads is not None:
            _positive_int("threads", self.threads)
        for name in ("weight_decay", "grad_clip"):
            config_checks.check_finite(name, getattr(self, name), positive=False)
        config_checks.check_finite("lr", self.lr, positive=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], found {self.min_lr_ratio!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, found {self.compile_mode!r}")
        if not isinstance(self.compile_options, dict):
            raise ValueError(f"compile_options must be a dict, found {self.compile_options!r}")
        config_checks.check_compile(self.compile, self.backend, self.compile_mode, self.compile_options)
        if self.compile_options and self.compile_mode != "default":
            raise ValueError(
                f"compile_options and compile_mode={self.compile_mode!r} exclude each other (torch.compile takes "
                "a mode or options): ask for CUDA graphs among the options, 'triton.cudagraphs': True")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, found {self.precision!r}")
        parse_model_name(self.model)
        config_checks.check_scheme(self.scheme, self.options)
        config_checks.check_device(self.device)
        config_checks.check_out(self.out, self.save_every, self.overwrite)
        if self.distributed not in distributed.MODES:
            raise ValueError(f"distributed must be one of {distributed.MODES}, found {self.distributed!r}")
        if self.resume and self.out is None:
            raise ValueError("resume needs out: the directory whose checkpoints to continue from")
        if not isinstance(self.stop_on_signal, bool):
            raise ValueError(f"stop_on_signal must be True or False, found {self.stop_on_signal!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: continue the run in out, or delete its "
                             "checkpoints and start over")
        self.data.validate()

    def warmup(self) -> int:
        """The warmup steps this run uses: ``warmup_steps``, or a tenth of ``steps``."""
        return self.steps // WARMUP_DIVISOR if self.warmup_steps is None else self.warmup_steps


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, found {value!r}")


def _non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, found {value!r}")


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by SIGTERM or SIGINT after step ``step``, its state saved at
    ``checkpoint`` (``resume=True`` continues it bit-exactly). A ``KeyboardInterrupt``, so
    that an ``except Exception`` does not carry on past it."""

    def __init__(self, signal_name: str, step: int, checkpoint: pathlib.Path):
        super().__init__(f"stopped by {signal_name} after step {step}; its state is saved in {checkpoint}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


@dataclass
class TrainResult:
    config: TrainConfig
    steps: list[int]  # the steps run by this invocation (1-based)
    losses: list[float]  # training loss of each of those steps (mean over the global batch)
    val: list[tuple[int, float]]  # (step, validation loss)
    final_train_loss: float
    final_val_loss: float
    tokens_per_s: float
    params: int
    new_params: int
    seconds: float
    metrics_path: pathlib.Path | None
    rank: int  # this process's rank (0 when not distributed): the CLI prints on rank 0 only
    model: nn.Module = field(repr=False)  # the trained model, unwrapped (no DDP / compile wrapper)
    splits: Splits = field(repr=False)
    #: the final evaluation's routing weights (``routing_log``); None for a scheme without them
    routing: RoutingWeights | None = field(default=None, repr=False)


# ------------------------------------------------------------------ optimisation
def _apply_settings(optimizer: torch.optim.Optimizer, scheduler, config: TrainConfig, step: int) -> None:
    """After a resume: the optimizer and scheduler state restore the learning rate and weight
    decay the checkpoint's run had (its ``lr``, and its schedule's value at ``step``); the
    config's apply instead. The same config gives the same floats (LambdaLR multiplies as
    here), so a resume with unchanged settings stays bit-exact."""
    scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    for group, decay in zip(optimizer.param_groups, optimizer_groups.weight_decays(config.weight_decay), strict=True):
        group["initial_lr"] = config.lr
        group["lr"] = config.lr * lr_factor(step, config)
        group["weight_decay"] = decay


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of ``lr`` for 0-based ``step``: linear warmup, then cosine to ``min_lr_ratio``."""
    warmup = config.warmup()
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def _autocast(config: TrainConfig, device: torch.device):
    if config.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- loop
@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, config: TrainConfig, info: distributed.DistInfo,
             device: torch.device) -> float:
    """Mean loss over ``eval_batches`` fixed validation batches (the same at every evaluation)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(config.eval_batches):
        x, y = batch_at(tokens, seed=config.seed, step=i, batch_size=config.batch_size, seq_len=config.seq_len,
                        rank=info.rank, world_size=info.world_size, stream=VAL_STREAM)
        with _autocast(config, device):
            _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    model.train(was_training)
    return distributed.mean_across_ranks(total / config.eval_batches, info).item()


def _evaluation(run: _Run) -> tuple[float, RoutingWeights | None]:
    """The validation loss, and the routing weights (``routing_log``) of the unwrapped model."""
    loss = evaluate(run.runner, run.splits.val, run.config, run.info, run.device)
    with _autocast(run.config, run.device):
        return loss, routing_log.routing_at_evaluation(run.model, run.splits.val, run.config, run.info, run.device)


def _scheme_options(model: nn.Module) -> dict | None:
    """The rewritten model's scheme options as used: defaults and automatic choices filled
    in (None: not rewritten)."""
    runtime = find_runtime(model)
    return None if runtime is None else runtime.scheme.resolved_options()


def data_digest(splits: Splits) -> str:
    """SHA-256 of the training and validation tokens: what ``config.data`` names (a path, a
    dataset) can change between a stop and a resume."""
    digest = hashlib.sha256()
    for tokens in (splits.train, splits.val):
        digest.update(len(tokens).to_bytes(8, "little"))
        digest.update(memoryview(tokens.contiguous().numpy()))
    return digest.hexdigest()


def _check_resume(payload: dict, config: TrainConfig, scheme_options: dict | None, digest: str) -> None:
    """Refuse to resume a different run. The scheme's options are compared with their
    defaults filled in where the checkpoint records them (:func:`_check_scheme_options`)."""
    saved, now = payload["config"], dataclasses.asdict(config)
    resolved = "scheme_options" in payload
    for name in _RESUME_MUST_MATCH:
        if name == "options" and resolved:
            continue  # the given options may differ where they pin a default to its recorded value
        if saved[name] != now[name]:
            raise ValueError(
                f"resume: {name} differs from the checkpoint's: checkpoint {saved[name]!r}, now {now[name]!r}"
            )
    _check_data(payload.get("data_digest"), digest, config)
    _check_not_past_the_end(payload["step"], config)
    _warn_if_warmup_differs(saved, config)
    _warn_if_settings_differ(saved, now, payload["step"])
    if resolved:
        _check_scheme_options(_resolve_recorded(payload["scheme_options"] or {}, scheme_options or {}),
                              scheme_options or {})
    elif scheme_options is not None:
        log.warning("resume: the checkpoint does not record its scheme options with their defaults (written "
                    "before they were recorded): defaults changed since then apply (see the scheme's docstring) "
                    "and the continuation may differ by rounding; pass the options the run started with "
                    "explicitly to keep them")


def _check_data(saved: str | None, digest: str, config: TrainConfig) -> None:
    if saved is None:
        log.info("resume: the checkpoint does not record a digest of its data (written before it was recorded)")
    elif saved != digest:
        raise ValueError(f"resume: the training and validation text differs from the checkpoint's (sha256 "
                         f"{digest[:12]} now, {saved[:12]} then): {config.data.hf_dataset or config.data.source!r} "
                         "changed since, or reads otherwise (the stdlib corpus on another Python); resume "
                         "with the text the run started on")


def _check_not_past_the_end(step: int, config: TrainConfig) -> None:
    """A checkpoint beyond where this invocation ends would train nothing (a run is not
    shortened by rewinding it)."""
    name, end = "stop_after" if config.stop_after is not None else "steps", _end(config)
    if step > end:
        raise ValueError(f"resume: the checkpoint is at step {step}, past {name}={end}; pass {name} >= {step} "
                         "to continue the run")


def _warn_if_settings_differ(saved: dict, now: dict, step: int) -> None:
    for name in _RESUME_MAY_CHANGE:
        if name in saved and saved[name] != now[name]:
            log.warning("resume: %s is %r now, %r in the checkpoint's run; the value given applies from step %d on",
                        name, now[name], saved[name], step + 1)


def _warn_if_warmup_differs(saved: dict, config: TrainConfig) -> None:
    """The schedule is the invocation's (``steps`` may grow, and an unset warmup with them),
    but a fixed warmup the resumed run no longer has (given then, or the old default of 20
    steps, and unset now) is said, with the value that keeps it."""
    before = saved.get("warmup_steps")
    if config.warmup_steps is None and before is not None and before != config.warmup():
        log.warning("resume: the learning-rate warmup is %d steps now, %d in the checkpoint's run; the rest of "
                    "the schedule follows %d (pass --warmup %d to keep the checkpoint's)", config.warmup(), before,
                    config.warmup(), before)


#: options that checkpoints written before they were resolved record as None, meaning "the
#: module default when the run ran" (``fused_merge``: two_phase.FUSED_MERGE), which is what
#: the same options resolve to now
_RECORDED_UNRESOLVED = ("fused_merge",)


def _resolve_recorded(before: dict, now: dict) -> dict:
    return {k: now.get(k) if k in _RECORDED_UNRESOLVED and v is None else v for k, v in before.items()}


def _check_scheme_options(before: dict, now: dict) -> None:
    """A default changed by an upgrade (``attnres`` ``group_size``, say: the same function
    computed in another order, no longer bit-exact) is named with the checkpoint's value."""
    diff = [f"{k}: checkpoint {before.get(k)!r}, now {now.get(k)!r}"
            for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if diff:
        raise ValueError("resume: the scheme options differ from the checkpoint's (defaults filled in): "
                         + "; ".join(diff) + ". Pass the checkpoint's values (--option KEY=VALUE) to continue "
                         "that run")


def train(config: TrainConfig, splits: Splits | None = None) -> TrainResult:
    """Train as ``config`` says; ``splits`` reuses already loaded data (``compare`` does)."""
    config.validate()
    import torch.distributed as dist

    owns_group = config.distributed != "none" and not dist.is_initialized()
    threads_before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    info = distributed.setup(config.distributed, config.device)
    try:
        return _train(config, splits, info)
    finally:
        torch.set_num_threads(threads_before)
        if owns_group:
            distributed.teardown(info)


@dataclass
class _Run:
    """What one invocation of ``train`` works with."""

    config: TrainConfig
    info: distributed.DistInfo
    device: torch.device
    splits: Splits
    model: nn.Module  # unwrapped: what is saved and returned
    runner: nn.Module  # what is called: the model, DDP's wrapper and/or torch.compile's
    optimizer: torch.optim.Optimizer
    scheduler: Any
    metrics: Metrics
    step: int  # steps completed so far, this invocation and earlier ones
    data_digest: str  # data_digest(splits), recorded in each checkpoint


def _train(config: TrainConfig, splits: Splits | None, info: distributed.DistInfo) -> TrainResult:
    start_time = time.perf_counter()
    device = distributed.rank_device(config.device, info)
    if splits is None:
        splits = load_splits(config.data, config.seed)
    built = _build(config, info, device)
    run = _prepare(config, info, device, splits, built.model)
    with StopRequests(enabled=config.stop_on_signal and config.out is not None) as stop:
        steps, losses, val, tokens_per_s = _run_steps(run, stop)
    if stop.requested is not None and run.step < _end(config):
        # no final evaluation: a preempted job has seconds to save before it is killed
        raise TrainingInterrupted(stop.requested, run.step, _save(run))
    final_val, routing = _evaluation(run)
    if not val or val[-1][0] != run.step:
        val.append((run.step, final_val))
        run.metrics.write_val(run.step, final_val, routing)
    if config.out is not None and steps:  # no steps: the checkpoint resumed from is this state
        _save(run)
    result = TrainResult(
        config=config, steps=steps, losses=losses, val=val,
        final_train_loss=final_train_loss(losses), final_val_loss=final_val,
        tokens_per_s=tokens_per_s, params=built.params, new_params=built.new_params,
        seconds=time.perf_counter() - start_time, metrics_path=run.metrics.path if run.metrics.enabled else None,
        rank=info.rank, model=run.model, splits=splits, routing=routing,
    )
    log.info("trained %s/%s for %d steps: train loss %.4f, val loss %.4f, %.0f tokens/s",
             config.model, config.scheme, len(steps), result.final_train_loss, final_val, result.tokens_per_s)
    return result


def _build(config: TrainConfig, info: distributed.DistInfo, device: torch.device):
    overrides = model_overrides(config.model_options, config.layers, config.d_model)
    built = build_model(config.model, overrides, config.scheme, config.options, config.seq_len, config.seed, device)
    built.model.train()
    if info.mode == "fsdp2":
        distributed.wrap(built.model, info, device)  # shards in place, before the optimizer sees the parameters
    return built


def _prepare(config: TrainConfig, info: distributed.DistInfo, device: torch.device, splits: Splits,
             model: nn.Module) -> _Run:
    """Optimizer and schedule, restored from the newest checkpoint with ``resume``; then the
    DDP wrapper and torch.compile (after loading, so that the state is the unwrapped model's)."""
    rows = config.batch_size // info.world_size
    if rows % config.grad_accum:
        raise ValueError(f"grad_accum={config.grad_accum} must divide each rank's rows (batch_size "
                         f"{config.batch_size} over {info.world_size} ranks: {rows}) into equal micro-batches")
    optimizer = optimizer_groups.make_optimizer(model, config.lr, config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    log.info("schedule: %d steps, %d of linear warmup to lr %g, then cosine to %g", config.steps, config.warmup(),
             config.lr, config.lr * config.min_lr_ratio)
    step = 0
    digest = data_digest(splits)
    if config.resume:
        def before_restore(payload: dict) -> None:
            _check_resume(payload, config, _scheme_options(model), digest)
            optimizer_groups.match_checkpoint(optimizer, model, payload["optimizer"])

        payload = checkpoint.load_latest(config.out, model, optimizer, scheduler, info, check=before_restore)
        step = payload["step"]
        _apply_settings(optimizer, scheduler, config, step)
    elif config.out is not None:
        _claim_out(config, info)
    metrics = Metrics(config.out, info.is_main, step if config.resume else None)
    runner = distributed.wrap(model, info, device) if info.mode == "ddp" else model
    if config.compile:
        mode = None if config.compile_mode == "default" else config.compile_mode
        runner = torch.compile(runner, backend=config.backend, mode=mode, options=config.compile_options or None)
    return _Run(config, info, device, splits, model, runner, optimizer, scheduler, metrics, step, digest)


def _claim_out(config: TrainConfig, info: distributed.DistInfo) -> None:
    """A new run in ``out``: checkpoints of an earlier run there would be mixed with its own
    (``keep_checkpoints`` deleting the new, lower steps first; ``resume`` later continuing
    the earlier run), so they are refused, or deleted with ``overwrite``."""
    newest = checkpoint.latest_checkpoint(config.out)
    if newest is None:
        return
    if not config.overwrite:
        raise ValueError(f"out {config.out} holds checkpoints of an earlier run (newest {newest.name}): pass "
                         "--resume to continue it or --overwrite to delete them and start over (TrainConfig "
                         "resume=True or overwrite=True), or another --out")
    checkpoint.remove_all(config.out, info)


def _end(config: TrainConfig) -> int:
    """The step this invocation ends at."""
    return config.stop_after if config.stop_after is not None else config.steps


def _run_steps(run: _Run, stop: StopRequests) -> tuple[list[int], list[float], list[tuple[int, float]], float]:
    """Train until ``stop_after`` or ``steps``, or until a rank is asked to stop
    (``stop.requested``); returns the steps, their losses, the periodic validation losses and
    the throughput (the invocation's first step left out as warm-up, unless it is the only
    one)."""
    config, info = run.config, run.info
    end = _end(config)
    tokens_per_step = config.batch_size * config.seq_len
    steps, losses, val = [], [], []
    train_time, timed_steps = 0.0, 0
    bar = tqdm(total=config.steps, initial=run.step, disable=not (config.progress and info.is_main),
               desc=config.scheme, unit="step", dynamic_ncols=True)
    while run.step < end:
        t0 = time.perf_counter()
        lr = run.optimizer.param_groups[0]["lr"]  # this step's: the scheduler steps inside
        loss, grad_norm, stopping = _train_step(run.runner, run.optimizer, run.scheduler, run.splits.train, run.step,
                                                config, info, run.device, stop)
        dt = time.perf_counter() - t0
        run.step += 1
        _check_finite(run, loss, grad_norm)
        if steps or run.step == end:
            train_time, timed_steps = train_time + dt, timed_steps + 1
        steps.append(run.step)
        losses.append(loss)
        record = {"step": run.step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt}
        if grad_norm is not None:  # measured where the gradients are clipped (grad_clip above 0)
            record["grad_norm"] = grad_norm
        run.metrics.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if stopping:  # agreed by every rank in the step's loss reduction: they all stop here
            stop.requested = stop.requested or "a stop signal to another rank"
            break
        if run.step < end and _every(config.eval_every, run.step):
            loss, routing = _evaluation(run)
            val.append((run.step, loss))
            run.metrics.write_val(run.step, loss, routing)
        if run.step < end and config.out is not None and _every(config.save_every, run.step):
            _save(run)
    bar.close()
    tokens_per_s = timed_steps * tokens_per_step / train_time if train_time > 0 else float("nan")
    return steps, losses, val, tokens_per_s


def _check_finite(run: _Run, loss: float, grad_norm: float | None) -> None:
    """Stop a diverged run before it saves: AdamW carries a NaN into every parameter, and
    ``keep_checkpoints`` would replace the finite checkpoints with such ones. The values are
    the same on every rank (the loss is averaged, the norm is of the whole gradient)."""
    if math.isfinite(loss):
        if grad_norm is None or math.isfinite(grad_norm):
            return
        what = f"the gradient norm is {grad_norm}"
    else:
        what = f"training loss is {loss}"
    raise FloatingPointError(f"{what} at step {run.step}; {_last_finite(run)}")


def _last_finite(run: _Run) -> str:
    newest = checkpoint.latest_checkpoint(run.config.out) if run.config.out is not None else None
    if newest is None:
        return "no checkpoint was written"
    return f"the newest checkpoint, {newest}, holds the last finite state: resume from it (with a lower --lr, say)"


def _check_parameters_finite(run: _Run) -> None:
    """Before a save: an update can overflow while its step's loss (and, unclipped, nothing
    else looked at) was finite. Every rank looks at its own parameters (shards under FSDP2)
    and all learn whether any found one."""
    names, params = zip(*run.model.named_parameters())
    finite = torch.stack([torch.isfinite(_local(p)).all() for p in params]).tolist()  # one sync, not one each
    bad = [name for name, ok in zip(names, finite) if not ok]
    found = distributed.mean_across_ranks(torch.tensor(float(len(bad)), device=run.device), run.info).item()
    if found > 0:
        named = f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""
        raise FloatingPointError(f"parameters are not finite after step {run.step}{named}, not saved; "
                                 + _last_finite(run))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _every(period: int, step: int) -> bool:
    return period > 0 and step % period == 0


def _train_step(runner: nn.Module, optimizer, scheduler, tokens: torch.Tensor, step: int, config: TrainConfig,
                info: distributed.DistInfo, device: torch.device, stop: StopRequests | None = None
                ) -> tuple[float, float | None, bool]:
    """One optimizer step; the mean loss over the ranks, the gradient norm before clipping
    (None without clipping), and whether any rank was asked to stop (``stop.requested``, up
    to the end of the step)."""
    x, y = batch_at(tokens, seed=config.seed, step=step, batch_size=config.batch_size, seq_len=config.seq_len,
                    rank=info.rank, world_size=info.world_size, stream=TRAIN_STREAM)
    loss = _forward_backward(runner, x, y, config, info, device)
    norm = None
    if config.grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(runner.parameters(), config.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # one reduction for both: the ranks agree to stop in the same step
    mean = loss.detach().float()
    both = torch.stack([mean, mean.new_full((), float(stop is not None and stop.requested is not None))])
    mean_loss, stopping = distributed.mean_across_ranks(both, info).tolist()
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor, each rank holding its shards' part
        norm = norm.full_tensor()
    return mean_loss, None if norm is None else norm.item(), stopping > 0


def _forward_backward(runner: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainConfig,
                      info: distributed.DistInfo, device: torch.device) -> torch.Tensor:
    """The gradients of this rank's rows, in ``grad_accum`` micro-batches; their mean loss."""
    losses = []
    for i, (xm, ym) in enumerate(zip(x.chunk(config.grad_accum), y.chunk(config.grad_accum))):
        if config.compile and config.compile_mode in _CUDAGRAPH_MODES:
            # a new iteration for the CUDA-graph trees: the last call's graph outputs may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with _gradient_sync(runner, info, i == config.grad_accum - 1):
            with _autocast(config, device):
                _, loss = runner(xm.to(device), ym.to(device))
            # equal micro-batches: the mean of their means is the batch's mean
            (loss / config.grad_accum if config.grad_accum > 1 else loss).backward()
        # a copy: under CUDA graphs the next micro-batch's replay writes over the graph's outputs
        losses.append(loss.detach().clone())
    return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


def _gradient_sync(runner: nn.Module, info: distributed.DistInfo, last: bool):
    """DDP averages the gradients over the ranks at the last micro-batch's backward only
    (``no_sync`` before); one process and FSDP2 (which reduces every backward, correct if
    not cheapest) need nothing."""
    if info.mode != "ddp" or last:
        return contextlib.nullcontext()
    return getattr(runner, "_orig_mod", runner).no_sync()  # under torch.compile, DDP is the wrapped module


def _save(run: _Run) -> pathlib.Path:
    _check_parameters_finite(run)
    return checkpoint.save(run.config.out, run.step, run.model, run.optimizer, run.scheduler, run.info,
                           extra={"config": dataclasses.asdict(run.config),
                                  "scheme_options": _scheme_options(run.model), "data_digest": run.data_digest},
                           keep=run.config.keep_checkpoints)
