"""The ``depthrewrite`` command: ``train`` and ``compare``. Parses and prints; the work is
done by ``depthrewrite.train``.

    depthrewrite compare                      # residual vs attnres vs block_attnres, tiny GPT, stdlib text, CPU
    depthrewrite train --model gpt:tiny --scheme attnres --steps 300 --out runs/attnres
    depthrewrite train --out runs/attnres --steps 300 --resume
    torchrun --nproc-per-node 2 -m depthrewrite.cli train --distributed ddp --scheme attnres
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from .errors import DepthRewriteError
from .train.compare import DEFAULT_SCHEMES, CompareConfig, compare, default_compare_train_config
from .train.distributed import MODES
from .train.loop import COMPILE_MODES, PRECISIONS, TrainConfig, train
from .train.model import preset_names


def parse_value(text: str):
    """``key=value`` values: int, then float, then true/false/none, else the string."""
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
        out[key.strip()] = parse_value(value.strip())
    return out


def _add_common(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"bundled preset: {', '.join(preset_names())}")
    m.add_argument("--layers", type=int, help="number of layers (overrides the preset)")
    m.add_argument("--d-model", type=int, help="model width (overrides the preset)")
    m.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other GPTConfig/MoEConfig field, e.g. dropout=0.1 (repeatable)")
    m.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="scheme option, e.g. block_size=4 (repeatable; compare: SCHEME:KEY=VALUE for one scheme)")
    d = p.add_argument_group("data (byte-level tokens)")
    d.add_argument("--data", help="'stdlib' (Python's own standard library sources), a text file or a directory")
    d.add_argument("--max-bytes", type=int, help="cap on the corpus size in bytes")
    d.add_argument("--doc-bytes", type=int, help="document size for splitting plain text files")
    d.add_argument("--val-fraction", type=float, help="fraction of documents held out for validation")
    d.add_argument("--hf-dataset", help="Hugging Face dataset name or local data file (needs `datasets`)")
    d.add_argument("--hf-split")
    d.add_argument("--hf-text-field")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int)
    t.add_argument("--stop-after", type=int, help="stop this invocation after this many steps (schedule unchanged)")
    t.add_argument("--batch-size", type=int, help="global batch size (split across ranks)")
    t.add_argument("--seq-len", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--min-lr-ratio", type=float, help="cosine floor as a fraction of --lr")
    t.add_argument("--warmup", type=int, dest="warmup_steps")
    t.add_argument("--weight-decay", type=float)
    t.add_argument("--grad-clip", type=float)
    t.add_argument("--precision", choices=PRECISIONS)
    t.add_argument("--compile", choices=("off", "on"))
    t.add_argument("--backend", help="torch.compile backend (default inductor)")
    t.add_argument("--compile-mode", choices=COMPILE_MODES,
                   help="torch.compile mode (default: default; reduce-overhead records CUDA graphs on a GPU)")
    t.add_argument("--seed", type=int)
    t.add_argument("--device")
    t.add_argument("--threads", type=int, help="torch CPU threads (train default: torch's; compare default: 1)")
    t.add_argument("--eval-every", type=int)
    t.add_argument("--eval-batches", type=int)
    t.add_argument("--out", help="output directory (metrics.jsonl, checkpoints/, plots)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


_DATA_ARGS = {"data": "source", "max_bytes": "max_bytes", "doc_bytes": "doc_bytes", "val_fraction": "val_fraction",
              "hf_dataset": "hf_dataset", "hf_split": "hf_split", "hf_text_field": "hf_text_field"}
_TRAIN_ARGS = ("model", "layers", "d_model", "steps", "stop_after", "batch_size", "seq_len", "lr", "min_lr_ratio",
               "warmup_steps", "weight_decay", "grad_clip", "precision", "backend", "compile_mode", "seed", "device",
               "threads", "eval_every", "eval_batches", "out", "save_every", "keep_checkpoints", "distributed", "scheme")


def _train_config(args: argparse.Namespace, base: TrainConfig, options: dict) -> TrainConfig:
    given = {k: getattr(args, k) for k in _TRAIN_ARGS if getattr(args, k, None) is not None}
    data = dataclasses.replace(base.data, **{f: getattr(args, a) for a, f in _DATA_ARGS.items()
                                             if getattr(args, a) is not None})
    if args.compile is not None:
        given["compile"] = args.compile == "on"
    if getattr(args, "resume", False):
        given["resume"] = True
    model_options = {**base.model_options, **parse_options(args.model_option, "--model-option")}
    return dataclasses.replace(base, **given, data=data, options=options, model_options=model_options,
                               progress=not args.no_progress)


def _cmd_train(args: argparse.Namespace) -> int:
    config = _train_config(args, TrainConfig(), parse_options(args.option, "--option"))
    result = train(config)
    if result.rank != 0:
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


def _cmd_compare(args: argparse.Namespace) -> int:
    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip()) if args.schemes else DEFAULT_SCHEMES
    shared, per_scheme = _split_compare_options(args.option, schemes)
    base = default_compare_train_config()
    if args.out is None:
        args.out = "runs/compare"
    config = CompareConfig(schemes=schemes, train=_train_config(args, base, shared), scheme_options=per_scheme,
                           out=args.out)
    result = compare(config)
    print(result.table)
    print(f"\nresults: {result.results_path}")
    print(f"loss curves: {result.curves_path}")
    for row in result.rows:
        where = row.heatmap or "(no heatmap: routing weights are recorded for attnres, block_attnres and mhar only)"
        print(f"routing weights {row.scheme}: {where}")
        if row.streams:
            mean = "n/a" if row.stream_cka is None else f"{row.stream_cka:.4f}"
            print(f"cross-stream CKA {row.scheme}: mean {mean}, {row.streams}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="depthrewrite", description="Inspect residual streams; train and compare depth-routing rewrites of "
        "the bundled GPT/MoE on byte-level text.", epilog="example: depthrewrite compare   (residual vs attnres vs block_attnres, ~2-3 min "
        "on a 2-core CPU)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train one model (optionally rewritten) on byte-level text")
    p_train.add_argument("--scheme", help="depthrewrite scheme, or 'none' for no rewrite at all (default residual)")
    _add_common(p_train)
    p_train.add_argument("--save-every", type=int, help="checkpoint every N steps (also at the end, with --out)")
    p_train.add_argument("--keep-checkpoints", type=int, help="newest checkpoints to keep (0: all)")
    p_train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p_train.add_argument("--distributed", choices=MODES, help="ddp or fsdp2 under torchrun")
    p_train.set_defaults(func=_cmd_train)
    p_cmp = sub.add_parser("compare", help="train several schemes on the same data and budget; table and plots")
    p_cmp.add_argument("--schemes", help=f"comma-separated (default {','.join(DEFAULT_SCHEMES)})")
    _add_common(p_cmp)
    p_cmp.set_defaults(func=_cmd_compare)
    p_ins = sub.add_parser("inspect", help="print the residual-stream table of a model")
    p_ins.add_argument("model", help="a bundled preset (gpt:tiny, moe:small, ...), a Hugging Face config.json, "
                       "a folder holding one, or a model id in the local cache (random weights, no download)")
    p_ins.add_argument("--layers", type=int, help="build the model with this many layers")
    p_ins.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p_ins.set_defaults(func=_cmd_inspect)
    return parser


def _cmd_inspect(args) -> int:
    import depthrewrite
    from depthrewrite.hf import model_from_config
    from depthrewrite.train.model import FAMILIES

    family, _, size = args.model.partition(":")
    if family in FAMILIES and size:
        presets, factory = FAMILIES[family]
        if size not in presets:
            raise ValueError(f"unknown {family} preset {size!r}; presets: {', '.join(presets)}")
        model = factory(size, **({"n_layer": args.layers} if args.layers else {}))
    else:
        model = model_from_config(args.model, args.layers)
    print(depthrewrite.inspect(model))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError, DepthRewriteError) as exc:
        print(f"depthrewrite {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
