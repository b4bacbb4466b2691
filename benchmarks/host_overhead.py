"""Host (CPU) time per call of the routing ops on the GPU, layer by layer: what a compiled
graph pays on the host for each ``depthrewrite::route`` / ``route_backward`` / ``fence_``,
``route_many`` / ``route_many_backward`` and ``route_merge`` / ``route_merge_backward``
call, apart from the GPU's work.

    python3 benchmarks/host_overhead.py [--sources 3 9 24] [--calls 200] [--repeats 7] [--profile-top 12]

Each row calls one layer ``--calls`` times back to back on a few tokens (the kernels take a
few microseconds, so the host sets the pace), synchronises, and reports the median over
``--repeats`` of the wall time per call, in microseconds. The two-phase table's columns (the
layers of one call) are timed interleaved, repeat by repeat (:func:`side_by_side_us`).
Layers, outermost first:

- ``op``: ``torch.ops.depthrewrite.<op>.default`` with autograd off, as Inductor's wrapper
  calls it (dispatcher, the custom op's layers, our CUDA kernel function);
- ``launcher``: :func:`route_forward` / :func:`route_backward` called directly;
- ``pointer tables``: the tables alone, found in the cache or uploaded;
- ``torch.add``: one eager ATen op, for scale.

Then the two-phase ops at the end-to-end model's sites (second table; session 21, when the
fused merge's profile showed the host issuing Block AttnRes's step in 88.8 ms against 45.6
without it): ``route_many`` for Block AttnRes's phase 1 (6 completed blocks, 8 sites) and for
full AttnRes's calls (45 sources and 4 sites, 2 sources and 1 site; session 35) and
``route_merge`` with the branch norm fused, one result (Block AttnRes) and two keyed ones
(DAR), each as the op, as our registered CUDA kernel function (``depthrewrite.kernels``'s:
the op's time beyond it is the dispatcher's and the custom op's wrapper's), as its
launcher and as its launcher with the torch finish; with ``--profile-top`` > 0, each op's
calls under ``cProfile`` first, the functions with the most own time.

Needs CUDA; prints the tables last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def per_call_us(fn, calls: int, repeats: int) -> float:
    """The median over ``repeats`` of the host's wall time per call of ``fn``, in us, over
    ``calls`` calls back to back and a synchronisation (one warm-up call first)."""
    return side_by_side_us((fn,), calls, repeats)[0]


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


def torch_finish(fn):
    """``fn`` with the parameter sums finished by torch ops (``param_grads.FUSED`` off, as
    before session 30)."""
    from depthrewrite.kernels import param_grads

    def call():
        previous, param_grads.FUSED = param_grads.FUSED, False
        try:
            return fn()
        finally:
            param_grads.FUSED = previous
    return call


def two_phase_cases(tokens: int, d: int, dev: str = "cuda") -> dict:
    """name -> (the op as a compiled graph calls it, our registered CUDA kernel function
    called directly, its Triton launcher called directly). :func:`two_phase_rows` times the
    launcher once more with the parameter sums finished by torch ops (``param_grads.FUSED``
    off: the sums, products and casts as 3-7 launches, as before session 30; the forwards
    have none, so their two launcher columns show the spread of these timings)."""
    import torch

    import depthrewrite.kernels  # registers the CUDA kernels
    from depthrewrite.kernels import route_many_triton as many
    from depthrewrite.kernels import route_merge_triton as merge
    from route_merge_speed import make

    ops, dt, cuda = torch.ops.depthrewrite, torch.bfloat16, depthrewrite.kernels.CUDA_KERNELS
    found = {}
    # Block AttnRes's phase 1 (6 completed blocks, 8 sites); full AttnRes's last group call
    # (45 sources, 4 sites: it keeps the statistics table) and an in-group call (2 sources, 1 site)
    for n, s, what in ((6, 8, "6 blocks, 8 sites"), (45, 4, "45 sources, 4 sites"), (2, 1, "2 sources, 1 site")):
        values = [torch.randn(tokens, d, device=dev, dtype=dt) for _ in range(n)]
        queries, weights = torch.randn(s, d, device=dev) * 0.1, torch.rand(s, d, device=dev) + 0.5
        out, lse, stats = ops.route_many.default(values, queries, weights, 1, 1e-6, None)
        out, lse = list(out), list(lse)
        grad_out, grad_lse = [torch.randn_like(o) for o in out], [torch.randn_like(t) for t in lse]
        kept = stats if stats.numel() else None
        a = (values, queries, weights)
        b = (grad_out, grad_lse, out, lse, stats, values, queries, weights)
        found[f"route_many fwd ({what})"] = (
            lambda a=a: ops.route_many.default(*a, 1, 1e-6, None), lambda a=a: cuda["route_many"](*a, 1, 1e-6, None),
            lambda a=a, kept=kept: many.route_many_forward(*a, 1, 1e-6, stats=kept))
        found[f"route_many bwd ({what})"] = (
            lambda b=b: ops.route_many_backward.default(*b, 1, 1e-6, None),
            lambda b=b: cuda["route_many_backward"](*b, 1, 1e-6, None),
            lambda b=b, kept=kept: many.route_many_backward(*b[:4], *b[5:], 1, 1e-6, stats=kept))
    for name, (j, keyed) in {"route_merge, normed, J=1": (1, False), "route_merge, normed, J=2 keyed": (2, True)}.items():
        inp = make(j, tokens, d, 1, keyed, True, dev, seed=11)
        args = (inp["outs"], inp["lses"], inp["values"], inp["keys"], inp["queries"], inp["key_norm_weights"],
                inp["mix"], 1, 1e-6, inp["out_norm_weight"], 1e-6)
        grad = torch.randn(tokens, d, device=dev, dtype=dt)
        found[f"{name} fwd"] = (lambda a=args: ops.route_merge.default(*a), lambda a=args: cuda["route_merge"](*a),
                                lambda a=args: merge.route_merge_forward(*a))
        found[f"{name} bwd"] = (lambda a=args, g=grad: ops.route_merge_backward.default(g, *a),
                                lambda a=args, g=grad: cuda["route_merge_backward"](g, *a),
                                lambda a=args, g=grad: merge.route_merge_backward(g, *a))
    return found


def two_phase_rows(tokens: int, d: int, calls: int, repeats: int, profile_top: int) -> dict[str, list[float]]:
    """name -> host us per call: the op, the op below the autograd keys, our kernel function,
    the Triton launcher, the launcher with the parameter sums finished by torch ops. Prints
    each op's profile first (``profile_top`` > 0)."""
    cases = two_phase_cases(tokens, d)
    for name, (op, _, _) in cases.items() if profile_top > 0 else ():
        print(f"== {name}: the op's calls under cProfile ({calls} calls)")
        print(profile(op, calls, profile_top), flush=True)
    return {name: side_by_side_us((fns[0], below_autograd(fns[0]), *fns[1:], torch_finish(fns[-1])), calls, repeats)
            for name, fns in cases.items()}


def side_by_side_us(fns, calls: int, repeats: int) -> list[float]:
    """:func:`per_call_us` of each of ``fns`` (the layers of one call), interleaved: each
    repeat times every layer once (the first layer rotating), so that a drift of the host's speed during the
    measurement moves every column alike (session 46: timed one after another, a launcher
    once measured more than the kernel function that calls it)."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for i in (k % len(fns) for k in range(r, r + len(fns))):
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[i]()
            torch.cuda.synchronize()
            times[i].append((time.perf_counter() - t0) / calls * 1e6)
    return [statistics.median(t) for t in times]


def below_autograd(fn):
    """``fn`` with the dispatcher starting below the autograd keys: the op's own autograd
    kernel (custom_op's, in Python, run for every call even without gradients) skipped, so
    that the difference from the op's column is that kernel's host time (session 46)."""
    import torch

    def call():
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return fn()
    return call


def profile(fn, calls: int, top: int) -> str:
    """cProfile's table of the ``top`` functions by own time over ``calls`` calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=int, nargs="+", default=[3, 9, 24])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile-top", type=int, default=12, help="0: no cProfile tables")
    args = ap.parse_args()
    import torch

    results = {n: rows_for(n, args.tokens, args.width, args.calls, args.repeats) for n in args.sources}
    with torch.no_grad():
        two_phase = two_phase_rows(args.tokens, args.width, args.calls, args.repeats, args.profile_top)
    names = [name for name, _ in results[args.sources[0]]]
    print(f"host us per call ({args.tokens} tokens, d={args.width}, bf16; median of {args.repeats} x {args.calls})")
    print("| layer | " + " | ".join(f"N={n}" for n in args.sources) + " |")
    print("| --- |" + " ---: |" * len(args.sources))
    for i, name in enumerate(names):
        print(f"| {name} | " + " | ".join(f"{results[n][i][1]:.1f}" for n in args.sources) + " |")
    print("| two-phase op (the end-to-end model's sites) | op | op below autograd | kernel function | launcher "
          "| launcher, torch finish |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, times in two_phase.items():
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
