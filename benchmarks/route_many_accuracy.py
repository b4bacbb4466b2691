"""``route_many``'s backward against float64, the fused kernels beside the reference,
where the sources are nearly equal (session 23; bf16 and ``--exact``, session 24):

    python3 benchmarks/route_many_accuracy.py [--device cpu] [--seeds 10] [--spreads 1.0 0.01] [--exact]
        [--dtype fp32|bf16]

Sources ``v_i = b + spread * n_i`` (one base row per token, ``n_i`` standard normal): at a
small spread the routed sources differ little, as DAR's two streams or a block's entries
can, and every gradient that sums ``dz_i`` over the sources cancels. The reference's
backward forms ``dz_i = a_i (<v_i, g> - sum_j a_j <v_j, g>)`` from one set of dot
products, so ``sum_i dz_i`` is 0 up to one rounding; the kernels take ``sum_j a_j <v_j, g>``
as ``<out, g>`` from the saved output (the flash-attention shortcut: no second pass over the
sources), which rounds along another path and leaves a common part in every ``dz_i``.
Printed per spread and with or without separate keys (DAR): the geometric mean over seeds
of the relative error against float64 of the query and key-norm-weight gradients and of a
DAR-like scalar ``sum_i <grad v_i, v_i - v_0>`` (with keys, also the key gradients'), for
the kernels and for the reference; without keys also the query gradient of the reference's
formula with the kernels' shortcut (:func:`query_grad`), the shortcut's share alone.
``--exact`` adds the kernels with ``exact_softmax_grad`` (the sum and the weights' sum
formed from the sources) after each row's figures: without the shortcut and without the
weights' rounding through ``lse``, what is left of the kernels' difference. ``--dtype bf16`` runs the sources and gradients in bf16 (the truth: float64 of
the same bf16 inputs), where the shortcut reads the output rounded to bf16. Without a GPU
the kernels run in Triton's interpreter (about a minute a row).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

#: the shape: sources, queries, tokens, width (one head); queries' std as the scheme
#: check's 350M setting (logits' std 2 at this width)
N, S, T, D = 8, 6, 64, 256
QUERY_STD = 0.125


def _inputs(seed: int, spread: float, keyed: bool, dtype: torch.dtype = torch.float32) -> dict:
    """The sources, their keys and the output gradients in ``dtype``; the parameters fp32."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(T, D, generator=gen)
    values = [(base + spread * torch.randn(T, D, generator=gen)).to(dtype) for _ in range(N)]
    return dict(values=values, keys=[v.clone() for v in values] if keyed else None,
                queries=torch.randn(S, D, generator=gen) * QUERY_STD, weights=torch.rand(S, D, generator=gen) + 0.5,
                grad_out=[torch.randn(T, D, generator=gen).to(dtype) for _ in range(S)],
                grad_lse=[torch.zeros(T, 1) for _ in range(S)])


def _reference_grads(inp: dict, dtype: torch.dtype, shortcut: bool = False) -> tuple:
    """The reference backward's gradients in ``dtype`` (``route_many.reference_backward``),
    with ``shortcut`` its ``sum_j a_j <v_j, g>`` taken as ``<out, g>`` as the kernels do."""
    from depthrewrite.ops.route_many import _reference, reference_backward

    cast = lambda ts: None if ts is None else [t.to(dtype) for t in ts]  # noqa: E731
    values, keys = cast(inp["values"]), cast(inp["keys"])
    wide = torch.promote_types(dtype, torch.float32)  # the parameters and lse gradients: fp32 at least
    q, w = inp["queries"].to(wide), inp["weights"].to(wide)
    out = list(_reference(values, q, w, 1, 1e-6, keys)[0].unbind(0)) if shortcut else None
    return reference_backward(cast(inp["grad_out"]), [t.to(wide) for t in inp["grad_lse"]], values, q, w, 1, 1e-6,
                              keys, shortcut_out=out)


def _kernel_grads(inp: dict, device: str, exact: bool = False) -> tuple:
    from depthrewrite.kernels import route_many_triton

    dev = lambda ts: None if ts is None else [t.to(device) for t in ts]  # noqa: E731
    values, keys = dev(inp["values"]), dev(inp["keys"])
    q, w = inp["queries"].to(device), inp["weights"].to(device)
    out, lse = route_many_triton.route_many_forward(values, q, w, 1, 1e-6, None, keys=keys)
    grads = route_many_triton.route_many_backward(dev(inp["grad_out"]), dev(inp["grad_lse"]), out, lse, values,
                                                  q, w, 1, 1e-6, {"exact_softmax_grad": exact}, keys=keys)
    return tuple([t.cpu() for t in g] if isinstance(g, list) else g.cpu() for g in grads)


def query_grad(inp: dict, dtype: torch.dtype, shortcut: bool) -> torch.Tensor:
    """The query gradient in ``dtype`` by the reference backward's formula, with or without
    the kernels' shortcut (:func:`_reference_grads`)."""
    return _reference_grads(inp, dtype, shortcut)[2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def errors(inp: dict, grads: tuple, exact: tuple) -> dict[str, float]:
    """Relative errors against ``exact`` (float64): query and weight gradients, the scalar
    ``sum_i <grad v_i, v_i - v_0>``, with keys the key gradients' scalar too."""
    def scalar(gs):
        first = inp["values"][0].double()
        return sum(float((g.double() * (v.double() - first)).sum()) for g, v in zip(gs, inp["values"]))

    out = {"query": _rel(grads[2], exact[2]), "key_norm_weight": _rel(grads[3], exact[3])}
    parts = [("values", 0)] + ([("keys", 1)] if inp["keys"] is not None else [])
    for name, i in parts:
        truth = scalar(exact[i])
        out[f"scalar of {name}"] = abs(scalar(grads[i]) - truth) / abs(truth)
    return out


def geometric_means(rows: list[dict]) -> dict[str, float]:
    return {k: math.exp(sum(math.log(max(r[k], 1e-30)) for r in rows) / len(rows)) for k in rows[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--spreads", type=float, nargs="+", default=[1.0, 0.01])
    ap.add_argument("--exact", action="store_true", help="also the kernels with exact_softmax_grad")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.seeds < 1 or min(args.spreads) <= 0:
        ap.error(f"--seeds and --spreads must be positive; found {args.seeds} and {args.spreads}")
    print(f"route_many {args.dtype} backward, {N} sources, {S} queries, {T} tokens, d = {D}, {args.device}, "
          f"{args.seeds} seeds: geometric mean of the relative error against float64, kernels / reference")
    for keyed in (False, True):
        for spread in args.spreads:
            kernel_rows, reference_rows, shortcut_rows, exact_rows = [], [], [], []
            for seed in range(args.seeds):
                inp = _inputs(seed, spread, keyed, dtype)
                exact = _reference_grads(inp, torch.float64)
                kernel_rows.append(errors(inp, _kernel_grads(inp, args.device), exact))
                reference_rows.append(errors(inp, _reference_grads(inp, dtype), exact))
                if args.exact:
                    exact_rows.append(errors(inp, _kernel_grads(inp, args.device, exact=True), exact))
                if not keyed:
                    shortcut_rows.append({"query": _rel(query_grad(inp, dtype, shortcut=True), exact[2])})
            k, r = geometric_means(kernel_rows), geometric_means(reference_rows)
            print(f"keys {keyed!s:5} spread {spread:g}: "
                  + "; ".join(f"{name} {k[name]:.1e} / {r[name]:.1e} ({k[name] / r[name]:.2f}x)" for name in k),
                  flush=True)
            if exact_rows:
                e = geometric_means(exact_rows)
                print("    the kernels with exact_softmax_grad: "
                      + "; ".join(f"{name} {e[name]:.1e} ({e[name] / r[name]:.2f}x)" for name in e))
            if shortcut_rows:
                shortcut = geometric_means(shortcut_rows)["query"]
                print(f"    the reference's formula with the kernels' shortcut: query {shortcut:.1e}")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit code is imported
    sys.exit(main())
