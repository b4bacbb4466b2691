"""Tensor parallelism (2 gloo ranks on the CPU, torchtitan's Llama with its TP plan):
plain tensor parallelism routes like one process; sequence parallelism is refused, eagerly
and by the backend, and without the refusal its routing gradients would be wrong
(depthrewrite/tensor_parallel.py).

Tolerance, against one process on the same batch: the loss to relative 1e-5; each routing
gradient to 1e-4 of its largest element. The ranks' matmuls add their shards' products in
another order than one process, which moves each token's term by float32 ulps; a routing
gradient sums those terms over the tokens, with both signs, and was off by at most 3.0e-5 of
its largest element (2e-6 absolute). A gradient missing a rank's share is off by tens of
percent (measured 17-80 % of the largest element on these shapes).
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import depthrewrite
from depthrewrite import tensor_parallel
from tests.conftest import free_port, join_group, leave_together, perturb_routing
from tests.handwritten_models import TitanLlama

WORLD = 2
RTOL = 1e-5
GRAD_TOL = 1e-4  # of each gradient's largest element (module docstring)
#: each plain-TP run: (scheme, compiled with the backend)
PLAIN_RUNS = (("block_attnres", False), ("dar", False), ("wav", False), ("block_attnres", True))


def _model(scheme: str) -> tuple[TitanLlama, torch.Tensor]:
    torch.manual_seed(0)
    model = TitanLlama(n_layers=3, dim=32)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    depthrewrite.rewrite(model, scheme, example_inputs=(tokens,))
    perturb_routing(model)
    return model, tokens


def _gradients(model: TitanLlama, tokens: torch.Tensor, compiled: bool = False) -> tuple[float, dict]:
    """The loss and every routing parameter's gradient (whole, as one process has it)."""
    run = torch.compile(model, backend="depthrewrite", options={"inner": "aot_eager"}) if compiled else model
    loss = F.cross_entropy(run(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if ".depth_route." in name and param.grad is not None:
            grad = param.grad
            grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return loss.item(), grads


def _parallelize(model: TitanLlama, mesh, sequence_parallel: bool) -> None:
    """torchtitan's TP plan for its Llama blocks; with ``sequence_parallel`` its norms and
    the stream between the blocks sharded on the sequence (the final norm, routed, left
    out: its router is its child, which SequenceParallel cannot replicate)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    for block in model.layers.values():
        plan = {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv",
                                                     "feed_forward.w1", "feed_forward.w3")}
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
        else:
            plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})


def _tp_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    join_group(rank, port, WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    found = {"plain": {}, "refused": {}}
    try:
        for scheme, compiled in PLAIN_RUNS:
            torch._dynamo.reset()
            model, tokens = _model(scheme)
            _parallelize(model, mesh, sequence_parallel=False)
            found["plain"][scheme, compiled] = _gradients(model, tokens, compiled)
        for compiled in (False, True):
            torch._dynamo.reset()
            model, tokens = _model("block_attnres")
            _parallelize(model, mesh, sequence_parallel=True)
            try:
                _gradients(model, tokens, compiled)
                found["refused"][compiled] = None
            except Exception as exc:  # compiled, Dynamo wraps the backend's error
                found["refused"][compiled] = str(exc)
        # the refusal's reason: without it, sequence parallelism runs and its gradients are off
        check = tensor_parallel.check_no_sequence_parallel
        tensor_parallel.check_no_sequence_parallel = lambda *args: None
        try:
            model, tokens = _model("block_attnres")
            _parallelize(model, mesh, sequence_parallel=True)
            found["unchecked"] = _gradients(model, tokens)
        finally:
            tensor_parallel.check_no_sequence_parallel = check
        leave_together()
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save(found, out)


def _largest_relative_error(got: dict, want: dict) -> float:
    """The largest error of any gradient, relative to that gradient's largest element."""
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n in want)


def test_plain_tensor_parallelism_routes_like_one_process_and_sequence_parallelism_is_refused(tmp_path):
    out = tmp_path / "tp.pt"
    mp.spawn(_tp_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    found = torch.load(out)
    for (scheme, compiled), (loss, grads) in found["plain"].items():
        want_loss, want = _gradients(*_model(scheme))
        assert grads.keys() == want.keys() and len(want) > 0, scheme
        torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=0, msg=f"{scheme} compiled={compiled}")
        assert _largest_relative_error(grads, want) < GRAD_TOL, (scheme, compiled)
    for compiled, message in found["refused"].items():
        assert message is not None and "sequence parallelism" in message, (compiled, message)
        assert ("depthrewrite backend" in message) == compiled, message
        assert "attention_norm" in message, message  # named by its path, compiled too
    loss, grads = found["unchecked"]
    want_loss, want = _gradients(*_model("block_attnres"))
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=0)  # the forward is right...
    assert _largest_relative_error(grads, want) > 0.1  # ...the routing gradients are not
