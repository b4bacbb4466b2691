"""benchmarks/backward_sequence.py replays a step's route_many_backward calls as the
compiled step makes them; its record of them is checked against the order and running sums
derived by hand from grouped full AttnRes's two-phase structure."""

from tests.benchmark_scripts import load_benchmark


def test_full_attnres_step_records_its_calls_in_backward_order_with_their_running_sums():
    sequence = load_benchmark("backward_sequence")
    calls = sequence.record_calls("attnres", layers=4)
    # 4 layers: 8 sites in groups of 4 and 9 entries (the embedding and each site's output).
    # The backward differentiates the readout first (every entry, 1 query, nothing summed
    # yet), then each group from the last: two one-query calls over the group's own first
    # entries (3, then 2) and its phase-1 call over the entries before the group (4
    # queries); by then every source they read has a gradient, each adds to its sum.
    def call(sources, queries, summed=True):
        return dict(sources=sources, queries=queries, heads=1, keys=False,
                    running=list(range(len(sources))) if summed else [])

    want = [call(list(range(9)), 1, summed=False)]
    for g in (1, 0):
        first = 4 * g + 1
        want += [call([first, first + 1, first + 2], 1), call([first, first + 1], 1), call(list(range(first)), 4)]
    assert calls == want
