"""benchmarks/shortcut_error.py: the one-pass backward's error against the exact float64
gradients, at the narrow kernel test shapes (Triton's interpreter without a GPU)."""

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton")


def test_errors_are_zero_for_one_source_and_smaller_in_fp16_than_in_bf16():
    script = load_benchmark("shortcut_error")
    results = script.rows(["route", "route_many"], ["bf16", "fp16"], max_width=24)
    by_case = {}
    for op, case, dtype, params, sources in results:
        by_case.setdefault((op, case), {})[dtype] = (params, sources)
    assert ("route", "n1_b5_d16_h1_keys_bias_scale") in by_case and ("route_many", "n1_s1_b3_d24_h1") in by_case
    for (op, case), errors in by_case.items():
        if case.startswith("n1_"):  # one source: its weight is the constant 1, no softmax to get wrong
            assert errors["bf16"][0] < 1e-6 and errors["fp16"][0] < 1e-6, (op, case, errors)
        else:  # the saved output's rounding: fp16 keeps 3 more bits than bf16
            assert 0 < errors["fp16"][0] < errors["bf16"][0], (op, case, errors)
        assert 0 < errors["fp16"][1] < errors["bf16"][1], (op, case, errors)
    lines = script.table(results)
    assert lines[-2].startswith("worst bf16: params ") and lines[-1].startswith("worst fp16: params ")
    assert len(lines) == 1 + len(results) + 2
