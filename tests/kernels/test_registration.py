"""How depthrewrite.kernels registers its CUDA kernels (DEPTHREWRITE_KERNEL_REGISTRATION,
read at import, so each case runs in a fresh interpreter): the default goes through the
custom op's ``register_kernel``, "dispatcher" registers our functions with the dispatcher
directly, anything else is refused with the variable and the allowed values named."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_DUMP = ("import torch, depthrewrite.kernels; "
         "print([l for l in torch._C._dispatch_dump('depthrewrite::{op}').splitlines() if l.startswith('CUDA:')])")


def _cuda_kernel_line(op: str, registration: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEPTHREWRITE_KERNEL_REGISTRATION"}
    if registration is not None:
        env["DEPTHREWRITE_KERNEL_REGISTRATION"] = registration
    return subprocess.run([sys.executable, "-c", _DUMP.format(op=op)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("registration", [None, "custom_op"])
def test_the_default_registers_through_the_custom_op(registration):
    run = _cuda_kernel_line("route_many_backward", registration)
    assert run.returncode == 0, run.stderr
    assert "torch/_library/custom_ops.py" in run.stdout


@pytest.mark.parametrize("op", ["route_many", "route_backward_into_", "route_merge_backward"])
def test_dispatcher_registration_registers_our_kernels_directly(op):
    run = _cuda_kernel_line(op, "dispatcher")
    assert run.returncode == 0, run.stderr
    assert "depthrewrite/kernels/__init__.py" in run.stdout and "custom_ops.py" not in run.stdout


def test_an_unknown_registration_is_refused_by_name():
    run = _cuda_kernel_line("route", "raw")
    assert run.returncode != 0
    assert "DEPTHREWRITE_KERNEL_REGISTRATION must be one of ('custom_op', 'dispatcher'); found 'raw'" in run.stderr
