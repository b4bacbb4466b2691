"""Software-pipeline stages that fit the device's shared memory.

A kernel loop run through Triton's software pipeline (``tl.range(..., num_stages=S)``, the
launch configs' ``stages``) keeps ``S - 1`` copies in shared memory of every row that one
iteration loads. On wide rows those copies outgrow what a program may have: route's backward
with keys at d = 32768 in float32 asks for 512 KiB, where an H200 gives 227 KiB, and Triton
then refuses the launch (``OutOfResources``). Each launcher that pipelines passes its bytes per
stage (an upper bound: every row its loop loads) to :func:`fit_stages`, which keeps the
measured stage count where it fits and otherwise takes fewer: the most that fit, or 0 (no
pipeline: the kernels' register prefetch) where not even 2 do. A stage count set in a launch
config that does not fit is refused with the bytes it needs instead.

``tests/kernels/test_shared_memory.py`` compiles the launchers' kernels for sm_90 on a
machine without a GPU and checks that the bound holds and that every launch at the widest row
fits an H200.
"""

from __future__ import annotations

import functools
import logging

import torch

__all__ = ["RESERVE", "pipeline_bytes", "device_limit", "fit_stages"]

log = logging.getLogger(__name__)

#: shared memory a kernel takes besides the pipeline's copies (its reductions and layout
#: changes): at most 16 KiB in the compiled kernels (sm_90, Triton 3.6 and 3.9), kept twice
RESERVE = 32 * 1024


def pipeline_bytes(stages: int, stage_bytes: int) -> int:
    """Shared memory a launch of ``stages`` pipeline stages of ``stage_bytes`` each may take."""
    return max(stages - 1, 0) * stage_bytes + RESERVE


@functools.cache
def device_limit(device: torch.device) -> int | None:
    """Shared memory a program may take on ``device`` (its opt-in maximum per block), in
    bytes; None off CUDA (Triton's interpreter has no limit)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def fit_stages(op: str, stages: int, stage_bytes: int, device: torch.device, configured: bool) -> int:
    """The pipeline stages to launch with: ``stages`` where they fit ``device``'s shared
    memory, else the most that do (0 where fewer than 2 do). ``configured``: ``stages`` came
    from the caller's launch config, which is refused instead (ValueError) if it does not fit."""
    if stages < 2:
        return stages
    limit = device_limit(device)
    if limit is None or pipeline_bytes(stages, stage_bytes) <= limit:
        return stages
    fitted = stages
    while fitted >= 2 and pipeline_bytes(fitted, stage_bytes) > limit:
        fitted -= 1
    fitted = fitted if fitted >= 2 else 0
    if configured:
        raise ValueError(
            f"{op} (Triton): config stages={stages} keeps {stages - 1} copies of {stage_bytes} bytes of rows in "
            f"shared memory ({pipeline_bytes(stages, stage_bytes)} bytes with the kernel's own), more than the "
            f"{limit} bytes a program may take on {device}; at most {fitted} stages "
            f"fit here (0: no pipeline)")
    log.debug("%s: %d pipeline stages of %d bytes do not fit %d bytes of shared memory; launching with %d",
              op, stages, stage_bytes, limit, fitted)
    return fitted
