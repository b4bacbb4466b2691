"""PNG figures for ``compare``, ``depthrewrite curves`` and ``depthrewrite routing``: loss
curves and routing-weight heatmaps.

Drawn on matplotlib ``Figure`` objects with the Agg canvas directly, not through pyplot,
so that importing this module never changes the user's global matplotlib backend.
"""

from __future__ import annotations

import math
import pathlib

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..routing_weights import RoutingWeights


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def loss_curves(runs: dict[str, tuple[list[int], list[float], list[tuple[int, float]]]],
                path: str | pathlib.Path) -> pathlib.Path:
    """``runs[scheme] = (steps, train losses, [(step, val loss)])``: train loss (smoothed
    over ~2% of the run) as lines, validation loss as markers of the same colour."""
    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (name, (steps, losses, val)) in enumerate(runs.items()):
        color = f"C{i}"
        window = max(1, len(losses) // 50)
        ax.plot(steps, _smooth(losses, window), color=color, lw=1.2, label=f"{name} train")
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "o--", color=color, ms=4, lw=0.8, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return pathlib.Path(path)


def routing_heatmap(weights: RoutingWeights, path: str | pathlib.Path) -> pathlib.Path:
    """Rows: sites (1..L) and the final readout F; columns: the sources; cell: mean weight."""
    matrix = weights.matrix()
    cols = weights.columns()
    rows = len(weights.labels)
    fig = Figure(figsize=(max(4.0, 0.45 * len(cols) + 2.5), max(3.0, 0.35 * rows + 1.5)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if weights.static:  # DenseFormer's scalars: any sign and size, so a scale centred on 0
        top = max(1.0, float(matrix.nan_to_num(0.0).abs().max()))
        image = ax.imshow(matrix.numpy(), vmin=-top, vmax=top, cmap="RdBu_r", aspect="auto")

        def dark(v):  # the scale's ends are dark
            return abs(v) > 0.6 * top
    else:
        image = ax.imshow(matrix.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")

        def dark(v):  # viridis is dark at its low end
            return v <= 0.6
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(rows), weights.labels, fontsize=8)
    ax.set_xlabel("source")
    ax.set_ylabel("site (F: final readout)")
    what = "static weights" if weights.static else "mean over tokens"
    ax.set_title(f"{weights.scheme}: depth-routing weights ({what})", fontsize=9)
    if rows * len(cols) <= 400:  # numbers stay legible up to about 20x20
        for r in range(rows):
            for c in range(len(cols)):
                v = matrix[r, c].item()
                if not math.isnan(v):
                    ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6,
                            color="white" if dark(v) else "black")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path)
    return pathlib.Path(path)
