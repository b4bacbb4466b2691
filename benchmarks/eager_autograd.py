"""The routing ops through eager autograd, for each choice of the ops' autograd kernel and
of how the CUDA kernels are registered: what eager training (no ``torch.compile``) pays.

    python3 benchmarks/eager_autograd.py [--out DIR] [--calls 100] [--repeats 9] [--steps 30] [--rounds 2]
                                         [--profile-top 30]

Each variant runs in a process of its own, since both choices are read at import:
``DEPTHREWRITE_AUTOGRAD`` ("flat": :mod:`depthrewrite.ops.flat_autograd`'s kernel, the
default; "custom_op": ``register_autograd``'s generated one) and
``DEPTHREWRITE_KERNEL_REGISTRATION`` ("custom_op", the default; "dispatcher"). Per variant:

- ``route us`` / ``route_many us``: the host's time per ``torch.autograd.grad`` of one
  forward and backward on 16 tokens, where the kernels take a few microseconds and the
  host sets the pace (``host_overhead.per_call_us``): ``route`` with 9 sources at d = 2048,
  ``route_many`` with 6 sources and 8 queries at d = 1024 (Block AttnRes's phase 1);
- ``fwdbwd ms`` at 16384 x 2048 x 9, a DESIGN.md shape, bf16: the same call timed by
  ``do_bench`` (median; as gpu_suite.py's "ours" column), and ``kern ms``, the two kernels
  called directly, as a compiled graph calls them;
- ``step ms``: one eager training step (forward, backward, no optimizer) of the bundled GPT
  rewritten with Block AttnRes, DAR block and full AttnRes (d = 256, 8 layers, 4 x 256
  tokens, bf16 autocast: host-bound), median over ``--steps`` steps.

The parent first times ``torch.compile`` of the reference at the DESIGN.md shape (fwd+bwd),
so the table gives each variant's ``compile / fwdbwd`` ratio (the issue's 4x goal). A
process's host speed varies from one process to the next (docs/benchmarks.md), so the
variants run ``--rounds`` times, in reverse order every other round, one row per run. With
``--profile-top`` each process also writes the functions with the most own time under
``cProfile`` in the 16-token ``route`` calls (``profile_<autograd>_<registration>.txt``).
Needs CUDA; prints the table last and writes ``eager_autograd.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (autograd kernel, CUDA registration), the defaults first
VARIANTS = (("flat", "custom_op"), ("custom_op", "custom_op"), ("flat", "dispatcher"), ("custom_op", "dispatcher"))
SHAPE = (16384, 2048, 9)
SCHEMES = ("block_attnres", "dar", "attnres")


def _design_inputs():
    """gpu_suite.py's inputs at SHAPE (bf16 sources, fp32 query and key-norm weight) as
    leaves, and an output gradient."""
    import torch

    from gpu_suite import make

    tokens, d, n = SHAPE
    inp = make(n, tokens, d, torch.bfloat16, seed=tokens + d + n)
    vals = [t.requires_grad_() for t in inp["values"]]
    grad = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    return vals, inp["query"].requires_grad_(), inp["key_norm_weight"].requires_grad_(), grad


def compile_ms() -> float:
    """torch.compile of the reference at SHAPE, forward and backward (gpu_suite's "compile")."""
    import torch

    from depthrewrite.ops.route import route_reference
    from gpu_suite import bench

    vals, q, w, grad = _design_inputs()
    compiled = torch.compile(route_reference, dynamic=False)
    return bench(lambda: torch.autograd.grad(compiled(vals, query=q, key_norm_weight=w), [*vals, q, w], grad))


def _host_rows(calls: int, repeats: int, profile_top: int, profile_path: Path | None) -> dict:
    import torch

    from host_overhead import per_call_us, profile

    op = torch.ops.depthrewrite
    d, n = 2048, 9
    vals = [torch.randn(16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]
    q = (torch.randn(d, device="cuda") * 0.02).requires_grad_()
    w = (torch.rand(d, device="cuda") + 0.5).requires_grad_()
    g = torch.randn(16, d, device="cuda", dtype=torch.bfloat16)
    route = lambda: torch.autograd.grad(op.route(vals, None, q, w, None, None, 1, 1e-6)[0], [*vals, q, w], g)  # noqa: E731
    d, n, s = 1024, 6, 8
    mv = [torch.randn(16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]
    mq = (torch.randn(s, d, device="cuda") * 0.02).requires_grad_()
    mw = (torch.rand(s, d, device="cuda") + 0.5).requires_grad_()
    mg = [torch.randn(16, d, device="cuda", dtype=torch.bfloat16) for _ in range(s)]

    def many():
        out, _lse, _stats = op.route_many(mv, mq, mw, 1, 1e-6, None)
        return torch.autograd.grad(out, [*mv, mq, mw], mg)

    rows = {"route us": per_call_us(route, calls, repeats), "route_many us": per_call_us(many, calls, repeats)}
    if profile_top > 0 and profile_path is not None:
        profile_path.write_text(profile(route, calls, profile_top))
    return rows


def _design_rows() -> dict:
    import torch

    from depthrewrite.kernels import route_triton
    from gpu_suite import bench

    vals, q, w, grad = _design_inputs()
    fwdbwd = lambda: torch.autograd.grad(  # noqa: E731
        torch.ops.depthrewrite.route(vals, None, q, w, None, None, 1, 1e-6)[0], [*vals, q, w], grad)

    def kern():  # the launchers take no autograd: the leaves' requires_grad must not reach them
        with torch.no_grad():
            o, lse, _ = route_triton.route_forward(vals, None, q, w, None, None, 1, 1e-6)
            return route_triton.route_backward(grad, o, lse, vals, None, q, w, None, None, 1, 1e-6)

    return {"fwdbwd ms": bench(fwdbwd), "kern ms": bench(kern)}


def _step_ms(scheme: str, steps: int) -> float:
    import torch

    import depthrewrite
    from depthrewrite.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, d_model=256, n_layer=8, n_head=4, max_seq_len=256)).cuda()
    model = depthrewrite.rewrite(model, scheme=scheme)
    ids = torch.randint(0, 256, (4, 256), device="cuda")
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _logits, loss = model(ids, ids)
        loss.backward()
        torch.cuda.synchronize()
        if i >= 3:  # the first steps compile the kernels
            times.append((time.perf_counter() - t0) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def child(args) -> int:
    import depthrewrite  # noqa: F401  (registers the ops and kernels)

    row = {"autograd": os.environ.get("DEPTHREWRITE_AUTOGRAD"),
           "registration": os.environ.get("DEPTHREWRITE_KERNEL_REGISTRATION")}
    name = f"profile_{row['autograd']}_{row['registration']}.txt"
    row.update(_host_rows(args.calls, args.repeats, args.profile_top, args.out / name if args.out else None))
    row.update(_design_rows())
    for scheme in SCHEMES:
        row[f"{scheme} step ms"] = _step_ms(scheme, args.steps)
    print("ROW " + json.dumps(row), flush=True)
    return 0


def _run_variant(autograd: str, registration: str, args) -> dict:
    env = {**os.environ, "DEPTHREWRITE_AUTOGRAD": autograd, "DEPTHREWRITE_KERNEL_REGISTRATION": registration}
    cmd = [sys.executable, __file__, "--child", "--calls", str(args.calls), "--repeats", str(args.repeats),
           "--steps", str(args.steps), "--profile-top", str(args.profile_top)]
    if args.out is not None:
        cmd += ["--out", str(args.out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    return {"autograd": autograd, "registration": registration, "error": done.returncode}


def table(rows: list[dict], compile_times: list[float]) -> list[str]:
    ref = statistics.median(compile_times)
    cols = ["route us", "route_many us", "fwdbwd ms", "kern ms"] + [f"{s} step ms" for s in SCHEMES]
    lines = [f"torch.compile of the reference, fwd+bwd at {'x'.join(map(str, SHAPE))}: "
             + ", ".join(f"{t:.3f}" for t in compile_times) + " ms (before and after the variants)",
             "| round | autograd | registration | " + " | ".join(cols) + " | compile / fwdbwd |",
             "| ---: | --- | --- |" + " ---: |" * (len(cols) + 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['round']} | {r['autograd']} | {r['registration']} | failed (exit {r['error']}) |")
            continue
        vals = " | ".join(f"{r[c]:.1f}" if c.endswith("us") or "step" in c else f"{r[c]:.3f}" for c in cols)
        lines.append(f"| {r['round']} | {r['autograd']} | {r['registration']} | {vals} | {ref / r['fwdbwd ms']:.2f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile-top", type=int, default=0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    compile_times = [compile_ms()]
    rows = []
    for k in range(args.rounds):
        for autograd, registration in VARIANTS[:: -1 if k % 2 else 1]:
            rows.append({"round": k + 1, **_run_variant(autograd, registration, args)})
    compile_times.append(compile_ms())
    lines = table(rows, compile_times)
    if args.out is not None:
        (args.out / "eager_autograd.json").write_text(json.dumps({"rows": rows, "compile_ms": compile_times}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
