"""Data-parallel training with PyTorch's own engines: DDP and FSDP2 (``fully_shard``).

The process group comes from the environment ``torchrun`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL on CUDA, gloo on
CPU. The global batch is split across ranks (see ``data.batch_at``); rank 0 logs and saves.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

MODES = ("none", "ddp", "fsdp2")


@dataclass(frozen=True)
class DistInfo:
    mode: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(mode: str, device: str) -> DistInfo:
    """Join the process group for ``mode`` ('none' runs alone and needs no group)."""
    if mode not in MODES:
        raise ValueError(f"distributed must be one of {MODES}, found {mode!r}")
    if mode == "none":
        return DistInfo()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"distributed={mode!r} needs RANK and WORLD_SIZE in the environment: launch with "
            "torchrun --nproc-per-node N -m depthrewrite.cli train ..."
        )
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    info = DistInfo(mode, dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    log.info("distributed %s: rank %d of %d", mode, info.rank, info.world_size)
    return info


def rank_device(device: str, info: DistInfo) -> torch.device:
    """Each rank gets its own GPU (``cuda`` becomes ``cuda:LOCAL_RANK``)."""
    if device == "cuda" and info.mode != "none":
        return torch.device("cuda", info.local_rank)
    return torch.device(device)


def wrap(model: nn.Module, info: DistInfo, device: torch.device) -> nn.Module:
    """DDP around the model, or FSDP2: ``fully_shard`` on each block, then on the root."""
    if info.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if info.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ValueError(
                f"fsdp2: expected a model with a .blocks stack (bundled GPT/MoE), found {type(model).__name__}"
            )
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def mean_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean over ranks, elementwise (each rank holds the mean over its equal share)."""
    if info.mode == "none":
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / info.world_size


def barrier(info: DistInfo) -> None:
    if info.mode != "none":
        dist.barrier()


def teardown(info: DistInfo) -> None:
    """Destroy the process group, after freeing what still refers to it. A compiled DDP
    wrapper outlives its run in reference cycles; were it freed after the group, at some
    later collection or at exit, its reducer would drop the group's last reference with the
    GIL held, and gloo's destructor would join a worker thread that may be waiting for the
    GIL to free its last work: a deadlock (seen once in CI, session 61)."""
    if info.mode != "none" and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
