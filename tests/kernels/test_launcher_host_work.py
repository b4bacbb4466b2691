"""The host work of a launcher call: the ATen ops it issues besides its kernel launches.

On the GPU each op costs the host a few microseconds (a dispatch, and a launch for the ones
that compute), and a training step makes hundreds of launcher calls, the steps of the
host-bound schemes (WAV, full AttnRes and MHAR) waiting on them (docs/benchmarks.md, session
66). So a launcher issues its outputs, its partial sums and the parameter gradients' last
sums and products, and nothing else: no view, slice, cast or copy of an input that the
kernels take by address anyway. These tests list the ops of one call (the kernels replaced
by no-ops, their pointer tables already cached as in a training loop's repeated calls).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

pytest.importorskip("triton")

from depthrewrite.kernels import param_grads, route_many_triton, route_triton  # noqa: E402
from tests.kernels.test_route_triton import DEVICE, _Launch  # noqa: E402

N, TOKENS, D = 5, 6, 32


class _Ops(TorchDispatchMode):
    """The ATen ops dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _ops_of_second_call(call) -> list[str]:
    call()  # the first call makes the pointer tables
    with _Ops() as ops:
        call()
    return ops.names


@pytest.fixture(autouse=True)
def _no_launches(monkeypatch):
    for module in (route_triton, route_many_triton, param_grads):
        for name in dir(module):
            if name.endswith("_kernel") and hasattr(getattr(module, name), "__getitem__"):
                monkeypatch.setattr(module, name, _Launch([]))  # launches nothing


def _rows(n, dtype=torch.bfloat16):
    return [torch.randn(TOKENS, D, device=DEVICE).to(dtype) for _ in range(n)]


def test_route_launchers_issue_their_outputs_partial_sums_and_parameter_sums_only():
    """WAV's site: a logit bias and a float32 source scale (read where it lies), the
    backward adding into running sums in place. The forward allocates its output, its
    log-sum-exp and the empty ``normed``; the backward its two partial sums (none for the
    norm it does not have), then sums them over the programs and multiplies."""
    values, sums = _rows(N), _rows(N)
    query, weight = torch.randn(D, device=DEVICE), torch.rand(D, device=DEVICE) + 0.5
    bias, scale = torch.randn(N, device=DEVICE), torch.rand(N, TOKENS, device=DEVICE)
    out, lse, _ = route_triton.route_forward(values, None, query, weight, bias, scale, 1, 1e-6)
    forward = _ops_of_second_call(lambda: route_triton.route_forward(values, None, query, weight, bias, scale, 1,
                                                                     1e-6))
    assert forward == ["empty.memory_format"] * 2 + ["new_empty.default"]
    backward = _ops_of_second_call(lambda: route_triton.route_backward(
        values[0], out, lse, values, None, query, weight, bias, scale, 1, 1e-6,
        grad_values_acc=sums[:-1] + [None], grad_values_out=sums))
    assert backward == ["empty.memory_format"] * 2 + ["sum.dim_IntList", "mul.Tensor", "mul.Tensor",
                                                      "sum.dim_IntList", "new_empty.default"]


def test_route_many_backward_issues_no_op_on_its_tables_or_query_rows():
    """Block AttnRes's block phase: one chunk of queries, so its tables and query rows go to
    the kernel from their start, with no slice or select a call (seven of them before
    session 66). Its source gradients written into tensors given (so that the tables repeat,
    as in a training loop), its ops are its partial sums, the query rows and the two
    parameter gradients."""
    values, queries = _rows(N), torch.randn(6, D, device=DEVICE)
    weights = torch.rand(6, D, device=DEVICE) + 0.5
    out, lse = _rows(6), [torch.zeros(TOKENS, 1, device=DEVICE) for _ in range(6)]
    grad_out, grad_lse = _rows(6), [torch.zeros(TOKENS, 1, device=DEVICE) for _ in range(6)]
    grads = _rows(N)
    names = _ops_of_second_call(lambda: route_many_triton.route_many_backward(
        grad_out, grad_lse, out, lse, values, queries, weights, 1, 1e-6, {"backward": "per_token"},
        grad_values_out=grads))
    assert names == ["empty.memory_format", "mul.Tensor"] + ["empty.memory_format"] * 2
