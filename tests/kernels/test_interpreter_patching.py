"""tests/interpreter_patching.py: Triton's interpreter without its repeated patching of
``triton.language`` inside a launch gives the same bits, restores the language after the
launch, and is in use in this session (conftest installs it)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the wrapper is for Triton's interpreter (no GPU)", allow_module_level=True)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from depthrewrite.kernels import route_many_triton  # noqa: E402
from tests import interpreter_patching  # noqa: E402


@triton.jit
def _row_sum(x_ptr, row, D: tl.constexpr):
    return tl.sum(tl.load(x_ptr + row * D + tl.arange(0, D)), 0)  # tl.sum: a jit function of Triton's own


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    for row in tl.static_range(ROWS):
        tl.store(out_ptr + row, _row_sum(x_ptr, row, D))


def _language_state() -> dict:
    """What the patching changes: the namespaces of ``triton.language`` and its tensor class."""
    return {("tl", name): value for name, value in vars(tl).items()} | {
        ("tensor", name): value for name, value in vars(tl.tensor).items()}


def test_helper_calls_skip_the_walk_and_the_launch_restores_the_language():
    assert interpreter_patching.install()  # conftest installed it: a second call keeps it
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    out = torch.empty(5)
    # Triton's own first launch in a process leaves some of what its helpers patched
    # (their scopes are dropped, not restored): that is its behaviour, not the wrapper's
    with interpreter_patching.uninstalled():
        _row_sums_kernel[(1,)](x, out, ROWS=5, D=16)
    before_state, before_skipped = _language_state(), interpreter_patching.skipped
    _row_sums_kernel[(1,)](x, out, ROWS=5, D=16)
    assert interpreter_patching.skipped - before_skipped >= 5  # at least the helper's calls after the first
    torch.testing.assert_close(out, x.sum(1), rtol=1e-6, atol=1e-6)
    after = _language_state()
    assert after.keys() == before_state.keys()
    assert all(after[name] is before_state[name] for name in after)


def test_route_many_kernels_give_the_same_bits_with_and_without_it():
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(5, 24, generator=gen) for _ in range(4)]
    keys = [torch.randn(5, 24, generator=gen) for _ in range(4)]
    queries, weights = torch.randn(3, 24, generator=gen) * 0.3, torch.rand(3, 24, generator=gen) + 0.5
    grad_out = [torch.randn(5, 24, generator=gen) for _ in range(3)]
    grad_lse = [torch.randn(5, 2, generator=gen) for _ in range(3)]

    def run():
        out, lse = route_many_triton.route_many_forward(values, queries, weights, 2, 1e-6, None, keys=keys)
        grads = route_many_triton.route_many_backward(grad_out, grad_lse, out, lse, values, queries, weights, 2,
                                                      1e-6, None, keys=keys)
        return [*out, *lse, *(t for g in grads for t in (g if isinstance(g, list) else [g]))]

    with_it = run()
    with interpreter_patching.uninstalled():
        without = run()
    assert len(with_it) == len(without) > 0
    assert all(torch.equal(a, b) for a, b in zip(with_it, without))
