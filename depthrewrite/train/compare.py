"""``compare(config) -> CompareResult``: train several schemes on the same data, seed and
budget, and write ``results.md`` (the table), ``loss_curves.png`` and, per routed scheme,
``routing_<scheme>.png`` (token-averaged depth-routing weights on a validation batch) and,
per DAR scheme, ``streams_<scheme>.png`` (cross-stream CKA of its two histories, docs/spec.md section 6).

Every scheme starts from the same base weights (the model is seeded before the rewrite)
and sees the same batches (batches are a function of ``(seed, step)``).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from dataclasses import dataclass, field

import torch

from .data import VAL_STREAM, batch_at, load_splits
from .loop import TrainConfig, TrainResult, train
from .plots import loss_curves, routing_heatmap
from .stream_similarity import stream_similarity, stream_similarity_plot

log = logging.getLogger(__name__)

DEFAULT_SCHEMES = ("residual", "attnres", "block_attnres")


def default_compare_train_config() -> TrainConfig:
    """The README's main job: the bundled tiny GPT, 2 MB of stdlib source, a budget that
    runs the three default schemes in about 2-3 minutes on a 2-core CPU.

    One CPU thread: the tiny model's ops are too small for intra-op parallelism to pay,
    and on a machine whose other core is busy every OpenMP barrier waits for it (measured
    here: the routed schemes ran several times slower with 2 threads than with 1)."""
    from .data import DataConfig

    return TrainConfig(model="gpt:tiny", data=DataConfig(max_bytes=2_000_000), steps=250, batch_size=16,
                       seq_len=128, lr=3e-3, eval_every=50, eval_batches=8, threads=1)  # warmup: 25 steps


@dataclass
class CompareConfig:
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    train: TrainConfig = field(default_factory=default_compare_train_config)
    #: options of one scheme, ``{scheme: {name: value}}``; ``train.options`` go to every scheme
    scheme_options: dict = field(default_factory=dict)
    out: str = "runs/compare"

    def validate(self) -> None:
        if not self.schemes or len(set(self.schemes)) != len(self.schemes):
            raise ValueError(f"schemes must be a non-empty list without repeats, found {list(self.schemes)}")
        unknown = sorted(set(self.scheme_options) - set(self.schemes))
        if unknown:
            raise ValueError(f"scheme_options names schemes {unknown} that are not in schemes {list(self.schemes)}")
        if self.train.distributed != "none":
            raise ValueError(f"compare runs in one process; found distributed={self.train.distributed!r}")
        for scheme in self.schemes:  # every run checked before the first trains
            self.run_config(scheme, pathlib.Path(self.out)).validate()

    def run_config(self, scheme: str, out: pathlib.Path) -> TrainConfig:
        """The training run of one scheme: the shared options, then the scheme's own. A
        comparison starts over: a rerun into the same out replaces its runs."""
        options = {**self.train.options, **self.scheme_options.get(scheme, {})}
        return dataclasses.replace(self.train, scheme=scheme, options=options, out=str(out / scheme),
                                   resume=False, overwrite=True)


@dataclass
class CompareRow:
    scheme: str
    params: int
    new_params: int
    final_train_loss: float
    final_val_loss: float
    tokens_per_s: float
    heatmap: pathlib.Path | None
    streams: pathlib.Path | None = None  # DAR only: the cross-stream CKA figure
    stream_cka: float | None = None  # DAR only: mean cross-stream CKA over the written entries


@dataclass
class CompareResult:
    rows: list[CompareRow]
    table: str  # the markdown table of results.md
    results_path: pathlib.Path
    curves_path: pathlib.Path
    runs: dict[str, TrainResult] = field(repr=False)


def compare(config: CompareConfig) -> CompareResult:
    config.validate()
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = load_splits(config.train.data, config.train.seed)
    runs: dict[str, TrainResult] = {}
    rows = []
    for scheme in config.schemes:
        run_config = config.run_config(scheme, out)
        log.info("compare: training %s", scheme)
        result = train(run_config, splits=splits)
        runs[scheme] = result
        heatmap = _heatmap(result, out / f"routing_{scheme}.png")
        streams, stream_cka = _stream_similarity(result, out / f"streams_{scheme}.png")
        rows.append(CompareRow(scheme, result.params, result.new_params, result.final_train_loss,
                               result.final_val_loss, result.tokens_per_s, heatmap, streams, stream_cka))
    curves = loss_curves({s: (r.steps, r.losses, r.val) for s, r in runs.items()}, out / "loss_curves.png")
    table = results_table(rows)
    results = out / "results.md"
    results.write_text(_results_markdown(config, table, rows))
    return CompareResult(rows, table, results, curves, runs)


def _val_batch(result: TrainResult) -> torch.Tensor:
    """The first validation batch of the run, on the model's device."""
    config = result.config
    x, _ = batch_at(result.splits.val, seed=config.seed, step=0, batch_size=config.batch_size,
                    seq_len=config.seq_len, stream=VAL_STREAM)
    return x.to(next(result.model.parameters()).device)


def _heatmap(result: TrainResult, path: pathlib.Path) -> pathlib.Path | None:
    """The final evaluation's routing weights (recorded by the run on its first validation batch)."""
    if result.routing is None:
        log.info("routing weights: scheme %r has none (no depth sources weighed); heatmap skipped",
                 result.config.scheme)
        return None
    return routing_heatmap(result.routing, path)


def _stream_similarity(result: TrainResult, path: pathlib.Path) -> tuple[pathlib.Path | None, float | None]:
    """DAR's cross-stream CKA per history entry (docs/spec.md section 6) on the validation batch, drawn to
    ``path``, and its mean over the written entries; ``(None, None)`` for other schemes."""
    similarity = stream_similarity(result.model, _val_batch(result), result.config.scheme)
    if similarity is None:
        return None, None
    return stream_similarity_plot(similarity, path), similarity.mean_written()


def results_table(rows: list[CompareRow]) -> str:
    lines = ["| scheme | params | new params | final train loss | val loss | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.scheme} | {r.params:,} | {r.new_params:,} | {r.final_train_loss:.4f} | "
                     f"{r.final_val_loss:.4f} | {r.tokens_per_s:,.0f} |")
    return "\n".join(lines)


def _results_markdown(config: CompareConfig, table: str, rows: list[CompareRow]) -> str:
    t = config.train
    data = t.data.hf_dataset or t.data.source
    lines = [
        "# depthrewrite compare", "",
        f"Model `{t.model}`, data `{data}` (byte-level, up to {t.data.max_bytes:,} bytes), seed {t.seed}, "
        f"{t.steps} steps of {t.batch_size} x {t.seq_len} tokens, lr {t.lr} (warmup {t.warmup()}, cosine), "
        f"{t.precision}, device {t.device}.", "",
        "Final train loss: mean of the last 10 steps. Val loss: mean over "
        f"{t.eval_batches} fixed validation batches (documents held out by a seeded split). "
        "Losses in nats per byte.", "",
        table, "",
        "![loss curves](loss_curves.png)", "",
    ]
    for r in rows:
        if r.heatmap is not None:
            lines += [f"![{r.scheme} routing weights]({r.heatmap.name})", ""]
    return "\n".join(lines + _streams_markdown(rows))


def _streams_markdown(rows: list[CompareRow]) -> list[str]:
    """The DAR schemes' cross-stream CKA: 1 means the two streams carry the same features."""
    dar = [r for r in rows if r.streams is not None]
    if not dar:
        return []
    lines = ["Cross-stream linear CKA of DAR's two histories, CKA(H0_i, H1_i) over the tokens of the first "
             "validation batch, mean over the entries the blocks wrote (H_0 = e is shared):", ""]
    for r in dar:
        mean = "n/a (no completed block)" if r.stream_cka is None else f"{r.stream_cka:.4f}"
        lines += [f"- {r.scheme}: mean cross-stream CKA {mean}", "", f"![{r.scheme} stream CKA]({r.streams.name})", ""]
    return lines
