"""How sharp a trained model's depth routing is, from its parameters (session 23):

    python3 benchmarks/query_scale.py RUN_OR_CHECKPOINT [--heads 1]

A routing logit is ``sum_c query[c] * w[c] * RMSNorm(key)[c]`` over one head's channels
(``w``: the key norm's weight). For keys whose entries have RMS 1 and no preferred
direction the logits over the sources then spread with standard deviation
``|query * w|`` over the head: the *logit scale* printed here, per router row and head.
``gpu_scheme_check.py``'s queries at std ``s`` give ``s * sqrt(d / heads)`` (16 at the 350M
model with s = 0.5: where its fp32 gradients are chaotic; 2 at s = 0.0625). Real keys are
not isotropic, so this is a scale, not the logits' spread itself.

Reads ``<run>/checkpoints/``'s newest checkpoint (``depthrewrite train --out RUN``) or a
checkpoint file; prints each router's largest logit scale, then the median and the largest
over the routers.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from depthrewrite.train.checkpoint import latest_checkpoint  # noqa: E402


def logit_scales(state: dict[str, torch.Tensor], heads: int = 1) -> dict[str, float]:
    """Per router (the prefix of its ``query`` parameter): the largest ``|query * w|`` over
    its rows and heads, ``w`` its ``key_norm_weight`` (ones where it has none)."""
    scales = {}
    for name, query in state.items():
        if not name.endswith(".query"):
            continue
        prefix = name[: -len("query")]
        weight = state.get(prefix + "key_norm_weight", torch.ones_like(query))
        rows = (query.float() * weight.float()).reshape(-1, query.shape[-1])
        if rows.shape[-1] % heads:
            raise ValueError(f"{name}: width {rows.shape[-1]} is not a multiple of --heads {heads}")
        scales[prefix.rstrip(".")] = float(rows.unflatten(-1, (heads, -1)).norm(dim=-1).max())
    return scales


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a run folder (its newest checkpoint) or a checkpoint file")
    ap.add_argument("--heads", type=int, default=1, help="routing heads (MHAR's)")
    args = ap.parse_args()
    path = pathlib.Path(args.path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            ap.error(f"{path}: no checkpoints/step_*.pt in this run folder")
        path = found
    payload = torch.load(path, map_location="cpu", weights_only=False)
    scales = logit_scales(payload["model"], args.heads)
    if not scales:
        ap.error(f"{path}: no routing queries (parameters named '*.query') in its model")
    for router, scale in scales.items():
        print(f"{router:40s} {scale:8.3f}")
    values = list(scales.values())
    print(f"{path} (step {payload.get('step')}): logit scale median {statistics.median(values):.3f}, "
          f"largest {max(values):.3f} over {len(values)} routers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
