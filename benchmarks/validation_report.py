"""Tables and a figure from the validation study's results (``study.json`` files).

    python benchmarks/validation_report.py docs/data/study_part1.json docs/data/study_part2.json \
        --figure docs/validation_loss.png

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
    """{(model, layers): {corpus: {scheme: [val losses over seeds]}}}"""
    out: dict = {}
    for r in runs:
        per = out.setdefault((r["model"], r["layers"]), {}).setdefault(r["corpus"].removesuffix(".txt"), {})
        per.setdefault(r["scheme"], []).append(r["final_val_loss"])
    return out


def table(runs: list[dict]) -> str:
    lines = []
    for (model, layers), corpora in sorted(groups(runs).items()):
        schemes = [s for s in SCHEME_ORDER if any(s in c for c in corpora.values())]
        lines += [f"\n**{model}, {layers} layers** (validation loss, nats per byte; in brackets: minus residual)\n",
                  "| corpus | " + " | ".join(schemes) + " |", "| --- |" + " ---: |" * len(schemes)]
        for corpus, per in sorted(corpora.items()):
            base = per.get("residual", [None])[0]
            cells = []
            for s in schemes:
                if s not in per:
                    cells.append("not run")
                    continue
                vals = per[s]
                text = f"{vals[0]:.4f}" + (f" / {vals[1]:.4f} (seed 1)" if len(vals) > 1 else "")
                if s != "residual" and base is not None:
                    text += f" ({vals[0] - base:+.4f})"
                cells.append(text)
            lines.append(f"| {corpus} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(runs: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = groups(runs)
    fig = Figure(figsize=(11, 3.6))
    FigureCanvasAgg(fig)
    keys = sorted(data)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for corpus, per in sorted(data[key].items()):
            base = per.get("residual", [None])[0]
            xs = [s for s in SCHEME_ORDER if s in per and s != "residual"]
            ax.plot(xs, [per[s][0] - base for s in xs], marker="o", label=corpus)
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
