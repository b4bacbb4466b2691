"""benchmarks/e2e_throughput.py's A/B configurations: each launch constant a configuration
sets exists in its module, is set, and is put back (a misspelt one would fail only on the
device, after its models compiled)."""

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton")


def test_every_launch_patch_sets_an_existing_constant():
    e2e = load_benchmark("e2e_throughput")
    assert "dar_block_exact" in e2e.CONFIGS and "block_attnres_exact" in e2e.CONFIGS
    for name, patch in e2e.LAUNCH_PATCHES.items():
        previous = e2e.apply_launch_patches(name)
        try:
            assert len(previous) == len(patch)
            for (module, constant, _), value in zip(previous, patch.values()):
                assert getattr(module, constant) == value, (name, constant)
        finally:
            for module, constant, value in reversed(previous):
                setattr(module, constant, value)
