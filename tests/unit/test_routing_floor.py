"""benchmarks/routing_floor.py counts a step's routing calls and the rows each must move;
the docs' floors rest on it, so its count is checked against one derived by hand from
Block AttnRes's two-phase structure."""

from tests.benchmark_scripts import load_benchmark


def _load():
    return load_benchmark("routing_floor")


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


def test_fused_merges_are_priced_per_distinct_row(monkeypatch):
    """With ``two_phase.FUSED_MERGE`` the second phase is ``route_merge`` calls, priced too:
    Block AttnRes merges one partial entry (the result's row and the entry read, x
    written; backward: x's gradient and the same rows read, two gradients written); DAR
    merges both streams, whose partial entries are each one target's value and the other's
    key: read once each, their value and key gradients written separately."""
    from depthrewrite.passes import two_phase

    floor = _load()
    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    # Block AttnRes, 12 layers in blocks of 6 sites: 5 sites a block merge, the readout none
    counter = floor.count_step("block_attnres", {"block_size": 6}, width=32, layers=12)
    merges = 4 * 5
    assert counter.calls["route_merge"] == counter.calls["route_merge_backward"] == merges
    assert counter.rows["route_merge"] == merges * (1 + 1 + 1)
    assert counter.rows["route_merge_backward"] == merges * (1 + 1 + 1 + 1 + 1)
    assert sum(counter.rows.values()) == 144 + merges * 8
    # DAR, 6 layers in blocks of 3 layers: 2 blocks of 6 sites, 5 merging in each
    counter = floor.count_step("dar", {"layers_per_block": 3}, width=32, layers=6)
    merges = 2 * 5
    assert counter.calls["route_merge"] == counter.calls["route_merge_backward"] == merges
    assert counter.rows["route_merge"] == merges * (2 + 2 + 1)
    assert counter.rows["route_merge_backward"] == merges * (1 + 2 + 2 + 2 + 2 * 2)
    assert sum(counter.rows.values()) == 166 + merges * 16


def test_configuration_count_sets_its_constants_back_and_adds_the_recomputed_merges():
    """``count`` runs an ``_fm`` configuration with ``two_phase.FUSED_MERGE`` on and puts the
    constant back; with the branch norms unfused (``_fmnf``) it adds the merges the compiled
    backward makes again (one per call), with them fused (``_fm``) none."""
    from depthrewrite.passes import two_phase

    floor = _load()
    before = two_phase.FUSED_MERGE
    merges = 8 * 5  # the benchmark model: 48 sites in 8 blocks of 6
    counter = floor.count("block_attnres_fmnf", width=32)
    assert two_phase.FUSED_MERGE == before
    assert counter.calls["route_merge"] == counter.calls["route_merge (recomputed)"] == merges
    assert counter.rows["route_merge (recomputed)"] == counter.rows["route_merge"] == merges * 3
    fused = floor.count("block_attnres_fm", width=32)
    assert fused.calls["route_merge"] == merges and fused.calls["route_merge (recomputed)"] == 0
    assert floor.count("block_attnres", width=32).calls["route_merge"] == 0


def test_merges_of_torch_ops_are_counted_per_call():
    """The second phase's merges that Inductor compiles (``merge_partial``,
    ``merge_routes``) are counted beside the routing calls, each priced as a fused merge
    would move its rows: K rows read and one written forward; the result's gradient and
    the K rows read, K gradients written backward (3K + 2 rows a call)."""
    floor = _load()
    # Block AttnRes, 12 layers in blocks of 6: the 5 later sites of each block merge their
    # block's partial sum into phase 1's result (K = 2)
    counter = floor.count_step("block_attnres", {"block_size": 6}, width=32, layers=12)
    assert (counter.merges.calls, counter.merges.rows) == (4 * 5, 4 * 5 * (3 * 2 + 2))
    # two-phase WAV, the same blocks: a block's first site merges phase 1's three results
    # alone (block 0's first site has only e: no merge), its later sites add the partial
    # block's three sources (block 0: one result, e's)
    counter = floor.count_step("wav", {"block_size": 6, "two_phase": True}, width=32, layers=12)
    calls = {(1, 3): 5, (3, 0): 3, (3, 3): 3 * 5}
    assert counter.merges.calls == sum(calls.values())
    assert counter.merges.rows == sum(n * (3 * (r + s) + 2) for (r, s), n in calls.items())


def test_fused_merges_leave_no_merges_of_torch_ops(monkeypatch):
    from depthrewrite.passes import two_phase

    floor = _load()
    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    counter = floor.count_step("block_attnres", {"block_size": 6}, width=32, layers=12)
    assert counter.merges.calls == counter.merges.rows == 0
    assert counter.calls["route_merge"] == 4 * 5
