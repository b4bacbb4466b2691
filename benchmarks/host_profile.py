"""Where a training step's host time goes, by package: the end-to-end models of
``e2e_throughput.py`` built the same way, then ``cProfile`` over steps each started on an
idle GPU (as ``e2e_throughput.host_issue_ms``), the self time of every Python function and
builtin summed by where its code lives (our launchers, the rest of depthrewrite, Inductor's
compiled wrappers, Triton's launcher, autograd, FSDP2, Dynamo's guards, ...).

    python3 benchmarks/host_profile.py --schemes baseline_pb_fsdp dar_block_pb_fsdp [--steps 5] [--top 25]

cProfile slows Python down by more than it slows C, so the shares are a map of the host's
time, not a step time: the step's unprofiled host time is printed beside them. Needs CUDA;
prints one table per model, then a side-by-side table by package last.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (package, substring of a function's file or name), the first that matches wins
PACKAGES = (
    ("depthrewrite launchers", "depthrewrite/kernels/"),
    ("depthrewrite ops", "depthrewrite/ops/"),
    ("depthrewrite other", "depthrewrite/"),
    ("inductor wrapper code", "torchinductor"),
    ("inductor runtime", "torch/_inductor/"),
    ("triton", "triton/"),
    ("fsdp", "torch/distributed/fsdp/"),
    ("distributed", "torch/distributed/"),
    ("dynamo", "torch/_dynamo/"),
    ("aot autograd", "torch/_functorch/"),
    ("autograd", "torch/autograd/"),
    ("custom ops", "torch/_library/"),
    ("torch ops", "torch/_ops.py"),
    ("nn modules", "torch/nn/"),
    ("optimizer", "torch/optim/"),
    ("torch other", "torch/"),
    ("builtins", "~:"),  # a builtin no profiled function called
)


def package_of(filename: str, function: str) -> str:
    where = f"{filename}:{function}"
    return next((name for name, part in PACKAGES if part in where), "other")


def by_package(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Self (exclusive) ms per step for each package. A builtin's time goes to the package of
    the function that called it most, so a tensor method called from the launchers counts as
    theirs."""
    totals: dict[str, float] = {}
    for (filename, _, function), (_, _, tottime, _, callers) in stats.stats.items():
        if filename == "~" and callers:  # a builtin: to its heaviest caller's package
            (cfile, _, cfunc), _ = max(callers.items(), key=lambda kv: kv[1][2])
            name = package_of(cfile, cfunc)
        else:
            name = package_of(filename, function)
        totals[name] = totals.get(name, 0.0) + tottime * 1e3 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def profile_model(name: str, steps: int, top: int) -> dict:
    import torch

    import e2e_throughput as e2e

    model, compiled = e2e._build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def step():
        x = torch.randint(0, model.config.vocab_size, (e2e.BATCH, e2e.SEQ), device="cuda", generator=gen)
        opt.zero_grad(set_to_none=True)
        _, loss = compiled(x, x)
        loss.backward()
        opt.step()

    for _ in range(e2e.WARMUP_STEPS + e2e.REWARM_STEPS):
        step()
    host_ms = e2e.host_issue_ms(step, steps)
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    spent = []
    for _ in range(steps):
        t0 = time.perf_counter()
        profiler.enable()
        step()
        profiler.disable()
        spent.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    print(f"== {name}: host {host_ms:.1f} ms a step unprofiled, {statistics.median(spent):.1f} profiled")
    stats.sort_stats("tottime").print_stats(top)
    return dict(host_ms=host_ms, profiled_ms=statistics.median(spent), packages=by_package(stats, steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["baseline_pb_fsdp", "dar_block_pb_fsdp"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows = {name: profile_model(name, args.steps, args.top) for name in args.schemes}
    names = list(rows)
    packages = sorted({p for row in rows.values() for p in row["packages"]},
                      key=lambda p: -max(row["packages"].get(p, 0.0) for row in rows.values()))
    print(f"host ms a step by package (cProfile self time, median step of {args.steps}; unprofiled host first)")
    print("| package | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    print("| unprofiled host | " + " | ".join(f"{rows[n]['host_ms']:.1f}" for n in names) + " |")
    print("| profiled step | " + " | ".join(f"{rows[n]['profiled_ms']:.1f}" for n in names) + " |")
    for p in packages:
        print(f"| {p} | " + " | ".join(f"{rows[n]['packages'].get(p, 0.0):.1f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
