"""Tables and a figure from the validation study's results (``study.json`` files).

    python benchmarks/validation_report.py docs/data/study_part1.json docs/data/study_part2.json \
        docs/data/study_part3.json --figure docs/validation_loss.png

Prints, per model and depth, the final validation loss of every scheme on every corpus and
its difference from the residual baseline (markdown), and draws the differences.
"""

from __future__ import annotations

import argparse
import json
import pathlib

SCHEME_ORDER = ("residual", "attnres", "block_attnres", "mhar", "wav", "dar")


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        runs += [r for r in json.loads(pathlib.Path(path).read_text())["runs"] if "error" not in r]
    return runs


def groups(runs: list[dict]) -> dict:
    """{(model, layers): {corpus: {scheme: {seed: final validation loss}}}}"""
    out: dict = {}
    for r in runs:
        per = out.setdefault((r["model"], r["layers"]), {}).setdefault(r["corpus"].removesuffix(".txt"), {})
        per.setdefault(r["scheme"], {})[r["seed"]] = r["final_val_loss"]
    return out


def paired_difference(per: dict, scheme: str) -> tuple[float, list[float]] | None:
    """Mean over seeds of (scheme - residual) on the same seed, and the per-seed differences:
    pairing by seed takes the initialisation/data-order noise shared by both runs out."""
    base = per.get("residual", {})
    diffs = [per[scheme][seed] - base[seed] for seed in sorted(per[scheme]) if seed in base]
    if not diffs:
        return None
    return sum(diffs) / len(diffs), diffs


def _cell(per: dict, scheme: str) -> str:
    if scheme not in per:
        return "not run"
    seeds = per[scheme]
    text = " / ".join(f"{seeds[k]:.4f}" for k in sorted(seeds))
    diff = paired_difference(per, scheme) if scheme != "residual" else None
    if diff is not None:
        mean, each = diff
        text += f" ({mean:+.4f}" + (" = mean of " + ", ".join(f"{d:+.4f}" for d in each) if len(each) > 1 else "") + ")"
    return text


def table(runs: list[dict]) -> str:
    lines = []
    for (model, layers), corpora in sorted(groups(runs).items()):
        schemes = [s for s in SCHEME_ORDER if any(s in c for c in corpora.values())]
        lines += [f"\n**{model}, {layers} layers** (validation loss, nats per byte, one value per seed; "
                  "in brackets: minus residual on the same seed, averaged over seeds)\n",
                  "| corpus | " + " | ".join(schemes) + " |", "| --- |" + " ---: |" * len(schemes)]
        for corpus, per in sorted(corpora.items()):
            lines.append(f"| {corpus} | " + " | ".join(_cell(per, s) for s in schemes) + " |")
    return "\n".join(lines)


def figure(runs: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = groups(runs)
    fig = Figure(figsize=(13, 3.6))
    FigureCanvasAgg(fig)
    keys = sorted(data)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for corpus, per in sorted(data[key].items()):
            xs = [s for s in SCHEME_ORDER if s in per and s != "residual" and paired_difference(per, s)]
            ax.plot(xs, [paired_difference(per, s)[0] for s in xs], marker="o", label=corpus)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_title(f"{key[0]}, {key[1]} layers", fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.set_ylabel("val loss - residual (nats/byte)", fontsize=8)
    fig.axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="+")
    parser.add_argument("--figure")
    args = parser.parse_args()
    runs = load(args.studies)
    print(table(runs))
    if args.figure:
        figure(runs, args.figure)
        print(f"\nfigure: {args.figure}")


if __name__ == "__main__":
    main()
