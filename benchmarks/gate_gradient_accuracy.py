"""How far DAR's gate (``mix``) gradients are from float64 in fp32, for eager, Inductor
alone and the backend with Inductor, with the fused merge (session 22: the numbers behind
gpu_scheme_check.py's fp32 rule, docs/benchmarks.md):

    python3 benchmarks/gate_gradient_accuracy.py [--device cpu] [--preset small] [--layers 0] [--batch 2 256]

Prints, per gate gradient, the relative error (``gpu_scheme_check._rel`` with its scales)
of each against the same model in float64 on the reference ops, and the backend's against
Inductor alone.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_scheme_check as check  # noqa: E402
import gradient_accuracy as accuracy  # noqa: E402

from depthrewrite.passes import two_phase  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's own")
    ap.add_argument("--batch", type=int, nargs=2, default=(2, 256), metavar=("ROWS", "TOKENS"))
    args = ap.parse_args()
    two_phase.FUSED_MERGE = True
    setup = check.Setup(inner="inductor", preset=args.preset, layers=args.layers or None, batch=tuple(args.batch))
    model = check._model("dar_fm", args.device, setup)
    idx = torch.randint(0, model.config.vocab_size, setup.batch, generator=torch.Generator().manual_seed(1))
    idx = idx.to(args.device)
    truth = check.float64_truth(model, idx)[1]
    ways = {"eager": "kernels", "inductor alone": "inductor", "backend": "backend"}  # gradient_accuracy's runs
    grads = {name: accuracy.run_grads(way, model, idx) for name, way in ways.items()}
    scales = check._scales(truth)
    print("| gradient | " + " | ".join(ways) + " | backend vs inductor alone |")
    print("| --- |" + " ---: |" * (len(ways) + 1))
    for n in (n for n in truth if n.endswith(".mix")):
        errors = [check._rel(grads[r][n], truth[n], scales[n]) for r in ways]
        vs = check._rel(grads["backend"][n], grads["inductor alone"][n])
        print(f"| {n} | " + " | ".join(f"{e:.1e}" for e in errors) + f" | {vs:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
