"""DDP and FSDP2 (2 processes, gloo on CPU) train like one process on the same global batch;
FSDP2 also when stopped halfway and resumed from its (gathered, full) checkpoint.

Tolerance: relative 1e-5 on every logged loss. The distributed runs are not bit-identical
to one process: each rank computes its loss and gradients over half the rows (different
float32 summation order in the loss mean and possibly in the matmul blocking), and the
gradient all-reduce adds the two halves in its own order. These differ by a few float32
ulps (measured: at most 4.8e-7 absolute on losses near 5, i.e. 1 ulp, over 6 steps, resume included), which
Adam carries forward without amplifying much over a few steps. A real bug (a rank's data
missing or duplicated, gradients summed instead of averaged, a shard not updated) moves
the losses by 1e-3 or more after the first update.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from depthrewrite.train import (DataConfig, TrainConfig, TrainingInterrupted, checkpoint, load_trained, loop,
                                read_metrics, train)
from depthrewrite.train.routing_log import read_routing
from tests.conftest import corpus_bytes, free_port, join_group, leave_together, perturb_routing, rank_environment

WORLD = 2
RTOL = 1e-5


def _config(mode: str, data: str, out: str) -> TrainConfig:
    # attnres: the routing parameters and the depth state cross the DDP/FSDP2 wrappers too
    return TrainConfig(model="gpt:tiny", layers=2, scheme="attnres", data=DataConfig(source=data, doc_bytes=2048),
                       steps=6, batch_size=8, seq_len=32, warmup_steps=2, eval_every=3, eval_batches=2, out=out,
                       distributed=mode, progress=False)


#: what each spawned rank runs, in order (output folder, mode, changes): DDP straight through;
#: FSDP2 stopped halfway and resumed from its checkpoint (the sharded save/load path); FSDP2
#: with Block AttnRes, whose phase 1 gathers the next block's routing parameters, shards
#: where it runs (depthrewrite.fsdp2); DDP
#: with DAR and WAV, whose sites that open a block (DAR's transport) or read e alone (WAV's
#: detail biases) take part in the backward with a zero gradient, as DDP requires
#: and DDP with gradient accumulation (its all-reduce at the last micro-batch only)
RUNS = (("ddp", "ddp", {}), ("fsdp2", "fsdp2", {"stop_after": 3}), ("fsdp2", "fsdp2", {"resume": True}),
        ("fsdp2_block", "fsdp2", {"scheme": "block_attnres"}), ("ddp_dar", "ddp", {"scheme": "dar"}),
        ("ddp_wav", "ddp", {"scheme": "wav"}), ("ddp_accum", "ddp", {"grad_accum": 2}))
#: the one-process run each distributed run is compared with, and its scheme
REFERENCES = {"ddp": "none", "fsdp2": "none", "fsdp2_block": "none_block", "ddp_dar": "none_dar",
              "ddp_wav": "none_wav", "ddp_accum": "none"}


def _worker(rank: int, data: str, root: str, ports: list) -> None:
    for (name, mode, extra), port in zip(RUNS, ports):  # one spawn for all: starting processes is the slow part
        rank_environment(rank, port, WORLD)
        config = _config(mode, data, os.path.join(root, name))
        for name, value in extra.items():
            setattr(config, name, value)
        train(config)


def _logged(path) -> tuple[list[float], list[float]]:
    records = read_metrics(path)
    return [r["loss"] for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r]


def test_ddp_and_fsdp2_with_resume_match_one_process(tmp_path):
    torch.set_num_threads(1)
    data = tmp_path / "text.txt"
    data.write_bytes(corpus_bytes("tinyshakespeare.txt", 200_000))
    single = train(_config("none", str(data), str(tmp_path / "none")))
    for name, scheme in (("none_block", "block_attnres"), ("none_dar", "dar"), ("none_wav", "wav")):
        config = _config("none", str(data), str(tmp_path / name))
        config.scheme = scheme
        train(config)
    ports = [free_port() for _ in RUNS]
    mp.spawn(_worker, args=(str(data), str(tmp_path), ports), nprocs=WORLD, join=True)
    want_loss, want_val = _logged(tmp_path / "none" / "metrics.jsonl")
    assert want_loss == single.losses and len(want_val) == 2
    for mode, reference in REFERENCES.items():
        want_loss, want_val = _logged(tmp_path / reference / "metrics.jsonl")
        loss, val = _logged(tmp_path / mode / "metrics.jsonl")
        assert len(loss) == len(want_loss) and len(val) == len(want_val), mode
        named = lambda m, mode=mode: f"{mode}: {m}"  # noqa: E731
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), rtol=RTOL, atol=0, msg=named)
        torch.testing.assert_close(torch.tensor(val), torch.tensor(want_val), rtol=RTOL, atol=0, msg=named)
        assert (tmp_path / mode / "checkpoints" / "step_00000006.pt").exists(), mode  # rank 0 saved
        _assert_same_routing(tmp_path / mode, tmp_path / reference, named)
        _assert_loads_like(tmp_path / mode, tmp_path / reference, named)


def _assert_loads_like(run, reference, named) -> None:
    """``load_trained`` reads rank 0's checkpoint (FSDP2's gathered from the shards) into a
    model that computes what the one process's does, as the losses match."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = (load_trained(path).model(ids) for path in (run, reference))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5, msg=named)


def _assert_same_routing(run, reference, named) -> None:
    """The routing weights each evaluation recorded: the ranks' shares averaged are the one
    process's batch (routing_log), so they match it as the losses do."""
    got, want = read_routing(run), read_routing(reference)
    assert [step for step, _ in got] == [step for step, _ in want] == [3, 6], named("routing steps")
    for (_, g), (_, w) in zip(got, want):
        assert g.source_labels == w.source_labels, named("routing sources")
        torch.testing.assert_close(torch.cat(g.weights), torch.cat(w.weights), rtol=RTOL, atol=1e-7, msg=named)


def test_torchrun_cli_ddp_prints_once_and_matches_one_process(tmp_path):
    """The user-facing path: ``torchrun -m depthrewrite.cli train --distributed ddp``."""
    data = tmp_path / "text.txt"
    data.write_bytes(corpus_bytes("tinyshakespeare.txt", 100_000))
    args = ["train", "--scheme", "block_attnres", "--layers", "2", "--data", str(data), "--doc-bytes", "2048",
            "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--threads", "1",
            "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
              "--master-port", str(free_port()), "-m", "depthrewrite.cli"]
    ran = subprocess.run(launch + args + ["--distributed", "ddp", "--out", str(tmp_path / "ddp")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("gpt:tiny / block_attnres: 4 steps") == 1  # rank 0 prints, rank 1 does not
    one = train(TrainConfig(model="gpt:tiny", layers=2, scheme="block_attnres",  # the same run, one process
                            data=DataConfig(source=str(data), doc_bytes=2048), steps=4, batch_size=8, seq_len=32,
                            eval_batches=1, threads=1, progress=False))
    got, _ = _logged(tmp_path / "ddp" / "metrics.jsonl")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one.losses), rtol=RTOL, atol=0)


def _stopped_worker(rank: int, data: str, out: str, port: int) -> None:
    """Rank 0 alone gets a SIGTERM, during step 2; every rank must stop after that step."""
    rank_environment(rank, port, WORLD)
    real = loop._train_step

    def step(runner, optimizer, scheduler, tokens, index, *args, **kwargs):
        if rank == 0 and index == 1:
            signal.raise_signal(signal.SIGTERM)
        return real(runner, optimizer, scheduler, tokens, index, *args, **kwargs)

    loop._train_step = step
    try:
        train(_config("ddp", data, out))
    except TrainingInterrupted as stopped:
        assert stopped.step == 2, (rank, stopped.step)
        return
    raise AssertionError(f"rank {rank} ran to the end")


def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    data = tmp_path / "text.txt"
    data.write_bytes(corpus_bytes("tinyshakespeare.txt", 100_000))
    mp.spawn(_stopped_worker, args=(str(data), str(tmp_path / "ddp"), free_port()), nprocs=WORLD, join=True)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "ddp")] == ["step_00000002.pt"]
    loss, _ = _logged(tmp_path / "ddp" / "metrics.jsonl")
    assert len(loss) == 2


def _compiled_ddp_teardown_worker(rank: int, data: str, port: int, out: str) -> None:
    """``train`` with DDP and torch.compile; counts the DDP wrappers alive when it destroys the group."""
    from torch.nn.parallel import DistributedDataParallel

    rank_environment(rank, port, WORLD)
    destroy, alive = torch.distributed.destroy_process_group, []

    def counting_destroy(*args, **kwargs):
        alive.append(sum(type(o) is DistributedDataParallel for o in gc.get_objects()))
        return destroy(*args, **kwargs)

    torch.distributed.destroy_process_group = counting_destroy
    config = _config("ddp", data, None)
    config.steps, config.warmup_steps, config.eval_every = 2, 1, 2
    config.compile, config.backend, config.compile_options = True, "depthrewrite", {"inner": "aot_eager"}
    train(config)
    if rank == 0:
        torch.save(alive, out)


def test_compiled_ddp_training_frees_its_wrapper_before_destroying_the_group(tmp_path):
    """A compiled DDP wrapper lives on in reference cycles after its run. ``train`` frees it
    before destroying the process group: freed after, its reducer would drop gloo's group with
    the GIL held, which deadlocked a rank at exit once in CI (``distributed.teardown``)."""
    data = tmp_path / "text.txt"
    data.write_bytes(corpus_bytes("tinyshakespeare.txt", 100_000))
    out = tmp_path / "alive.pt"
    mp.spawn(_compiled_ddp_teardown_worker, args=(str(data), free_port(), str(out)), nprocs=WORLD, join=True)
    assert torch.load(out) == [0]


#: the schemes trained under torchtitan's stack: two-phase with one stream, with two, and site by site
TITAN_SCHEMES = ("block_attnres", "dar", "wav")


def _titan_losses(model, rank: int | None, steps: int = 3, summed: bool = False, device: str = "cpu") -> list[float]:
    """SGD steps on a fixed stream of batches: the whole batch in one process (``rank``
    None), or this rank's half, its loss averaged over the ranks. ``summed``: FSDP2 sums the
    ranks' gradients (torchtitan's ``set_gradient_divide_factor(1.0)``), so each rank's
    backward takes its loss divided by the number of ranks. The batches made on the CPU,
    then moved to ``device``."""
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (4, 16), generator=batches).to(device)
        mine = tokens if rank is None else tokens[rank * 2:(rank + 1) * 2]
        loss = F.cross_entropy(model(mine).flatten(0, 1), mine.flatten())
        (loss / WORLD if summed else loss).backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if rank is not None:
            torch.distributed.all_reduce(loss)
            loss /= WORLD
        losses.append(loss.item())
    return losses


def _titan_model(scheme: str, built: str):
    """The rewritten Llama: built ``"with values"`` (torch's init, seeded), ``"titan_init"``
    (then given titan_init's values) or ``"on the meta device"`` (no values yet)."""
    import depthrewrite
    from tests.handwritten_models import TitanLlama, titan_init

    torch.manual_seed(0)
    with torch.device("meta") if built == "on the meta device" else contextlib.nullcontext():
        model = TitanLlama(n_layers=4)
    if built == "titan_init":
        titan_init(model)
    return depthrewrite.rewrite(model, scheme, example_inputs=(torch.randint(0, 128, (2, 8)),), meta_init=titan_init)


def _titan_worker(rank: int, port: int, out: str, built: str, hsdp: bool, on_gpus: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import depthrewrite
    from depthrewrite import backend
    from tests.handwritten_models import titan_init

    # on GPUs: nccl, Inductor and the fused kernels (the backend's defaults); on the CPU:
    # gloo and AOTAutograd alone (Inductor's C++ compiles would take minutes)
    device = join_group(rank, port, WORLD, on_gpus)
    options = None if on_gpus else {"inner": "aot_eager"}
    # HSDP: each rank a replica holding the whole of every parameter as its one shard
    mesh = init_device_mesh("cuda" if on_gpus else "cpu", (WORLD, 1),
                            mesh_dim_names=("replicate", "shard")) if hsdp else None
    losses, phase_one = {}, {}
    try:
        # the block's call updates the depth runtime inside each checkpoint (README, torch.compile)
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            for scheme in TITAN_SCHEMES:
                torch._dynamo.reset()  # one model's blocks at a time on checkpoint_wrapper's code (README)
                backend.clear_reports()
                model = _titan_model(scheme, built)
                if built != "on the meta device":
                    model.to(device)
                # torchtitan's order: activation checkpointing, then compile, then FSDP2, per block
                for name, layer in list(model.layers.items()):
                    layer = checkpoint_wrapper(layer, preserve_rng_state=False)
                    layer = torch.compile(layer, backend="depthrewrite", fullgraph=True, options=options)
                    model.layers.register_module(name, layer)
                for layer in model.layers.values():
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                summed = built == "on the meta device"  # torchtitan's reduction too: summed, not averaged
                if summed:
                    for module in model.modules():
                        if isinstance(module, FSDPModule):
                            module.set_gradient_divide_factor(1.0)
                            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
                if built == "on the meta device":
                    model.to_empty(device=device)
                    titan_init(model)
                    depthrewrite.reset_routing_parameters(model)
                losses[scheme] = _titan_losses(model, rank, summed=summed, device=device)
                phase_one[scheme] = sum(n for op, n in backend.lowered_ops().items() if "route_many " in op)
        leave_together()
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save((losses, phase_one), out)


#: GPUs: the losses of Inductor's fused code and our Triton kernels against eager on the
#: same GPU, float32; the one-GPU tests compare gradients at 1e-4 (test_per_block_compile.py)
GPU_RTOL = 1e-4
#: how the model is built, how it is sharded, and where it trains: 2 CPU ranks, or 2 GPUs
#: where the machine has them (the device machine's multi-GPU kinds). There FSDP2 reduces on
#: its own CUDA streams, which one rank or gloo never shows (the race that
#: fsdp2._add_after_backward closes, session 60)
TITAN_RUNS = [
    pytest.param("with values", "FSDP", False, id="with values-FSDP-cpu"),
    # torchtitan's meta-device build and its summed reduction under HSDP, in one run (two
    # until session 65: each run of the three schemes costs CI a minute)
    pytest.param("on the meta device", "HSDP", False, id="on the meta device-HSDP-cpu"),
    pytest.param("with values", "FSDP", True, id="with values-FSDP-2 GPUs", marks=pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs (the device machine's multi-GPU kinds)")),
]


@pytest.mark.parametrize("built,sharding,on_gpus", TITAN_RUNS)
def test_torchtitans_stack_trains_like_one_process(tmp_path, built, sharding, on_gpus):
    """torchtitan's training set-up on a rewritten torchtitan-style Llama: each block
    checkpointed (``checkpoint_wrapper``), compiled with the backend (``fullgraph=True``)
    and sharded with FSDP2, on 2 ranks: the losses of 3 SGD steps match one eager process
    on the whole batch. The two-phase schemes (Block AttnRes, DAR) run phase 1 under FSDP2
    too: it gathers the next block's routing parameters, which are shards where it runs,
    and reduces their gradients as FSDP2 does (averaged, FSDP2's default; summed where
    ``set_gradient_divide_factor(1.0)``, as torchtitan sets, in the meta case), and under
    HSDP (2 replicas of one shard: the replicas' gradients added by an all-reduce).
    Built on the meta device, as torchtitan builds: rewritten there, wrapped, compiled and
    sharded, then ``to_empty``, the model's init and ``reset_routing_parameters`` on the
    shards; the one process builds the same values on the CPU and rewrites them. On 2
    GPUs: nccl, Inductor and the fused kernels, against one eager process on the first."""
    out = tmp_path / "losses.pt"
    mp.spawn(_titan_worker, args=(free_port(), str(out), built, sharding == "HSDP", on_gpus), nprocs=WORLD, join=True)
    got, phase_one = torch.load(out)
    # two-phase under FSDP2: route_many in the block graphs (WAV routes site by site by default)
    assert phase_one == {"block_attnres": phase_one["block_attnres"], "dar": phase_one["dar"], "wav": 0}
    assert phase_one["block_attnres"] > 0 and phase_one["dar"] > 0, phase_one
    device = "cuda:0" if on_gpus else "cpu"
    for scheme in TITAN_SCHEMES:
        model = _titan_model(scheme, "with values" if built == "with values" else "titan_init").to(device)
        want = _titan_losses(model, None, device=device)
        assert want[-1] < want[0], scheme  # the steps train
        torch.testing.assert_close(torch.tensor(got[scheme]), torch.tensor(want), rtol=GPU_RTOL if on_gpus else RTOL,
                                   atol=0, msg=scheme)


#: the two-phase schemes, whose phase 1 gathers the next block's shards under FSDP2
REENTRANT_SCHEMES = ("block_attnres", "dar")


def _checkpoint_forward_reentrant(layer) -> None:
    """``layer.forward`` run through a re-entrant checkpoint, as Hugging Face's
    ``gradient_checkpointing_enable()`` with ``use_reentrant=True`` runs it (keywords bound
    first: the re-entrant form takes none)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    inner = layer.forward

    def forward(*args, **kwargs):
        return checkpoint(functools.partial(inner, **kwargs), *args, use_reentrant=True)

    layer.forward = forward


def _reentrant_worker(rank: int, port: int, out: str, ranks: int, on_gpus: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    from depthrewrite import fsdp2

    device = join_group(rank, port, ranks, on_gpus)
    losses, nested, waited = {}, {}, {}
    # where each end-of-backward addition ran (in a nested backward, the checkpoint's, or
    # not), and how many of FSDP2's reductions it found pending (none on the CPU: no streams)
    add_now, wait, outer_tasks, add_tasks, pending = fsdp2._add_now, fsdp2.wait_for_fsdp_reductions, set(), [], []

    def recorded_add(task):
        add_tasks.append(task)
        return add_now(task)

    def recorded_wait(params):
        pending.append(sum(len(fsdp2.pending_reductions(g)) for g in fsdp2.holding_groups(params)))
        return wait(params)

    fsdp2._add_now, fsdp2.wait_for_fsdp_reductions = recorded_add, recorded_wait
    try:
        for scheme in REENTRANT_SCHEMES:
            model = _titan_model(scheme, "with values").to(device)
            for layer in model.layers.values():
                _checkpoint_forward_reentrant(layer)
                fully_shard(layer)
            fully_shard(model)
            # the outer backward's task, seen from a hook on the logits' gradient
            model.output.register_full_backward_hook(
                lambda *_: outer_tasks.add(torch._C._current_graph_task_id()))
            add_tasks.clear()
            pending.clear()
            # one rank takes the whole batch
            losses[scheme] = _titan_losses(model, rank if ranks > 1 else None, device=device)
            # the phase 1 of blocks 1.. runs inside the checkpointed forwards: added from
            # their nested backwards (block 0's, made as the state starts in its call,
            # outside the checkpoint, from the outer one)
            nested[scheme] = len(set(add_tasks) - outer_tasks)
            waited[scheme] = sum(pending)
        leave_together()
    finally:
        fsdp2._add_now, fsdp2.wait_for_fsdp_reductions = add_now, wait
        torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save((losses, nested, waited), out)


#: (ranks, on GPUs) of the re-entrant test: gloo on the CPU; nccl on one GPU (FSDP2's streams
#: and events, one rank); nccl on two
REENTRANT_RUNS = [
    pytest.param(WORLD, False, id="cpu"),
    pytest.param(1, True, id="1 GPU", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param(WORLD, True, id="2 GPUs", marks=pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs (the device machine's multi-GPU kinds)")),
]


@pytest.mark.parametrize("ranks,on_gpus", REENTRANT_RUNS)
def test_reentrant_checkpoint_of_each_forward_under_fsdp2_trains_like_one_process(tmp_path, ranks, on_gpus):
    """Each block's forward checkpointed re-entrantly (Hugging Face's
    ``gradient_checkpointing_enable()`` with ``use_reentrant=True``) and sharded with FSDP2:
    phase 1's gradients reach the next block's shards from inside the checkpoint's nested
    backward, whose end comes before FSDP2's final callback (the test checks that they
    did), and the losses of 3 SGD steps match one process without checkpoints or FSDP2.
    Our addition then waits for FSDP2's pending reductions into the same ``.grad``
    (``fsdp2.wait_for_fsdp_reductions``): on the GPUs (nccl, the fused kernels, eager) the
    test checks that it found some pending, since FSDP2 reduces on streams of its own; on the
    CPU there are none. The race that wait closes shows on 2 GPUs only."""
    out = tmp_path / "losses.pt"
    mp.spawn(_reentrant_worker, args=(free_port(), str(out), ranks, on_gpus), nprocs=ranks, join=True)
    got, nested, waited = torch.load(out)
    assert all(nested[scheme] > 0 for scheme in REENTRANT_SCHEMES), nested
    if on_gpus:
        assert all(waited[scheme] > 0 for scheme in REENTRANT_SCHEMES), waited
    device = "cuda:0" if on_gpus else "cpu"
    for scheme in REENTRANT_SCHEMES:
        want = _titan_losses(_titan_model(scheme, "with values").to(device), None, device=device)
        torch.testing.assert_close(torch.tensor(got[scheme]), torch.tensor(want), rtol=GPU_RTOL if on_gpus else RTOL,
                                   atol=0, msg=scheme)


#: the schemes compiled whole under DDP: the depth state crosses DDPOptimizer's graph splits
DDP_COMPILE_SCHEMES = ("dar", "wav", "attnres")


def _ddp_compile_model(scheme: str):
    import depthrewrite
    from depthrewrite.models.gpt import gpt_from_preset

    torch.manual_seed(0)
    # d = 128: each layer's parameters (~0.8 MB) fill DDP's smallest bucket, 1 MB
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=3, d_model=128), scheme)
    perturb_routing(model)
    return model


def _free_before_leaving(ddp_modules: list) -> None:
    """Free every DDP module while the process group is still registered. A DDP module freed
    after ``destroy_process_group`` (at the worker's return) drops the group's last reference
    from its reducer, with the GIL held; gloo's destructor then joins its worker threads, one
    of which may be freeing the last barrier's work and waits for the GIL: rank 1 hung so
    once in CI (session 61)."""
    # the compiled DDP modules outlive their ``del`` in cycles that Dynamo's caches hold:
    # on torch 2.13 either of these two lines alone frees them
    torch._dynamo.reset()
    gc.collect()
    alive = sum(ref() is not None for ref in ddp_modules)
    if alive:
        raise RuntimeError(f"{alive} DDP module(s) still alive before the process group is destroyed")


def _ddp_compile_worker(rank: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from depthrewrite import backend

    join_group(rank, port, WORLD)
    found, ddp_modules = {}, []
    try:
        for scheme in DDP_COMPILE_SCHEMES:
            torch._dynamo.reset()
            backend.clear_reports()
            model = _ddp_compile_model(scheme)
            ddp = DDP(model, bucket_cap_mb=1)
            ddp_modules.append(weakref.ref(ddp))
            # torch.compile of the DDP module: Dynamo's DDPOptimizer splits the graph where
            # DDP's buckets end, and the backend compiles each piece
            compiled = torch.compile(ddp, backend="depthrewrite", options={"inner": "aot_eager"})
            tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
            mine = tokens[rank * 2:(rank + 1) * 2]
            _, loss = compiled(mine, mine)
            loss.backward()
            found[scheme] = ({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                             [r.num_routing_ops for r in backend.reports()])
            del ddp, compiled, loss
        _free_before_leaving(ddp_modules)
        leave_together()
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save(found, out)


def _routing_calls_compiled_whole(scheme: str, tokens) -> int:
    """The routing calls of the model's graph compiled in one piece (one process, no DDP)."""
    from depthrewrite import backend

    torch._dynamo.reset()
    backend.clear_reports()
    with torch.no_grad():
        torch.compile(_ddp_compile_model(scheme), backend="depthrewrite", options={"inner": "aot_eager"})(tokens)
    (report,) = backend.reports()
    return report.num_routing_ops


def test_ddp_compiled_whole_splits_its_graph_and_matches_one_process(tmp_path):
    """``torch.compile(DDP(model), backend="depthrewrite")`` on 2 ranks with DDP's smallest
    buckets: the graph reaches the backend in several pieces, between which the depth state
    passes, the pieces hold the routing calls of the graph compiled whole, and each gradient equals one
    eager process's on the whole batch (DDP averages the ranks' halves)."""
    out = tmp_path / "ddp.pt"
    mp.spawn(_ddp_compile_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    found = torch.load(out)
    for scheme in DDP_COMPILE_SCHEMES:
        model = _ddp_compile_model(scheme)
        tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
        _, loss = model(tokens, tokens)
        loss.backward()
        grads, routing_calls = found[scheme]
        assert len(routing_calls) > 1, (scheme, routing_calls)
        assert sum(routing_calls) == _routing_calls_compiled_whole(scheme, tokens), (scheme, routing_calls)
        want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == want.keys(), scheme
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{scheme}: {name}")
