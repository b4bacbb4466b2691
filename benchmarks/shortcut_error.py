"""How far the fused backward's gradients are from the exact ones, in half precision, at the
kernel tests' shapes (``tests/kernels``' CASES of ``route`` and ``route_many``):

    python3 benchmarks/shortcut_error.py [--dtypes bf16 fp16] [--ops route route_many] [--max-width 8192]

The kernels' tests compare each gradient with a float64 oracle that makes the same use of
the output saved in the activation dtype (the one-pass backward's ``<out, g>`` shortcut,
docs/design.md "The softmax backward's shortcut"), tightly. This prints what that
shortcut costs against the exact float64 gradients of the same rounded inputs: per case,
the largest relative L2 error of the parameter gradients (query, key-norm weight, logit
bias) and of the source gradients (values, keys). The error is largest where few tokens
are summed and one source takes most of the weight: the shortcut's common part in every
``dz_j`` does not shrink with ``a_j (1 - a_j)`` as the gradient does. Without a GPU the
kernels run in Triton's interpreter, which rounds to bf16 toward zero (about twice the
GPU's rounding error). One line per case and dtype, the worst of each column last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def route_errors(case, dtype) -> tuple[float, float]:
    """(worst parameter gradient, worst source gradient) error of ``route`` at a kernel test case."""
    from tests.kernels import test_route_triton as t

    n, batch, d, heads, keys, bias, scale = case
    inp = t._make(n, batch, d, heads, keys, bias, scale, dtype, seed=n * 1000 + d)
    grad_out = torch.randn(*batch, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    _, _, _, grads = t._run_fused(t._on(inp, t.DEVICE), grad_out.to(t.DEVICE))
    _, _, _, exact = t._oracle_f64(inp, grad_out)
    sources = n * (2 if keys else 1)
    errs = [t._rel(g, e) for g, e in zip(grads, exact)]
    return max(errs[sources:]), max(errs[:sources])


def route_many_errors(case, dtype) -> tuple[float, float]:
    """The same for ``route_many`` (its CASES' entry, without keys)."""
    from tests.kernels import test_route_many_triton as t

    n, s, batch, d, heads = case
    seed = n * 100 + s
    inp = t._make(n, s, batch, d, heads, dtype, seed, False)
    _, _, grads, grad_out, grad_lse = t._run(inp, dtype, seed)
    _, _, exact = t._oracle_f64(inp, grad_out, grad_lse)
    errs = [t._rel(g, e) for g, e in zip(grads, exact)]  # values, then queries and weights
    return max(errs[n:]), max(errs[:n])


def rows(ops, dtypes, max_width: int) -> list[tuple[str, str, str, float, float]]:
    from tests.kernels import test_route_many_triton, test_route_triton

    cases = {"route": (test_route_triton.CASES, route_errors, test_route_triton._case_id),
             "route_many": (test_route_many_triton.CASES, route_many_errors,
                            lambda c: "n{}_s{}_b{}_d{}_h{}".format(c[0], c[1], "x".join(map(str, c[2])), c[3], c[4]))}
    out = []
    for op in ops:
        table, errors, name = cases[op]
        width = 2 if op == "route" else 3  # the width's place in a case
        for case in table:
            if case[width] > max_width:
                continue
            for label in dtypes:
                out.append((op, name(case), label, *errors(case, DTYPES[label])))
    return out


def table(results) -> list[str]:
    lines = [f"{'op':10s} {'case':32s} {'dtype':5s} {'params':>8s} {'sources':>8s}"]
    lines += [f"{op:10s} {case:32s} {dt:5s} {p:8.1e} {s:8.1e}" for op, case, dt, p, s in results]
    for dt in sorted({r[2] for r in results}):
        mine = [r for r in results if r[2] == dt]
        worst_p, worst_s = max(mine, key=lambda r: r[3]), max(mine, key=lambda r: r[4])
        lines.append(f"worst {dt}: params {worst_p[3]:.1e} ({worst_p[0]} {worst_p[1]}), "
                     f"sources {worst_s[4]:.1e} ({worst_s[0]} {worst_s[1]})")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16"])
    ap.add_argument("--ops", nargs="+", choices=["route", "route_many"], default=["route", "route_many"])
    ap.add_argument("--max-width", type=int, default=8192, help="skip cases wider than this (the interpreter's time)")
    args = ap.parse_args(argv)
    print("\n".join(table(rows(args.ops, args.dtypes, args.max_width))))


if __name__ == "__main__":
    main()
