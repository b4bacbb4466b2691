"""Launch ``route_many``'s forward and backward a few times at one block-phase shape, for a
profiler to read (Nsight Compute on the device machine: ``device_session.sh ncu``).

    python3 benchmarks/route_many_launches.py [--tokens 16384] [--width 1024] [--sources 4]
        [--queries 6] [--heads 1] [--keys] [--config '{"backward": "per_token"}'] [--repeat 3]
        [--stats] [--running]

Random bf16 sources, queries and output gradients as ``gpu_suite.py``'s block phase makes
them; ``--config`` is ``route_many_backward``'s launch config (JSON). ``--stats``: the
forward keeps its statistics table for the backward, as the op does where it keeps one
(``route_many.stats_table``); ``--running``: a running sum for every source, as full
AttnRes's calls take them (``depthrewrite.grad_accumulation``). Prints nothing but the shape:
the profiler's report is the output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from depthrewrite.kernels import route_many_triton  # noqa: E402
from depthrewrite.ops.route_many import stats_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--queries", type=int, default=6)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--keys", action="store_true", help="separate keys (DAR's phase 1)")
    ap.add_argument("--config", type=json.loads, default=None, help="the backward's launch config, JSON")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stats", action="store_true", help="the forward's statistics table kept for the backward")
    ap.add_argument("--running", action="store_true", help="a running sum for every source")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rows(count: int) -> list[torch.Tensor]:
        return [torch.randn(args.tokens, args.width, device="cuda", generator=gen).to(torch.bfloat16)
                for _ in range(count)]

    values = rows(args.sources)
    keys = rows(args.sources) if args.keys else None
    queries = torch.randn(args.queries, args.width, device="cuda", generator=gen) / args.width**0.5
    weights = torch.rand(args.queries, args.width, device="cuda", generator=gen) + 0.5
    grads = rows(args.queries)
    grad_lse = [torch.randn(args.tokens, args.heads, device="cuda", generator=gen) for _ in range(args.queries)]
    stats = stats_table(values, queries, args.heads, keys) if args.stats else None
    running = rows(args.sources) if args.running else None
    print(f"route_many tokens={args.tokens} d={args.width} N={args.sources} S={args.queries} "
          f"heads={args.heads} keys={args.keys} stats={stats is not None} running={args.running} "
          f"config={args.config}", flush=True)
    with torch.no_grad():
        for _ in range(args.repeat):
            out, lse = route_many_triton.route_many_forward(values, queries, weights, args.heads, 1e-6, keys=keys,
                                                            stats=stats)
            route_many_triton.route_many_backward(grads, grad_lse, out, lse, values, queries, weights, args.heads,
                                                  1e-6, args.config, keys=keys, stats=stats, grad_values_acc=running)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
