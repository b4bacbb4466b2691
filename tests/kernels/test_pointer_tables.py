"""The routing kernels' pointer tables (:mod:`depthrewrite.kernels.pointer_tables`): the
cache of uploaded tables, and the fused kernels captured in CUDA graphs (GPU only), the
path ``torch.compile(..., mode="reduce-overhead")`` takes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from depthrewrite.kernels import pointer_tables as pt  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(autouse=True)
def _empty_cache():
    pt.clear_cache()
    yield
    pt.clear_cache()


def _tensors(n):
    return [torch.randn(4, 8, device=DEVICE) for _ in range(n)]


def test_tables_hold_the_addresses_in_order_with_zero_for_none():
    a, b = _tensors(3), _tensors(2)
    first, second = pt.pointer_tables(DEVICE, a, [b[0], None, b[1]])
    assert first.tolist() == [t.data_ptr() for t in a]
    assert second.tolist() == [b[0].data_ptr(), 0, b[1].data_ptr()]


def test_a_repeated_call_reuses_its_tables_and_any_difference_makes_new_ones():
    a, b = _tensors(3), _tensors(3)
    tables = pt.pointer_tables(DEVICE, a, b)
    assert pt.pointer_tables(DEVICE, a, b) is tables
    # same addresses split differently, a changed address: tables of their own, right content
    regrouped = pt.pointer_tables(DEVICE, a + b[:1], b[1:])
    assert regrouped is not tables and regrouped[0].tolist() == [t.data_ptr() for t in a + b[:1]]
    changed = pt.pointer_tables(DEVICE, a[:2] + b[:1], b)
    assert changed[0].tolist()[2] == b[0].data_ptr()
    assert tables[0].tolist() == [t.data_ptr() for t in a]  # the cached entry is unchanged


def test_the_cache_keeps_the_most_recent_entries(monkeypatch):
    monkeypatch.setattr(pt, "CACHE_ENTRIES", 2)
    groups = [_tensors(1) for _ in range(3)]
    first = pt.pointer_tables(DEVICE, groups[0])
    pt.pointer_tables(DEVICE, groups[1])
    assert pt.pointer_tables(DEVICE, groups[0]) is first  # refreshed: now the most recent
    pt.pointer_tables(DEVICE, groups[2])  # evicts groups[1], the least recent
    assert pt.pointer_tables(DEVICE, groups[0]) is first
    assert len(pt._cache) == 2


def test_threads_sharing_the_cache_get_the_right_tables(monkeypatch):
    """Several threads looking up, inserting and evicting at once (a small cache): every
    returned table holds the addresses it was asked for."""
    import concurrent.futures

    monkeypatch.setattr(pt, "CACHE_ENTRIES", 8)
    groups = [_tensors(3) for _ in range(24)]

    def work(seed):
        rng = torch.Generator().manual_seed(seed)
        for _ in range(300):
            a, b = (groups[int(i)] for i in torch.randint(0, len(groups), (2,), generator=rng))
            first, second = pt.pointer_tables(DEVICE, a, b[:2])
            if first.tolist() != [t.data_ptr() for t in a] or second.tolist() != [t.data_ptr() for t in b[:2]]:
                return False
        return True

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: between a lookup and its refresh too
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(pool.map(work, range(4)))
    finally:
        sys.setswitchinterval(interval)
    assert len(pt._cache) <= 8


@gpu_only
def test_the_stream_is_part_of_the_key():
    a = _tensors(2)
    tables = pt.pointer_tables(DEVICE, a)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = pt.pointer_tables(DEVICE, a)
    side.synchronize()
    assert other is not tables and other[0].tolist() == tables[0].tolist()


def _route_inputs(n, tokens, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    values = [torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n)]
    query = torch.randn(d, device="cuda", generator=gen) * 2 / d**0.5
    weight = torch.rand(d, device="cuda", generator=gen) + 0.5
    grad = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    acc = [torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n)]
    return values, query, weight, grad, acc


def _step(values, query, weight, grad, acc):
    out, lse, _ = torch.ops.depthrewrite.route.default(values, None, query, weight, None, None, 2, 1e-6)
    grads = torch.ops.depthrewrite.route_backward.default(grad, out, lse, values, None, query, weight, None, None, 2,
                                                          1e-6, None, None, 1e-6, acc, None)
    return [out, *grads[0], grads[2], grads[3]]


@gpu_only
def test_captured_fused_route_replays_bit_for_bit_on_new_data():
    import depthrewrite.kernels  # noqa: F401  (registers the CUDA kernels)

    static = _route_inputs(9, 333, 1000, seed=0)
    flat_static = [static[0], [static[1]], [static[2]], [static[3]], static[4]]
    _step(*static)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    kept = len(pt._captured_host_tables)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = _step(*static)
    assert len(pt._captured_host_tables) > kept  # the tables were copied inside the graph
    for seed in (1, 2):
        fresh = _route_inputs(9, 333, 1000, seed=seed)
        for dst, src in zip(sum(flat_static, []), sum([fresh[0], [fresh[1]], [fresh[2]], [fresh[3]], fresh[4]], [])):
            dst.copy_(src)
        # churn both allocators between capture and replay: the graph must not depend on
        # host or device blocks that were handed back
        for _ in range(20):
            pt.pointer_tables(torch.device("cuda"), _tensors(5))
            torch.tensor(list(range(64)), dtype=torch.int64, pin_memory=True).to("cuda", non_blocking=True)
        graph.replay()
        expected = _step(*fresh)
        torch.cuda.synchronize()
        for got, want in zip(results, expected):
            assert torch.equal(got, want)


@gpu_only
@pytest.mark.parametrize("scheme,options", [("block_attnres", {}), ("dar", {"layers_per_block": 2})])
def test_reduce_overhead_compilation_matches_eager_on_fresh_batches(scheme, options):
    """The whole compiled step recorded as CUDA graphs (Inductor's cudagraph trees) with
    the fused kernels inside: loss and gradients match eager, step after step, on new data."""
    import depthrewrite
    from depthrewrite import backend
    from depthrewrite.models.gpt import gpt_from_preset

    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=4), scheme, **options).cuda().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.add_(0.1 * torch.randn_like(p))
    torch._dynamo.reset()
    backend.clear_reports()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(1)
    kept = len(pt._captured_host_tables)
    for step in range(4):  # warm-up, recording, then replays
        idx = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda", generator=gen)
        results = []
        for fn in (compiled, model):
            torch.compiler.cudagraph_mark_step_begin()
            model.zero_grad(set_to_none=True)
            _, loss = fn(idx, idx)
            loss.backward()
            results.append((loss.detach().clone(),
                            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (loss, grads), (eager_loss, eager_grads) = results
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        assert grads.keys() == eager_grads.keys()
        for name in eager_grads:
            torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
    report = backend.last_report()
    assert report.config_patches.get("triton.cudagraphs")
    # the routing calls were captured (their tables copied inside the graphs), not skipped
    assert len(pt._captured_host_tables) >= kept + report.num_routing_ops
    assert set(report.implementation.values()) == {"triton"}


def test_cache_counts_say_which_lookups_found_their_table():
    """``cache_counts``: a first lookup makes its table, a repeat finds it, new addresses
    make another (clear_cache keeps the counts: they are the process's)."""
    a, b = _tensors(2), _tensors(2)
    before = pt.cache_counts()
    pt.pointer_tables(DEVICE, a)
    pt.pointer_tables(DEVICE, a)
    pt.pointer_tables(DEVICE, b)
    pt.clear_cache()
    pt.pointer_tables(DEVICE, a)
    after = pt.cache_counts()
    assert (after["made"] - before["made"], after["hits"] - before["hits"]) == (3, 1)


def test_tables_report_each_groups_alignment_and_a_hit_keeps_it():
    """The kernels' ALIGNED hint comes from the tables: a group is aligned when every
    address in it is a multiple of 16 bytes (0 for None counts as one). A contiguous view one
    element into its storage is 4 bytes off for float32, so its group alone is not."""
    a, b = _tensors(2), _tensors(2)
    shifted = torch.randn(33, device=DEVICE)[1:].view(4, 8)
    tables = pt.pointer_tables(DEVICE, a, [b[0], shifted], [None, b[1]], [])
    assert tables.aligned == (True, False, True, True)
    assert tables.all_aligned(0, 2, 3) and not tables.all_aligned(1) and not tables.all_aligned()
    again = pt.pointer_tables(DEVICE, a, [b[0], shifted], [None, b[1]], [])
    assert again is tables and again.aligned == (True, False, True, True)
