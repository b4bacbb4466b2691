"""depthrewrite.fsdp2's gather of FSDP2's shards, on 3 gloo ranks: parameters of several
shapes whose rows the ranks do not divide evenly (FSDP2's chunks of 2, 2 and 1 rows, and
one rank holding no row at all) gathered in one collective come back whole, and the
gradient reaching them lands on each sharded parameter's ``.grad`` summed over the ranks
and divided as FSDP2 divides (by the number of ranks by default, by a set
``gradient_divide_factor`` otherwise), after the callbacks queued as the backward began
(FSDP2's, which waits for the reduce-scatters writing the ``.grad`` we add to). The model-level runs (phase 1 under FSDP2 and HSDP
against one process) are in tests/e2e/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.conftest import free_port, join_group, leave_together

RANKS = 3
#: the parameters' shapes: 5 rows over 3 ranks (chunks 2, 2, 1), 4 rows of 3 (2, 2, 0), 1 row
#: of 3; each rank's part of the gather holds 2, 6 and 3 elements of them, so that no
#: order but the right one lays them out the same
SHAPES = ((5,), (4, 3), (1, 3))


def _weights(rank: int) -> list[torch.Tensor]:
    """What each rank multiplies the gathered parameters by: its loss's gradient, distinct
    by rank and element."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _worker(rank: int, port: int, factor: float | None, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from depthrewrite import fsdp2

    join_group(rank, port, RANKS)
    try:
        torch.manual_seed(0)  # the same values on every rank
        module = nn.Module()
        for i, shape in enumerate(SHAPES):
            module.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape)))
        whole = [p.detach().clone() for p in module.parameters()]
        fully_shard(module)
        if factor is not None:
            module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        params = list(module.parameters())
        plans = fsdp2.gather_plans(params)
        assert all(q is not None for q in plans), plans
        # asked again (eager phase 1 asks at every call), the groups come from the cache,
        # FSDP2's states not walked
        walk, fsdp2._walk_fsdp_groups = fsdp2._walk_fsdp_groups, None
        try:
            assert fsdp2.gather_plans(params) == plans
        finally:
            fsdp2._walk_fsdp_groups = walk
        assert len({fsdp2.batch_key(q) for q in plans}) == 1  # one collective for all
        tap = fsdp2.tap_for(module, "all", params, plans)
        assert fsdp2.tap_for(module, "all", params, plans) is tap  # kept, not made again
        gathered = fsdp2.gathered(params, plans, tap)
        loss = sum((w * g).sum() for w, g in zip(_weights(rank), gathered))
        # FSDP2 queues its final callback (the one that waits for its reduce-scatters) as the
        # backward begins: one queued then must still see no gradient of ours
        seen_at_first_callback = []
        loss.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(
            lambda: seen_at_first_callback.append([p.grad for p in params])))
        loss.backward()
        assert seen_at_first_callback == [[None] * len(params)]
        grads = [p.grad.full_tensor() for p in params]
        local_rows = [p.to_local().shape[0] for p in params]
        leave_together()
    finally:
        torch.distributed.destroy_process_group()
    torch.save((whole, [g.detach() for g in gathered], grads, local_rows), f"{out}.{rank}")


@pytest.mark.parametrize("factor", [None, 1.0])
def test_shards_of_uneven_rows_gather_in_one_collective_and_their_gradients_reduce_as_fsdp2s(tmp_path, factor):
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(free_port(), factor, out), nprocs=RANKS, join=True)
    results = [torch.load(f"{out}.{rank}") for rank in range(RANKS)]
    whole = results[0][0]
    assert [r[3] for r in results] == [[2, 2, 1], [2, 2, 0], [1, 0, 0]]  # the uneven shards the test is about
    summed = [sum(w) for w in zip(*(_weights(rank) for rank in range(RANKS)))]
    divisor = RANKS if factor is None else factor
    for _, gathered, grads, _ in results:
        for value, got in zip(whole, gathered):
            torch.testing.assert_close(got, value, rtol=0, atol=0)  # the same values, whole
        for expected, got in zip(summed, grads):
            torch.testing.assert_close(got, expected / divisor, rtol=1e-6, atol=1e-6)
