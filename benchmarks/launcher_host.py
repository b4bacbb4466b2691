"""Host time of the routing ops at the end-to-end model's call sites, as a compiled graph
calls them (``torch.ops.depthrewrite.<op>.default``, no autograd), one JSON line per case.
For A/B runs of two versions of the package: each version in a process of its own (the
package found first on ``sys.path``: put a copy's root first in PYTHONPATH), several
processes in turn (session 66).

    python3 benchmarks/launcher_host.py [--tokens 16] [--calls 100] [--repeats 9] [--label NAME]
    python3 benchmarks/launcher_host.py --summarize FILE.jsonl   # a table: each case's median per label
    python3 benchmarks/launcher_host.py --profile 25   # and each case's 25 costliest functions (cProfile) on stderr
    python3 benchmarks/launcher_host.py --parts   # with CUDA: also the launcher called directly, and without its launches

Cases (d = 1024, bf16, few tokens so that the host sets the pace):

- WAV's site (``route`` and ``route_backward_into_``): 16 sources, a logit bias and a
  per-token source scale, the backward adding into 15 running sums in place;
- full MHAR's site: 25 sources, 16 heads, no bias, running sums in place;
- Block AttnRes's block phase (``route_many`` and ``route_many_backward``): 6 completed
  blocks, 6 sites, with the statistics table;
- full AttnRes's group call (``route_many_backward_into_``): 13 sources, 4 sites, running sums;
- block MHAR's fused merge (``route_merge`` and ``route_merge_backward``; the scheme option
  ``fused_merge=True``): one result, 16 heads, no keys, no norm (session 71).

With CUDA: us per call, median over ``repeats`` of ``calls`` calls and a synchronisation.
``--parts`` adds, per case, the same calls of our launcher directly (``launcher_us``: no
dispatcher, no custom-op wrapper) and of the launcher with its Triton launches replaced by
no-ops (``no_launch_us``): the op's time less ``launcher_us`` is the dispatch's share,
``launcher_us`` less ``no_launch_us`` Triton's launches'.
Without CUDA (this repository's CI machines): the same calls through the launchers on the
CPU in Triton's interpreter with every kernel launch replaced by a no-op, so the figure is
the launchers' own host work (Python and the ATen ops they issue, on CPU tensors), not a
GPU host's; the ATen ops one call issues are counted either way (``aten_ops``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_parts import aten_op_count  # noqa: E402

if not Path("/dev/nvidia0").exists() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported: the launchers' CPU path


def _stub_kernel_launches() -> dict:
    """Every ``@triton.jit`` kernel of the launchers replaced by a no-op; returns what was
    replaced ((module, name) -> kernel) for :func:`_restore`."""
    from depthrewrite.kernels import param_grads, route_many_triton, route_merge_triton, route_triton

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    replaced = {}
    for module in (route_triton, route_many_triton, route_merge_triton, param_grads):
        for name in dir(module):
            if name.endswith("_kernel") and hasattr(getattr(module, name), "__getitem__"):
                replaced[module, name] = getattr(module, name)
                setattr(module, name, NoLaunch())
    return replaced


def _restore(replaced: dict) -> None:
    """The kernels :func:`_stub_kernel_launches` replaced, put back."""
    for (module, name), kernel in replaced.items():
        setattr(module, name, kernel)


def cases(tokens: int, device: str, call) -> dict:
    """name -> (op name, its arguments), made once; ``call(op, args)`` runs an op (the first
    results feed the backward cases)."""
    import torch

    d, dt = 1024, torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(66)

    def rows(n: int) -> list:
        return [torch.randn(tokens, d, generator=gen).to(device, dt) for _ in range(n)]

    def vector(scale: float = 0.1) -> torch.Tensor:
        return (torch.randn(d, generator=gen) * scale).to(device)

    found = {}
    for name, n, heads, biased in (("WAV site", 16, 1, True), ("full MHAR site", 25, 16, False)):
        values, grad = rows(n), rows(1)[0]
        query, weight = vector(), vector() + 1.0
        bias = torch.full((n,), -2.0, device=device) if biased else None
        scale = torch.rand(n, tokens, generator=gen).to(device) if biased else None
        forward = (values, None, query, weight, bias, scale, heads, 1e-6)
        out, lse, _ = call("route", forward)
        found[f"{name}: route, N={n}"] = ("route", forward)
        found[f"{name}: route_backward_into_, N={n}"] = (
            "route_backward_into_", (grad, out, lse, *forward, None, None, 1e-6, rows(n), list(range(n - 1)), [], []))
    for name, n, s, into in (("Block AttnRes phase 1", 6, 6, False), ("full AttnRes group", 13, 4, True)):
        values = rows(n)
        queries = (torch.randn(s, d, generator=gen) * 0.1).to(device)
        weights = (torch.rand(s, d, generator=gen) + 0.5).to(device)
        forward = (values, queries, weights, 1, 1e-6, None)
        out, lse, stats = call("route_many", forward)
        backward = ([torch.randn_like(o) for o in out], [torch.randn_like(t) for t in lse], list(out), list(lse),
                    stats, values, queries, weights, 1, 1e-6, None)
        found[f"{name}: route_many, N={n}, S={s}"] = ("route_many", forward)
        if into:
            found[f"{name}: route_many_backward_into_, N={n}, S={s}"] = (
                "route_many_backward_into_", (*backward, rows(n), list(range(n - 1)), [], []))
        else:
            found[f"{name}: route_many_backward, N={n}, S={s}"] = ("route_many_backward", backward)
    out, lse, value = rows(1)[0], torch.randn(tokens, 16, generator=gen).to(device), rows(1)[0]
    merge = ([out], [lse], [value], None, vector()[None], (vector() + 1.0)[None], torch.ones(1, device=device), 16,
             1e-6)
    found["block MHAR merge: route_merge, J=1, H=16"] = ("route_merge", merge)
    found["block MHAR merge: route_merge_backward, J=1, H=16"] = ("route_merge_backward", (rows(1)[0], *merge))
    return found


def per_call_us(fn, calls: int, repeats: int, sync) -> float:
    """The median over ``repeats`` of the host's wall time per call of ``fn`` (us) over
    ``calls`` calls back to back and a synchronisation."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def profile_calls(fn, calls: int, top: int) -> str:
    """cProfile's table of ``calls`` calls of ``fn``: the ``top`` functions by their own time
    (where a launcher call's host time goes: our Python, ATen, Triton's launch path)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def summarize(path: str) -> str:
    """A markdown table of the JSON lines in ``path``: per case, each label's median us over
    its processes (their figures beside it) and its ATen ops a call."""
    by_case: dict[str, dict[str, list[dict]]] = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            by_case.setdefault(row["case"], {}).setdefault(row["label"], []).append(row)
    labels = sorted({label for rows in by_case.values() for label in rows})
    lines = ["| case | " + " | ".join(f"{label} us (processes) | {label} ATen ops" for label in labels) + " |",
             "| --- |" + " ---: | ---: |" * len(labels)]
    for case, rows in by_case.items():
        cells = []
        for label in labels:
            runs = rows.get(label, [])
            us = [r["us"] for r in runs]
            cells += [f"{statistics.median(us):.1f} ({', '.join(f'{u:.0f}' for u in us)})" if us else "",
                      str(runs[0]["aten_ops"]) if runs else ""]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--label", default="", help="a name for this process's version of the package")
    ap.add_argument("--summarize", metavar="FILE", help="print the table of a file of this script's lines, and stop")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="also print each case's TOP costliest functions over its calls (cProfile) on stderr")
    ap.add_argument("--parts", action="store_true",
                    help="with CUDA, also time the launcher called directly and without its kernel launches")
    opts = ap.parse_args()
    if opts.summarize:
        print(summarize(opts.summarize))
        return 0
    import torch

    import depthrewrite
    import depthrewrite.kernels  # noqa: F401  (registers the CUDA kernels)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # our CUDA kernel functions (the launchers below the op); on the CPU they are what is
    # timed, the op's CPU key being the reference
    from depthrewrite.kernels import CUDA_KERNELS

    if not cuda:
        _stub_kernel_launches()

    def call(op: str, args: tuple):
        return getattr(torch.ops.depthrewrite, op).default(*args) if cuda else CUDA_KERNELS[op](*args)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        for name, (op, args) in cases(opts.tokens, device, call).items():
            row = {"label": opts.label, "package": str(Path(depthrewrite.__file__).parent), "case": name,
                   "us": round(per_call_us(lambda: call(op, args), opts.calls, opts.repeats, sync), 1),
                   "aten_ops": aten_op_count(lambda: CUDA_KERNELS[op](*args)),
                   "device": torch.cuda.get_device_name() if cuda else "cpu (kernels not launched)"}
            if opts.parts and cuda:
                direct = lambda: CUDA_KERNELS[op](*args)  # noqa: E731
                row["launcher_us"] = round(per_call_us(direct, opts.calls, opts.repeats, sync), 1)
                replaced = _stub_kernel_launches()
                try:
                    row["no_launch_us"] = round(per_call_us(direct, opts.calls, opts.repeats, sync), 1)
                finally:
                    _restore(replaced)
            print(json.dumps(row), flush=True)
            if opts.profile:
                print(f"== {name}\n" + profile_calls(lambda: call(op, args), opts.calls, opts.profile),
                      file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
