"""gpu_suite.py's summary table off the H200: the ratios against a floor at the card's own
copy rate (an H100's op table, session 72, docs/benchmarks.md)."""

from tests.benchmark_scripts import load_benchmark

ROWS = [dict(mode="fwdbwd", tokens=16384, d=2048, n=9, floor=1.0, ours=3.0, ours_kernels=2.0, fla=4.0),
        dict(mode="fwd", tokens=16384, d=2048, n=9, floor=0.5, ours=1.0, fla=1.5)]


def test_a_slower_card_gets_ratios_against_a_floor_at_its_own_copy_rate():
    suite = load_benchmark("gpu_suite")
    lines = suite.card_floor_lines(ROWS, suite.HBM_BPS / 2)  # half the rate: the floor twice as long
    assert "x 2.00" in lines[1]
    fwdbwd, fwd = lines[-2].split(), lines[-1].split()
    assert fwdbwd[5:] == ["2.000", "|", "1.50", "1.00", "2.00"]  # floor, ours, kern, FLA
    assert fwd[5:] == ["1.000", "|", "1.00", "-", "1.50"]  # no kernel-only time in the forward rows
    table = suite.table([], ROWS, [], suite.HBM_BPS / 2)
    assert table.endswith(lines[-1])


def test_the_floors_own_card_gets_no_second_floor():
    suite = load_benchmark("gpu_suite")
    for rate in (suite.HBM_BPS, suite.HBM_BPS * 0.97, suite.HBM_BPS * 1.04):
        assert suite.card_floor_lines(ROWS, rate) == []
        assert "card's copy rate" not in suite.table([], ROWS, [], rate)
