"""How distinct DAR's two depth streams are: linear CKA between them, entry by entry.

DAR (docs/spec.md section 6, ``passes/dar.py``) keeps two histories ``H^0``, ``H^1`` of completed entries
(``H^j_0 = e``); its reciprocal keys only help if the streams carry different features.
The ``selfkv`` variant with symmetric ``beta`` keeps them identical (CKA 1 everywhere).

:func:`record_dar_streams` runs one forward pass with the final readout's ``read`` shadowed
by an instance attribute (removed afterwards, as ``depthrewrite.routing_weights`` does for its routers):
the readout sees the state after the whole stack, so its histories hold every completed
entry. The forward pass itself is unchanged and ``passes/dar.py`` is not touched.
:func:`linear_cka` is the linear CKA of Kornblith et al. (2019) over tokens::

    CKA(X, Y) = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)    (Xc, Yc: centred over tokens)

The figure is drawn here rather than in ``plots.py`` because only this recorder uses it.
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from ..passes.base import DeltaReadout
from ..passes.dar import DarRouter, DualRoute
from ..passes.runtime import ROUTER_ATTR

log = logging.getLogger(__name__)


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA between two feature matrices of the same tokens: ``x`` (n, p), ``y`` (n, q),
    one row per token. Computed in float64; 1 when ``y`` is ``x`` up to an orthogonal
    transform and isotropic scaling."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"linear_cka: x and y must be (tokens, features) with the same number of tokens, "
                         f"found {tuple(x.shape)} and {tuple(y.shape)}")
    x = x.double() - x.double().mean(0)
    y = y.double() - y.double().mean(0)
    norm_x = torch.linalg.matrix_norm(x.T @ x)
    norm_y = torch.linalg.matrix_norm(y.T @ y)
    if norm_x == 0 or norm_y == 0:
        # a constant feature matrix has no similarity structure: CKA is undefined (0/0)
        raise ValueError("linear_cka: x and y must vary across tokens; found a constant feature matrix")
    return (torch.linalg.matrix_norm(y.T @ x) ** 2 / (norm_x * norm_y)).item()


@dataclass
class StreamSimilarity:
    """Cross-stream CKA of one forward pass: ``cka[i] = CKA(H^0_i, H^1_i)`` over the tokens
    of the batch, for every completed history entry (``labels``: ``e``, then ``1``, ``2``,
    ... for the entries the blocks completed)."""

    scheme: str
    labels: list[str]
    cka: list[float]

    def mean_written(self) -> float | None:
        """Mean CKA over the entries the sites wrote; ``H_0 = e`` is shared by construction
        (always 1) and left out. ``None`` when no block completed an entry."""
        written = self.cka[1:]
        return sum(written) / len(written) if written else None


def _dar_readout(model: nn.Module) -> DualRoute | None:
    """The model's final readout router when it is DAR's (any variant), else None."""
    for module in model.modules():
        table = getattr(module, ROUTER_ATTR, None)
        if isinstance(table, nn.ModuleDict) and "readout" in table:
            router = table["readout"]
            router = router.inner if isinstance(router, DeltaReadout) else router
            if isinstance(router, DualRoute) and not isinstance(router, DarRouter):
                return router
    return None


@torch.no_grad()
def record_dar_streams(model: nn.Module, input_ids: torch.Tensor):
    """Run ``model(input_ids)`` in eval mode and return ``(H0, H1)``, the two streams'
    completed entries as the final readout saw them (tuples of (batch, seq, d) tensors);
    ``None`` when the model is not rewritten with ``dar``. The partial pair of an unfinished
    last block is not an entry and is left out."""
    readout = _dar_readout(model)
    if readout is None:
        return None
    seen: dict = {}

    def read(state, h, _read=readout.read):
        seen["state"] = state
        return _read(state, h)

    was_training = model.training
    model.eval()
    readout.__dict__["read"] = read
    try:
        model(input_ids)
    finally:
        readout.__dict__.pop("read", None)
        model.train(was_training)
    if "state" not in seen:
        raise RuntimeError("stream similarity: the DAR readout did not run during the forward pass")
    return seen["state"][0]  # (history, partial[, the two-phase plan's phase-1 result])


def stream_similarity(model: nn.Module, input_ids: torch.Tensor, scheme: str = "") -> StreamSimilarity | None:
    """Cross-stream CKA per history entry on one batch; ``None`` (logged at debug level) for
    models without DAR's two streams."""
    history = record_dar_streams(model, input_ids)
    if history is None:
        log.debug("stream similarity: no DAR readout in %s (scheme %r); skipped", type(model).__name__, scheme)
        return None
    h0, h1 = history
    cka = [linear_cka(a.flatten(0, -2), b.flatten(0, -2)) for a, b in zip(h0, h1)]
    labels = ["e"] + [str(i) for i in range(1, len(cka))]
    return StreamSimilarity(scheme, labels, cka)


def stream_similarity_plot(similarity: StreamSimilarity, path: str | pathlib.Path) -> pathlib.Path:
    """Bars: CKA(H^0_i, H^1_i) per history entry i."""
    n = len(similarity.labels)
    fig = Figure(figsize=(max(4.0, 0.4 * n + 2.0), 3.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(n), similarity.cka, color="C0")
    for i, value in enumerate(similarity.cka):
        ax.text(i, value + 0.01, f"{value:.3f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(n), similarity.labels, fontsize=8)
    ax.set_ylim(0.0, 1.1)
    ax.set_xlabel("history entry (e: embedding; i: DAR block i)")
    ax.set_ylabel("linear CKA")
    ax.set_title(f"{similarity.scheme}: cross-stream CKA(H0_i, H1_i) over tokens", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return pathlib.Path(path)
