"""benchmarks/cpp_wrapper_host.py, whose figures docs/benchmarks.md quotes (session 58), on
a one-layer DAR block model."""

import torch

from tests.benchmark_scripts import load_benchmark


def test_both_wrappers_are_timed_on_the_same_model():
    """Each wrapper's compilation trains the same weights on the same tokens: their first
    losses agree (Inductor generates the same kernels and calls them from Python or from
    C++), and each step time is a positive median."""
    host = load_benchmark("cpp_wrapper_host")
    row = host.measure("dar_block", layers=1, steps=1, repeats=2)
    assert row["python_ms"] > 0 and row["cpp_ms"] > 0
    assert row["python_first_s"] > row["python_ms"] / 1e3 and row["cpp_first_s"] > row["cpp_ms"] / 1e3  # compiles
    assert row["loss_difference"] < 1e-5
    assert torch._inductor.config.cpp_wrapper is False  # set for each compilation only
