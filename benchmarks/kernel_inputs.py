"""What each profiled Inductor kernel reads and writes, and the bandwidth it reached: joins
the profile that ``benchmarks/kernel_code.py`` prints with the Triton code Inductor logged
in the same process (compiled with ``TORCHINDUCTOR_BENCHMARK_KERNEL=1``, which adds each
kernel's estimated bytes, ``kernel_num_gb``, to its metadata):

    TORCHINDUCTOR_BENCHMARK_KERNEL=1 TORCH_LOGS=output_code \\
        python3 benchmarks/kernel_code.py dar_block 60 > profile.txt 2> code.txt
    python3 benchmarks/kernel_inputs.py code.txt profile.txt

One row per profiled kernel: ms per step, calls, its pointer arguments (inputs, outputs,
in-place), its estimated GB per call, the TB/s that makes, and the graph nodes Inductor
fused into it (from the comment above its code; a name the profile cut short that fits
several kernels gets each column's range over them) (Inductor's estimate counts
each buffer once per call: a kernel far under the HBM's ~4.8 TB/s either re-reads its
inputs, has too little parallel work, or is latency-bound). Kernels that are not Inductor's
(ours, cuBLAS, cuDNN) are listed with their time alone.
"""

from __future__ import annotations

import argparse
import re
import sys

#: one Inductor kernel in the logged module: its name, then its source up to the closing quotes
KERNEL = re.compile(r"async_compile\.triton\(\s*'(?P<name>\w+)',\s*'''(?P<src>.*?)'''", re.S)
SIGNATURE = re.compile(r"def (?P<name>\w+)\((?P<args>[^)]*)\)")
NUM_GB = re.compile(r"'kernel_num_gb':\s*([0-9.eE+-]+)")
#: the comment Inductor writes above each kernel: the graph nodes fused into it
SOURCE_NODES = re.compile(r"# Topologically Sorted Source Nodes: \[(?P<nodes>[^\]]*)\]")
#: a profile row of kernel_code.py: "    2.11   21 triton_red_fused_..."
PROFILE_ROW = re.compile(r"^\s*(?P<ms>[0-9.]+)\s+(?P<calls>\d+)\s+(?P<kernel>\S.*)$")


def inductor_kernels(code: str) -> dict[str, dict]:
    """Per kernel name in Inductor's logged code: its pointer arguments by kind, its
    estimated GB per call (None where the metadata has none), the graph nodes fused into it
    and how many kernels of that name the code defines (the profile adds up their times;
    the details are the first's)."""
    kernels, nodes = {}, [(m.end(), m["nodes"]) for m in SOURCE_NODES.finditer(code)]
    for match in KERNEL.finditer(code):
        src = match["src"]
        before = [names for end, names in nodes if end <= match.start()]
        sig = SIGNATURE.search(src)
        args = [a.strip().split(":")[0].strip() for a in sig["args"].split(",")] if sig else []
        gb = NUM_GB.search(src)
        if match["name"] in kernels:  # the forward's and the backward's modules number their kernels apart
            kernels[match["name"]]["defined"] += 1
            continue
        kernels[match["name"]] = dict(
            defined=1,
            inputs=sum(a.startswith("in_ptr") for a in args),
            outputs=sum(a.startswith("out_ptr") for a in args),
            in_place=sum(a.startswith("in_out_ptr") for a in args),
            gb=float(gb[1]) if gb else None,
            nodes=before[-1] if before else "",
        )
    return kernels


def profile_rows(text: str) -> list[tuple[float, int, str]]:
    rows = []
    for line in text.splitlines():
        match = PROFILE_ROW.match(line)
        if match:
            rows.append((float(match["ms"]), int(match["calls"]), match["kernel"].strip()))
    return rows


def _candidates(kernels: dict[str, dict], profiled: str) -> list[dict]:
    """The logged kernels a profiled name can be: itself, or every kernel it is the start
    of (profiles written before session 22 cut names to 120 characters, and kernels that
    differ only past that point share one cut name)."""
    if profiled in kernels:
        return [kernels[profiled]]
    return [info for name, info in kernels.items() if name.startswith(profiled)]


def _span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{low:{fmt}}-{high:{fmt}}"


def table(kernels: dict[str, dict], rows: list[tuple[float, int, str]]) -> list[str]:
    """One row per profiled kernel; where a cut name matches several logged kernels, each
    column is the range over them and the name says how many."""
    lines = ["| ms/step | calls | in | out | in-place | GB/call | TB/s | kernel | graph nodes fused |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for ms, calls, name in rows:
        infos = _candidates(kernels, name)
        if not infos:
            lines.append(f"| {ms:.2f} | {calls} | | | | | | {name} | |")
            continue
        gbs = [info["gb"] for info in infos if info["gb"] is not None]
        gb = _span(gbs, ".3f") if gbs else ""
        rate = _span([g * calls / ms for g in gbs], ".2f") if gbs and ms > 0 else ""  # GB/ms = TB/s
        counts = [_span([info[key] for info in infos], "d") for key in ("inputs", "outputs", "in_place")]
        nodes = _shortened(infos[0]["nodes"])
        if len(infos) > 1:
            name, nodes = f"{name} (one of {len(infos)} kernels with this cut name)", ""
        elif infos[0]["defined"] > 1:
            name, rate = f"{name} (x{infos[0]['defined']}: the first's details)", ""
        lines.append(f"| {ms:.2f} | {calls} | {' | '.join(counts)} | {gb} | {rate} | {name} | {nodes} |")
    return lines


def _shortened(nodes: str, keep: int = 8) -> str:
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    return ", ".join(names[:keep]) + (f", ... ({len(names)} in all)" if len(names) > keep else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("code", help="stderr of kernel_code.py run with TORCH_LOGS=output_code")
    ap.add_argument("profile", help="stdout of kernel_code.py (the profiled kernels)")
    args = ap.parse_args()
    with open(args.code, encoding="utf-8", errors="replace") as f:
        kernels = inductor_kernels(f.read())
    with open(args.profile, encoding="utf-8") as f:
        rows = profile_rows(f.read())
    if not rows:
        print(f"kernel_inputs: no profile rows in {args.profile}", file=sys.stderr)
        return 1
    print(f"{len(kernels)} Inductor kernels in the code, {len(rows)} profiled")
    print("\n".join(table(kernels, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
