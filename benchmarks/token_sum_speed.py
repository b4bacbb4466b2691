"""The merges' sum over the tokens (``source_logit.token_weighted_sum``) as one matrix
product, in each operand layout, beside Inductor's reduction of the same sum (session 68):

    python3 benchmarks/token_sum_speed.py [--tokens 16384] [--width 1024] [--repeats 50]

For H = 1 (Block AttnRes, DAR) and 16 heads (block MHAR): the sum of ``stored`` (bf16,
``(T, d)``) weighted per token and head by float32 weights, as two bf16 rows each
(rounding and remainder), accumulated in float32. Each layout's median over ``--repeats``
timings of a CUDA graph that calls it on each of a pool of distinct random inputs larger
than the L2 cache (so each call reads its ``stored`` from HBM, and no host time falls
between the kernels), and the bandwidth that makes (the bytes of ``stored`` once). Prints a table; needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics

import torch

#: distinct inputs cycled through, 4 x 32 MiB at the default shape: more than an H100's or
#: an H200's 50-60 MiB of L2
POOL = 4


def _split_rows(w: torch.Tensor) -> torch.Tensor:
    hi = w.to(torch.bfloat16)
    return torch.cat([hi, (w - hi.float()).to(torch.bfloat16)], dim=1)  # (T, 2H)


def layouts() -> dict:
    """name -> function(weights (T, H) float32, stored (T, d) bf16) -> (2H, d) or (d, 2H) float32."""
    def padded(w, s):  # the weight rows padded to 8 columns: 16-byte aligned rows
        rows = _split_rows(w)
        rows = torch.nn.functional.pad(rows, (0, max(0, 8 - rows.shape[1])))
        return torch.mm(rows.t(), s, out_dtype=torch.float32)

    return {
        "rows (T, 2H), transposed": lambda w, s: torch.mm(_split_rows(w).t(), s, out_dtype=torch.float32),
        "rows (2H, T), contiguous": lambda w, s: torch.mm(_split_rows(w).t().contiguous(), s,
                                                          out_dtype=torch.float32),
        "stored transposed, (d, 2H)": lambda w, s: torch.mm(s.t(), _split_rows(w), out_dtype=torch.float32),
        "rows padded to 8": padded,
    }


def _inductor_sum(heads: int):
    def plain(w, s):  # the sum as Inductor's reduction over the tokens
        return (w.unsqueeze(-1) * s.float().unflatten(-1, (heads, -1))).sum(0).flatten()

    return torch.compile(plain)


def _time(fn, inputs, repeats: int) -> float:
    """Median ms of one ``fn`` call over ``repeats`` timings, each a replay of a CUDA graph
    that calls it once on every input in turn (no host time between the kernels), divided
    by the inputs' count."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (and compile) on every input, off the default stream
        for w, s in inputs:
            fn(w, s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, s in inputs:
            fn(w, s)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(inputs))
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("token_sum_speed.py: needs CUDA (torch.mm with out_dtype is a CUDA product)")
    gb = args.tokens * args.width * 2 / 1e9
    print(f"{torch.cuda.get_device_name()}, T = {args.tokens}, d = {args.width}, median of {args.repeats}")
    print("| heads | layout | us | TB/s (stored once) |")
    print("| ---: | --- | ---: | ---: |")
    for heads in (1, 16):
        inputs = [(torch.randn(args.tokens, heads, device="cuda"),
                   torch.randn(args.tokens, args.width, device="cuda").to(torch.bfloat16)) for _ in range(POOL)]
        cases = dict(layouts(), **{"Inductor's reduction": _inductor_sum(heads)})
        for name, fn in cases.items():
            ms = _time(fn, inputs, args.repeats)
            print(f"| {heads} | {name} | {ms * 1e3:.1f} | {gb / ms:.2f} |")


if __name__ == "__main__":
    main()
