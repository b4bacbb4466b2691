"""benchmarks/device_session.sh, whose modes docs/benchmarks.md cites as the commands of its
GPU figures: each mode its header lists is a label of its `case`, and no label is there
twice (bash runs the first and never reaches a second: session 79 left `trained79` twice,
with `h200table79` running what `h200last79` was meant to, and `h200last79` missing)."""

import collections
import re
import subprocess

from tests.benchmark_scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "device_session.sh"


def _modes_listed() -> list[str]:
    """The modes of the header's usage lines (``#   OUT=... bash .../device_session.sh MODE``)."""
    return re.findall(r"^#\s+OUT=\.\.\. bash benchmarks/device_session\.sh (\S+)", SCRIPT.read_text(), re.M)


def _case_labels() -> list[str]:
    """The labels of the script's top-level `case "$1"` (unindented; alternatives split)."""
    body = SCRIPT.read_text().split('case "$1" in\n', 1)[1]
    labels = re.findall(r"^([A-Za-z0-9_|-]+)\)", body, re.M)
    return [name for label in labels for name in label.split("|")]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_listed_mode_is_a_label_and_no_label_is_there_twice():
    labels = _case_labels()
    assert len(labels) > 100  # the parse found the case (166 labels at session 80's end)
    repeated = sorted(name for name, count in collections.Counter(labels).items() if count > 1)
    assert repeated == [], f"labels that bash reaches only once: {repeated}"
    missing = sorted(set(_modes_listed()) - set(labels))
    assert missing == [], f"modes the header lists that the case lacks: {missing}"
