"""``depthrewrite::route_merge``'s kernels timed against Inductor's compilation of the same
math and the HBM floor, at the end-to-end model's shape, with launch variants side by side.

    python3 benchmarks/route_merge_speed.py [--tokens 16384] [--width 1024] [--reps 100]

Cases: Block AttnRes's merge (one result, no keys), block MHAR's (16 heads), DAR's (two
results, each stream's partial entry the other's key), and Block AttnRes's, block MHAR's
(session 30: the fused merge's form, its fastest end to end) and DAR's with the branch's
RMSNorm fused (``out_norm_weight``: the normed row written instead of ``x``;
Inductor compiles the merge and the norm together). For each: the forward and the
backward of our kernels (``route_merge_forward`` / ``route_merge_backward``, called
directly: no dispatcher) at the default launch and each variant of :data:`VARIANTS`, and
``torch.compile`` (Inductor) of the reference, forward and backward through autograd; every
result first checked against the reference in float32 (relative error printed). The floor
is the rows each pass must move at least once (``routing_floor``'s pricing: forward reads
the results and the distinct entries, writes ``x``; backward reads ``x``'s gradient and
those rows and writes a gradient per row argument) at 4.8 TB/s. Times: ``gpu_suite.bench``
(median over ``--reps`` ms of calls after a warm-up, CUDA events), on fresh random bf16 data
per case. Those events surround each call, so a call whose host issue time is longer than
its GPU time is timed as the host's (session 21: the backward's 185-274 us of host time
against ~100 us of GPU work); ``--graph`` times our kernels replayed from a CUDA graph
instead (``gpu_suite.bench_graph``), the GPU's time alone, Inductor's still per call. On a
machine without CUDA (Triton's interpreter, a tiny shape) it checks the numbers and prints
host times, which say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_floor import HBM_BYTES_PER_S, _rows  # noqa: E402

#: launch variants timed beside the default (route_merge_triton._launch's entries)
VARIANTS = {
    "warps2": {"num_warps": 2},
    "warps8": {"num_warps": 8},
    "t1": {"block_t": 1},
    "sm8": {"per_sm": 8},
    # session 27: the backward's persistent grid with more, smaller programs per SM (its
    # row reductions across fewer warps), and its token blocks through Triton's software
    # pipeline (``stages``)
    "sm16": {"per_sm": 16},
    "w2_sm8": {"num_warps": 2, "per_sm": 8},
    "w2_sm16": {"num_warps": 2, "per_sm": 16},
    "w2_t1_sm16": {"num_warps": 2, "block_t": 1, "per_sm": 16},
    "w1_t1_sm16": {"num_warps": 1, "block_t": 1, "per_sm": 16},
    "w1_t1_sm32": {"num_warps": 1, "block_t": 1, "per_sm": 32},
    "s3": {"stages": 3},
    "w2_s3": {"num_warps": 2, "stages": 3},
    "w2_sm8_s3": {"num_warps": 2, "per_sm": 8, "stages": 3},
    "w2_t1_sm16_s3": {"num_warps": 2, "block_t": 1, "per_sm": 16, "stages": 3},
    # session 30: the multi-head backward's default is 3 stages; this is its launch before
    "s0": {"stages": 0},
}
#: name -> (results J, heads, keyed by the other stream's entry, the branch norm fused)
CASES = {"block_attnres": (1, 1, False, False), "block_attnres_normed": (1, 1, False, True),
         "mhar_block": (1, 16, False, False), "mhar_block_normed": (1, 16, False, True),
         "dar_block": (2, 1, True, False), "dar_block_normed": (2, 1, True, True)}


def make(j: int, tokens: int, d: int, heads: int, shared_keys: bool, norm: bool, device: str, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rows():
        return torch.randn(tokens, d, device=device, generator=gen).to(torch.bfloat16)

    values = [rows() for _ in range(j)]
    return dict(
        outs=[rows() for _ in range(j)],
        # log-sum-exps near the logits' scale: the weights spread over (0, 1)
        lses=[torch.randn(tokens, heads, device=device, generator=gen) for _ in range(j)],
        values=values, keys=values[::-1] if shared_keys else None,
        queries=torch.randn(j, d, device=device, generator=gen) * heads**0.5 / d**0.5,
        key_norm_weights=torch.rand(j, d, device=device, generator=gen) + 0.5,
        mix=torch.rand(j, device=device, generator=gen) + 0.25, heads=heads,
        out_norm_weight=torch.rand(d, device=device, generator=gen) + 0.5 if norm else None,
    )


def floor_ms(inp: dict, backward: bool) -> float:
    """The HBM floor of one call, priced as ``routing_floor`` prices the step's calls."""
    rows = _rows("route_merge_backward" if backward else "route_merge", inp)
    return rows * inp["outs"][0].numel() * 2 / HBM_BYTES_PER_S * 1e3


def timer(device: str, reps: int, graph: bool = False):
    if device == "cuda":
        from gpu_suite import bench, bench_graph

        return bench_graph if graph else (lambda fn: bench(fn, rep=reps))

    def host_ms(fn):
        fn()
        times = []
        for _ in range(max(3, reps // 20)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return host_ms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(name: str, tokens: int, d: int, device: str, reps: int, seed: int, graph: bool = False) -> list[dict]:
    from depthrewrite.kernels import route_merge_triton as kernels
    from depthrewrite.ops.route_merge import _reference

    j, heads, shared, norm = CASES[name]
    inp = make(j, tokens, d, heads, shared, norm, device, seed)
    args = (inp["outs"], inp["lses"], inp["values"], inp["keys"], inp["queries"], inp["key_norm_weights"],
            inp["mix"], heads, 1e-6, inp["out_norm_weight"], 1e-6)
    grad = torch.randn(tokens, d, device=device).to(torch.bfloat16)
    ms = timer(device, reps)

    leaves = [t.detach().float().requires_grad_() for t in args[0] + args[1] + args[2]]
    ref_args = (leaves[:j], leaves[j:2 * j], leaves[2 * j:], None if inp["keys"] is None else leaves[2 * j:][::-1],
                *args[4:])
    x_ref = _reference(*ref_args)
    g_ref = torch.autograd.grad(x_ref, leaves, grad.float())

    def error(config):
        """The worst relative error of a launch's output and gradients against the reference."""
        x = kernels.route_merge_forward(*args, config=config)
        got = kernels.route_merge_backward(grad, *args, config=config)
        # keys shared with values: their gradients sum to the entries' (as autograd adds them)
        g_values = [gv + gk for gv, gk in zip(got[2], got[3][::-1])] if inp["keys"] is not None else got[2]
        return max([_rel(x, x_ref)] + [_rel(a, b) for a, b in zip(got[0] + got[1] + g_values, g_ref)])

    compiled = torch.compile(_reference, dynamic=False)
    inductor_leaves = [t.detach().requires_grad_() for t in args[0] + args[2]]
    ind_args = (inductor_leaves[:j], args[1], inductor_leaves[j:],
                None if inp["keys"] is None else inductor_leaves[j:][::-1], *args[4:])

    def inductor_fwd_bwd():
        torch.autograd.grad(compiled(*ind_args), inductor_leaves, grad)

    rows = [dict(case=name, impl="inductor", fwd=ms(lambda: compiled(*ind_args)), fwd_bwd=ms(inductor_fwd_bwd),
                 error=None)]
    ours_ms = timer(device, reps, graph)  # Inductor's above: events around each call (module docstring)
    for variant, config in {"ours": None, **VARIANTS}.items():
        rows.append(dict(case=name, impl=variant, error=error(config),
                         fwd=ours_ms(lambda: kernels.route_merge_forward(*args, config=config)),
                         bwd=ours_ms(lambda: kernels.route_merge_backward(grad, *args, config=config))))
    floors = dict(fwd=floor_ms(inp, False), bwd=floor_ms(inp, True))
    for row in rows:
        row.update(floor_fwd=floors["fwd"], floor_bwd=floors["bwd"])
    return rows


TABLE_HEAD = ["| case | impl | fwd ms | x floor | bwd ms | x floor | fwd+bwd ms | x floor | x inductor's fwd+bwd "
              "| error vs the reference |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]


def table(rows: list[dict]) -> list[str]:
    """Table rows (no head) for the rows of one or more cases."""
    out = []
    inductor = {r["case"]: r["fwd_bwd"] for r in rows if r["impl"] == "inductor"}
    for r in rows:
        total = r.get("fwd_bwd", r["fwd"] + r.get("bwd", 0.0))
        floor_total = r["floor_fwd"] + r["floor_bwd"]
        bwd = f"{r['bwd']:.3f} | {r['bwd'] / r['floor_bwd']:.2f}" if "bwd" in r else "- | -"
        out.append(f"| {r['case']} | {r['impl']} | {r['fwd']:.3f} | {r['fwd'] / r['floor_fwd']:.2f} | {bwd} | "
                   f"{total:.3f} | {total / floor_total:.2f} | {total / inductor[r['case']]:.2f} | "
                   + ("-" if r["error"] is None else f"{r['error']:.1e}") + " |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=100, help="do_bench's rep (ms of timed calls) on CUDA")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--graph", action="store_true",
                    help="time our kernels replayed from a CUDA graph (gpu_suite.bench_graph: the GPU's time "
                         "alone); Inductor's stay timed per call")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import depthrewrite.kernels  # noqa: F401  (registers the CUDA kernels)

    # each case's rows as soon as they are timed: a run stopped at its time limit keeps them
    clock = "CUDA events around each call, median" if device == "cuda" else "host times: NOT GPU figures"
    if args.graph and device == "cuda":
        clock = "ours: CUDA-graph replays, the GPU's time alone; Inductor: CUDA events around each call"
    print(f"route_merge at {args.tokens} tokens x d = {args.width}, bf16, {device} ({clock}); "
          f"every launch checked against the float32 reference (worst relative error of the output and gradients)")
    print("\n".join(TABLE_HEAD), flush=True)
    for i, name in enumerate(args.cases):
        case_rows = run_case(name, args.tokens, args.width, device, args.reps, seed=100 + i, graph=args.graph)
        print("\n".join(table(case_rows)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
