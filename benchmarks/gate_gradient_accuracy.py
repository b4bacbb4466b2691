"""How far DAR's gate (``mix``) gradients are from float64 in fp32, for eager, Inductor
alone and the backend with Inductor, with the fused merge (session 22: the numbers behind
gpu_scheme_check.py's fp32 rule, docs/benchmarks.md):

    python3 benchmarks/gate_gradient_accuracy.py [--device cpu] [--preset small] [--layers 0] [--batch 2 256]

Prints, per gate gradient, the relative error (``gpu_scheme_check._rel`` with its scales)
of each against the same model in float64 on the reference ops, and the backend's against
Inductor alone.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_scheme_check as check  # noqa: E402

from depthrewrite import backend  # noqa: E402
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
    exact = copy.deepcopy(model).double()
    _, truth = check._loss_and_grads(exact, exact, idx, "fp32")
    runs = {"eager": model}
    runs["inductor alone"] = torch.compile(model, backend="inductor", fullgraph=True)
    runs["backend"] = torch.compile(model, backend=backend.depthrewrite_backend, fullgraph=True,
                                    options={"inner": "inductor"})
    grads = {}
    for name, fn in runs.items():
        torch._dynamo.reset()
        _, grads[name] = check._loss_and_grads(model, fn, idx, "fp32")
    scales = check._scales(truth)
    print("| gradient | " + " | ".join(runs) + " | backend vs inductor alone |")
    print("| --- |" + " ---: |" * (len(runs) + 1))
    for n in (n for n in truth if n.endswith(".mix")):
        errors = [check._rel(grads[r][n], truth[n], scales[n]) for r in runs]
        vs = check._rel(grads["backend"][n], grads["inductor alone"][n])
        print(f"| {n} | " + " | ".join(f"{e:.1e}" for e in errors) + f" | {vs:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
