"""Check and time the fused routing kernels on the GPU, in one call.

    python3 benchmarks/gpu_suite.py [--out DIR] [--budget-s 520] [--no-e2e] [--no-compile-ref]
                                    [--quick] [--e2e-only] [--e2e-schemes baseline,block_attnres,attnres]

On the device machine, carry the FLA wheel (``.whl/``) and start with
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl;
export PYTHONPATH=/tmp/site:$PWD`` (docs/benchmarks.md has the exact commands).

1. correctness of the Triton kernels against the reference (fp32 arithmetic on the same
   bf16/fp16/fp32 inputs) at the DESIGN.md shapes and awkward ones: output and every
   gradient, max relative L2 error per call; the registered CUDA kernel is what
   ``torch.ops.depthrewrite.route`` runs;
2. timing (median, triton.testing.do_bench, fresh random data per shape) of the routing op
   forward and forward+backward, bf16: eager reference, torch.compile of the reference,
   ours (launch variants too), FLA's fused_attnres if importable, and the HBM floor;
3. if time is left: training-step throughput and peak memory of the bundled GPT
   (d=1024, 24 layers, seq 2048, bf16): baseline with Inductor vs the rewritten model with
   the depthrewrite backend.

Writes results.json and log lines under --out (default $OUT); prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import depthrewrite  # noqa: E402,F401
from depthrewrite.kernels import route_triton  # noqa: E402
from depthrewrite.ops.route import route_reference  # noqa: E402

HBM_BPS = 4.3e12  # measured device-to-device copy rate on this machine kind (KINDS.md)
DESIGN_SHAPES = [(16384, 2048, 9), (16384, 2048, 33), (16384, 4096, 9), (8192, 4096, 65)]
# DESIGN.md anchors (H200, bf16, ms): eager, torch.compile, FLA fused, floor
ANCHORS = {
    ("fwd", 16384, 2048, 9): (2.78, 1.96, 0.394, 0.156),
    ("fwd", 16384, 2048, 33): (9.38, 6.40, 0.643, 0.531),
    ("fwd", 16384, 4096, 9): (5.66, 3.98, 0.392, 0.312),
    ("fwd", 8192, 4096, 65): (21.55, 15.79, 1.290, 1.030),
    ("fwdbwd", 16384, 2048, 9): (9.80, 6.24, 1.569, 0.453),
    ("fwdbwd", 16384, 2048, 33): (31.39, 17.63, 4.268, 1.576),
    ("fwdbwd", 16384, 4096, 9): (18.15, 12.68, 2.292, 0.905),
    ("fwdbwd", 8192, 4096, 65): (66.42, 39.00, 8.210, 3.075),
}

T0 = time.time()
LOG: list[str] = []


def say(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- inputs


def make(n, tokens, d, dtype, heads=1, keys=False, bias=False, scale=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    return dict(
        values=[rnd(tokens, d).to(dtype) for _ in range(n)],
        keys=[rnd(tokens, d).to(dtype) for _ in range(n)] if keys else None,
        query=rnd(d) * (2.0 * heads**0.5 / d**0.5),
        key_norm_weight=torch.rand(d, generator=g, device=dev) + 0.5,
        logit_bias=rnd(n) if bias else None,
        source_scale=(torch.rand(n, tokens, generator=g, device=dev) + 0.5) if scale else None,
        heads=heads,
    )


def leaves_of(inp):
    out = [*inp["values"], *(inp["keys"] or []), inp["query"], inp["key_norm_weight"]]
    return out + ([inp["logit_bias"]] if inp["logit_bias"] is not None else [])


def rebuild(inp, leaves):
    n = len(inp["values"])
    values, rest = leaves[:n], leaves[n:]
    keys = None
    if inp["keys"] is not None:
        keys, rest = rest[:n], rest[n:]
    return dict(values=values, keys=keys, query=rest[0], key_norm_weight=rest[1],
                logit_bias=rest[2] if len(rest) > 2 else None, source_scale=inp["source_scale"], heads=inp["heads"])


def op_call(inp):
    return torch.ops.depthrewrite.route(inp["values"], inp["keys"], inp["query"], inp["key_norm_weight"],
                                        inp["logit_bias"], inp["source_scale"], inp["heads"], 1e-6)


def ref_call(inp):
    return route_reference(inp["values"], inp["keys"], query=inp["query"], key_norm_weight=inp["key_norm_weight"],
                           logit_bias=inp["logit_bias"], source_scale=inp["source_scale"], heads=inp["heads"])


# ---------------------------------------------------------------------- correctness


def check_case(name, n, tokens, d, dtype, **kw):
    inp = make(n, tokens, d, dtype, **kw)
    grad_out = torch.randn(tokens, d, device="cuda").to(dtype)
    # reference: fp32 arithmetic on the same (rounded) inputs
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves_of(inp)]
    ref_inp = rebuild(inp, ref_leaves)
    ref_out = ref_call(ref_inp)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, grad_out.float())
    ours_leaves = [t.detach().requires_grad_() for t in leaves_of(inp)]
    ours_inp = rebuild(inp, ours_leaves)
    out = op_call(ours_inp)  # the dispatcher: must reach the Triton kernel
    grads = torch.autograd.grad(out, ours_leaves, grad_out)
    direct = route_triton.route_forward(inp["values"], inp["keys"], inp["query"], inp["key_norm_weight"],
                                        inp["logit_bias"], inp["source_scale"], inp["heads"], 1e-6)
    dispatched = torch.equal(direct, out.detach())
    names = ([f"v{i}" for i in range(n)] + ([f"k{i}" for i in range(n)] if kw.get("keys") else [])
             + ["query", "key_norm_weight"] + (["logit_bias"] if kw.get("bias") else []))
    errs = {nm: rel(g, r) for nm, g, r in zip(names, grads, ref_grads)}
    finite = all(torch.isfinite(g).all().item() for g in grads) and torch.isfinite(out).all().item()
    worst = max(errs, key=errs.get)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    out_err = rel(out, ref_out)
    ok = finite and dispatched and out_err < tol and errs[worst] < max(tol, 1e-4 if dtype == torch.float32 else tol)
    # determinism: the backward twice, bit for bit
    again = torch.autograd.grad(op_call(ours_inp), ours_leaves, grad_out)
    deterministic = all(torch.equal(a, b) for a, b in zip(grads, again))
    ok = ok and deterministic
    res = dict(name=name, n=n, tokens=tokens, d=d, dtype=str(dtype), out_err=out_err, worst_grad=worst,
               worst_grad_err=errs[worst], q_err=errs["query"], w_err=errs["key_norm_weight"],
               dispatched=dispatched, deterministic=deterministic, finite=finite, ok=ok, **{k: v for k, v in kw.items()})
    say(f"check {name:34s} out {out_err:.1e} grad max {errs[worst]:.1e} ({worst}) q {errs['query']:.1e} "
        f"w {errs['key_norm_weight']:.1e} dispatched={dispatched} det={deterministic} -> {'OK' if ok else 'FAIL'}")
    del inp, ref_leaves, ours_leaves, grads, again
    torch.cuda.empty_cache()
    return res


QUICK_CHECKS = {"design 16384x2048x33", "design 8192x4096x65", "d7186 h2 keys bias scale",
                "n65 d1000 h4 bias scale", "n33 d2048 h16 keys fp16", "n1 d4096 keys bias scale"}


def correctness(quick: bool = False):
    bf16 = torch.bfloat16
    cases = [(f"design {t}x{d}x{n}", n, t, d, bf16, {}) for t, d, n in DESIGN_SHAPES]
    cases += [
        ("d7186 h2 keys bias scale", 9, 1001, 7186, bf16, dict(heads=2, keys=True, bias=True, scale=True)),
        ("d7186 fp32", 3, 257, 7186, torch.float32, dict(bias=True)),
        ("n65 d1000 h4 bias scale", 65, 777, 1000, bf16, dict(heads=4, bias=True, scale=True)),
        ("n33 d2048 h16 keys fp16", 33, 333, 2048, torch.float16, dict(heads=16, keys=True)),
        ("n1 d4096 keys bias scale", 1, 129, 4096, bf16, dict(keys=True, bias=True, scale=True)),
        ("n2 d1000 fp32 scale", 2, 4099, 1000, torch.float32, dict(scale=True)),
        ("n129 d64 bias", 129, 1023, 64, bf16, dict(bias=True)),
    ]
    if quick:
        cases = [c for c in cases if c[0] in QUICK_CHECKS]
    results = []
    for name, n, t, d, dt, kw in cases:
        try:
            results.append(check_case(name, n, t, d, dt, **kw))
        except Exception as exc:  # keep going: report every case
            say(f"check {name}: ERROR {exc!r}")
            LOG.append(traceback.format_exc())
            results.append(dict(name=name, ok=False, error=repr(exc)))
    return results


# --------------------------------------------------------------------------- timing


def floor_ms(tokens, d, n, mode):
    tensors = (n + 1) if mode == "fwd" else (3 * n + 2)
    return tensors * tokens * d * 2 / HBM_BPS * 1e3


def bench(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def fla_fn():
    try:
        from fla.ops.attnres import fused_attnres
    except Exception as exc:  # not installed or not importable on this machine
        say(f"FLA not importable: {exc!r}")
        return None
    return fused_attnres


def timing(compile_ref: bool, budget_s: float, quick: bool = False):
    torch._dynamo.config.recompile_limit = 64
    compiled_ref = torch.compile(route_reference, dynamic=False) if compile_ref else None
    fla = fla_fn()
    rows = []
    for tokens, d, n in DESIGN_SHAPES:
        inp = make(n, tokens, d, torch.bfloat16, seed=tokens + d + n)
        leaves = [t.detach().requires_grad_() for t in leaves_of(inp)]
        grad_out = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        lin = rebuild(inp, leaves)
        vals, q, w = lin["values"], lin["query"], lin["key_norm_weight"]

        impls = {
            "eager": lambda: route_reference(vals, query=q, key_norm_weight=w),
            "ours": lambda: torch.ops.depthrewrite.route(vals, None, q, w, None, None, 1, 1e-6),
        }
        if compiled_ref is not None and time.time() - T0 < budget_s * 0.6:
            impls["compile"] = lambda: compiled_ref(vals, query=q, key_norm_weight=w)
        if fla is not None:
            impls["fla"] = lambda: fla(q, vals, w)
        if quick:  # ours and FLA only; eager and torch.compile were timed by the full run
            impls.pop("eager")
        for variant, cfg in () if quick else (("ours_t1_nopf", dict(block_t=1, prefetch=False)), ("ours_t1_pf", dict(block_t=1)),
                             ("ours_t4_pf", dict(block_t=4)), ("ours_nopf", dict(prefetch=False))):
            impls[variant] = (lambda cfg=cfg: route_triton.route_forward(vals, None, q, w, None, None, 1, 1e-6, config=cfg))

        for mode in ("fwd", "fwdbwd"):
            fl = floor_ms(tokens, d, n, mode)
            row = dict(mode=mode, tokens=tokens, d=d, n=n, floor=fl)
            for name, fn in impls.items():
                if mode == "fwdbwd" and name.startswith("ours_"):
                    continue
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            ms = bench(fn)
                    else:
                        ms = bench(lambda fn=fn: torch.autograd.grad(fn(), [*vals, q, w], grad_out))
                    row[name] = ms
                except Exception as exc:
                    say(f"time {mode} {tokens}x{d}x{n} {name}: ERROR {exc!r}")
                    LOG.append(traceback.format_exc())
                    row[name] = None
                torch.cuda.empty_cache()
            if mode == "fwdbwd":
                variants = (("ours_bwd_only", {}), ("bwd_pf", dict(prefetch=True)),
                            ("bwd_pf_ps8", dict(prefetch=True, per_sm=8)), ("bwd_t2", dict(block_t=2)),
                            ("bwd_ps8", dict(per_sm=8)), ("bwd_ps2", dict(per_sm=2)))
                if quick:
                    variants = variants[:3]
                for variant, cfg in variants:
                    try:
                        with torch.no_grad():
                            row[variant] = bench(lambda cfg=cfg: route_triton.route_backward(
                                grad_out, vals, None, q, w, None, None, 1, 1e-6, config=cfg))
                    except Exception as exc:
                        say(f"time bwd variant {variant}: ERROR {exc!r}")
                        row[variant] = None
            say("time " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            rows.append(row)
        del inp, leaves, lin, vals, grad_out
        torch.cuda.empty_cache()
    return rows


def copy_bandwidth():
    x = torch.empty(2 * 1024**3 // 4, device="cuda", dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / (ms * 1e-3)


# ------------------------------------------------------------------------- end to end


def e2e(budget_s: float, schemes):
    from depthrewrite.models.gpt import gpt_from_preset

    rows = []
    batch, seq = 8, 2048
    for scheme in schemes:
        if time.time() - T0 > budget_s - 120:  # a 24-layer compile plus 13 steps takes a minute or two
            say(f"e2e {scheme}: skipped (time budget)")
            rows.append(dict(scheme=scheme, skipped=True))
            continue
        try:
            torch.manual_seed(0)
            model = gpt_from_preset("medium", max_seq_len=seq)
            backend = "inductor"
            if scheme != "baseline":
                from depthrewrite.backend import depthrewrite_backend

                model = depthrewrite.rewrite(model, scheme)
                backend = depthrewrite_backend  # the callable: no pip install (entry point) there
            model = model.cuda().to(torch.bfloat16).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            compiled = torch.compile(model, backend=backend)
            x = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

            def step():
                opt.zero_grad(set_to_none=True)
                _, loss = compiled(x, x)
                loss.backward()
                opt.step()
                return loss

            t = time.time()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            compile_s = time.time() - t
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            steps = 10
            start.record()
            for _ in range(steps):
                loss = step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / steps
            report = None
            if scheme != "baseline":
                from depthrewrite.backend import last_report

                rep = last_report()
                report = dict(ops=rep.ops, implementation=rep.implementation, aot=rep.aot_graphs) if rep else None
            row = dict(scheme=scheme, step_ms=ms, tokens_per_s=batch * seq / (ms * 1e-3),
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30, compile_s=compile_s,
                       loss=float(loss), report=report)
            say("e2e " + json.dumps(row))
            rows.append(row)
            del model, opt, compiled
        except Exception as exc:
            say(f"e2e {scheme}: ERROR {exc!r}")
            LOG.append(traceback.format_exc())
            rows.append(dict(scheme=scheme, error=repr(exc)))
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------- table


def table(checks, rows, e2e_rows, bw):
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s (floor uses {HBM_BPS / 1e12:.1f})", ""]
    bad = [c["name"] for c in checks if not c.get("ok")]
    worst = max((c.get("out_err", 0), c.get("worst_grad_err", 0)) for c in checks if "out_err" in c) if checks else None
    lines.append(f"correctness: {len(checks) - len(bad)}/{len(checks)} OK; failing: {bad or 'none'}; "
                 f"worst (out, grad) rel err {worst}")
    lines.append("")
    lines.append("mode   tokens  d    N  | eager  compile  FLA    ours   floor | ours/floor ours/FLA compile/ours")
    for r in rows:
        def f(k):
            v = r.get(k)
            return f"{v:6.3f}" if isinstance(v, float) else "   -  "
        ours, fla, comp = r.get("ours"), r.get("fla"), r.get("compile")
        a = ANCHORS.get((r["mode"], r["tokens"], r["d"], r["n"]))
        ratio = lambda x, y: f"{x / y:5.2f}" if isinstance(x, float) and isinstance(y, float) else "  -  "
        comp_ref = comp if isinstance(comp, float) else (a[1] if a else None)
        lines.append(f"{r['mode']:6s} {r['tokens']:6d} {r['d']:4d} {r['n']:3d} | {f('eager')} {f('compile')} {f('fla')} "
                     f"{f('ours')} {r['floor']:6.3f} | {ratio(ours, r['floor'])}      {ratio(ours, fla)}    "
                     f"{ratio(comp_ref, ours)}")
    for r in e2e_rows:
        if "step_ms" in r:
            lines.append(f"e2e {r['scheme']:14s} {r['step_ms']:8.1f} ms/step {r['tokens_per_s']:10.0f} tok/s "
                         f"peak {r['peak_gib']:.1f} GiB (compile+3 steps {r['compile_s']:.0f}s)")
        else:
            lines.append(f"e2e {r['scheme']:14s} {r.get('error', 'skipped')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--budget-s", type=float, default=520.0, help="skip optional parts past this many seconds")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-compile-ref", action="store_true")
    ap.add_argument("--e2e-schemes", default="baseline,block_attnres,attnres")
    ap.add_argument("--e2e-only", action="store_true", help="skip the op checks and timings")
    ap.add_argument("--quick", action="store_true",
                    help="a few checks, ours and FLA only, no e2e (a short re-run after a kernel change)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    say(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    results: dict = dict(bandwidth=None, checks=[], timing=[], e2e=[])

    def dump(summary: str = "") -> None:
        # after every phase: a run stopped at its limit still leaves what it measured
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        with open(os.path.join(args.out, "log.txt"), "w") as fh:
            fh.write("\n".join(LOG) + "\n\n" + summary + "\n")

    results["bandwidth"] = bw = HBM_BPS if (args.quick or args.e2e_only) else copy_bandwidth()
    checks, rows = [], []
    if not args.e2e_only:
        results["checks"] = checks = correctness(args.quick)
        dump()
        results["timing"] = rows = timing(not (args.no_compile_ref or args.quick), args.budget_s, args.quick)
        dump()
    skip_e2e = args.no_e2e or args.quick
    results["e2e"] = e2e_rows = [] if skip_e2e else e2e(args.budget_s, args.e2e_schemes.split(","))
    summary = table(checks, rows, e2e_rows, bw)
    dump(summary)
    print("\n" + summary)
    return 0 if all(c.get("ok") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
