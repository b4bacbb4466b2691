"""benchmarks/gradient_accuracy.py's summary: errors grouped by the gradient's kind (its last
name), each kind's median and largest, then over every gradient."""

from tests.benchmark_scripts import load_benchmark


def test_errors_are_summarised_by_kind_and_over_all():
    accuracy = load_benchmark("gradient_accuracy")
    errors = {"blocks.0.depth_route.site1.mix": 1e-3, "blocks.1.depth_route.site1.mix": 3e-3,
              "blocks.2.depth_route.site1.mix": 2e-3, "blocks.0.attn.qkv.weight": 5e-6}
    kinds = accuracy.by_kind(errors)
    assert list(kinds) == ["mix", "weight", "all"]
    assert kinds["mix"] == (2e-3, 3e-3)
    assert kinds["weight"] == (5e-6, 5e-6)
    assert kinds["all"] == ((1e-3 + 2e-3) / 2, 3e-3)  # the median of an even count: the mean of the middle two
