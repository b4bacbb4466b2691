"""Host (CPU) time per call of the routing ops on the GPU, layer by layer: what a compiled
graph pays on the host for each ``depthrewrite::route`` / ``route_backward`` / ``fence_``
call, apart from the GPU's work.

    python3 benchmarks/host_overhead.py [--sources 3 9 24] [--calls 200] [--repeats 7]

Each row calls one layer ``--calls`` times back to back on a few tokens (the kernels take a
few microseconds, so the host sets the pace), synchronises, and reports the median over
``--repeats`` of the wall time per call, in microseconds. Layers, outermost first:

- ``op``: ``torch.ops.depthrewrite.<op>.default`` with autograd off, as Inductor's wrapper
  calls it (dispatcher, the custom op's layers, our CUDA kernel function);
- ``launcher``: :func:`route_forward` / :func:`route_backward` called directly;
- ``pointer tables``: the tables alone, found in the cache or uploaded;
- ``torch.add``: one eager ATen op, for scale.

Needs CUDA; prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, calls: int, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def rows_for(n: int, tokens: int, d: int, calls: int, repeats: int) -> list[tuple[str, float]]:
    import torch

    import depthrewrite.kernels  # noqa: F401  (registers the CUDA kernels)
    from depthrewrite.kernels.pointer_tables import clear_cache, pointer_tables
    from depthrewrite.kernels.route_triton import route_backward, route_forward

    dev, dt = "cuda", torch.bfloat16
    values = [torch.randn(tokens, d, device=dev, dtype=dt) for _ in range(n)]
    query = torch.randn(d, device=dev) * 0.1
    weight = torch.rand(d, device=dev) + 0.5
    grad = torch.randn(tokens, d, device=dev, dtype=dt)
    acc = [torch.randn(tokens, d, device=dev, dtype=dt) for _ in range(n)]
    route, route_bwd, fence = (torch.ops.depthrewrite.route.default, torch.ops.depthrewrite.route_backward.default,
                               torch.ops.depthrewrite.fence_.default)
    with torch.no_grad():
        out, lse, _ = route(values, None, query, weight, None, None, 1, 1e-6)
        layers = [
            ("route op", lambda: route(values, None, query, weight, None, None, 1, 1e-6)),
            ("route_forward launcher", lambda: route_forward(values, None, query, weight, None, None, 1, 1e-6)),
            ("route_backward op", lambda: route_bwd(grad, out, lse, values, None, query, weight, None, None, 1, 1e-6)),
            ("route_backward op, running sums",
             lambda: route_bwd(grad, out, lse, values, None, query, weight, None, None, 1, 1e-6,
                               None, None, 1e-6, acc, None)),
            ("route_backward launcher",
             lambda: route_backward(grad, out, lse, values, None, query, weight, None, None, 1, 1e-6)),
            ("pointer tables (fwd), cached", lambda: pointer_tables(values[0].device, values, [])),
            ("pointer tables (fwd), uploaded", lambda: (clear_cache(), pointer_tables(values[0].device, values, []))),
            ("fence_ op", lambda: fence(grad)),
            ("torch.add", lambda: torch.add(grad, grad)),
        ]
        return [(name, per_call_us(fn, calls, repeats)) for name, fn in layers]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=int, nargs="+", default=[3, 9, 24])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    results = {n: rows_for(n, args.tokens, args.width, args.calls, args.repeats) for n in args.sources}
    names = [name for name, _ in results[args.sources[0]]]
    print(f"host us per call ({args.tokens} tokens, d={args.width}, bf16; median of {args.repeats} x {args.calls})")
    print("| layer | " + " | ".join(f"N={n}" for n in args.sources) + " |")
    print("| --- |" + " ---: |" * len(args.sources))
    for i, name in enumerate(names):
        print(f"| {name} | " + " | ".join(f"{results[n][i][1]:.1f}" for n in args.sources) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
