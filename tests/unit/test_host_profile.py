"""benchmarks/host_profile.py sums a profile's self time by package; the docs' map of a
step's host time rests on where it puts each function, builtins above all (a tensor
method's time belongs to the code that called it)."""

import cProfile
import pstats

import torch

from depthrewrite.kernels import route_triton
from tests.benchmark_scripts import load_benchmark


def _profiled(fn, calls: int) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    return pstats.Stats(profiler)


def test_a_builtin_counts_for_the_package_that_called_it():
    host_profile = load_benchmark("host_profile")
    rows = [torch.randn(4, 8) for _ in range(3)]
    # _contiguous is one of our launchers' helpers; the tensor methods it calls are builtins
    stats = _profiled(lambda: route_triton._contiguous([r.t() for r in rows]), 200)
    packages = host_profile.by_package(stats, steps=200)
    builtins = [(key, entry) for key, entry in stats.stats.items() if key[0] == "~" and "contiguous" in key[2]]
    assert builtins, "the profile must hold Tensor.contiguous as a builtin"
    own_ms = sum(entry[2] for _, entry in builtins) * 1e3 / 200
    assert packages["depthrewrite launchers"] >= own_ms > 0


def test_packages_are_matched_by_path_first_match_wins():
    host_profile = load_benchmark("host_profile")
    assert host_profile.package_of("/x/depthrewrite/kernels/route_many_triton.py", "route_many_forward") == \
        "depthrewrite launchers"
    assert host_profile.package_of("/x/depthrewrite/passes/two_phase.py", "f") == "depthrewrite other"
    assert host_profile.package_of("/tmp/torchinductor_root/ab/cab.py", "call") == "inductor wrapper code"
    assert host_profile.package_of("/x/torch/distributed/fsdp/_fully_shard/_fsdp_state.py", "f") == "fsdp"
    assert host_profile.package_of("/x/torch/distributed/_functional_collectives.py", "f") == "distributed"
    assert host_profile.package_of("/x/elsewhere.py", "f") == "other"
