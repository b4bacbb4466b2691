"""benchmarks/per_block_memory.py and benchmarks/per_block_host.py, whose figures
docs/benchmarks.md quotes (session 57), on a small DAR block model compiled whole and block
by block."""

import torch

from tests.benchmark_scripts import load_benchmark

# two layers: the properties below hold from the second block on, and each layer more
# costs this test ~15 s of Inductor's compilation on a 2-core machine
SMALL = dict(layers=2, d_model=32, batch=2, tokens=8)


def test_block_graphs_save_the_depth_state_they_receive():
    """Compiled block by block, each block graph keeps for its backward the depth-state
    tensors it was given (inputs cost AOTAutograd's partitioner nothing to save), so more
    stream-shaped tensors are saved than by the whole graph."""
    memory = load_benchmark("per_block_memory")
    torch._dynamo.reset()
    whole = memory.measure("dar_block", per_block=False, **SMALL)
    torch._dynamo.reset()
    each = memory.measure("dar_block", per_block=True, **SMALL)
    assert 0 < each["saved_stream_shaped_inputs"] <= each["saved_stream_shaped"]
    assert each["saved_stream_shaped"] > whole["saved_stream_shaped"]
    assert each["saved_mib"] > whole["saved_mib"]
    for row in (whole, each):
        assert row["peak_mib"] >= row["at_backward_mib"] > 0


def test_the_guard_probe_checks_each_block_on_its_own_call():
    """The probe rebuilds each compiled frame's locals from the call (its free variables
    included); the guards hold on them, or it raises."""
    host = load_benchmark("per_block_host")
    torch._dynamo.reset()
    # the model and batch of the test above: its block graphs, from Inductor's caches where it ran first
    run, model = host.build("dar_block", SMALL["layers"], per_block=True, d_model=SMALL["d_model"])
    ids = torch.randint(0, model.config.vocab_size, (SMALL["batch"], SMALL["tokens"]),
                        generator=torch.Generator().manual_seed(1))

    def step():
        _, loss = run(ids, ids)
        loss.backward()

    step()
    first, again = host.guard_check_times(model, step, steps=2)
    assert len(first) == len(again) == 2 and min(first + again) > 0
    sizes = host.bytecode_sizes(model)
    assert [part.split(":")[0] for part in sizes.split(", ")] == ["block 0", "block 1"]
