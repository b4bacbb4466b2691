"""Where ``route_many``'s backward spends its GPU time, kernel by kernel (CUDA only):
the default kernel and the split backward's launch forms at the block phase's one-head
shapes (bf16, 16384 tokens, S = 6), each config's calls under ``torch.profiler``; prints
per config the median call time (``triton.testing.do_bench``) and each kernel's us per
call, then a short table.

    python benchmarks/split_backward_parts.py [--configs NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: (tokens, d, sources, queries, separate keys)
SHAPES = [(16384, 1024, 4, 6, False), (16384, 1024, 8, 6, False), (16384, 1024, 4, 6, True),
          (16384, 1024, 8, 6, True), (16384, 2048, 4, 6, False)]
CONFIGS = {
    "default": None,
    "split": {"backward": "split"},
    "split_dot": {"backward": "split", "split_grads": "dot"},
    "split_dot_pp8": {"backward": "split", "split_grads": "dot", "split_per_sm": 8},
    "split_dot_w8": {"backward": "split", "split_grads": "dot", "num_warps": 8},
    "split_t32": {"backward": "split", "split_t": 32},
    "split_t4": {"backward": "split", "split_t": 4},
    # one source at a time in the stats kernel, with the dot gradient kernel
    **{f"ps_t{t}": {"backward": "split", "split_stats": "per_source", "split_t": t, "split_grads": "dot"}
       for t in (1, 2, 4, 8)},
    "ps_t2_w2": {"backward": "split", "split_stats": "per_source", "split_t": 2, "split_grads": "dot", "num_warps": 2},
    # the dot gradient kernel's tiles and pipeline
    "dot_t32": {"backward": "split", "split_grads": "dot", "split_grads_t": 32},
    "dot_c128": {"backward": "split", "split_grads": "dot", "split_grads_c": 128},
    "dot_c32": {"backward": "split", "split_grads": "dot", "split_grads_c": 32},
    "dot_ns1": {"backward": "split", "split_grads": "dot", "split_grads_stages": 1},
    "dot_ns2": {"backward": "split", "split_grads": "dot", "split_grads_stages": 2},
}


def _inputs(tokens, d, n, s, keys):
    gen = torch.Generator(device="cuda").manual_seed(tokens + d + n + s + keys)

    def rows(count):
        return [torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(count)]

    return dict(values=rows(n), keys=rows(n) if keys else None,
                queries=torch.randn(s, d, device="cuda", generator=gen) / d**0.5,
                weights=torch.rand(s, d, device="cuda", generator=gen) + 0.5, grads=rows(s),
                grad_lse=[torch.randn(tokens, 1, device="cuda", generator=gen) for _ in range(s)])


def _kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """us per call of each CUDA kernel ``fn`` launches, over ``calls`` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            per_kernel[evt.key[:60]] += evt.device_time_total / calls
    return dict(per_kernel)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import triton

    from depthrewrite.kernels import route_many_triton
    rows = []
    for tokens, d, n, s, keys in SHAPES:
        inp = _inputs(tokens, d, n, s, keys)
        with torch.no_grad():
            out, lse = route_many_triton.route_many_forward(inp["values"], inp["queries"], inp["weights"], 1, 1e-6,
                                                            keys=inp["keys"])
        for name in args.configs:
            def call(cfg=CONFIGS[name]):
                return route_many_triton.route_many_backward(inp["grads"], inp["grad_lse"], out, lse, inp["values"],
                                                             inp["queries"], inp["weights"], 1, 1e-6, cfg,
                                                             keys=inp["keys"])
            ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            kernels = _kernel_times(call)
            row = dict(tokens=tokens, d=d, n=n, s=s, keys=keys, config=name, ms=ms, kernels=kernels)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del inp, out, lse
        torch.cuda.empty_cache()
    print("\n| d | n | keys | config | ms | largest kernels (us per call) |\n| ---: | ---: | --- | --- | ---: | --- |")
    for r in rows:
        top = sorted(r["kernels"].items(), key=lambda kv: -kv[1])[:3]
        print(f"| {r['d']} | {r['n']} | {r['keys']} | {r['config']} | {r['ms']:.3f} | "
              + ", ".join(f"{k} {v:.0f}" for k, v in top) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
