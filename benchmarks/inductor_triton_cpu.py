"""Which Triton kernels Inductor makes of a two-phase merge and its branch norm, on a
machine without a GPU (session 71).

    python3 benchmarks/inductor_triton_cpu.py [--heads 16] [--tokens 512] [--width 1024] [--code]

Inductor is made to generate Triton code for CPU tensors (``cpu_backend="triton"``); each
kernel is recorded, never compiled or run (Triton has no CPU driver here), so the outputs
are garbage and only the code counts. The scheduler that decides which operations share a
kernel is the one a CUDA compile uses: for block MHAR's merge it gave the kernels that
session 71's GPU profile showed (a kernel for the key's RMS statistic, one for the 16
per-head logits over T * 16 rows of d / 16, one for the merge and the norm). Prints one
line per kernel: forward or backward, rows, elements reduced per row (0: pointwise), name;
``--code`` prints each kernel's source after it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthrewrite.ops import merge_partial  # noqa: E402


class _NotRun:
    """A kernel that is recorded, not compiled: its launches do nothing."""

    def run(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def generated_kernels(fn, *inputs) -> list[tuple[str, str]]:
    """``[(phase, source), ...]``: the Triton kernels Inductor generates for ``fn(*inputs)``
    (CPU tensors), ``phase`` "forward" or "backward" (the sum of the output's float32
    values differentiated). Torch's internals are patched for the call and put back."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton

    sources: list[str] = []

    def record(self, kernel_name, source_code, device_str="cuda"):
        if source_code not in sources:  # a module loaded twice asks for its kernels twice
            sources.append(source_code)
        return _NotRun()

    saved = torch_triton.triton_hash_with_backend, async_compile.AsyncCompile.triton
    # Triton has no CPU driver here: the code generation asks it for a hash of its backend
    torch_triton.triton_hash_with_backend = lambda: "no-driver"
    async_compile.AsyncCompile.triton = record
    torch._dynamo.reset()
    try:
        with inductor_config.patch(cpu_backend="triton", fx_graph_cache=False, autotune_local_cache=False):
            out = torch.compile(fn, backend="inductor", fullgraph=True)(*inputs)
            forward_count = len(sources)
            out.float().sum().backward()
    finally:
        torch_triton.triton_hash_with_backend, async_compile.AsyncCompile.triton = saved
        torch._dynamo.reset()
    return [("forward" if k < forward_count else "backward", code) for k, code in enumerate(sources)]


def kernel_shape(source: str) -> tuple[int, int]:
    """(rows, elements reduced per row; 0 for a pointwise kernel) of a generated kernel."""
    rows = int(re.search(r"xnumel = (\d+)", source).group(1))
    reduced = re.search(r"r0_numel = (\d+)", source)
    return rows, int(reduced.group(1)) if reduced else 0


def merge_kernels(heads: int, tokens: int, width: int) -> list[tuple[str, str]]:
    """:func:`generated_kernels` of ``merge_partial`` (bf16 activations, float32 routing
    parameters) followed by the branch's RMSNorm, as block MHAR (``heads`` 16) or Block
    AttnRes (1) makes it at each site with a partial sum."""
    gen = torch.Generator().manual_seed(0)
    out, partial = (torch.randn(tokens, width, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    lse = torch.randn(tokens, heads, generator=gen).requires_grad_()
    query, key_weight = (torch.randn(width, generator=gen).requires_grad_() for _ in range(2))
    norm_weight = torch.randn(width, generator=gen).bfloat16().requires_grad_()

    def merge_and_norm(out, lse, partial, query, key_weight, norm_weight):
        x = merge_partial(out, lse, partial, query=query, key_norm_weight=key_weight, heads=heads)
        return F.rms_norm(x, (width,), norm_weight, eps=1e-6)

    return generated_kernels(merge_and_norm, out, lse, partial, query, key_weight, norm_weight)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--code", action="store_true", help="print each kernel's source")
    args = ap.parse_args(argv)
    for phase, source in merge_kernels(args.heads, args.tokens, args.width):
        rows, reduced = kernel_shape(source)
        name = re.search(r"def (triton_\w+)\(", source).group(1)
        print(f"{phase:8} {rows:>9} rows {reduced:>6} reduced  {name}")
        if args.code:
            print(source)


if __name__ == "__main__":
    main()
