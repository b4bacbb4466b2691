"""The ``depthrewrite`` command: ``inspect``, ``train``, ``compare``, ``routing``, ``curves`` and
``sample``. Parses and prints; the work is done by ``depthrewrite.inspect`` and ``depthrewrite.train``.

    depthrewrite inspect gpt:small            # the residual-stream table of a preset or HF config
    depthrewrite compare                      # residual vs attnres vs block_attnres, tiny GPT, stdlib text, CPU
    depthrewrite train --model gpt:tiny --scheme attnres --steps 300 --out runs/attnres
    depthrewrite train --out runs/attnres --steps 300 --resume
    depthrewrite routing runs/attnres          # the routing weights its latest evaluation recorded
    depthrewrite curves runs/attnres runs/dar  # their loss curves in one figure, and a table
    depthrewrite sample runs/attnres --prompt "ROMEO:"  # text from its newest checkpoint
    torchrun --nproc-per-node 2 -m depthrewrite.cli train --distributed ddp --scheme attnres
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import re
import signal
import sys

from .errors import DepthRewriteError
from .train.compare import DEFAULT_SCHEMES, CompareConfig, compare, default_compare_train_config
from .train.distributed import MODES
from .train.loop import COMPILE_MODES, PRECISIONS, WARMUP_DIVISOR, TrainConfig, TrainingInterrupted, train
from .train.model import preset_names


#: how --option and --model-option read VALUE (in the help and in parse_value's docstring)
VALUE_FORMS = ("VALUE: an int, a float, true/false, none, a tuple of those written a,b or (a,b) or [a,b] "
               "(e.g. beta_init=1.0,0.5), else a string")
_BRACKETS = {"(": ")", "[": "]"}


def parse_value(text: str):
    """``key=value`` values: int, then float, then true/false/none, else the string; a
    comma-separated list, bare or in ``()`` or ``[]``, is a tuple of such values
    (``beta_init=1.0,0.5``; ``()`` is the empty tuple, ``(1,)`` a tuple of one)."""
    text = text.strip()
    if text[:1] in _BRACKETS and text[-1:] == _BRACKETS[text[0]]:
        return _parse_tuple(text, text[1:-1])
    if "," in text:
        return _parse_tuple(text, text)
    return _parse_scalar(text)


def _parse_tuple(text: str, inner: str) -> tuple:
    if not inner.strip():
        return ()
    items = [item.strip() for item in inner.split(",")]
    if items[-1] == "" and len(items) > 1:  # a trailing comma, as in Python's (1,)
        items.pop()
    for item in items:
        if not item or item[0] in _BRACKETS or item[-1] in _BRACKETS.values():
            raise ValueError(f"a tuple value is comma-separated numbers, words or none (not nested, no empty "
                             f"items), found {text!r}")
    return tuple(_parse_scalar(item) for item in items)


def _parse_scalar(text: str):
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_options(items: list[str], flag: str) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects key=value, found {item!r}")
        try:
            out[key.strip()] = parse_value(value)
        except ValueError as exc:
            raise ValueError(f"{flag} {item!r}: {exc}") from exc
    return out


def _add_common(p: argparse.ArgumentParser, base: TrainConfig, out_default: str) -> None:
    """The model, data and training flags of train and compare; ``base`` gives the defaults
    the help shows (the two subcommands' differ)."""
    _add_model_args(p.add_argument_group("model"), base)
    _add_data_args(p.add_argument_group("data (byte-level tokens)"), base.data)
    _add_training_args(p.add_argument_group("training"), base, out_default)
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="(default warning)")


def _add_model_args(m, base: TrainConfig) -> None:
    m.add_argument("--model", help=f"bundled preset: {', '.join(preset_names())} (default {base.model})")
    m.add_argument("--layers", type=int, help="number of layers (default: the preset's)")
    m.add_argument("--d-model", type=int, help="model width (default: the preset's)")
    m.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other GPTConfig/MoEConfig field, e.g. dropout=0.1 (repeatable)")
    m.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="scheme option, e.g. block_size=4 (repeatable; compare: SCHEME:KEY=VALUE for one scheme). "
                   + VALUE_FORMS)


def _add_data_args(d, data) -> None:
    d.add_argument("--data", help="'stdlib' (Python's own standard library sources), a text file or a directory "
                   f"(default {data.source})")
    d.add_argument("--max-bytes", type=int, help=f"cap on the corpus size in bytes (default {data.max_bytes:,})")
    d.add_argument("--doc-bytes", type=int,
                   help=f"document size for splitting plain text files (default {data.doc_bytes})")
    d.add_argument("--val-fraction", type=float,
                   help=f"fraction of documents held out for validation (default {data.val_fraction})")
    d.add_argument("--hf-dataset", help="Hugging Face dataset name or local data file (needs `datasets`)")
    d.add_argument("--hf-split", help=f"(default {data.hf_split})")
    d.add_argument("--hf-text-field", help=f"(default {data.hf_text_field})")


def _add_training_args(t, base: TrainConfig, out_default: str) -> None:
    t.add_argument("--steps", type=int, help=f"length of the run and of the LR schedule (default {base.steps})")
    t.add_argument("--stop-after", type=int, help="end this invocation at this step of the run, counted from its "
                   "start as --steps is, not from a resumed checkpoint (schedule unchanged; default: run all "
                   "--steps)")
    t.add_argument("--batch-size", type=int,
                   help=f"global batch size, split across ranks (default {base.batch_size})")
    t.add_argument("--grad-accum", type=int, help="micro-batches each rank's share of a step is run in, the "
                   f"gradients summed: the same step in less memory (default {base.grad_accum})")
    t.add_argument("--seq-len", type=int, help=f"tokens (bytes) per sequence (default {base.seq_len})")
    t.add_argument("--lr", type=float, help=f"peak learning rate (default {base.lr})")
    t.add_argument("--min-lr-ratio", type=float,
                   help=f"cosine floor as a fraction of --lr (default {base.min_lr_ratio})")
    t.add_argument("--warmup", type=int, dest="warmup_steps", help="linear warmup steps, fewer than --steps "
                   f"(default: --steps // {WARMUP_DIVISOR}, {base.warmup()} of {base.steps})")
    t.add_argument("--weight-decay", type=float, help="AdamW weight decay of the model's own matrices and "
                   f"embeddings, none on the routing parameters (default {base.weight_decay})")
    t.add_argument("--grad-clip", type=float, help=f"gradient norm clip, 0: off (default {base.grad_clip})")
    t.add_argument("--precision", choices=PRECISIONS, help=f"(default {base.precision})")
    t.add_argument("--compile", choices=("off", "on"),
                   help=f"torch.compile (default {'on' if base.compile else 'off'})")
    t.add_argument("--backend", help=f"torch.compile backend (default {base.backend})")
    t.add_argument("--compile-mode", choices=COMPILE_MODES,
                   help=f"torch.compile mode (default '{base.compile_mode}'; reduce-overhead records CUDA graphs "
                   "on a GPU)")
    t.add_argument("--compile-option", action="append", default=[], metavar="KEY=VALUE",
                   help="torch.compile option, repeatable: the depthrewrite backend's (recompute_branch_outputs=narrow, "
                   "max_sum_terms=4, ...) or an Inductor setting; not with --compile-mode (default: none)")
    t.add_argument("--seed", type=int, help=f"(default {base.seed})")
    t.add_argument("--device", help=f"(default {base.device})")
    t.add_argument("--threads", type=int, help="torch CPU threads (default "
                   + ("torch's)" if base.threads is None else f"{base.threads})"))
    t.add_argument("--eval-every", type=int, help=f"validation every N steps, 0: at the end only (default "
                   f"{base.eval_every})")
    t.add_argument("--eval-batches", type=int,
                   help=f"validation batches per evaluation (default {base.eval_batches})")
    t.add_argument("--out", help=f"output directory (metrics.jsonl, checkpoints/, plots; default {out_default})")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")


_DATA_ARGS = {"data": "source", "max_bytes": "max_bytes", "doc_bytes": "doc_bytes", "val_fraction": "val_fraction",
              "hf_dataset": "hf_dataset", "hf_split": "hf_split", "hf_text_field": "hf_text_field"}
_TRAIN_ARGS = ("model", "layers", "d_model", "steps", "stop_after", "batch_size", "grad_accum", "seq_len", "lr",
               "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "precision", "backend", "compile_mode",
               "seed", "device", "threads", "eval_every", "eval_batches", "out", "save_every", "keep_checkpoints",
               "distributed", "scheme")


def _train_config(args: argparse.Namespace, base: TrainConfig, options: dict) -> TrainConfig:
    given = {k: getattr(args, k) for k in _TRAIN_ARGS if getattr(args, k, None) is not None}
    data = dataclasses.replace(base.data, **{f: getattr(args, a) for a, f in _DATA_ARGS.items()
                                             if getattr(args, a) is not None})
    if args.compile is not None:
        given["compile"] = args.compile == "on"
    for flag in ("resume", "overwrite"):
        if getattr(args, flag, False):
            given[flag] = True
    model_options = {**base.model_options, **parse_options(args.model_option, "--model-option")}
    compile_options = {**base.compile_options, **parse_options(args.compile_option, "--compile-option")}
    return dataclasses.replace(base, **given, data=data, options=options, model_options=model_options,
                               compile_options=compile_options, progress=not args.no_progress)


def _cmd_train(args: argparse.Namespace) -> int:
    config = _train_config(args, TrainConfig(), parse_options(args.option, "--option"))
    if args.keep_checkpoints is not None and config.out is None:  # its default is not an error: checked here
        raise ValueError("--keep-checkpoints needs --out, the folder checkpoints go to; found none")
    result = train(config)
    if result.rank != 0:
        return 0
    if not result.steps:  # resumed at its end already (the same command run again)
        step, val_loss = result.val[-1]
        print(f"{config.model} / {config.scheme}: the run in {config.out} is at step {step} already, where this "
              f"invocation ends: nothing to train (a larger --steps continues it); val loss {val_loss:.4f}")
        return 0
    print(f"{config.model} / {config.scheme}: {len(result.steps)} steps, final train loss "
          f"{result.final_train_loss:.4f}, val loss {result.final_val_loss:.4f}, "
          f"{result.tokens_per_s:,.0f} tokens/s, {result.params:,} params ({result.new_params:,} new), "
          f"{result.seconds:.1f} s")
    if result.metrics_path is not None:
        print(f"metrics: {result.metrics_path}; checkpoints: {config.out}/checkpoints/")
    return 0


def _split_compare_options(items: list[str], schemes: tuple[str, ...]) -> tuple[dict, dict]:
    shared, per_scheme = [], {}
    for item in items:
        head, sep, rest = item.partition(":")
        if sep and "=" not in head:
            if head not in schemes:
                raise ValueError(f"--option {item!r}: scheme {head!r} is not in --schemes {list(schemes)}")
            per_scheme.setdefault(head, []).append(rest)
        else:
            shared.append(item)
    return (parse_options(shared, "--option"),
            {s: parse_options(v, "--option") for s, v in per_scheme.items()})


COMPARE_OUT = "runs/compare"


def _cmd_compare(args: argparse.Namespace) -> int:
    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip()) if args.schemes else DEFAULT_SCHEMES
    shared, per_scheme = _split_compare_options(args.option, schemes)
    base = default_compare_train_config()
    if args.out is None:
        args.out = COMPARE_OUT
    config = CompareConfig(schemes=schemes, train=_train_config(args, base, shared), scheme_options=per_scheme,
                           out=args.out)
    result = compare(config)
    print(result.table)
    print(f"\nresults: {result.results_path}")
    print(f"loss curves: {result.curves_path}")
    for row in result.rows:
        where = row.heatmap or "(no heatmap: this scheme weighs no depth sources)"
        print(f"routing weights {row.scheme}: {where}")
        if row.streams:
            mean = "n/a" if row.stream_cka is None else f"{row.stream_cka:.4f}"
            print(f"cross-stream CKA {row.scheme}: mean {mean}, {row.streams}")
    print(f"text from a scheme's trained model: depthrewrite sample {pathlib.Path(args.out) / '<scheme>'}")
    return 0


def _cmd_routing(args: argparse.Namespace) -> int:
    from .train.metrics import metrics_file
    from .train.plots import routing_heatmap
    from .train.routing_log import read_routing

    if args.site is not None and (args.step is not None or args.plot is not None):
        raise ValueError("--site prints one site at every evaluation, as a table; --step and --plot are for one "
                         "evaluation's heatmap: give one or the other")
    evaluations = read_routing(args.run)
    if not evaluations:
        raise ValueError(f"{args.run!r}: no evaluation in its metrics file recorded routing weights (its scheme has "
                         "none, no evaluation has run yet, or the run was written before they were recorded)")
    if args.site is not None:
        return _print_site_over_steps(evaluations, args.site)
    step, weights = evaluations[-1] if args.step is None else _evaluation_at(evaluations, args.step)
    print(f"{weights.scheme}: depth-routing weights at step {step}, mean over the first validation batch's tokens "
          f"(rows: sites, F: the final readout; columns: the sources they read)")
    print(weights.table())
    plot = routing_heatmap(weights, args.plot or metrics_file(args.run, "routing").parent / f"routing_step_{step}.png")
    print(f"heatmap: {plot}")
    return 0


def _print_site_over_steps(evaluations: list, site: str) -> int:
    """One site's weights at every evaluation: a row per step (``RoutingWeights.table``'s
    layout, the steps as its row labels)."""
    from .routing_weights import RoutingWeights

    labels = evaluations[-1][1].labels
    if site not in labels:
        raise ValueError(f"--site {site!r}: the run's sites are {', '.join(labels)} (F: the final readout)")
    rows = [(step, w.labels.index(site), w) for step, w in evaluations]
    over_steps = RoutingWeights(evaluations[-1][1].scheme, [str(step) for step, _, _ in rows],
                                [w.weights[k] for _, k, w in rows], [w.source_labels[k] for _, k, w in rows])
    print(f"{over_steps.scheme}: site {site}'s depth-routing weights at each evaluation, mean over the first "
          "validation batch's tokens (rows: steps; columns: the sources it reads)")
    print(over_steps.table())
    return 0


def _evaluation_at(evaluations: list, step: int):
    for at, weights in evaluations:
        if at == step:
            return at, weights
    steps = [at for at, _ in evaluations]
    shown = ", ".join(map(str, steps)) if len(steps) <= 8 else (
        f"{', '.join(map(str, steps[:4]))}, ..., {', '.join(map(str, steps[-3:]))}")
    raise ValueError(f"--step {step}: no evaluation at that step recorded routing weights; the {len(steps)} that "
                     f"did are at steps {shown}")


def _cmd_curves(args: argparse.Namespace) -> int:
    from .train.metrics import read_history
    from .train.plots import loss_curves

    read = [read_history(run) for run in args.runs]
    histories = dict(zip(_run_labels(args.runs), read, strict=True))
    print(curves_table(histories))
    print(f"\nloss curves: {loss_curves({k: (h.steps, h.losses, h.val) for k, h in histories.items()}, args.out)}")
    return 0


def _run_labels(runs: list[str]) -> list[str]:
    """Each run's folder name (its metrics file's folder's), or the paths as given where two names agree."""
    from .train.metrics import metrics_file

    names = [metrics_file(run, "curves").parent.resolve().name for run in runs]
    return names if len(set(names)) == len(names) else list(runs)


def curves_table(histories: dict) -> str:
    """A markdown row per run: steps logged, the final train loss (mean of the last 10 steps),
    the last and the best validation loss with their steps."""
    def at(found):
        return "-" if found is None else f"{found[1]:.4f} (step {found[0]})"

    lines = ["| run | steps | final train loss | last val loss | best val loss |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for label, h in histories.items():
        lines.append(f"| {label} | {h.steps[-1] if h.steps else 0} | {h.final_train_loss():.4f} | "
                     f"{at(h.val[-1] if h.val else None)} | {at(h.best_val())} |")
    return "\n".join(lines)


#: between the texts of ``depthrewrite sample --samples N``
SAMPLE_SEPARATOR = "\n" + "-" * 40 + "\n"


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from .train.sampling import BYTE_TOKENS, decode, encode, generate
    from .train.trained_model import load_trained

    if not pathlib.Path(args.run).is_dir():
        raise FileNotFoundError(f"{args.run!r}: no such folder (a run's --out folder, holding checkpoints/)")
    for flag, value, least in (("--tokens", args.tokens, 0), ("--samples", args.samples, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, found {value}")
    trained = load_trained(args.run, step=args.step, device=args.device)
    context = trained.seq_len if args.context is None else args.context
    longest = trained.model.config.max_seq_len
    if context > longest:
        raise ValueError(f"--context {context}: the model reads at most {longest} positions (its max_seq_len)")
    prompt = encode(args.prompt).expand(args.samples, -1)  # one row a sample, drawn side by side
    vocab = trained.model.config.vocab_size
    ids = generate(trained.model, prompt.to(args.device), args.tokens, temperature=args.temperature,
                   top_k=args.top_k, context=context, token_limit=BYTE_TOKENS if vocab > BYTE_TOKENS else None,
                   generator=torch.Generator().manual_seed(args.seed))
    print(f"{trained.config['model']} / {trained.config['scheme']} at step {trained.step} ({trained.checkpoint}); "
          f"temperature {args.temperature}, top-k {args.top_k or 'all'}, context {context}, seed {args.seed}:",
          file=sys.stderr)
    sys.stdout.write(SAMPLE_SEPARATOR.join(decode(row) for row in ids.cpu()) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="depthrewrite", description="Inspect residual streams; train and compare depth-routing rewrites of "
        "the bundled GPT/MoE on byte-level text.", epilog="example: depthrewrite compare   (residual vs attnres vs block_attnres, ~2 min "
        "on a 2-core CPU)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train one model (optionally rewritten) on byte-level text")
    train_base = TrainConfig()
    p_train.add_argument("--scheme", help="depthrewrite scheme, or 'none' for no rewrite at all "
                         f"(default {train_base.scheme})")
    _add_common(p_train, train_base, out_default="none: nothing written")
    p_train.add_argument("--save-every", type=int, help="checkpoint every N steps, 0: at the end only, with --out "
                         f"(default {train_base.save_every})")
    p_train.add_argument("--keep-checkpoints", type=int, help="newest checkpoints to keep, 0: all "
                         f"(default {train_base.keep_checkpoints})")
    p_train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p_train.add_argument("--overwrite", action="store_true", help="delete the checkpoints already in --out and start "
                         "over (without it, or --resume, such an --out is refused)")
    p_train.add_argument("--distributed", choices=MODES, help="ddp or fsdp2 under torchrun (default "
                         f"{train_base.distributed}: one process)")
    p_train.set_defaults(func=_cmd_train)
    p_cmp = sub.add_parser("compare", help="train several schemes on the same data and budget; table and plots")
    p_cmp.add_argument("--schemes", help=f"comma-separated (default {','.join(DEFAULT_SCHEMES)})")
    _add_common(p_cmp, default_compare_train_config(), out_default=COMPARE_OUT)
    p_cmp.set_defaults(func=_cmd_compare)
    p_ins = sub.add_parser("inspect", help="print the residual-stream table of a model")
    p_ins.add_argument("model", help="a bundled preset (gpt:tiny, moe:small, ...), a Hugging Face config.json, "
                       "a folder holding one, or a model id in the local cache (random weights, no download); "
                       "or a file of a model saved whole with torch.save (unpickled: only a file you trust)")
    p_ins.add_argument("--layers", type=int, help="build the model with this many layers")
    p_ins.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p_ins.set_defaults(func=_cmd_inspect)
    p_rt = sub.add_parser("routing", help="print and draw the depth-routing weights a training run recorded at an "
                          "evaluation (a live run too)")
    p_rt.add_argument("run", help="a run's --out folder, or its metrics.jsonl")
    p_rt.add_argument("--step", type=int, help="the evaluation's step (default: the latest)")
    p_rt.add_argument("--plot", help="where the heatmap goes (default: routing_step_<STEP>.png in the run's folder)")
    p_rt.add_argument("--site", help="instead, one site's weights at every evaluation, a row per step: the site's "
                      "label, 1..L or F (the final readout)")
    p_rt.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p_rt.set_defaults(func=_cmd_routing)
    p_cur = sub.add_parser("curves", help="the loss curves of several training runs in one figure, and a table "
                           "(live runs too)")
    p_cur.add_argument("runs", nargs="+", help="runs' --out folders, or their metrics.jsonl files")
    p_cur.add_argument("--out", default="loss_curves.png", help="where the figure goes (default loss_curves.png)")
    p_cur.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p_cur.set_defaults(func=_cmd_curves)
    p_smp = sub.add_parser("sample", help="continue a prompt with a trained run's model (byte-level text)")
    p_smp.add_argument("run", help="a run's --out folder (of train, or compare's runs/compare/<scheme>); its "
                       "checkpoint is unpickled, as --resume does: only a run you trust")
    p_smp.add_argument("--prompt", default="\n", help="the text to continue (default: a newline, the separator "
                       "between the training documents; in bash, $'ROMEO:\\n' ends with one)")
    p_smp.add_argument("--tokens", type=int, default=500, help="bytes to generate (default 500)")
    p_smp.add_argument("--samples", type=int, default=1, help="continuations of the prompt, drawn side by side and "
                       "printed apart by a line of dashes (default 1)")
    p_smp.add_argument("--temperature", type=float, default=0.8, help="0: the likeliest byte each time (default 0.8)")
    p_smp.add_argument("--top-k", type=int, help="sample among the k likeliest bytes (default: all)")
    p_smp.add_argument("--context", type=int, help="bytes the model sees (default: the run's --seq-len, the window "
                       "it trained on)")
    p_smp.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    p_smp.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p_smp.add_argument("--device", default="cpu", help="default cpu")
    p_smp.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p_smp.set_defaults(func=_cmd_sample)
    return parser


def _cmd_inspect(args) -> int:
    import depthrewrite
    from depthrewrite.train.model import FAMILIES

    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be a positive int, found {args.layers}")
    family, _, size = args.model.partition(":")
    if family in FAMILIES and size:
        presets, factory = FAMILIES[family]
        if size not in presets:
            raise ValueError(f"unknown {family} preset {size!r}; presets: {', '.join(presets)}")
        model = factory(size, **({"n_layer": args.layers} if args.layers is not None else {}))
    elif _is_torch_save_file(args.model):
        model = _saved_whole_model(args.model, args.layers)
    else:
        model = _with_recorded_rewrite(_hf_model(args.model, args.layers))
    print(depthrewrite.inspect(model))
    return 0


def _is_torch_save_file(name: str) -> bool:
    """A file ``torch.save`` wrote (a zip archive since torch 1.6), not a config."""
    import zipfile

    return pathlib.Path(name).is_file() and zipfile.is_zipfile(name)


def _saved_whole_model(name: str, layers: int | None):
    """The model ``torch.save(model, name)`` wrote. Unpickling runs code from the file, as
    ``torch.load(weights_only=False)`` does: the command is given the file by its user."""
    import torch
    from torch import nn

    if layers is not None:
        raise ValueError(f"--layers cannot change a model saved whole ({name!r}); found --layers {layers}")
    saved = torch.load(name, map_location="cpu", weights_only=False)
    if not isinstance(saved, nn.Module):
        raise ValueError(f"{name!r} holds an object of type {type(saved).__name__}, not a model saved whole "
                         "(torch.save(model)): a state_dict has no architecture to inspect")
    return saved


def _with_recorded_rewrite(model):
    """``model`` rewritten as its config records (a ``save_pretrained`` of a rewritten model),
    so that inspect shows the scheme and options it was saved with; else as it is."""
    import depthrewrite
    from depthrewrite.hf import recorded_recipe

    recipe = recorded_recipe(model)
    if not recipe:
        return model
    return depthrewrite.rewrite(model, recipe["scheme"], **recipe["options"])


#: what a Hugging Face model id can look like: "name" or "owner/name" (huggingface_hub's rule)
_MODEL_ID = re.compile(r"^(?![.-])[\w.-]{1,96}(?<![.-])(/(?![.-])[\w.-]{1,96}(?<![.-]))?$")


def _hf_model(name: str, layers: int | None):
    """``name`` as a config.json, a folder or a cached model id; one that is none of them (nor
    a preset) is said to be so, not in the words of the Hugging Face lookup it would fail."""
    from depthrewrite.hf import model_from_config

    path = pathlib.Path(name)
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"the folder {name!r} holds no config.json")
    if path.exists():
        return model_from_config(name, layers)
    nowhere = (f"no such file or folder: {name!r}; nor is it a bundled preset ({', '.join(preset_names())}) "
               "or a model id in the local Hugging Face cache (inspect downloads nothing)")
    if not _MODEL_ID.match(name) or name.endswith(".json"):
        raise FileNotFoundError(nowhere)
    try:
        return model_from_config(name, layers)
    except DepthRewriteError as exc:
        if isinstance(exc.__cause__, OSError):  # the cache lookup failed
            raise FileNotFoundError(nowhere) from exc
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`depthrewrite inspect ... | head`): no traceback
        # Python flushes stdout again at exit: send that flush nowhere, or it raises once more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a program stopped by SIGPIPE exits with (`yes | head`)
    except TrainingInterrupted as exc:  # a checkpoint was saved: not an error, but not a finished run
        resume = " (--resume continues the run)" if args.command == "train" else ""
        print(f"depthrewrite {args.command}: {exc}{resume}", file=sys.stderr)
        return 128 + (signal.SIGINT if exc.signal_name == "SIGINT" else signal.SIGTERM)
    except (ValueError, FileNotFoundError, ImportError, DepthRewriteError, FloatingPointError) as exc:
        print(f"depthrewrite {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
