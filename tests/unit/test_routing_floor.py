"""benchmarks/routing_floor.py counts a step's routing calls and the rows each must move;
the docs' floors rest on it, so its count is checked against one derived by hand from
Block AttnRes's two-phase structure."""

import importlib.util
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "routing_floor.py"


def _load():
    spec = importlib.util.spec_from_file_location("routing_floor", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_block_attnres_step_counts_the_two_phase_calls_and_rows():
    floor = _load()
    # 12 layers: 24 sites in 4 blocks of 6. Phase 1 routes the completed entries for each
    # group (group g reads e and g completed blocks: g + 1 sources, 6 queries; the readout,
    # a group of its own, 5 sources and 1 query); the backward recomputes every group's
    # phase 1 but the last two (two_phase.KEEP_LAST_PHASE_ONE) and differentiates each once.
    counter = floor.count_step("block_attnres", {"block_size": 6}, width=32, layers=12)
    groups = [(g + 1, 6) for g in range(4)] + [(5, 1)]
    forward = sum(n + s for n, s in groups)  # sources read, outputs written
    recomputed = sum(n + s for n, s in groups[:3])
    backward = sum(2 * s + 2 * n for n, s in groups)  # output gradients and outputs, sources and their gradients
    assert dict(counter.calls) == {"route_many": 5 + 3, "route_many_backward": 5}
    assert sum(counter.rows.values()) == forward + recomputed + backward == 144


def test_dar_step_counts_both_streams_keyed_calls():
    floor = _load()
    # 6 layers, 3 per DAR block: 12 sites in 2 blocks of 6. Each group routes both streams
    # (one route_many each, keys from the other stream): group g reads g + 1 entries of each
    # stream with 6 queries, the readout's group 3 entries with 1. Recomputed in the
    # backward: group 0 (the last two groups' phase 1 is kept).
    counter = floor.count_step("dar", {"layers_per_block": 3}, width=32, layers=6)
    groups = [(1, 6), (2, 6), (3, 1)]
    forward = 2 * sum(2 * n + s for n, s in groups)  # values and keys read, outputs written
    recomputed = 2 * sum(2 * n + s for n, s in groups[:1])
    backward = 2 * sum(2 * s + 2 * 2 * n for n, s in groups)
    assert dict(counter.calls) == {"route_many": 6 + 2, "route_many_backward": 6}
    assert sum(counter.rows.values()) == forward + recomputed + backward == 166
