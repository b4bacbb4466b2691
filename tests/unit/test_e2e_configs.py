"""benchmarks/e2e_throughput.py's A/B configurations: each launch constant a configuration
sets exists in its module, is set, and is put back, and each backend option it passes is
the backend's or an Inductor setting (a misspelt one would fail only on the device, after
its models compiled)."""

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton")


def test_every_launch_patch_sets_an_existing_constant():
    e2e = load_benchmark("e2e_throughput")
    assert "dar_block_exact" in e2e.CONFIGS and "block_attnres_exact" in e2e.CONFIGS
    # a launch variant of a configuration with backend options (CUDA graphs) keeps them
    assert e2e.BACKEND_OPTIONS["mhar_block_fm_cg_tfin"] == e2e.BACKEND_OPTIONS["mhar_block_fm_cg"] != {}
    assert e2e.CONFIGS["mhar_block_fm_cg_tfin"][:2] == e2e.CONFIGS["mhar_block_fm_cg"][:2]
    for name, patch in e2e.LAUNCH_PATCHES.items():
        with e2e.launch_patches(name) as previous:
            assert len(previous) == len(patch)
            for (module, constant, _), value in zip(previous, patch.values()):
                assert getattr(module, constant) == value, (name, constant)


def test_launch_patches_hold_inside_the_block_only():
    """``launch_patches`` sets a configuration's constants for the block and puts them back
    after it, also when the block raises; a name without patches changes nothing."""
    from depthrewrite import grad_accumulation

    e2e = load_benchmark("e2e_throughput")
    before = grad_accumulation.ROUTE_MANY_MULTI_HEAD
    with e2e.launch_patches("mhar_block_mhsums"):
        assert grad_accumulation.ROUTE_MANY_MULTI_HEAD is True
    assert grad_accumulation.ROUTE_MANY_MULTI_HEAD == before
    with pytest.raises(RuntimeError, match="inside"):
        with e2e.launch_patches("mhar_block_mhsums"):
            raise RuntimeError("inside")
    assert grad_accumulation.ROUTE_MANY_MULTI_HEAD == before
    with e2e.launch_patches("default"):
        assert grad_accumulation.ROUTE_MANY_MULTI_HEAD == before


def test_every_backend_variant_names_real_settings():
    """Each A/B configuration's backend options are the backend's own or Inductor settings
    that exist (what the backend passes on to Inductor), and the plain model's "_cg" and
    "_cdt" references take Inductor settings only."""
    import torch

    from depthrewrite import backend

    e2e = load_benchmark("e2e_throughput")
    inductor_settings = torch._inductor.config.get_config_copy()
    gm = torch.fx.symbolic_trace(lambda x: (x + 1,))  # AOTAutograd takes tuple outputs
    for name, options in e2e.BACKEND_OPTIONS.items():
        backend.clear_reports()
        backend.depthrewrite_backend(gm, [torch.randn(1, 2)], options={**options, "inner": "aot_eager"})
        passed_on = backend.last_report().config_patches
        unknown = sorted(set(passed_on) - set(inductor_settings))
        assert not unknown, f"{name}: {unknown} are neither backend options nor Inductor settings"
        if name.startswith("baseline_"):  # compiled by Inductor itself: no backend options
            assert passed_on == options, name


def test_each_configuration_is_compared_with_the_baseline_compiled_the_same_way():
    """A CUDA-graph configuration's row (a launch variant of one too) against the baseline
    recorded as CUDA graphs: its plain peak misses the graphs' pool (session 30's table
    had compared ``mhar_block_fm_cg_tfin`` with the plain baseline: 0.107x peak)."""
    e2e = load_benchmark("e2e_throughput")
    assert e2e.baseline_of("mhar_block_fm_cg_tfin") == "baseline_cg"
    assert e2e.baseline_of("mhar_block_cg") == "baseline_cg"
    assert e2e.baseline_of("block_attnres_cdt") == "baseline_cdt"
    assert e2e.baseline_of("dar_block_fm_narrow_noasserts") == "baseline_noasserts"
    assert e2e.baseline_of("dar_block_fm_narrow_cpp") == "baseline_cpp"
    assert e2e.baseline_of("dar_block_pb_cpp") == "baseline_pb_cpp"
    assert e2e.baseline_of("mhar_block_fm_tfin") == e2e.baseline_of("dar_block") == "baseline"
    for name in e2e.CONFIGS:  # every baseline a row can name is a configuration
        assert e2e.baseline_of(name) in e2e.CONFIGS, name


def test_rows_whose_host_sets_the_pace_are_marked():
    """A row whose host takes 90 % of its step or more is marked host-bound in the table
    (session 35: the same kernels measured 105.6 and 112.5 ms a step as the host's speed
    changed); rows below that share, and rows without a host time, are not."""
    e2e = load_benchmark("e2e_throughput")
    row = {"name": "attnres", "step_ms": 112.5, "host_ms": 108.5, "host_op_us": 8.2, "tokens_per_s": 1.0,
           "peak_gib": 20.8}
    base = {"name": "baseline", "step_ms": 79.1, "host_ms": 28.2, "tokens_per_s": 1.0, "peak_gib": 16.2}
    fast = dict(row, step_ms=105.6, host_ms=92.9)
    assert e2e.host_bound(row) and not e2e.host_bound(fast) and not e2e.host_bound(base)
    assert not e2e.host_bound({"step_ms": 1.0})
    lines = e2e.table([base, row, fast]).splitlines()
    assert "108.5 (8.2) host-bound |" in lines[3] and "host-bound |" not in lines[2] + lines[4]


def test_trials_record_the_garbage_collections_inside_them():
    """``GcTimes`` counts a full collection made inside it, with its time, and none after it
    is left; ``trial_table`` prints each trial's step beside its collections (and the pointer
    tables it made, where recorded); a ``_gcfreeze`` configuration is its base configuration
    with the same patches and backend options."""
    import gc

    e2e = load_benchmark("e2e_throughput")
    garbage = [[i] for i in range(20000)]
    with e2e.GcTimes() as times:
        gc.collect(0)
        gc.collect()
    del garbage
    gc.collect()
    assert times.full == 1 and times.ms > 0.0
    row = {"name": "dar_block", "trial_ms": [113.6, 148.3], "gc_ms": [0.4, 912.0], "gc_full": [0, 1]}
    assert e2e.trial_table([row, {"name": "baseline"}]) == (
        "trials dar_block: 113.6 ms/step (gc 0 ms, 0 full), 148.3 ms/step (gc 912 ms, 1 full)")
    row["tables_made"] = [0, 130]  # rows since session 44's run 5 count the tables made too
    assert e2e.trial_table([row]).endswith("148.3 ms/step (gc 912 ms, 1 full; 130 tables made)")
    row.update(segments_made=[0, 2], rewarm_steps=4)  # and since session 45 the segments and rewarm
    assert e2e.trial_table([row]) == ("trials dar_block after 4 steps: 113.6 ms/step (gc 0 ms, 0 full; "
                                      "0 tables made, 0 segments), 148.3 ms/step (gc 912 ms, 1 full; "
                                      "130 tables made, 2 segments)")
    assert e2e.CONFIGS["dar_block_fm_narrow_gcfreeze"][:2] == e2e.CONFIGS["dar_block_fm_narrow"][:2]
    assert e2e.BACKEND_OPTIONS["dar_block_fm_narrow_gcfreeze"] == e2e.BACKEND_OPTIONS["dar_block_fm_narrow"] != {}
    assert e2e.baseline_of("dar_block_gcfreeze") == "baseline"


def test_rewarm_runs_until_a_step_changes_nothing():
    """``rewarm`` runs the least number of steps, then more until one step made no table and
    allocated no segment, and stops at the most it may run when the counts never settle."""
    e2e = load_benchmark("e2e_throughput")
    after_each_step = iter([(1, 5), (1, 5), (2, 5), (2, 5), (2, 5)])
    state = {"now": (0, 0)}

    def step():
        state["now"] = next(after_each_step)

    # steps: 1 (0,0)->(1,5), 2 (1,5)->(1,5) but the least is 3, 3 (1,5)->(2,5), 4 (2,5)->(2,5): settled
    assert e2e.rewarm(step, least=3, most=12, counts=lambda: state["now"]) == 4
    growing = iter(range(100))
    assert e2e.rewarm(lambda: None, least=2, most=5, counts=lambda: next(growing)) == 5


def test_launchers_host_time_is_counted_inside_the_step_and_the_launchers_put_back(monkeypatch):
    """``launcher_host_ms`` times each launcher the step calls (through the module attribute,
    as the registered kernel functions reach it), per step, and leaves the modules' own
    functions in place afterwards, also when the step raises."""
    import time

    from depthrewrite.kernels import route_merge_triton

    e2e = load_benchmark("e2e_throughput")

    def slow_forward(*args, **kwargs):
        time.sleep(0.002)
        return "x"

    monkeypatch.setattr(route_merge_triton, "route_merge_forward", slow_forward)
    results = []

    def step():
        results.append(route_merge_triton.route_merge_forward(1, k=2))
        results.append(route_merge_triton.route_merge_forward(3))

    found = e2e.launcher_host_ms(step, 3, synchronize=lambda: None)
    assert results == ["x"] * 6
    assert set(found) == {"route_merge_forward"} and found["route_merge_forward"]["calls"] == 2
    assert found["route_merge_forward"]["ms"] >= 4.0
    assert route_merge_triton.route_merge_forward is slow_forward

    def failing():
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        e2e.launcher_host_ms(failing, 1, synchronize=lambda: None)
    assert route_merge_triton.route_merge_forward is slow_forward
