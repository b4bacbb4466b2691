"""The routing kernels' shared memory, compiled for sm_90 (and sm_80, sm_89) on a machine
without a GPU.

Triton's software pipeline keeps copies of a loop's rows in shared memory; at wide rows they
outgrew an H200's 227 KiB and the launches failed (``OutOfResources``: 12 of the GPU kernel
tests at d = 32768 in session 55, in route's and route_merge's backwards and route_many's
forward and backward). ``depthrewrite.kernels.shared_memory.fit_stages`` now fits the stages
to the device. ``shared_memory_probe.py`` records the launchers' launches (a GPU's limit
assumed: an H200's unless given) and compiles each with the installed Triton: its
``metadata.shared`` is what the GPU would be asked for.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from depthrewrite.kernels import shared_memory  # noqa: E402

PROBE = pathlib.Path(__file__).with_name("shared_memory_probe.py")
H200_SHARED = 232448

#: the widest row the kernels take (MAX_ROW = 32768), float32 with every extra row a loop loads
WIDEST = ["route:32768:1:fp32:keys,acc:default", "route:32768:1:bf16:keys:default", "route:32768:16:fp32:keys:default",
          "route_many:32768:1:fp32:keys,acc:default", "route_many:32768:1:bf16::default",
          "route_many:32768:16:fp32:keys:default", "route_merge:32768:16:fp32:keys,norm:default",
          "route_merge:32768:16:bf16:keys:default", "route:32768:1:fp32:keys,norm:default",
          "route:32768:16:bf16:norm,fused:default"]
#: the token sum's kernel (no pipeline of ours) at the widest row in float32 and at block
#: MHAR's 16 heads in bf16: it compiles for sm_90 off the GPU (none was lent when it was
#: written), and within an H200's shared memory (Triton 3.9 gives it none at one head, and
#: 512 bytes at 16 heads, whose 128-row tiles sum their rows across warps)
TOKEN_SUM = ["token_sum:32768:1:fp32::default", "token_sum:1024:16:bf16::default"]
#: pipelines asked for by the launch config at rows where they fit: the bound against the compiler
PIPELINED = ["route:1024:1:fp32:keys,acc:3", "route:2048:16:bf16:keys:3", "route_many:1024:1:fp32:keys,acc:3",
             "route_many:1024:16:bf16:keys,acc:3", "route_merge:1024:16:fp32:keys,norm:2",
             "route_merge:1024:16:bf16::3", "route_merge:2048:1:bf16:keys:3"]
#: the launches whose pipelines were timed on the H200 (route_triton's and route_many_triton's
#: comments, route_merge_triton.MULTI_HEAD_BACKWARD_STAGES): the fit must leave them as they were
TIMED = ["route:4096:1:bf16::default", "route:1024:1:bf16:acc:default", "route_many:1024:1:bf16::default",
         "route_many:1024:1:bf16:keys:default", "route_merge:1024:16:bf16::default"]


#: GPUs with less shared memory a program (``shared_memory_per_block_optin``): compute
#: capability and bytes. A100 (sm_80) 163 KiB; RTX 3090 / 4090, L4, L40 (sm_86 / sm_89) 99 KiB
SMALLER_GPUS = {80: 166912, 89: 101376}
#: the launches whose stages those fit differently from an H200 (route_merge's at d = 32768
#: take none on an H200 already, and compile slowly)
SMALLER_CASES = ["route:32768:1:fp32:keys,acc:default", "route:32768:1:bf16:keys:default",
                 "route_many:32768:1:bf16::default", "route:4096:1:fp32:keys,acc:default",
                 "route_many:2048:1:fp32:keys:default"]


def _probe(cases: list[str], arch: int = 90, shared: int = H200_SHARED) -> dict[str, list[dict]]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "PROBE_ARCH": str(arch),
           "PROBE_SHARED": str(shared)}
    done = subprocess.run([sys.executable, str(PROBE), *cases], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        rows.setdefault(row["case"], []).append(row)
    return rows


@pytest.fixture(scope="module")
def launches() -> dict[str, list[dict]]:
    return _probe(WIDEST + TOKEN_SUM + PIPELINED + TIMED)


@pytest.mark.parametrize("case", WIDEST + TOKEN_SUM)
def test_every_launch_at_the_widest_row_fits_an_h200(launches, case):
    assert launches[case], case
    for row in launches[case]:
        assert row["shared"] <= H200_SHARED, row


@pytest.mark.parametrize("arch", sorted(SMALLER_GPUS))
def test_every_launch_fits_gpus_with_less_shared_memory(arch):
    limit = SMALLER_GPUS[arch]
    launches = _probe(SMALLER_CASES, arch, limit)
    for case in SMALLER_CASES:
        assert launches[case], case
        for row in launches[case]:
            assert row["shared"] <= limit, row


@pytest.mark.parametrize("case", PIPELINED)
def test_the_stage_bound_holds_and_is_close(launches, case):
    pipelined = [row for row in launches[case] if (row.get("stages") or 0) >= 2 and "fit" in row]
    assert pipelined, f"{case}: no pipelined launch"
    stages = int(case.rsplit(":", 1)[1])
    for row in pipelined:
        fit = row["fit"]
        assert row["stages"] == fit["stages"] == stages, row
        assert row["shared"] <= shared_memory.pipeline_bytes(stages, fit["stage_bytes"]), row
        # the bound's copies at most twice what the compiler takes: stages are not given up
        # for nothing
        assert (stages - 1) * fit["stage_bytes"] <= 2 * row["shared"], row


@pytest.mark.parametrize("case", TIMED)
def test_the_timed_pipelines_keep_their_stages(launches, case):
    fits = [row["fit"] for row in launches[case] if row.get("fit", {}).get("requested", 0) >= 2]
    assert fits, f"{case}: no pipelined launch"
    for fit in fits:
        assert fit["stages"] == fit["requested"], (case, fit)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(shared_memory, "device_limit", lambda device: H200_SHARED)
    return torch.device("cuda", 0)


def test_fit_takes_the_most_stages_that_fit(h200):
    assert shared_memory.fit_stages("route", 4, 60_000, h200, configured=False) == 4
    assert shared_memory.fit_stages("route", 4, 90_000, h200, configured=False) == 3
    assert shared_memory.fit_stages("route", 4, 150_000, h200, configured=False) == 2
    assert shared_memory.fit_stages("route", 3, 250_000, h200, configured=False) == 0
    assert shared_memory.fit_stages("route", 1, 10**9, h200, configured=False) == 1


def test_a_configured_stage_count_that_does_not_fit_is_refused(h200):
    with pytest.raises(ValueError, match=r"route_many \(Triton\): config stages=3 .*232448 bytes.*at most 2 stages"):
        shared_memory.fit_stages("route_many", 3, 150_000, h200, configured=True)


def test_no_limit_off_cuda():
    assert shared_memory.device_limit(torch.device("cpu")) is None
    assert shared_memory.fit_stages("route", 3, 10**9, torch.device("cpu"), configured=True) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads a GPU's properties")
def test_the_limit_is_the_devices_opt_in_maximum():
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    limit = shared_memory.device_limit(device)
    assert limit == props.shared_memory_per_block_optin > props.shared_memory_per_block
    if (props.major, props.minor) == (9, 0):  # H100 / H200
        assert limit == H200_SHARED
