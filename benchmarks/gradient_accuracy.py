"""How far each way of running a scheme is from float64, gradient by gradient (session 23):

    python3 benchmarks/gradient_accuracy.py [--device cuda] [--config dar] [--preset medium]
        [--layers 0] [--batch 2 1024] [--query-std 0.5] [--runs kernels reference] [--top 12]
        [--precision fp32|bf16] [--json PATH]

The same rewritten bundled GPT (``gpu_scheme_check._model``: queries moved off zero, with
``--query-std``, ``gpu_scheme_check.QUERY_STD`` by default) runs in float64 on the
reference ops (the truth) and in ``--precision`` (fp32, or bf16 autocast) each of ``--runs`` ways:

- ``reference``: eager, the routing ops on their pure-PyTorch reference;
- ``kernels``: eager, the routing ops on the fused kernels (the Triton ones on CUDA);
- ``inductor``: Inductor alone (the routing ops on the reference inside its graph);
- ``backend``: ``backend="depthrewrite"`` with Inductor inside, as training compiles it;
- ``shortcut``: eager on the reference ops, ``route_many``'s backward taking
  ``sum_j a_j <v_j, g>`` as ``<out, g>`` from its saved output as the fused kernels do
  (``route_many.reference_backward``'s ``shortcut_out``): the kernels' rounding path where
  they cannot run (the CPU at this size), or the shortcut's share where they can;
- ``inductor_shortcut``: Inductor alone with that shortcut (the backend's rounding path on
  the GPU, where Inductor runs everything but the routing kernels, emulated on the CPU);
- ``kernels_exact``, ``backend_exact``: ``kernels`` and ``backend`` with the kernels' backward
  forming ``sum_j a_j <v_j, g>`` from the sources (``set_exact_softmax_grad(True)``);
- ``inductor_casts``: Inductor alone keeping eager's bf16 round trips between the ops it
  fuses (``emulate_precision_casts``; off by default, where Inductor skips them and keeps
  fp32), as the kernels' bf16 outputs do.

Prints each run's errors (``gpu_scheme_check.errors_against``) summarised by the gradient's
kind (its last name: every ``transport``). With two runs or more, also the ``--top``
gradients where the first run is furthest from the truth relative to the second, and for
each run against each later one as its reference how many gradients fail
gpu_scheme_check's rule for the precision (applied to two correct implementations, the rule shows how
much rounding alone moves at the setup). It tells a kernel that is less accurate than its
reference (every kind worse by a similar factor) from a wrong gradient (a few gradients far
off, the rest as accurate) and from a model whose gradients are themselves ill-conditioned
(every run equally far). ``--json`` writes every gradient's error per run, for rules
worked out afterwards (rewritten as each run ends).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_scheme_check as check  # noqa: E402

from depthrewrite import backend  # noqa: E402
from depthrewrite.kernels import set_exact_softmax_grad, set_fused_enabled  # noqa: E402

RUNS = ("reference", "kernels", "inductor", "backend", "shortcut", "inductor_shortcut", "kernels_exact",
        "backend_exact", "inductor_casts")


@contextlib.contextmanager
def no_compile_caches():
    """Compile afresh: a cached compilation of the same graph (AOTAutograd's and Inductor's
    caches, on disk too) would bring back a backward traced with or without the shortcut."""
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        yield


@contextlib.contextmanager
def kernels_shortcut():
    """``route_many``'s reference backward with the fused kernels' shortcut, in eager."""
    module = importlib.import_module("depthrewrite.ops.route_many")  # the module: ops exports a function of its name
    original = module._route_many_backward_op

    def shortcut(grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads, eps, keys):
        return module.reference_backward(grad_out, grad_lse, values, queries, key_norm_weights, heads, eps, keys,
                                         shortcut_out=out)

    module._route_many_backward_op = shortcut  # _backward looks the op up by this name at each call
    try:
        yield
    finally:
        module._route_many_backward_op = original


def run_grads(way: str, model, idx, precision: str = "fp32") -> dict:
    """The gradients of ``model`` run ``way`` in ``precision`` (module docstring)."""
    torch._dynamo.reset()
    base = way.removesuffix("_exact")
    previous = set_fused_enabled(base in ("kernels", "backend"))
    previous_exact = set_exact_softmax_grad(way.endswith("_exact"))
    try:
        fn = model
        if base in ("inductor", "inductor_shortcut", "inductor_casts"):
            fn = torch.compile(model, backend="inductor", fullgraph=True)
        elif base == "backend":
            fn = torch.compile(model, backend=backend.depthrewrite_backend, fullgraph=True,
                               options={"inner": "inductor"})
        casts = torch._inductor.config.patch(emulate_precision_casts=base == "inductor_casts")
        with kernels_shortcut() if base.endswith("shortcut") else contextlib.nullcontext(), no_compile_caches(), casts:
            return check._loss_and_grads(model, fn, idx, precision)[1]
    finally:
        set_fused_enabled(previous)
        set_exact_softmax_grad(previous_exact)


def by_kind(errors: dict) -> dict[str, tuple[float, float]]:
    """Per kind of gradient (last name), then over all of them, the median and largest error."""
    kinds = dict(sorted(check.group_by_kind(errors).items()), all=list(errors.values()))
    return {kind: (statistics.median(v), max(v)) for kind, v in kinds.items()}


def print_kinds(errors: dict[str, dict]) -> None:
    """The table of :func:`by_kind`, one column per run."""
    runs = list(errors)
    kinds = {way: by_kind(e) for way, e in errors.items()}
    print("| kind | " + " | ".join(runs) + " |")
    print("| --- |" + " ---: |" * len(runs))
    for kind in kinds[runs[0]]:
        print(f"| {kind} | " + " | ".join(f"{kinds[w][kind][0]:.1e} / {kinds[w][kind][1]:.1e}" for w in runs) + " |")


def print_top(errors: dict[str, dict], top: int) -> None:
    """The ``top`` gradients where the first run's error is largest against the second's."""
    runs = list(errors)
    first, second = runs[:2]
    ranked = sorted(errors[first], key=lambda n: errors[first][n] / max(errors[second][n], 1e-30), reverse=True)
    print(f"\n{first} against {second}: the {top} gradients with the largest ratio of errors")
    for name in ranked[:top]:
        print(f"  {name:50s} " + "  ".join(f"{w} {errors[w][name]:.2e}" for w in runs))


def print_rule(errors: dict[str, dict], precision: str = "fp32") -> None:
    """gpu_scheme_check's rule for ``precision``, each run against each later one as its reference."""
    runs = list(errors)
    for i, candidate in enumerate(runs):
        for reference in runs[i + 1:]:
            verdict = check.judge(errors[candidate], errors[reference], precision)
            allowed = verdict.allowed
            over = [n for n in allowed if errors[candidate][n] > allowed[n]]
            print(f"\nthe {precision} rule, {candidate} against {reference} as the reference: {len(over)} of "
                  f"{len(allowed)} gradients over their allowance; closest {verdict.worst} at "
                  f"{verdict.gradient_ratio:.2f}x; the kind median nearest its "
                  f"allowance {verdict.worst_kind}'s at {verdict.median_ratio:.2f}x"
                  + "".join(f"\n  {n}: {errors[candidate][n]:.2e} > {allowed[n]:.2e}" for n in over))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", default="dar", choices=list(check.CONFIGS))
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's own")
    ap.add_argument("--batch", type=int, nargs=2, default=(2, 1024), metavar=("ROWS", "TOKENS"))
    ap.add_argument("--query-std", type=float, default=check.QUERY_STD)
    ap.add_argument("--runs", nargs="+", default=["kernels", "reference"], choices=RUNS)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--json", type=Path, help="write {run: {gradient: error}} here")
    args = ap.parse_args()
    repeated = len(set(args.runs)) < len(args.runs)
    if args.layers < 0 or args.top < 0 or min(args.batch) < 1 or args.query_std <= 0 or repeated:
        ap.error(f"--layers and --top must be >= 0, --batch and --query-std positive, --runs each once; found "
                 f"{args.layers}, {args.top}, {args.batch}, {args.query_std} and {args.runs}")
    setup = check.Setup(preset=args.preset, layers=args.layers or None, batch=tuple(args.batch),
                        query_std=args.query_std)
    model = check._model(args.config, args.device, setup)
    idx = torch.randint(0, model.config.vocab_size, setup.batch, generator=torch.Generator().manual_seed(1))
    idx = idx.to(args.device)
    truth = check.float64_truth(model, idx)[1]
    errors = {}
    for way in args.runs:  # each run's errors written as it ends: a run cut by a time limit keeps the earlier ones
        start = time.perf_counter()
        errors[way] = check.errors_against(run_grads(way, model, idx, args.precision), truth)
        print(f"{way}: {time.perf_counter() - start:.0f} s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(errors, indent=1, sort_keys=True))
    print(f"{args.config}, preset {args.preset}, layers {model.config.n_layer}, batch {tuple(args.batch)}, "
          f"{args.device}, {args.precision}: relative error against float64, median / largest per kind")
    print_kinds(errors)
    if len(args.runs) > 1:
        print_top(errors, args.top)
        print_rule(errors, args.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
