"""Per-graph Inductor defaults, from hints a scheme leaves in the graph Dynamo traces.

Some Inductor settings help one scheme's compiled step and not the others'. A scheme
traces the operations that call for one inside :func:`hinted`, which tags the nodes Dynamo
records (``torch.fx.traceback.annotate``, as :mod:`depthrewrite.recompute` tags partial
sums); the backend applies :data:`INDUCTOR_DEFAULTS` for each hint its graph carries,
unless the caller set that setting (``torch.compile(..., options={...})``).

- ``"dar_transport"``, DAR's gated write with transport: ``max_fusion_size=16`` (Inductor's
  default is 64). Inductor otherwise fuses the backward of a whole block's transport chain
  into reductions of 35-40 inputs that run at 1.5-1.8 TB/s (session 22). With 16, DAR
  block at 350M on one H200 ran 1.4-1.9 % shorter steps, and Inductor's kernels took
  2.8-3.2 ms less a step, in three runs side by side (session 28, docs/benchmarks.md).
  The same setting left Block AttnRes and WAV level and made block MHAR's Inductor
  kernels 0.7 ms slower, so it is not applied to every graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

__all__ = ["hinted", "graph_hints", "inductor_defaults", "INDUCTOR_DEFAULTS", "HINT_KEY"]

log = logging.getLogger(__name__)

#: the ``torch.fx.traceback.annotate`` key of a hint
HINT_KEY = "depthrewrite_hint"
#: hint -> the Inductor settings a graph that carries it gets by default
INDUCTOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "dar_transport": {"max_fusion_size": 16},
}


def hinted(hint: str):
    """Context for the operations that call for ``hint``'s Inductor defaults: tagged while
    Dynamo traces them (where ``torch.fx.traceback.annotate`` exists), nothing in eager mode."""
    if hint not in INDUCTOR_DEFAULTS:
        raise ValueError(f"hinted: unknown hint {hint!r}; expected one of {sorted(INDUCTOR_DEFAULTS)}")
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return annotate({HINT_KEY: hint})


def graph_hints(nodes: Iterable[fx.Node]) -> set[str]:
    """The hints the nodes carry."""
    return {hint for node in nodes if (hint := (node.meta.get("custom") or {}).get(HINT_KEY))}


def inductor_defaults(nodes: Iterable[fx.Node], chosen: dict[str, Any]) -> dict[str, Any]:
    """The Inductor settings that a graph's hints (those its ``nodes`` carry, the backend
    walking its subgraphs too) call for and ``chosen`` (the caller's settings) does not set."""
    hints = sorted(graph_hints(nodes))
    defaults = {key: value for hint in hints for key, value in INDUCTOR_DEFAULTS[hint].items() if key not in chosen}
    if defaults:
        log.info("depthrewrite backend: Inductor settings %s for this graph's hints %s", defaults, hints)
    return defaults
