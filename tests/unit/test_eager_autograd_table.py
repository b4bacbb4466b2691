"""benchmarks/eager_autograd.py's table: the figures docs/benchmarks.md quotes (session 52)."""

from tests.benchmark_scripts import load_benchmark


def _row(round_, autograd, fwdbwd):
    row = {"round": round_, "autograd": autograd, "registration": "custom_op", "route us": 1219.84,
           "route_many us": 1875.2, "fwdbwd ms": fwdbwd, "kern ms": 0.572}
    return row | {f"{s} step ms": 53.44 for s in ("block_attnres", "dar", "attnres")}


def test_ratio_is_the_median_compile_time_over_each_rows_time():
    script = load_benchmark("eager_autograd")
    lines = script.table([_row(1, "flat", 1.25), _row(1, "custom_op", 2.0),
                          {"round": 2, "autograd": "flat", "registration": "dispatcher", "error": 1}],
                         [6.0, 5.0, 4.0])
    assert lines[0].endswith("6.000, 5.000, 4.000 ms (before and after the variants)")
    assert lines[3] == "| 1 | flat | custom_op | 1219.8 | 1875.2 | 1.250 | 0.572 | 53.4 | 53.4 | 53.4 | 4.00 |"
    assert lines[4].endswith("| 2.000 | 0.572 | 53.4 | 53.4 | 53.4 | 2.50 |")
    assert lines[5] == "| 2 | flat | dispatcher | failed (exit 1) |"
