"""gpu_scheme_check's rule applied afterwards to saved errors (session 25):

    python3 benchmarks/scheme_check_rule.py docs/data/gradient_accuracy_*_small_*_session25.json \\
        docs/data/accuracy_dar_bf16_2026-12-01_session25_run2.json \\
        docs/data/scheme_check_350m_2026-12-01_session25_run*.json

Two kinds of file, told apart by their shape:

- ``gradient_accuracy.py --json`` (``{run: {gradient: error}}``, every way of running one
  scheme, all correct implementations): the rule applied to every run as the candidate
  against every other run and every pair of others as the references, and every run but
  those two against the scheme check's references (``inductor`` and ``reference``; the
  check's candidate is ``backend``). A rule that fails a correct pair fails correct code.
- ``gpu_scheme_check.py --json`` (a list of rows): each row's references' errors.

For both, how much the rule can still see: the share of gradients on which an error of 0.1,
and of 1.0 (a gradient zeroed), would be over its allowance (the check's references; for
the first kind ``inductor`` and ``reference``), and the kinds with gradients on which a
zeroed one would pass. The precision is read from the file name
(``bf16`` in it, else fp32) for the first kind, from the row for the second.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scheme_check as check  # noqa: E402

#: the references of the scheme check with ``--inner inductor``, as gradient_accuracy.py names the runs
CHECK_REFERENCES = ("inductor", "reference")
#: the errors whose detection is counted: a tenth, and a gradient zeroed
PROBES = (0.1, 1.0)


def worst_ratio(candidate: dict, ref_errors: dict, precision: str) -> float:
    """The larger of the candidate's worst gradient and worst kind median over their
    allowances (over 1: the rule fails it; gpu_scheme_check.judge)."""
    verdict = check.judge(candidate, ref_errors, precision)
    return max(verdict.gradient_ratio, verdict.median_ratio)


def farthest(runs: dict, references: tuple[str, ...]) -> dict:
    """Per gradient, the largest error among the runs named ``references``."""
    return check.farthest([runs[r] for r in references])


def detection(ref_errors: dict, precision: str) -> str:
    """The share of gradients on which each of PROBES would fail the check; then the kinds
    on which a zeroed gradient would pass it somewhere (how many of the kind's gradients)."""
    allowed = check.allowances(ref_errors, precision)
    shares = ", ".join(f"an error of {probe:g} caught on "
                       f"{100 * sum(probe > a for a in allowed.values()) / len(allowed):.0f} %" for probe in PROBES)
    unseen = [f"{kind} {sum(a >= PROBES[-1] for a in values)} of {len(values)}"
              for kind, values in sorted(check.group_by_kind(allowed).items()) if max(values) >= PROBES[-1]]
    return shares + (f"; a zeroed gradient unseen on {', '.join(unseen)}" if unseen else "")


def report_runs(name: str, runs: dict, precision: str) -> None:
    """Every run against every other and every pair of others; the check's own pair."""
    if len(runs) < 2:
        print(f"{name}: {len(runs)} run, nothing to judge")
        return
    for count in (1, 2):
        if count >= len(runs):
            break
        worst = []
        for candidate in runs:
            for refs in itertools.combinations([r for r in runs if r != candidate], count):
                worst.append((worst_ratio(runs[candidate], farthest(runs, refs), precision), candidate, refs))
        ratio, candidate, refs = max(worst)
        failing = sum(w[0] > 1 for w in worst)
        print(f"{name} ({precision}), {count} reference(s): {len(worst)} pairs, {failing} failing; worst "
              f"{ratio:.2f}x ({candidate} against {' + '.join(refs)})")
    if all(r in runs for r in CHECK_REFERENCES):
        ref_errors = farthest(runs, CHECK_REFERENCES)
        for candidate in (r for r in runs if r not in CHECK_REFERENCES):
            verdict = check.judge(runs[candidate], ref_errors, precision)
            print(f"    {candidate} against {' + '.join(CHECK_REFERENCES)}: gradient {verdict.gradient_ratio:.2f}x, "
                  f"kind median {verdict.median_ratio:.2f}x")
        print(f"    what it can see: {detection(ref_errors, precision)}")


def report_rows(name: str, rows: list[dict]) -> None:
    for row in rows:
        if "ranked" not in row:
            print(f"{name}: {row['scheme']} {row['precision']}: no errors saved ({row.get('error')})")
            continue
        ref_errors = {n: ref for n, _, ref, _ in row["ranked"]}
        print(f"{name}: {row['scheme']} {row['precision']} ok={row['ok']}; {detection(ref_errors, row['precision'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.files:
        data = json.loads(path.read_text())
        if isinstance(data, list):
            report_rows(path.name, data)
        else:
            report_runs(path.name, data, "bf16" if "bf16" in path.name else "fp32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
