"""bf16 accuracy of the fused branch norm (``fuse_output_norms``) against the float64 truth,
next to the unfused compiled model's, on the GPU scheme check's models (CPU is enough).

    python benchmarks/norm_fusion_accuracy.py [--scheme dar_fm] [--seeds 8]

For each seed: the scheme check's tiny GPT (``gpu_scheme_check._model``), one bf16-autocast
step eager, compiled with the norms fused and compiled without (``inner="aot_eager"``,
``two_phase.FUSED_MERGE`` on), and the same model in float64 for the truth. Prints the
geometric mean of the fused / unfused relative gradient errors over the scalar parameters
(DAR's ``mix``, ``transport``, ``beta``: at most 2 elements) and over the others, and per
seed the worst ratio of the fused model's error to the scheme check's allowance (4x the
eager model's own error, or 3e-2): above 1 the check's per-gradient rule fails it.
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gpu_scheme_check as check  # noqa: E402
from depthrewrite import backend  # noqa: E402
from depthrewrite.passes import two_phase  # noqa: E402


def seed_errors(scheme: str, seed: int) -> tuple[dict, dict, dict, dict]:
    """Relative gradient errors against float64: eager, fused, unfused; and the truth."""
    model = check._model(scheme, "cpu")
    idx = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(seed))
    _, eager = check._loss_and_grads(model, model, idx, "bf16")
    exact = copy.deepcopy(model).double()
    _, truth = check._loss_and_grads(exact, exact, idx, "fp32")
    compiled = {}
    for fuse in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(model, backend=backend.depthrewrite_backend, fullgraph=True,
                           options={"inner": "aot_eager", "fuse_output_norms": fuse})
        compiled[fuse] = check._loss_and_grads(model, fn, idx, "bf16")[1]

    def errors(grads):
        return {n: check._rel(grads[n], truth[n]) for n in truth}
    return errors(eager), errors(compiled[True]), errors(compiled[False]), truth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="dar_fm", choices=check.FUSED_MERGE_CONFIGS)
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    two_phase.FUSED_MERGE = True
    logs = {"scalar": [], "other": []}
    worst = []
    for seed in range(1, args.seeds + 1):
        eager, fused, unfused, truth = seed_errors(args.scheme, seed)
        for name in truth:
            if fused[name] > 0 and unfused[name] > 0:
                logs["scalar" if truth[name].numel() <= 2 else "other"].append(math.log(fused[name] / unfused[name]))
        allowed = check.allowances({n: eager[n] for n in truth}, "bf16")
        worst.append(max(fused[n] / allowed[n] for n in truth))
    for kind, values in logs.items():
        print(f"{args.scheme} {kind} parameters: {len(values)} errors, geometric mean of fused / unfused "
              f"{math.exp(sum(values) / len(values)):.3f}")
    print("worst fused error / the scheme check's allowance, per seed:", " ".join(f"{w:.2f}" for w in worst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
