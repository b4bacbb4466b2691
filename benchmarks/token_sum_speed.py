"""The merges' sum over the tokens (``source_logit.token_weighted_sum``) as one matrix
product, in each operand layout, beside Inductor's reduction of the same sum (session 68)
and the op's Triton kernel (``kernels/token_sum_triton.py``, session 81) at its defaults and
other launch settings (session 82):

    python3 benchmarks/token_sum_speed.py [--tokens 16384] [--width 1024] [--repeats 50] [--parts 3]

For H = 1 (Block AttnRes, DAR) and 16 heads (block MHAR): the sum of ``stored`` (bf16,
``(T, d)``) weighted per token and head by float32 weights, each weight as ``--parts``
bf16 parts (``source_logit.split_into_parts``; the library's ``WEIGHT_PARTS`` by default;
session 68's run 4 timed 2), accumulated in float32. Each layout's median over
``--repeats`` timings of a CUDA graph that calls it on each of a pool of distinct random
inputs larger than the L2 cache (so each call reads its ``stored`` from HBM, and no host
time falls between the kernels), and the bandwidth that makes (the bytes of ``stored``
once). Prints a table; needs CUDA.
"""

from __future__ import annotations

import argparse
import sys

import torch

from depthrewrite.ops import source_logit
from depthrewrite.ops.source_logit import split_into_parts

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # gpu_suite, beside this script

#: distinct inputs cycled through, 4 x 32 MiB at the default shape: more than an H100's or
#: an H200's 50-60 MiB of L2
POOL = 4


def layouts(parts: int) -> dict:
    """name -> function(weights (T, H) float32, stored (T, d) bf16) -> the sums, float32:
    ``(parts * H, d)``, or ``(d, parts * H)`` for the transposed source."""
    def split(w):
        return split_into_parts(w, torch.bfloat16, parts)  # (T, parts * H)

    def padded(w, s):  # the weight rows padded to 8 columns: 16-byte aligned rows
        rows = split(w)
        rows = torch.nn.functional.pad(rows, (0, max(0, 8 - rows.shape[1])))
        return torch.mm(rows.t(), s, out_dtype=torch.float32)

    return {
        "rows (T, kH), transposed": lambda w, s: torch.mm(split(w).t(), s, out_dtype=torch.float32),
        "rows (kH, T), contiguous": lambda w, s: torch.mm(split(w).t().contiguous(), s, out_dtype=torch.float32),
        "stored transposed, (d, kH)": lambda w, s: torch.mm(s.t(), split(w), out_dtype=torch.float32),
        "rows padded to 8": padded,
    }


def _inductor_sum(heads: int):
    def plain(w, s):  # the sum as Inductor's reduction over the tokens
        return (w.unsqueeze(-1) * s.float().unflatten(-1, (heads, -1))).sum(0).flatten()

    return torch.compile(plain)


#: the kernel's launch settings timed beside its defaults (session 82): module constant ->
#: value; "gathered" is the session-81 form, a weight loaded per column at any head width
TRITON_SETTINGS = {
    "defaults": {},
    "gathered": {"MIN_ONE_HEAD_BLOCK_D": 1 << 30},
    "8 warps": {"NUM_WARPS": 8},
    "8 warps, 2 programs/SM": {"NUM_WARPS": 8, "PROGRAMS_PER_SM": 2},
    "2 programs/SM": {"PROGRAMS_PER_SM": 2},
    "tile 4096": {"TILE": 4096},
    "tile 4096, 8 programs/SM": {"TILE": 4096, "PROGRAMS_PER_SM": 8},
    "tile 16384, 8 warps, 2 programs/SM": {"TILE": 16384, "NUM_WARPS": 8, "PROGRAMS_PER_SM": 2},
    "tile 16384, 8 warps, 1 program/SM": {"TILE": 16384, "NUM_WARPS": 8, "PROGRAMS_PER_SM": 1},
}


def _triton_sum(heads: int, settings: dict):
    """The kernel with ``settings`` (module constants) in force for each call, the CUDA
    graph's capture included; restored after."""
    from depthrewrite.kernels import token_sum_triton

    def call(w, s):
        saved = {name: getattr(token_sum_triton, name) for name in settings}
        for name, value in settings.items():
            setattr(token_sum_triton, name, value)
        try:
            return token_sum_triton.token_weighted_sum_triton(w, s, heads)
        finally:
            for name, value in saved.items():
                setattr(token_sum_triton, name, value)

    return call


def _time(fn, inputs, repeats: int) -> float:
    """Median ms of one ``fn`` call: a CUDA graph that calls it once on every input in turn
    (no host time between the kernels), replayed ``repeats`` times, over the inputs' count."""
    from gpu_suite import bench_graph

    return bench_graph(lambda: [fn(w, s) for w, s in inputs], calls=1, replays=repeats) / len(inputs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--parts", type=int, default=source_logit.WEIGHT_PARTS,
                        help="bf16 parts a weight is split into (default: the library's)")
    args = parser.parse_args(argv)
    if args.parts < 1:
        raise SystemExit(f"token_sum_speed.py: --parts must be at least 1; found {args.parts}")
    if not torch.cuda.is_available():
        raise SystemExit("token_sum_speed.py: needs CUDA (torch.mm with out_dtype is a CUDA product)")
    gb = args.tokens * args.width * 2 / 1e9
    print(f"{torch.cuda.get_device_name()}, T = {args.tokens}, d = {args.width}, {args.parts} parts, "
          f"median of {args.repeats}")
    print("| heads | layout | us | TB/s (stored once) |")
    print("| ---: | --- | ---: | ---: |")
    for heads in (1, 16):
        inputs = [(torch.randn(args.tokens, heads, device="cuda"),
                   torch.randn(args.tokens, args.width, device="cuda").to(torch.bfloat16)) for _ in range(POOL)]
        cases = dict(layouts(args.parts), **{"Inductor's reduction": _inductor_sum(heads)})
        cases.update({f"Triton kernel, {name}": _triton_sum(heads, settings)
                      for name, settings in TRITON_SETTINGS.items()})
        for name, fn in cases.items():
            ms = _time(fn, inputs, args.repeats)
            print(f"| {heads} | {name} | {ms * 1e3:.1f} | {gb / ms:.2f} |")


if __name__ == "__main__":
    main()
