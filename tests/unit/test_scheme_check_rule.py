"""benchmarks/scheme_check_rule.py: gpu_scheme_check's rule applied afterwards to saved
errors, every correct run against every other, and what the rule can still see."""

import json

from tests.benchmark_scripts import load_benchmark

RUNS = {"reference": {"a.mix": 0.01, "b.mix": 0.2, "c.mix": 0.05},
        "inductor": {"a.mix": 0.3, "b.mix": 0.02, "c.mix": 0.05},
        "backend": {"a.mix": 0.05, "b.mix": 0.05, "c.mix": 0.9}}


def test_judge_gives_the_worst_gradient_and_kind_median_over_their_allowances():
    rule = load_benchmark("scheme_check_rule")
    ref_errors = rule.farthest(RUNS, ("inductor", "reference"))
    assert ref_errors == {"a.mix": 0.3, "b.mix": 0.2, "c.mix": 0.05}
    verdict = rule.check.judge(RUNS["backend"], ref_errors, "bf16")
    gradient, median = verdict.gradient_ratio, verdict.median_ratio
    assert abs(gradient - 0.9 / 0.6) < 1e-9  # c: 2 x the kind's largest, 0.3, above 4 x 0.05
    assert abs(median - 0.05 / 0.4) < 1e-9  # the median 0.05 against 2 x 0.2
    assert verdict.worst == "c.mix" and not verdict.ok
    assert rule.worst_ratio(RUNS["backend"], ref_errors, "bf16") == gradient


def test_detection_counts_the_gradients_on_which_an_error_would_fail():
    rule = load_benchmark("scheme_check_rule")
    # allowances 1.2 (4 x 0.3), 0.8 (4 x 0.2) and 0.6 (2 x 0.3, the kind's largest): 0.1
    # passes everywhere, 1.0 fails on two of the three
    assert rule.detection({"a.mix": 0.3, "b.mix": 0.2, "c.mix": 0.05}, "bf16") == \
        "an error of 0.1 caught on 0 %, an error of 1 caught on 67 %; a zeroed gradient unseen on mix 1 of 3"


def test_detection_names_no_kind_where_every_gradient_is_seen():
    rule = load_benchmark("scheme_check_rule")
    # allowances 0.2 (4 x 0.05) and 0.4 (4 x 0.1; 2 x 0.1 on its kind): 1.0 fails on both
    assert rule.detection({"a.mix": 0.05, "b.beta": 0.1}, "bf16") == \
        "an error of 0.1 caught on 0 %, an error of 1 caught on 100 %"


def test_both_kinds_of_file_are_reported(tmp_path, capsys, monkeypatch):
    rule = load_benchmark("scheme_check_rule")
    runs = tmp_path / "runs_bf16.json"
    runs.write_text(json.dumps(RUNS))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"scheme": "dar", "precision": "fp32", "ok": True,
                                 "ranked": [["a.mix", 2e-6, 1e-6, 1e-4]]},
                                {"scheme": "wav", "precision": "bf16", "ok": False, "error": "OutOfMemoryError"}]))
    monkeypatch.setattr("sys.argv", ["scheme_check_rule.py", str(runs), str(rows)])
    assert rule.main() == 0
    out = capsys.readouterr().out
    # backend against reference alone (c.mix 0.9 over 2 x 0.2, the kind's largest) and inductor alone (2 x 0.3)
    assert "runs_bf16.json (bf16), 1 reference(s): 6 pairs, 2 failing; worst 2.25x (backend against reference)" in out
    assert "backend against inductor + reference: gradient 1.50x, kind median 0.12x" in out
    assert "rows.json: dar fp32 ok=True; an error of 0.1 caught on 100 %, an error of 1 caught on 100 %" in out
    assert "rows.json: wav bf16: no errors saved (OutOfMemoryError)" in out


def test_a_file_of_one_run_has_nothing_to_judge(tmp_path, capsys, monkeypatch):
    rule = load_benchmark("scheme_check_rule")
    one = tmp_path / "one_bf16.json"
    one.write_text(json.dumps({"reference": RUNS["reference"]}))
    monkeypatch.setattr("sys.argv", ["scheme_check_rule.py", str(one)])
    assert rule.main() == 0
    assert capsys.readouterr().out == "one_bf16.json: 1 run, nothing to judge\n"
