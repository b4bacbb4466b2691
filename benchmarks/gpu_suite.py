"""Check and time the fused routing kernels on the GPU, in one call.

    python3 benchmarks/gpu_suite.py [--out DIR] [--budget-s 520] [--no-e2e] [--no-compile-ref]
                                    [--quick] [--e2e-only] [--scheme-check] [--block-phase-only]
                                    [--no-block-phase] [--design-launch-only] [--launch-ab [ROUNDS]]
                                    [--phase-shapes {block,block_attnres,full_attnres,grouped_mhar}] [--phase-registers]
                                    [--e2e-schemes baseline,block_attnres,mhar_block,wav,dar_block,attnres,mhar]

On the device machine, carry the FLA wheel (``.whl/``) and start with
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl;
export PYTHONPATH=/tmp/site:$PWD`` (docs/benchmarks.md has the exact commands).

1. correctness of the Triton kernels against the reference (fp32 arithmetic on the same
   bf16/fp16/fp32 inputs) at the DESIGN.md shapes and awkward ones: output and every
   gradient, max relative L2 error per call; the registered CUDA kernel is what
   ``torch.ops.depthrewrite.route`` runs. The one-pass backward takes ``sum_j a_j da_j``
   from the output saved in the activation dtype (documented rounding, route_triton's
   docstring): pass/fail compares the gradients with the fp32 reference given that same
   saved output; the error against the exact reference is logged too (``exact``);
2. timing (median, triton.testing.do_bench, fresh random data per shape): phase 1 of the
   two-phase Block AttnRes (``route_many`` for the S sites of a block against S routes,
   kernels called directly, launch variants); then the routing op
   forward and forward+backward, bf16: eager reference, torch.compile of the reference,
   ours (launch variants too), FLA's fused_attnres if importable, and the HBM floor; the
   fused output norm (``norm_fused``) against the op followed by an RMSNorm (``norm_unfused``);
3. ``--scheme-check``: every scheme compiled with the backend against eager on the GPU
   (benchmarks/gpu_scheme_check.py);
4. unless ``--no-e2e``: training-step throughput and peak memory of the bundled GPT
   (d=1024, 24 layers, seq 2048, bf16): baseline with Inductor vs each scheme with the
   depthrewrite backend (benchmarks/e2e_throughput.py: compiled in parallel, timed one at
   a time).

Writes results.json and log lines under --out (default $OUT); prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # e2e_throughput, gpu_scheme_check

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import depthrewrite  # noqa: E402,F401
from depthrewrite.kernels import route_triton  # noqa: E402
from depthrewrite.ops.route import route_logits_reference, route_reference  # noqa: E402
from depthrewrite.ops.route_many import stats_table  # noqa: E402

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
    out, _lse, _normed = torch.ops.depthrewrite.route(inp["values"], inp["keys"], inp["query"], inp["key_norm_weight"],
                                                      inp["logit_bias"], inp["source_scale"], inp["heads"], 1e-6)
    return out


def ref_kwargs(inp):
    return dict(query=inp["query"], key_norm_weight=inp["key_norm_weight"], logit_bias=inp["logit_bias"],
                source_scale=inp["source_scale"], heads=inp["heads"])


def ref_call(inp):
    return route_reference(inp["values"], inp["keys"], **ref_kwargs(inp))


def reference_grads(inp, grad_out, saved_out):
    """fp32 reference output and gradients, exact and given ``saved_out``: the one-pass
    backward takes sum_j a_j da_j as <g, saved_out>, i.e. shifts each logit gradient by
    -a_i <g, saved_out - out>; the constant-weighted term below has exactly that gradient."""
    leaves = [t.detach().float().requires_grad_() for t in leaves_of(inp)]
    ref_inp = rebuild(inp, leaves)
    out = ref_call(ref_inp)
    g = grad_out.float()
    exact = torch.autograd.grad(out, leaves, g, retain_graph=len(inp["values"]) > 1)
    if len(inp["values"]) == 1:
        return out.detach(), exact, exact
    z = route_logits_reference(ref_inp["values"], ref_inp["keys"], **ref_kwargs(ref_inp))
    delta = ((saved_out.float() - out.detach()) * g).unflatten(-1, (inp["heads"], -1)).sum(-1)
    shift = torch.autograd.grad(-(torch.softmax(z.detach(), 0) * delta * z).sum(), leaves, allow_unused=True)
    given = [e if s is None else e + s for e, s in zip(exact, shift)]
    return out.detach(), exact, given


# ---------------------------------------------------------------------- correctness


def check_case(name, n, tokens, d, dtype, **kw):
    inp = make(n, tokens, d, dtype, **kw)
    grad_out = torch.randn(tokens, d, device="cuda").to(dtype)
    ours_leaves = [t.detach().requires_grad_() for t in leaves_of(inp)]
    ours_inp = rebuild(inp, ours_leaves)
    out = op_call(ours_inp)  # the dispatcher: must reach the Triton kernel
    grads = torch.autograd.grad(out, ours_leaves, grad_out)
    # reference: fp32 arithmetic on the same (rounded) inputs, exact and given our saved output
    ref_out, exact_grads, ref_grads = reference_grads(inp, grad_out, out.detach())
    direct, _lse, _normed = route_triton.route_forward(inp["values"], inp["keys"], inp["query"], inp["key_norm_weight"],
                                                       inp["logit_bias"], inp["source_scale"], inp["heads"], 1e-6)
    dispatched = torch.equal(direct, out.detach())
    names = ([f"v{i}" for i in range(n)] + ([f"k{i}" for i in range(n)] if kw.get("keys") else [])
             + ["query", "key_norm_weight"] + (["logit_bias"] if kw.get("bias") else []))
    errs = {nm: rel(g, r) for nm, g, r in zip(names, grads, ref_grads)}
    exact_errs = {nm: rel(g, r) for nm, g, r in zip(names, grads, exact_grads)}
    finite = all(torch.isfinite(g).all().item() for g in grads) and torch.isfinite(out).all().item()
    worst = max(errs, key=errs.get)
    exact_worst = max(exact_errs, key=exact_errs.get)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    out_err = rel(out, ref_out)
    ok = finite and dispatched and out_err < tol and errs[worst] < tol
    if dtype == torch.float32:  # the saved output's rounding is negligible in fp32: exact too
        ok = ok and exact_errs[exact_worst] < tol
    # determinism: the backward twice, bit for bit
    again = torch.autograd.grad(op_call(ours_inp), ours_leaves, grad_out)
    deterministic = all(torch.equal(a, b) for a, b in zip(grads, again))
    ok = ok and deterministic
    res = dict(name=name, n=n, tokens=tokens, d=d, dtype=str(dtype), out_err=out_err, worst_grad=worst,
               worst_grad_err=errs[worst], q_err=errs["query"], w_err=errs["key_norm_weight"],
               exact_worst_grad=exact_worst, exact_worst_grad_err=exact_errs[exact_worst],
               exact_q_err=exact_errs["query"], exact_w_err=exact_errs["key_norm_weight"],
               dispatched=dispatched, deterministic=deterministic, finite=finite, ok=ok, **{k: v for k, v in kw.items()})
    say(f"check {name:34s} out {out_err:.1e} grad max {errs[worst]:.1e} ({worst}) q {errs['query']:.1e} "
        f"w {errs['key_norm_weight']:.1e} exact: grad max {exact_errs[exact_worst]:.1e} ({exact_worst}) "
        f"q {exact_errs['query']:.1e} dispatched={dispatched} det={deterministic} -> {'OK' if ok else 'FAIL'}")
    del inp, ours_leaves, grads, again, exact_grads, ref_grads
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
    # one call first: a kernel's first call compiles it, and do_bench sizes its warm-up from
    # the first calls it times (a variant timed first read up to 30 % slow, session 12 run 2)
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_graph(fn, calls: int = 10, replays: int = 20) -> float:
    """Median ms of one call of ``fn``, ``calls`` calls recorded in a CUDA graph and replayed
    ``replays`` times between CUDA events: the GPU's time alone. :func:`bench` records its
    events around each call, so where the host takes longer to issue a call than the GPU to
    run it (the routing calls of a step at d = 1024: 95-575 us of host time against 30-640 us
    of GPU time, docs/benchmarks.md session 21) it counts the host's time too. The calls of
    a graph run back to back on the same inputs with no cache flush between them: inputs
    larger than the L2 cache (50 MB) are read from HBM all the same."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs its warm-up off the default stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def fla_fn():
    try:
        from fla.ops.attnres import fused_attnres
    except Exception as exc:  # not installed or not importable on this machine
        say(f"FLA not importable: {exc!r}")
        return None
    return fused_attnres


def timing(compile_ref: bool, budget_s: float, quick: bool = False, widths: tuple[int, ...] | None = None):
    torch._dynamo.config.recompile_limit = 64
    compiled_ref = torch.compile(route_reference, dynamic=False) if compile_ref else None
    fla = fla_fn()
    rows = []
    for tokens, d, n in DESIGN_SHAPES:
        if widths and d not in widths:
            continue
        inp = make(n, tokens, d, torch.bfloat16, seed=tokens + d + n)
        leaves = [t.detach().requires_grad_() for t in leaves_of(inp)]
        grad_out = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        lin = rebuild(inp, leaves)
        vals, q, w = lin["values"], lin["query"], lin["key_norm_weight"]

        impls = {
            "eager": lambda: route_reference(vals, query=q, key_norm_weight=w),
            "ours": lambda: torch.ops.depthrewrite.route(vals, None, q, w, None, None, 1, 1e-6)[0],
        }
        if compiled_ref is not None and time.time() - T0 < budget_s * 0.6:
            impls["compile"] = lambda: compiled_ref(vals, query=q, key_norm_weight=w)
        if fla is not None:
            impls["fla"] = lambda: fla(q, vals, w)
        if quick:  # ours and FLA only; eager and torch.compile were timed by the full run
            impls.pop("eager")
        if not quick:  # the fused output norm against route followed by a separate RMSNorm (fp32 math)
            impls["norm_fused"] = lambda: torch.ops.depthrewrite.route(vals, None, q, w, None, None, 1, 1e-6, w, 1e-6)[2]
            impls["norm_unfused"] = lambda: torch.nn.functional.rms_norm(
                torch.ops.depthrewrite.route(vals, None, q, w, None, None, 1, 1e-6)[0].float(), (d,), weight=w,
                eps=1e-6).to(torch.bfloat16)
        for variant, cfg in () if quick else (("ours_t1_nopf", dict(block_t=1, prefetch=False)), ("ours_t1_pf", dict(block_t=1)),
                             ("ours_t4_pf", dict(block_t=4)), ("ours_nopf", dict(prefetch=False))):
            impls[variant] = (lambda cfg=cfg: route_triton.route_forward(vals, None, q, w, None, None, 1, 1e-6,
                                                                         config=cfg)[0])

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
                # the backward alone, from the forward's saved output and lse (prefetch is the default)
                # bwd_t1: one token per program (at d = 4096 the default until session 11, which
                # made it 2 tokens with 4 warps)
                # bwd_uncapped: the compiler's registers, 4 programs per SM (at d = 2048 the
                # default until session 11, which capped them at 96 with 5 programs per SM; at
                # d = 4096 until session 12, which made it 8 programs per SM)
                # bwd_ps4: 4 programs per SM with the default's register cap, if any
                variants = (("ours_bwd_only", {}), ("bwd_t1", dict(block_t=1)),
                            ("bwd_uncapped", dict(maxnreg=None, per_sm=4)),
                            ("bwd_nopf", dict(prefetch=False)), ("bwd_ps8", dict(per_sm=8)),
                            ("bwd_ps4", dict(per_sm=4)),
                            ("bwd_nopf_ps8", dict(prefetch=False, per_sm=8)), ("bwd_t2", dict(block_t=2)),
                            ("bwd_ps2", dict(per_sm=2)))
                if quick:
                    variants = variants[:4]
                with torch.no_grad():
                    fwd_out, fwd_lse, _ = route_triton.route_forward(vals, None, q, w, None, None, 1, 1e-6)

                def kernels_fwd_bwd():  # what a compiled graph runs: the two kernels, no autograd engine
                    o, l, _ = route_triton.route_forward(vals, None, q, w, None, None, 1, 1e-6)
                    return route_triton.route_backward(grad_out, o, l, vals, None, q, w, None, None, 1, 1e-6)

                with torch.no_grad():
                    row["ours_kernels"] = bench(kernels_fwd_bwd)
                for variant, cfg in variants:
                    try:
                        with torch.no_grad():
                            row[variant] = bench(lambda cfg=cfg: route_triton.route_backward(
                                grad_out, fwd_out, fwd_lse, vals, None, q, w, None, None, 1, 1e-6, config=cfg))
                    except Exception as exc:
                        say(f"time bwd variant {variant}: ERROR {exc!r}")
                        row[variant] = None
            say("time " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            rows.append(row)
        del inp, leaves, lin, vals, grad_out, fwd_out, fwd_lse
        torch.cuda.empty_cache()
    return rows


#: the phase-1 shapes of the e2e Block AttnRes, MHAR and DAR, and wider rows (d = 2048, 4096)
#: (tokens, d, completed blocks N, sites S, heads, separate keys: DAR's reciprocal keys)
BLOCK_PHASE_SHAPES = [(16384, 1024, 4, 6, 1, False), (16384, 1024, 8, 6, 1, False), (16384, 1024, 4, 6, 16, False),
                      (16384, 1024, 8, 6, 16, False), (16384, 2048, 4, 6, 1, False), (16384, 1024, 4, 6, 1, True),
                      (16384, 1024, 8, 6, 1, True),
                      (16384, 4096, 4, 6, 1, False)]  # a 7B-wide model's blocks (not timed before)
#: full AttnRes's route_many calls at 350M (groups of 4 sites, 24 layers; session 31's profile:
#: its backward kernel 22.9 ms of the step's 30.3 ms of routing): a group's 4 queries over
#: every entry made before the group (N = 1 + 4g up to 45), the readout's one query over all
#: 49 (48 sites make whole groups, so it is a group of its own), and one query over the 2-3
#: entries its own group has made (``attnres.add_group_entries``); 37 calls a step, counted
#: in session 32 (session 31's list had a 5-query last group, which the model does not make)
FULL_ATTNRES_PHASE_SHAPES = [(16384, 1024, 13, 4, 1, False), (16384, 1024, 29, 4, 1, False),
                             (16384, 1024, 45, 4, 1, False), (16384, 1024, 49, 1, 1, False),
                             (16384, 1024, 2, 1, 1, False), (16384, 1024, 3, 1, 1, False),
                             (16384, 1024, 13, 2, 1, False)]  # 2 queries: PER_TOKEN_LAUNCH's entry
#: grouped full MHAR's route_many calls at 350M (groups of 4 sites, 16 heads: a group's 4
#: queries over every entry made before it, N = 1 + 4g up to 45), then block MHAR's (6
#: queries over 4 or 8 blocks): the tiled backward and its parameter reduction against the
#: per-token kernel, which forms the parameter sums in its registers (session 41)
GROUPED_MHAR_PHASE_SHAPES = [(16384, 1024, 13, 4, 16, False), (16384, 1024, 29, 4, 16, False),
                             (16384, 1024, 45, 4, 16, False), (16384, 1024, 4, 6, 16, False),
                             (16384, 1024, 8, 6, 16, False)]
#: Block AttnRes's phase-1 calls at 350M (8 blocks of 6 sites: 6 queries over the blocks
#: completed so far), a few of them (session 66)
BLOCK_ATTNRES_PHASE_SHAPES = [(16384, 1024, 2, 6, 1, False), (16384, 1024, 4, 6, 1, False),
                              (16384, 1024, 7, 6, 1, False)]
PHASE_SHAPES = {"block": BLOCK_PHASE_SHAPES, "block_attnres": BLOCK_ATTNRES_PHASE_SHAPES,
                "full_attnres": FULL_ATTNRES_PHASE_SHAPES,
                "grouped_mhar": GROUPED_MHAR_PHASE_SHAPES}
#: launch variants of route_many timed at each shape (the defaults are chosen from them):
#: forward queries per program and warps; backward tokens per program (tiled) and warps,
#: and the one-pass per-token backward
#: the launch config of the ``_nostats`` variants: the defaults, without the forward's
#: statistics table (the forward keeps none, the backward forms the logits from the rows:
#: before session 34)
NO_STATS = {}
BLOCK_PHASE_FWD_VARIANTS = {"": None, "_nostats": NO_STATS,
                            # the online softmax rescaled at every new maximum (before session 34;
                            # since, only past a margin: route_triton.LAZY_RESCALE)
                            "_eager": {"lazy_rescale": False},
                            "_w1": {"num_warps": 1}, "_w2": {"num_warps": 2}, "_w4": {"num_warps": 4},
                            "_q1w1": {"block_q": 1, "num_warps": 1}, "_q1w2": {"block_q": 1, "num_warps": 2},
                            "_q4": {"block_q": 4}, "_q4w8": {"block_q": 4, "num_warps": 8},
                            # with the lazy rescale (session 34): 4 queries a program at 127
                            # registers with 4 warps, 222 with 2 (sm_90, no spill), 8 at 241 with 4
                            "_q4w2": {"block_q": 4, "num_warps": 2}, "_q4w4": {"block_q": 4, "num_warps": 4},
                            "_q8w4": {"block_q": 8, "num_warps": 4},
                            "_q8w8": {"block_q": 8, "num_warps": 8},
                            # one chunk's tokens after another (each chunk reads every source
                            # from memory: the order of one launch per chunk, before session 16)
                            "_cm": {"order": "chunk_major"},
                            # session 15's launches: one head 2 warps (1 with keys), several
                            # heads 2 queries and 4 warps, one chunk's tokens after another
                            "_cm_w2": {"order": "chunk_major", "num_warps": 2},
                            "_cm_w1": {"order": "chunk_major", "num_warps": 1},
                            "_cm_q2w4": {"order": "chunk_major", "block_q": 2, "num_warps": 4},
                            # runs of consecutive tokens per program, the next token's first
                            # source loaded during the current one's last (session 17)
                            **{f"_r{k}": {"tokens_per_program": k} for k in (2, 4, 8, 16, 32)},
                            "_r8_w2": {"tokens_per_program": 8, "num_warps": 2},
                            "_r8_cm": {"tokens_per_program": 8, "order": "chunk_major"},
                            # the sources copied into shared memory stages - 1 ahead by Triton's
                            # software pipeline (session 17)
                            **{f"_s{k}": {"stages": k} for k in (2, 3, 4, 6)},
                            "_s3_w2": {"stages": 3, "num_warps": 2}, "_s3_r8": {"stages": 3, "tokens_per_program": 8},
                            # a register cap (session 27): more programs resident per SM, at the
                            # price of spills (the forward held 242 registers at N = 4, session 18)
                            **{f"_cap{k}": {"maxnreg": k} for k in (64, 96, 128, 168, 200, 232)}}
#: the backward's config marker of a call given a running sum for every source
#: (depthrewrite.grad_accumulation with route_many_backward in ACCUMULATED_OPS; session 36)
RUNNING_SUMS = {"backward": None}
BLOCK_PHASE_BWD_VARIANTS = {"": None, "_nostats": NO_STATS, "_running": RUNNING_SUMS,
                            "_tiled": {"backward": "tiled"},
                            "_pertoken": {"backward": "per_token"},
                            # the per-token default requests 2-4 sources ahead up to d = 2048
                            # (session 11; route_many_triton.PER_TOKEN_PREFETCH); one ahead, as before
                            "_pertoken_pf1": {"backward": "per_token", "prefetch": True},
                            # three and four sources ahead at every query count (session 35: 2 KB
                            # rows, 2 in flight per program at d = 1024; 168 registers at 4 queries
                            # either way; since, 8 queries take 4 by default)
                            "_pf3": {"prefetch": 3}, "_pf4": {"prefetch": 4},
                            # the per-token kernel spills at one head with S = 6 (8 padded query rows,
                            # 4 warps: 255 registers; kernel_registers.py); 8 warps and 4 queries per
                            # chunk were slower (session 10): the parameter gradients through a table
                            # (no spill), two sources requested ahead, both
                            "_pertoken_table": {"backward": "per_token", "param": "table"},
                            "_pertoken_pf2": {"backward": "per_token", "prefetch": 2},
                            "_pertoken_pf2_table": {"backward": "per_token", "prefetch": 2, "param": "table"},
                            "_tiled_t2w4": {"backward": "tiled", "block_t": 2, "num_warps": 4},
                            "_tiled_t1w2": {"backward": "tiled", "num_warps": 2},
                            # the per-token backward's sources through Triton's software pipeline (session 17)
                            **{f"_pertoken_s{k}": {"backward": "per_token", "stages": k} for k in (2, 3, 4)},
                            "_pertoken_s3_table": {"backward": "per_token", "stages": 3, "param": "table"},
                            # the parameter reduction's tiles through Triton's software pipeline,
                            # its programs per SM (session 18)
                            **{f"_tiled_ps{k}": {"backward": "tiled", "param_stages": k} for k in (2, 3, 4)},
                            **{f"_tiled_ps3_pp{k}": {"backward": "tiled", "param_stages": 3, "param_per_sm": k}
                               for k in (2, 3, 8)},
                            "_pertoken_s3_table_ps3": {"backward": "per_token", "stages": 3, "param": "table",
                                                       "param_stages": 3},
                            # sum_j a_j <v_j, g> formed from the sources (read twice) instead of
                            # <out, g> from the saved output (session 24)
                            "_exact": {"exact_softmax_grad": True},
                            # register caps (session 27): every backward kernel was latency-bound at
                            # 255 registers, 8 warps per SM (session 18's Nsight Compute run); the
                            # per-token grid is persistent, so its programs per SM rise with the cap
                            "_pertoken_cap128_pp4": {"backward": "per_token", "maxnreg": 128, "per_sm": 4},
                            "_pertoken_cap168_pp3": {"backward": "per_token", "maxnreg": 168, "per_sm": 3},
                            "_pertoken_w8_cap128": {"backward": "per_token", "num_warps": 8, "maxnreg": 128},
                            "_pertoken_table_cap128_pp4": {"backward": "per_token", "param": "table", "maxnreg": 128,
                                                           "per_sm": 4},
                            **{f"_tiled_cap{k}": {"backward": "tiled", "maxnreg": k} for k in (96, 128, 168)},
                            # more persistent programs per SM where fewer query rows are held
                            # (full AttnRes: 4 queries, 217 registers; 168 with the table; session
                            # 31's kernel_registers.py), and 8 warps a program; uncapped (since
                            # session 32 the default launch caps 4 queries at 168 registers)
                            **{f"_pertoken_pp{k}": {"backward": "per_token", "per_sm": k, "maxnreg": None}
                               for k in (3, 4, 6, 8)},
                            "_pertoken_w8": {"backward": "per_token", "num_warps": 8, "maxnreg": None},
                            "_pertoken_table_pp3": {"backward": "per_token", "param": "table", "per_sm": 3,
                                                    "maxnreg": None},
                            # the per-token launch of session 31 at every query count: 2 programs
                            # per SM, the compiler's registers (since session 32: by the queries a
                            # program holds, route_many_triton.PER_TOKEN_LAUNCH)
                            "_pertoken_s31": {"backward": "per_token", "per_sm": 2, "maxnreg": None},
                            # Block AttnRes's 6-7 queries in chunks of 4 or 2 (PER_TOKEN_LAUNCH's
                            # 3 or 4 programs per SM, no spill; fp32 partial gradients between
                            # the chunks) rather than one chunk of 8 padded rows that spills
                            **{f"_pertoken_q{k}": {"backward": "per_token", "block_q": k} for k in (2, 4)},
                            # several heads (8 warps a program): a call's queries in one chunk (4 or
                            # 8), not MULTI_HEAD_BACKWARD_QUERIES' 2 (fp32 partial gradients between
                            # chunks); 4 queries at 16 warps, one program per SM; 4 queries with
                            # running sums (sm_90 code of Triton 3.6 at 16 heads, d = 1024: 128
                            # registers at 4 queries and 8 warps, 2 programs per SM; session 41)
                            "_pertoken_q8": {"backward": "per_token", "block_q": 8},
                            "_pertoken_q4_w16": {"backward": "per_token", "block_q": 4, "num_warps": 16, "per_sm": 1},
                            "_pertoken_q4_s3": {"backward": "per_token", "block_q": 4, "stages": 3},
                            "_running_pertoken_q4": {"_running": True, "backward": "per_token", "block_q": 4},
                            # a source's three row sums reduced one by one (before session 33;
                            # since, joined in one reduction: route_many_triton.PER_TOKEN_FUSED_SUMS)
                            "_pertoken_sums1": {"backward": "per_token", "fused_sums": False},
                            # a call's 6 queries as 8 padded rows (before session 66; since, two
                            # tiles of 4 + 2: route_many_triton.SPLIT_QUERIES), and the two tiles'
                            # launch choices (session 66: 2 sources ahead, 2 programs per SM)
                            "_nosplit": {"split_queries": False},
                            **{f"_split_pf{k}": {"prefetch": {1: True}.get(k, k)} for k in (1, 2, 3, 4)},
                            "_split_cap168_pp3": {"maxnreg": 168, "per_sm": 3},
                            "_split_cap200": {"maxnreg": 200},
                            # the launch choices again with a running sum for every source, as full
                            # AttnRes's calls run since session 36 (grad_accumulation; its launches
                            # were chosen without them): each sum read one source ahead (a
                            # "_running" key marks them; it is not a config entry)
                            **{f"_running_{name}": {"_running": True, **cfg} for name, cfg in (
                                # the register prefetch, 1-4 ahead (2: the default before session 38;
                                # since, 3 stages at 1 and 4 queries: RUNNING_PER_TOKEN_STAGES)
                                ("pf1", {"prefetch": True, "stages": 0}), ("pf2", {"prefetch": 2, "stages": 0}),
                                ("pf3", {"prefetch": 3, "stages": 0}), ("pf4", {"prefetch": 4, "stages": 0}),
                                ("s2", {"stages": 2}), ("s3", {"stages": 3}), ("s4", {"stages": 4}),
                                ("pp2", {"per_sm": 2}), ("pp4", {"per_sm": 4}),
                                ("uncapped_pp2", {"per_sm": 2, "maxnreg": None}),
                                ("cap128_pp4", {"per_sm": 4, "maxnreg": 128}),
                                ("cap200_pp2", {"per_sm": 2, "maxnreg": 200}),
                                ("w8_pp2", {"num_warps": 8, "per_sm": 2, "maxnreg": None}),
                                ("w8_cap128_pp2", {"num_warps": 8, "per_sm": 2, "maxnreg": 128}),
                                ("table", {"param": "table"}), ("table_cap128_pp4", {"param": "table", "per_sm": 4,
                                                                                      "maxnreg": 128}),
                                ("sums1", {"fused_sums": False}), ("tiled", {"backward": "tiled"}))}}


def block_phase_timing(pattern: str | None = None, timer=bench, shapes=BLOCK_PHASE_SHAPES,
                       registers: bool = False) -> list[dict]:
    """Phase 1 of two-phase Block AttnRes: ``route_many`` (S queries, each source read once)
    against S separate routes over the same N sources (what site-by-site routing costs for
    the completed blocks), both as kernels called directly, forward + backward, bf16. The
    floor of route_many: forward N + S rows, backward N + 2S read and N written (each N
    twice with keys: values and keys read, both gradients written). ``pattern``: time only
    the variants whose names it matches (a regular expression), and the defaults. ``timer``:
    :func:`bench` (events around each call) or :func:`bench_graph` (CUDA-graph replays).
    ``shapes``: a list like :data:`BLOCK_PHASE_SHAPES` (:data:`PHASE_SHAPES` names them).
    ``registers``: also record each variant's registers (:func:`compiled_registers`)."""
    from depthrewrite.kernels import route_many_triton

    rows = []
    for tokens, d, n, s, heads, with_keys in shapes:
        gen = torch.Generator(device="cuda").manual_seed(tokens + d + n + s)
        vals = [torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(n)]
        keys = [torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(n)] \
            if with_keys else None
        q = torch.randn(s, d, device="cuda", generator=gen) / d**0.5
        w = torch.rand(s, d, device="cuda", generator=gen) + 0.5
        g = [torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(s)]
        gl = [torch.randn(tokens, heads, device="cuda", generator=gen) for _ in range(s)]

        # the forward's statistics table where the op keeps one (route_many.saves_stats); the
        # _nostats variants (config NO_STATS) run without it, as before session 34
        stats = stats_table(vals, q, heads, keys)
        with torch.no_grad():
            saved = route_many_triton.route_many_forward(vals, q, w, heads, 1e-6, keys=keys, stats=stats)

        def many_fwd(cfg=None):
            kept = None if cfg is NO_STATS else stats
            return route_many_triton.route_many_forward(vals, q, w, heads, 1e-6, cfg, keys=keys, stats=kept)

        # running sums for the _running variant (fresh random rows, one per source and key)
        sums = [torch.randn_like(v) for v in vals]
        key_sums = [torch.randn_like(k) for k in keys] if keys else None

        def many_bwd(cfg=None):
            kept = None if cfg is NO_STATS else stats
            running = cfg is RUNNING_SUMS or bool(cfg and cfg.get("_running"))
            if cfg and "_running" in cfg:
                cfg = {k: v for k, v in cfg.items() if k != "_running"}
            return route_many_triton.route_many_backward(g, gl, saved[0], saved[1], vals, q, w, heads, 1e-6, cfg,
                                                         keys=keys, stats=kept,
                                                         grad_values_acc=sums if running else None,
                                                         grad_keys_acc=key_sums if running else None)

        def per_site():
            for j in range(s):
                o, l, _ = route_triton.route_forward(vals, keys, q[j], w[j], None, None, heads, 1e-6)
                route_triton.route_backward(g[j], o, l, vals, keys, q[j], w[j], None, None, heads, 1e-6)

        m = 2 * n if with_keys else n  # source rows per token
        row = dict(tokens=tokens, d=d, n=n, s=s, heads=heads, keys=with_keys,
                   floor=(2 * m + 3 * s + m) * tokens * d * 2 / HBM_BPS * 1e3)
        with torch.no_grad():
            for part, fn, variants in (("fwd", many_fwd, _matching(BLOCK_PHASE_FWD_VARIANTS, pattern)),
                                       ("bwd", many_bwd, _matching(BLOCK_PHASE_BWD_VARIANTS, pattern))):
                for name, cfg in variants.items():
                    try:
                        if registers:
                            row[f"regs_{part}{name}"] = compiled_registers(lambda cfg=cfg, fn=fn: fn(cfg), part)
                        row[f"many_{part}{name}"] = timer(lambda cfg=cfg, fn=fn: fn(cfg))
                    except Exception as exc:
                        say(f"block-phase {part}{name}: ERROR {exc!r}")
            row["per_site"] = timer(per_site)
        fwd = {k: v for k, v in row.items() if k.startswith("many_fwd")}
        bwd = {k: v for k, v in row.items() if k.startswith("many_bwd")}
        row["many_best"] = min(fwd.values()) + min(bwd.values())
        row["best_fwd"], row["best_bwd"] = min(fwd, key=fwd.get), min(bwd, key=bwd.get)
        say("block-phase " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rows.append(row)
        del vals, keys, g, gl, saved, sums, key_sums
        torch.cuda.empty_cache()
    return rows


def compiled_registers(call, part: str) -> str:
    """``"registers/spill bytes"`` of the ``_route_many_fwd_kernel`` (``part="fwd"``) or
    per-token ``_route_many_bwd_kernel`` (``"bwd"``) binaries that ``call()`` launches, as
    this device's Triton compiled them (its cache cleared first, so the binaries are this
    call's; Triton's disk cache makes the recompile cheap); "-" when the call launches none
    (the tiled backward) or this Triton keeps its binaries elsewhere."""
    from depthrewrite.kernels import route_many_triton

    fn = route_many_triton._route_many_fwd_kernel if part == "fwd" else route_many_triton._route_many_bwd_kernel
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        return "-"
    caches.clear()
    call()
    torch.cuda.synchronize()
    found = sorted({(k.n_regs, k.n_spills) for entry in caches.values() for k in entry[0].values()
                    if getattr(k, "n_regs", None) is not None})
    return " ".join(f"{r}/{sp}" for r, sp in found) or "-"


#: per-site ``route`` launch variants (tokens, d, N sources, heads): the shapes of MHAR
#: block, WAV and full AttnRes sites at 350M; "" is the default launch
SITE_ROUTE_SHAPES = [(16384, 1024, 4, 1), (16384, 1024, 8, 16), (16384, 1024, 16, 1), (16384, 1024, 33, 1),
                     (16384, 1024, 33, 16)]
#: a WAV site as the model calls it: one head with a logit bias, a source scale and the
#: gradients added to running sums (its floor also reads the N running sums)
SITE_ROUTE_WAV_SHAPES = [(16384, 1024, 16, 1)]
#: ``--mhar-site-only``: full MHAR's sites as the model calls them: 16 heads, no bias or
#: scale, the gradients added to running sums (its sites route over 1-49 sources)
SITE_ROUTE_MHAR_SHAPES = [(16384, 1024, 9, 16), (16384, 1024, 25, 16), (16384, 1024, 41, 16)]
SITE_ROUTE_FWD_VARIANTS = {"": None, "_t1w1": {"block_t": 1, "num_warps": 1}, "_t1w2": {"block_t": 1, "num_warps": 2},
                           "_t2w2": {"block_t": 2, "num_warps": 2}, "_t2w4": {"block_t": 2, "num_warps": 4},
                           "_t4w4": {"block_t": 4, "num_warps": 4}, "_t4w8": {"block_t": 4, "num_warps": 8},
                           "_pair": {"pair_reduce": True},
                           # the sources through Triton's software pipeline (session 18), with
                           # the launch's register cap or without
                           **{f"_s{k}": {"stages": k} for k in (2, 3, 4)},
                           "_s3_uncapped": {"stages": 3, "maxnreg": None},
                           # 16 heads (session 37): one token a program on 2 warps (80 registers, 12
                           # programs per SM by registers; 72 and 14 with the pipeline: sm_90 code of
                           # the device's Triton 3.6, docs/data/route_16_head_registers_*.py)
                           "_s3_t1w2": {"stages": 3, "block_t": 1, "num_warps": 2},
                           # rescaled at every new maximum (before session 34; route_triton.LAZY_RESCALE)
                           "_eager": {"lazy_rescale": False}}
SITE_ROUTE_BWD_VARIANTS = {"": None, "_t1w1": {"block_t": 1, "num_warps": 1}, "_t1w2": {"block_t": 1, "num_warps": 2},
                           "_t2w2": {"block_t": 2, "num_warps": 2}, "_t4w4": {"block_t": 4, "num_warps": 4},
                           "_ps8": {"per_sm": 8}, "_ps5": {"per_sm": 5}, "_ps3": {"per_sm": 3},
                           # the launch before session 12 (the compiler's registers, 4 programs
                           # per SM); the defaults since: one head capped at 96 registers with 5
                           # programs per SM, 16 heads 8 programs (route_triton.RESIDENCY_ELEMS)
                           "_uncapped": {"maxnreg": None, "per_sm": 4},
                           # the sources through Triton's software pipeline (session 18)
                           **{f"_s{k}": {"stages": k} for k in (2, 3, 4)},
                           "_s3_uncapped": {"stages": 3, "maxnreg": None, "per_sm": 4},
                           # 16 heads with running sums (session 37; sm_90 code of the device's
                           # Triton 3.6, docs/data/route_16_head_registers_*.py): the launch before
                           # took 146 registers (3 programs per SM), 168 with the pipeline; capped
                           # at 128, 4 programs (8 bytes spilled without the pipeline, none with it:
                           # _s3_r128, the default since); one token on 4 warps 80 / 87 registers
                           # (6 / 5 programs) but 28 / 38 barriers against 9 / 19
                           "_r128": {"maxnreg": 128, "per_sm": 4},
                           "_s3_r128": {"stages": 3, "maxnreg": 128, "per_sm": 4},
                           # the 16-head launch before session 37 (run 1 timed it as _ps8, then the same)
                           "_mh0": {"stages": 0, "maxnreg": None, "per_sm": 8},
                           "_t1w4_ps6": {"block_t": 1, "num_warps": 4, "per_sm": 6},
                           "_s3_t1w4_ps5": {"stages": 3, "block_t": 1, "num_warps": 4, "per_sm": 5},
                           # sum_j a_j <v_j, g> from the sources, read twice (session 24)
                           "_exact": {"exact_softmax_grad": True},
                           # a source's three row sums reduced one by one (before session 33;
                           # since, joined in one reduction: route_triton.BACKWARD_FUSED_SUMS)
                           "_sums1": {"fused_sums": False}}
#: ``--design-launch-only``: tokens per program and warps at the DESIGN.md shapes (one head;
#: the defaults: one token per program and 4 warps at d = 2048, 2 tokens at d = 4096 with 8
#: warps forward and 4 backward)
DESIGN_FWD_VARIANTS = {"": None, "_t1w4": {"block_t": 1, "num_warps": 4}, "_t1w8": {"block_t": 1, "num_warps": 8},
                       "_t2w4": {"block_t": 2, "num_warps": 4}, "_t2w8": {"block_t": 2, "num_warps": 8},
                       "_t4w8": {"block_t": 4, "num_warps": 8},
                       # register caps (maxnreg): one token with 4 warps at d = 2048 is capped
                       # at 72 by default since session 13 (route_triton.FORWARD_MAXNREG; 7
                       # programs per SM); uncapped 76 registers, 6 programs; capped at 64 8 programs
                       # and 20 bytes spilled (sm_90 PTX, kernel_registers.py)
                       "_uncapped": {"maxnreg": None}, "_r64": {"maxnreg": 64},
                       # the row's square sum and query dot in one reduction (sm_90 PTX: 6
                       # bar.sync instead of 9); slower at d = 2048 in session 13 run 2
                       "_pair": {"pair_reduce": True},
                       # the sources through Triton's software pipeline (session 18)
                       **{f"_s{k}": {"stages": k} for k in (2, 3, 4)}, "_s3_uncapped": {"stages": 3, "maxnreg": None}}
DESIGN_BWD_VARIANTS = {"": None, "_t1w4": {"block_t": 1, "num_warps": 4}, "_t1w8": {"block_t": 1, "num_warps": 8},
                       "_t2w4": {"block_t": 2, "num_warps": 4}, "_t2w8": {"block_t": 2, "num_warps": 8},
                       "_ps8": {"per_sm": 8},
                       # d = 2048: registers capped at 96 with 5 programs per SM by default since
                       # session 11 (route_triton.RESIDENCY_ELEMS); d = 4096: 8 programs per SM
                       # since session 12 (WIDE_BACKWARD_PER_SM); uncapped, 4 programs, as before
                       "_uncapped": {"maxnreg": None, "per_sm": 4},
                       # the sources through Triton's software pipeline (session 18)
                       **{f"_s{k}": {"stages": k} for k in (2, 3, 4)},
                       "_s3_uncapped": {"stages": 3, "maxnreg": None, "per_sm": 4}}


def _matching(variants: dict, pattern: str | None) -> dict:
    """The launch variants whose names match ``pattern`` (a regular expression; None: all),
    and the default ("")."""
    return {k: v for k, v in variants.items() if not k or pattern is None or re.search(pattern, k)}


def _site_inputs(tokens: int, d: int, n: int, heads: int, wav: bool, sums: bool | None = None):
    """A site's route call, bf16, random (seeded by the shape): ``(values, query,
    key_norm_weight, grad_out, logit_bias, source_scale, running sums)``, the last three
    None unless ``wav`` (a WAV-like call: a bias, a scale, running sums); ``sums`` (None: as
    ``wav``) gives running sums alone (full MHAR's calls)."""
    sums = wav if sums is None else sums
    gen = torch.Generator(device="cuda").manual_seed(tokens + d + n + heads)
    vals = [torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(n)]
    q = torch.randn(d, device="cuda", generator=gen) / d**0.5
    w = torch.rand(d, device="cuda", generator=gen) + 0.5
    g = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen) if wav else None
    scale = torch.rand(n, tokens, device="cuda", generator=gen) + 0.5 if wav else None
    acc = [torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(n)] if sums else None
    return vals, q, w, g, bias, scale, acc


def site_route_timing(shapes=None, fwd_variants=None, bwd_variants=None, sums: bool = False) -> list[dict]:
    """``route`` (one query) forward and backward kernels called directly with launch
    variants, bf16, against the HBM floor of each (rows moved per token: forward N read
    and 1 written; backward N sources, the output gradient and the output read, N source
    gradients written, and with running sums N more read). ``shapes`` (tokens, d, N, heads;
    None: SITE_ROUTE_SHAPES and SITE_ROUTE_WAV_SHAPES) with running sums if ``sums``."""
    rows = []
    fwd_variants, bwd_variants = fwd_variants or SITE_ROUTE_FWD_VARIANTS, bwd_variants or SITE_ROUTE_BWD_VARIANTS
    shapes = [s + (False, sums) for s in shapes] if shapes else (
        [s + (False, False) for s in SITE_ROUTE_SHAPES] + [s + (True, True) for s in SITE_ROUTE_WAV_SHAPES])
    for tokens, d, n, heads, wav, with_sums in shapes:
        vals, q, w, g, bias, scale, acc = _site_inputs(tokens, d, n, heads, wav, with_sums)
        with torch.no_grad():
            out, lse, _ = route_triton.route_forward(vals, None, q, w, bias, scale, heads, 1e-6)
        row = dict(tokens=tokens, d=d, n=n, heads=heads, wav=wav, sums=with_sums,
                   floor_fwd=(n + 1) * tokens * d * 2 / HBM_BPS * 1e3,
                   floor_bwd=((3 if with_sums else 2) * n + 2) * tokens * d * 2 / HBM_BPS * 1e3)
        with torch.no_grad():
            for name, cfg in fwd_variants.items():
                row[f"fwd{name}"] = bench(lambda cfg=cfg: route_triton.route_forward(
                    vals, None, q, w, bias, scale, heads, 1e-6, config=cfg))
            for name, cfg in bwd_variants.items():
                row[f"bwd{name}"] = bench(lambda cfg=cfg: route_triton.route_backward(
                    g, out, lse, vals, None, q, w, bias, scale, heads, 1e-6, config=cfg, grad_values_acc=acc))
        say("site-route " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rows.append(row)
        del vals, g, out, lse
        torch.cuda.empty_cache()
    return rows


#: ``--launch-ab``: route's forward launch candidates timed in alternating rounds, each
#: against the default of its shape (tokens, d, N, heads, WAV-like: with a logit bias and a
#: source scale). A single pass can mislead: the forward capped at 64 registers was faster
#: at 16384x2048x9 and slower at x33 in session 11 run 5, faster at both in session 13 run
#: 2, faster and slower again in run 3 (9 rounds), where 72 was faster at both in every
#: round (the default since: route_triton.FORWARD_MAXNREG); pair_reduce was 0.099 against
#: 0.131 ms at 16 heads, N = 8 in run 2 and level in run 3's rounds
LAUNCH_AB = {(16384, 2048, 9, 1, False): {"_uncapped": {"maxnreg": None}, "_r64": {"maxnreg": 64}},
             (16384, 2048, 33, 1, False): {"_uncapped": {"maxnreg": None}, "_r64": {"maxnreg": 64}},
             (16384, 2048, 16, 1, True): {"_uncapped": {"maxnreg": None}},
             (16384, 1024, 33, 1, False): {"_r64": {"maxnreg": 64}, "_r80": {"maxnreg": 80}}}


def launch_ab(rounds: int = 7) -> list[dict]:
    """route's forward: the default launch and LAUNCH_AB's candidates, ``rounds`` rounds per
    shape, each round timing every launch once in a rotated order (so that none is always
    first or last); per launch the median of the rounds' medians and the spread."""
    rows = []
    for (tokens, d, n, heads, wav), candidates in LAUNCH_AB.items():
        vals, q, w, _, bias, scale, _ = _site_inputs(tokens, d, n, heads, wav)
        launches = {"default": None, **candidates}
        names = list(launches)
        times: dict[str, list[float]] = {name: [] for name in names}
        with torch.no_grad():
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(bench(lambda cfg=launches[name]: route_triton.route_forward(
                        vals, None, q, w, bias, scale, heads, 1e-6, config=cfg), rep=100))
        base = sorted(times["default"])[rounds // 2]
        for name in names:
            ts = sorted(times[name])
            row = dict(tokens=tokens, d=d, n=n, heads=heads, wav=wav, launch=name, median=ts[rounds // 2], low=ts[0],
                       high=ts[-1], vs_default=ts[rounds // 2] / base, rounds=times[name],
                       floor=(n + 1) * tokens * d * 2 / HBM_BPS * 1e3)
            say("launch-ab " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            rows.append(row)
        del vals
        torch.cuda.empty_cache()
    return rows


def launch_ab_table(rows) -> list[str]:
    lines = ["", "route forward launches in alternating rounds (ms): median of rounds [low, high], x default",
             "tokens  d    N  H launch        | median  low    high   | x default  floor"]
    for r in rows:
        launch = r["launch"] + (" wav" if r["wav"] else "")
        lines.append(f"{r['tokens']:6d} {r['d']:4d} {r['n']:3d} {r['heads']:2d} {launch:13s} | {r['median']:6.3f} "
                     f"{r['low']:6.3f} {r['high']:6.3f} | {r['vs_default']:6.3f}   {r['floor']:6.3f}")
    return lines


def site_route_table(rows) -> list[str]:
    lines = ["", "site route kernels (ms): default launch, best variant, floor",
             "tokens  d    N  H | fwd    best   (variant)   floor | bwd    best   (variant)   floor"]
    for r in rows:
        parts = []
        for part in ("fwd", "bwd"):
            times = {k: v for k, v in r.items() if k.startswith(part) and not k.startswith("floor")}
            best = min(times, key=times.get)
            parts.append(f"{r[part]:6.3f} {times[best]:6.3f} ({best[3:] or 'default':9s}) {r['floor_' + part]:6.3f}")
        wav = " wav" if r.get("wav") else " sums" if r.get("sums") else ""
        lines.append(f"{r['tokens']:6d} {r['d']:4d} {r['n']:3d} {r['heads']:2d}{wav} | " + " | ".join(parts))
    return lines


def copy_bandwidth():
    x = torch.empty(2 * 1024**3 // 4, device="cuda", dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / (ms * 1e-3)


# ------------------------------------------------------------------------- end to end


def e2e(schemes: list[str], profile: int = 0) -> list[dict]:
    """Training throughput and peak memory, one process per model (benchmarks/e2e_throughput.py);
    ``profile``: with a kernel profile listing each model's ``profile`` largest kernels (0: none)."""
    import e2e_throughput

    return e2e_throughput.run(schemes, wave=4, steps=10, trials=3, timeout_s=230, say=say, profile=profile)


def scheme_check() -> list[dict]:
    """Every scheme compiled with the backend against eager (benchmarks/gpu_scheme_check.py)."""
    import gpu_scheme_check

    return gpu_scheme_check.run(list(gpu_scheme_check.CONFIGS), "cuda", say=say)


# ---------------------------------------------------------------------------- table


def block_phase_table(rows) -> list[str]:
    lines = ["", "block phase 1 (fwd+bwd kernels, ms): route_many for S sites vs S routes over the same N sources",
             "tokens  d    N  S  H keys | fwd    bwd    best   per_site floor | best/floor per_site/best  (best variants)"]
    for r in rows:
        lines.append(f"{r['tokens']:6d} {r['d']:4d} {r['n']:3d} {r['s']:2d} {r['heads']:2d} {'yes' if r['keys'] else ' no'}  | "
                     f"{r.get('many_fwd') or float('nan'):6.3f} "
                     f"{r.get('many_bwd') or float('nan'):6.3f} {r['many_best']:6.3f} {r['per_site']:6.3f} "
                     f"{r['floor']:6.3f} | {r['many_best'] / r['floor']:5.2f}      {r['per_site'] / r['many_best']:5.2f}"
                     f"   ({r['best_fwd']}, {r['best_bwd']})")
    return lines + _variant_lines(rows)


def _variant_lines(rows) -> list[str]:
    """Every timed backward variant per shape (ms, and registers/spill bytes where recorded),
    beside the default's: the variants' own table (the summary above shows the best only)."""
    lines = ["", "backward variants (ms; x the default; registers/spill bytes)"]
    for r in rows:
        base = r.get("many_bwd")
        lines.append(f"N={r['n']} S={r['s']} H={r['heads']} keys={'yes' if r['keys'] else 'no'}:")
        for key, ms in r.items():
            if key.startswith("many_bwd") and isinstance(ms, float):
                name = key[len("many_bwd"):] or "(default)"
                ratio = f"{ms / base:5.2f}x" if base else "  -  "
                lines.append(f"  {name:28s} {ms:7.3f} {ratio} {r.get('regs_bwd' + key[len('many_bwd'):], '')}")
    return lines


#: how far a card's measured copy rate may stray from HBM_BPS before the table also gives the
#: ratios against a floor at the card's own rate (an H100 copies at ~3.0 TB/s: session 72)
CARD_RATE_TOLERANCE = 0.05


def _ratio(x, y) -> str:
    """``x / y`` for the tables, or a dash where either was not measured."""
    return f"{x / y:5.2f}" if isinstance(x, float) and isinstance(y, float) else "  -  "


def card_floor_lines(rows, bw) -> list[str]:
    """On a card whose copy rate ``bw`` is not HBM_BPS's (the floor column's, an H200's), the
    x-floor ratios against a floor at the card's own measured rate: each shown ratio times
    ``bw / HBM_BPS``. Nothing on a card within CARD_RATE_TOLERANCE of it."""
    scale = bw / HBM_BPS
    if abs(scale - 1) <= CARD_RATE_TOLERANCE or not rows:
        return []
    lines = ["", f"floor at this card's copy rate ({bw / 1e12:.2f} TB/s: the floor column x {1 / scale:.2f})",
             "mode   tokens  d    N  | floor  | ours/floor kern/floor FLA/floor"]
    for r in rows:
        floor = r["floor"] / scale
        lines.append(f"{r['mode']:6s} {r['tokens']:6d} {r['d']:4d} {r['n']:3d} | {floor:6.3f} | "
                     f"{_ratio(r.get('ours'), floor)}      {_ratio(r.get('ours_kernels'), floor)}      "
                     f"{_ratio(r.get('fla'), floor)}")
    return lines


def table(checks, rows, e2e_rows, bw, phase_rows=()):
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s (floor uses {HBM_BPS / 1e12:.1f})", ""]
    bad = [c["name"] for c in checks if not c.get("ok")]
    worst = max((c.get("out_err", 0), c.get("worst_grad_err", 0)) for c in checks if "out_err" in c) if checks else None
    lines.append(f"correctness: {len(checks) - len(bad)}/{len(checks)} OK; failing: {bad or 'none'}; "
                 f"worst (out, grad) rel err {worst}")
    lines.append("")
    lines.append("ours: the op through the dispatcher (fwdbwd: torch.autograd.grad, as eager training runs it); "
                 "kern: the forward and backward kernels called directly (fwdbwd only), as a compiled graph runs them")
    lines.append("mode   tokens  d    N  | eager  compile  FLA    ours   kern   floor | ours/floor ours/FLA kern/FLA "
                 "kern/floor compile/ours")
    for r in rows:
        def f(k):
            v = r.get(k)
            return f"{v:6.3f}" if isinstance(v, float) else "   -  "
        ours, fla, comp = r.get("ours"), r.get("fla"), r.get("compile")
        a = ANCHORS.get((r["mode"], r["tokens"], r["d"], r["n"]))
        comp_ref = comp if isinstance(comp, float) else (a[1] if a else None)
        lines.append(f"{r['mode']:6s} {r['tokens']:6d} {r['d']:4d} {r['n']:3d} | {f('eager')} {f('compile')} {f('fla')} "
                     f"{f('ours')} {f('ours_kernels')} {r['floor']:6.3f} | {_ratio(ours, r['floor'])}      "
                     f"{_ratio(ours, fla)}    {_ratio(r.get('ours_kernels'), fla)}    "
                     f"{_ratio(r.get('ours_kernels'), r['floor'])}      {_ratio(comp_ref, ours)}")
    lines += card_floor_lines(rows, bw)
    if phase_rows:
        lines += block_phase_table(phase_rows)
    if e2e_rows:
        import e2e_throughput

        lines += ["", e2e_throughput.table(e2e_rows), "", e2e_throughput.breakdown_table(e2e_rows)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--budget-s", type=float, default=520.0, help="skip optional parts past this many seconds")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-compile-ref", action="store_true")
    ap.add_argument("--e2e-schemes", default="baseline,block_attnres,mhar_block,wav,dar_block,attnres,mhar")
    ap.add_argument("--scheme-check", action="store_true", help="also compile every scheme against eager")
    ap.add_argument("--e2e-only", action="store_true", help="skip the op checks and timings")
    ap.add_argument("--e2e-profile", type=int, nargs="?", const=12, default=0, metavar="TOP",
                    help="e2e: also a GPU kernel time breakdown per model, with its TOP largest kernels (12)")
    ap.add_argument("--block-phase-only", action="store_true",
                    help="only the launch-variant timings: route_many (two-phase phase 1) and per-site route")
    ap.add_argument("--variants", default=None, metavar="REGEX",
                    help="--block-phase-only: only route_many's launch variants whose names match (and the "
                         "defaults), no site-route timings")
    ap.add_argument("--phase-shapes", choices=sorted(PHASE_SHAPES), default="block",
                    help="--block-phase-only: route_many's shapes, the block schemes' phase 1 (default) or "
                         "full AttnRes's calls")
    ap.add_argument("--phase-registers", action="store_true",
                    help="--block-phase-only: also record the registers and spills of each forward and "
                         "per-token backward variant as this device compiles it")
    ap.add_argument("--site-route-only", action="store_true",
                    help="only the per-site route launch variants at the model's d = 1024 shapes")
    ap.add_argument("--mhar-site-only", action="store_true",
                    help="only route's launch variants at full MHAR's site shapes (16 heads, running sums)")
    ap.add_argument("--route-variants", default=None, metavar="REGEX",
                    help="--site-route-only, --mhar-site-only, --design-launch-only: only route's launch "
                         "variants whose names match (and the defaults)")
    ap.add_argument("--design-launch-only", action="store_true",
                    help="only route's forward and backward kernels at the DESIGN.md shapes, other tokens per program and warps")
    ap.add_argument("--launch-ab", type=int, nargs="?", const=7, default=0, metavar="ROUNDS",
                    help="only route's forward launch candidates (LAUNCH_AB) against the default, "
                         "in alternating rounds")
    ap.add_argument("--graph-timing", action="store_true",
                    help="the block phase's calls timed as CUDA-graph replays (bench_graph: the GPU's time "
                         "alone) instead of events around each call")
    ap.add_argument("--no-block-phase", action="store_true",
                    help="skip the launch-variant timings of route_many (timed alone by --block-phase-only)")
    ap.add_argument("--widths", type=int, nargs="+", default=None,
                    help="time only the DESIGN.md shapes of these widths d (default: all)")
    ap.add_argument("--table-from", default=None, metavar="RESULTS_JSON",
                    help="print the summary table of an earlier run's results.json again (no GPU needed)")
    ap.add_argument("--quick", action="store_true",
                    help="a few checks, ours and FLA only, no block phase, no e2e (a short re-run after a kernel change)")
    args = ap.parse_args()
    if args.table_from:
        with open(args.table_from) as fh:
            saved = json.load(fh)
        print(table(saved.get("checks", []), saved.get("timing", []), saved.get("e2e", []), saved["bandwidth"],
                    saved.get("block_phase", [])))
        return 0
    phase_timer = bench_graph if args.graph_timing else bench  # the block phase's clock
    os.makedirs(args.out, exist_ok=True)
    say(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    results: dict = dict(bandwidth=None, checks=[], timing=[], e2e=[])

    def dump(summary: str = "") -> None:
        # after every phase: a run stopped at its limit still leaves what it measured
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        with open(os.path.join(args.out, "log.txt"), "w") as fh:
            fh.write("\n".join(LOG) + "\n\n" + summary + "\n")

    if args.block_phase_only:
        results["block_phase"] = phase_rows = block_phase_timing(args.variants, phase_timer,
                                                                 PHASE_SHAPES[args.phase_shapes],
                                                                 registers=args.phase_registers)
        dump()
        results["site_route"] = site_rows = [] if args.variants else site_route_timing()
        summary = "\n".join(block_phase_table(phase_rows) + site_route_table(site_rows))
        dump(summary)
        print(summary)
        return 0
    if args.site_route_only or args.mhar_site_only:
        results["site_route"] = site_rows = site_route_timing(
            SITE_ROUTE_MHAR_SHAPES if args.mhar_site_only else None,
            _matching(SITE_ROUTE_FWD_VARIANTS, args.route_variants),
            _matching(SITE_ROUTE_BWD_VARIANTS, args.route_variants), sums=args.mhar_site_only)
        summary = "\n".join(site_route_table(site_rows))
        dump(summary)
        print(summary)
        return 0
    if args.launch_ab:
        results["launch_ab"] = rows = launch_ab(args.launch_ab)
        summary = "\n".join(launch_ab_table(rows))
        dump(summary)
        print(summary)
        return 0
    if args.design_launch_only:
        shapes = [(tokens, d, n, 1) for tokens, d, n in DESIGN_SHAPES]
        results["design_launch"] = rows = site_route_timing(shapes, _matching(DESIGN_FWD_VARIANTS, args.route_variants),
                                                            _matching(DESIGN_BWD_VARIANTS, args.route_variants))
        summary = "\n".join(site_route_table(rows))
        dump(summary)
        print(summary)
        return 0
    results["bandwidth"] = bw = HBM_BPS if (args.quick or args.e2e_only) else copy_bandwidth()
    checks, rows, phase_rows = [], [], []
    if not args.e2e_only:
        results["checks"] = checks = correctness(args.quick)
        dump()
        results["block_phase"] = phase_rows = [] if (args.quick or args.no_block_phase) else block_phase_timing(
            timer=phase_timer)
        dump()
        results["timing"] = rows = timing(not (args.no_compile_ref or args.quick), args.budget_s, args.quick,
                                                args.widths)
        dump()
    skip_e2e = args.no_e2e or args.quick
    if args.scheme_check:
        results["scheme_check"] = scheme_check()
        dump()
    results["e2e"] = e2e_rows = [] if skip_e2e else e2e(args.e2e_schemes.split(","), args.e2e_profile)
    summary = table(checks, rows, e2e_rows, bw, phase_rows)
    dump(summary)
    print("\n" + summary)
    return 0 if all(c.get("ok") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
