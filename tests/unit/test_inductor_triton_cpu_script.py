"""benchmarks/inductor_triton_cpu.py: Inductor's Triton kernels for a merge, read on the
CPU. What it shows is what session 71 found on the GPU (docs/design.md, "Why MHAR's merges
are more of Inductor's kernels"): a one-head merge and its branch norm are one kernel over
the token rows each way; with 16 heads the per-head logits and weight gradients are
kernels of their own, over T * 16 rows."""

from __future__ import annotations

from tests.benchmark_scripts import load_benchmark

TOKENS, WIDTH = 64, 256


def _shapes(heads):
    script = load_benchmark("inductor_triton_cpu")
    kernels = script.merge_kernels(heads, TOKENS, WIDTH)
    return [(phase, script.kernel_shape(source)) for phase, source in kernels]


def test_a_one_head_merge_is_one_kernel_over_the_rows_each_way():
    shapes = _shapes(1)
    assert [s for p, s in shapes if p == "forward"] == [(TOKENS, WIDTH)]
    assert [s for p, s in shapes if p == "backward" and s == (TOKENS, WIDTH)] == [(TOKENS, WIDTH)]


def test_a_16_head_merge_has_kernels_over_the_heads_rows():
    shapes = _shapes(16)
    forward = [s for p, s in shapes if p == "forward"]
    assert forward.count((TOKENS * 16, WIDTH // 16)) == 1 and forward.count((TOKENS, WIDTH)) == 2
    assert [s for p, s in shapes if p == "backward"].count((TOKENS * 16, WIDTH // 16)) == 1
