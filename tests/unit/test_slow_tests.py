"""tests/slow_tests.py: which node ids its entries mark slow, and which entries it reports as
stale (conftest.py stops a run on them)."""

from __future__ import annotations

import pytest

from tests import slow_tests
from tests.slow_tests import entry_matches, is_slow, stale_entries

FILE = "tests/e2e/test_x.py"


@pytest.mark.parametrize("entry,node_id,expected", [
    (f"{FILE}::test_a", f"{FILE}::test_a", True),
    (f"{FILE}::test_a", f"{FILE}::test_a[dar-1]", True),  # every case of the test
    (f"{FILE}::test_a", f"{FILE}::test_ab", False),  # not a prefix of another test's name
    (f"{FILE}::test_a", "tests/e2e/test_y.py::test_a", False),
    (f"{FILE}::test_a[dar]", f"{FILE}::test_a[dar]", True),
    (f"{FILE}::test_a[dar]", f"{FILE}::test_a[dar-1]", False),  # a case matches whole
    (f"{FILE}::test_a[dar]", f"{FILE}::test_a", False),
    (f"{FILE}::test_a[dar-*]", f"{FILE}::test_a[dar-the whole block]", True),
    (f"{FILE}::test_a[*-32768-*]", f"{FILE}::test_a[3-2-batch17-32768-16-True-dtype0]", True),
    (f"{FILE}::test_a[*-32768-*]", f"{FILE}::test_a[3-2-batch17-1000-16-True-dtype0]", False),
    (f"{FILE}::test_a[[a]]", f"{FILE}::test_a[[a]]", True),  # brackets are the ids' own, not classes
    (f"{FILE}::test_a[[a]]", f"{FILE}::test_a[a]", False),
])
def test_an_entry_matches_its_tests_and_cases_only(entry, node_id, expected):
    assert entry_matches(entry, node_id) is expected


def test_an_entry_is_stale_only_where_its_file_was_collected_whole(monkeypatch):
    entries = {f"{FILE}::test_a": 1, f"{FILE}::test_gone": 1, "tests/unit/test_z.py::test_b[x]": 1}
    monkeypatch.setattr(slow_tests, "SLOW_TESTS", entries)
    collected = [f"{FILE}::test_a", "tests/unit/test_z.py::test_b[y]"]
    everything = [f"{FILE}::test_gone", "tests/unit/test_z.py::test_b[x]"]
    assert stale_entries(collected, [""]) == everything
    assert stale_entries(collected, ["tests"]) == everything
    assert stale_entries(collected, ["tests/e2e/"]) == [f"{FILE}::test_gone"]
    assert stale_entries(collected, [FILE]) == [f"{FILE}::test_gone"]
    # a run of one named test (its argument holds "::", so conftest passes no whole path)
    assert stale_entries([f"{FILE}::test_a"], []) == []
    assert stale_entries(collected, ["tests/e2e/test_x"]) == []  # a prefix of a name is not its folder


def test_the_marks_follow_the_entries():
    assert is_slow("tests/e2e/test_distributed.py::test_torchtitans_stack_trains_like_one_process[with x]")
    assert not is_slow("tests/compile/test_backend.py::test_routed_schemes_match_eager_through_inductor[mhar]")
    assert is_slow("tests/compile/test_backend.py::test_routed_schemes_match_eager_through_inductor[dar]")


class _Item:
    def __init__(self, nodeid):
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark):
        self.marks.append(mark.name)


class _Config:
    def __init__(self, rootpath, args):
        self.rootpath, self.args = rootpath, args


def test_conftests_hook_marks_the_named_tests_and_stops_on_a_stale_entry(monkeypatch, tmp_path):
    from tests import conftest

    monkeypatch.setattr(slow_tests, "SLOW_TESTS", {f"{FILE}::test_a[dar]": 1})
    items = [_Item(f"{FILE}::test_a[dar]"), _Item(f"{FILE}::test_a[wav]")]
    conftest.pytest_collection_modifyitems(_Config(tmp_path, [str(tmp_path / "tests")]), items)
    assert [item.marks for item in items] == [["slow"], []]
    with pytest.raises(pytest.UsageError, match=r"test_x.py::test_a\[dar\]"):
        conftest.pytest_collection_modifyitems(_Config(tmp_path, [str(tmp_path / "tests")]), items[1:])
    # the same items from a run of one named test: nothing judged
    conftest.pytest_collection_modifyitems(_Config(tmp_path, [f"{tmp_path}/{FILE}::test_a[wav]"]), items[1:])
