"""The routing ops' own autograd kernel (depthrewrite.ops.flat_autograd) against the one
``torch.library.custom_op`` generates: the same gradients, bit for bit, in a process that
keeps the generated one (``DEPTHREWRITE_AUTOGRAD=custom_op``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import depthrewrite  # noqa: F401  (registers the ops)
from depthrewrite.ops import flat_autograd, route_many, route_merge
from depthrewrite.ops.flat_autograd import _splice, _spliced_grads, _unsplice

ROOT = Path(__file__).resolve().parents[2]


def _leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).requires_grad_()


def gradient_cases() -> dict[str, list[torch.Tensor]]:
    """Each case's output and the gradients of its leaves (None where a leaf gets none),
    flattened; seeded, so two processes build the same inputs."""
    torch.manual_seed(0)
    results = {}
    t, d, n = 3, 24, 5

    # route with keys, bias, scale and the fused output norm, every tensor argument a leaf
    vals = [_leaf(2, t, d) for _ in range(n)]
    keys = [_leaf(2, t, d) for _ in range(n)]
    q, w, bias = _leaf(d, scale=0.3), (torch.rand(d) + 0.5).requires_grad_(), _leaf(n)
    scale = torch.rand(n, 2, t) + 0.5
    onw = (torch.rand(d) + 0.5).requires_grad_()
    out, _lse, normed = torch.ops.depthrewrite.route(vals, keys, q, w, bias, scale, 2, 1e-6, onw, 1e-5)
    leaves = [*vals, *keys, q, w, bias, onw]
    loss = (out * torch.randn_like(out)).sum() + (normed * torch.randn_like(normed)).sum()
    results["route, all arguments"] = [out, normed, *torch.autograd.grad(loss, leaves, allow_unused=True)]

    # route with the trailing defaults left out and only the sources needing gradients
    vals = [_leaf(t, d) for _ in range(n)]
    q, w = torch.randn(d) * 0.3, torch.rand(d) + 0.5
    out = torch.ops.depthrewrite.route(vals, None, q, w, None, None, 1, 1e-6)[0]
    results["route, sources only"] = [out, *torch.autograd.grad(out, vals, torch.randn_like(out))]

    # route_many with keys, one output unused
    vals, keys = [_leaf(t, d) for _ in range(n)], [_leaf(t, d) for _ in range(n)]
    qs, ws = _leaf(3, d, scale=0.3), (torch.rand(3, d) + 0.5).requires_grad_()
    outs, lses = route_many(vals, keys, queries=qs, key_norm_weights=ws)
    loss = (outs[0] * torch.randn_like(outs[0])).sum() + (outs[2] * torch.randn_like(outs[2])).sum() + lses[1].sum()
    results["route_many, keys"] = [*outs, *lses, *torch.autograd.grad(loss, [*vals, *keys, qs, ws])]

    # route_merge, two keyed results with the output norm, and one without keys or norm
    for keyed in (True, False):
        j = 2 if keyed else 1
        outs = [_leaf(t, d) for _ in range(j)]
        lses = [_leaf(t, 1) for _ in range(j)]
        vals = [_leaf(t, d) for _ in range(j)]
        keys = [_leaf(t, d) for _ in range(j)] if keyed else None
        qs, ws, mix = _leaf(j, d, scale=0.3), (torch.rand(j, d) + 0.5).requires_grad_(), _leaf(j)
        onw = (torch.rand(d) + 0.5).requires_grad_() if keyed else None
        merged = route_merge(outs, lses, vals, keys, queries=qs, key_norm_weights=ws, mix=mix, out_norm_weight=onw)
        leaves = [*outs, *lses, *vals, *(keys or []), qs, ws, mix] + ([onw] if keyed else [])
        results[f"route_merge, keyed={keyed}"] = [merged, *torch.autograd.grad(merged, leaves,
                                                                               torch.randn_like(merged))]
    return results


def test_splice_and_unsplice_are_inverses():
    is_list = (True, False, True, True, False)
    args = ([1, 2], "x", None, [], 3.0)
    flat, lengths = _splice(args, is_list)
    assert flat == [1, 2, "x", 3.0] and lengths == [2, -1, 0]
    assert _unsplice(flat, is_list, lengths) == list(args)
    # a list argument's gradient may be None (no gradient for any of its entries)
    assert _spliced_grads((None, None, None, [], "g"), is_list, lengths) == [None, None, None, "g"]


def test_the_ops_run_the_flat_kernel():
    vals = [_leaf(2, 8) for _ in range(3)]
    out = torch.ops.depthrewrite.route(vals, None, torch.randn(8), torch.rand(8) + 0.5, None, None, 1, 1e-6)[0]
    assert type(out.grad_fn).__name__ == "FlatBackwardFor_depthrewrite_routeBackward"
    outs, _ = route_many(vals, queries=torch.randn(2, 8), key_norm_weights=torch.ones(2, 8))
    assert type(outs[0].grad_fn).__name__ == "FlatBackwardFor_depthrewrite_route_manyBackward"


def test_same_gradients_as_custom_ops_own_kernel(tmp_path):
    saved = tmp_path / "custom_op.pt"
    env = {**os.environ, flat_autograd.AUTOGRAD_ENV: "custom_op"}
    # the other process runs on this one's thread count: CPU kernels may round otherwise with
    # another (on an AVX2-only host 2 threads against conftest's 1 moved the outputs' last bits)
    threads = str(torch.get_num_threads())
    subprocess.run([sys.executable, __file__, str(saved), threads], env=env, check=True, cwd=ROOT)
    theirs = torch.load(saved)
    ours = gradient_cases()
    assert set(ours) == set(theirs)
    for case, tensors in ours.items():
        assert len(tensors) == len(theirs[case]), case
        for i, (a, b) in enumerate(zip(tensors, theirs[case])):
            assert (a is None) == (b is None), (case, i)
            assert a is None or torch.equal(a, b), (case, i)


def test_bad_choice_is_refused(monkeypatch):
    monkeypatch.setenv(flat_autograd.AUTOGRAD_ENV, "pytree")
    with pytest.raises(ValueError, match="DEPTHREWRITE_AUTOGRAD must be one of .*found 'pytree'"):
        flat_autograd.autograd_choice()


def test_import_does_not_warn_about_the_replaced_kernel():
    done = subprocess.run([sys.executable, "-W", "always", "-c", "import depthrewrite"], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    assert "Overriding a previously registered kernel" not in done.stderr


if __name__ == "__main__":  # the other process of test_same_gradients_as_custom_ops_own_kernel
    torch.set_num_threads(int(sys.argv[2]))
    torch.save({case: [None if t is None else t.detach() for t in ts] for case, ts in gradient_cases().items()},
               sys.argv[1])
