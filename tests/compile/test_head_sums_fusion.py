"""MHAR's merges as Inductor's Triton backend compiles them: with the per-head sums over
whole rows (``head_sums.MASKED_HEAD_SUMS``, the default) a 16-head merge and its branch
norm are one kernel over the token rows each way, as a one-head merge is; as a view per
head they are kernels of two shapes, each reading the rows (docs/design.md "MHAR's merges
as whole-row reductions").

No GPU here: Inductor is made to generate its Triton code for CPU tensors
(``cpu_backend="triton"``), and the kernels are recorded, never compiled or run. The
scheduler that decides which operations share a kernel is the one a GPU compile uses; the
CUDA timings are in docs/benchmarks.md, session 71.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import torch._inductor.async_compile as async_compile
import torch._inductor.config as inductor_config
import torch.utils._triton as torch_triton

from depthrewrite.ops import head_sums, merge_partial

T, D, HEADS = 96, 256, 16


class _NotRun:
    """A kernel that is recorded, not compiled: its launches do nothing."""

    def run(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _kernel_shapes(monkeypatch, masked: bool) -> list[tuple[int, int]]:
    """(rows, reduced elements per row) of each Triton kernel Inductor generates for a
    16-head merge followed by the branch's RMSNorm, forward then backward (0: a pointwise
    kernel)."""
    sources = []

    def record(self, kernel_name, source_code, device_str="cuda"):
        if source_code not in sources:  # a module loaded twice asks for its kernels twice
            sources.append(source_code)
        return _NotRun()

    # Triton has no CPU driver here: the code generation asks it for a hash of its backend
    monkeypatch.setattr(torch_triton, "triton_hash_with_backend", lambda: "no-driver")
    monkeypatch.setattr(async_compile.AsyncCompile, "triton", record)
    monkeypatch.setattr(head_sums, "MASKED_HEAD_SUMS", masked)
    gen = torch.Generator().manual_seed(0)
    out, partial = (torch.randn(T, D, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    lse = torch.randn(T, HEADS, generator=gen).requires_grad_()
    query, key_weight = (torch.randn(D, generator=gen).requires_grad_() for _ in range(2))
    norm_weight = torch.randn(D, generator=gen).bfloat16().requires_grad_()

    def merge_and_norm(out, lse, partial, query, key_weight, norm_weight):
        x = merge_partial(out, lse, partial, query=query, key_norm_weight=key_weight, heads=HEADS)
        return F.rms_norm(x, (D,), norm_weight, eps=1e-6)

    torch._dynamo.reset()
    try:
        with inductor_config.patch(cpu_backend="triton", fx_graph_cache=False, autotune_local_cache=False):
            compiled = torch.compile(merge_and_norm, backend="inductor", fullgraph=True)
            y = compiled(out, lse, partial, query, key_weight, norm_weight)
            y.float().sum().backward()  # the kernels do nothing: only the backward's compile matters
    finally:
        torch._dynamo.reset()
    shapes = []
    for code in sources:
        rows = int(re.search(r"xnumel = (\d+)", code).group(1))
        reduced = re.search(r"r0_numel = (\d+)", code)
        shapes.append((rows, int(reduced.group(1)) if reduced else 0))
    return shapes


def test_a_16_head_merge_is_one_kernel_over_the_rows_each_way(monkeypatch):
    shapes = _kernel_shapes(monkeypatch, masked=True)
    over_rows = [s for s in shapes if s == (T, D)]
    per_head = [s for s in shapes if s[1] == D // HEADS]
    # forward: the key's statistic, the 16 logits, the merge and the norm in one kernel;
    # backward: the norm's and the merge's gradients and the 16 weights' in one (the rest:
    # per-token values, the parameters' sums over the tokens)
    assert len(over_rows) == 2, shapes
    assert not per_head, shapes


def test_as_views_per_head_the_merge_needs_kernels_of_two_shapes(monkeypatch):
    """The check above can fail: in the form before session 71 the forward's key statistic,
    logits and merge are three kernels and the backward's norm and weight gradients two,
    two of them over the heads' T * H rows."""
    shapes = _kernel_shapes(monkeypatch, masked=False)
    assert len([s for s in shapes if s == (T * HEADS, D // HEADS)]) == 2, shapes
    assert len([s for s in shapes if s == (T, D)]) == 3, shapes
