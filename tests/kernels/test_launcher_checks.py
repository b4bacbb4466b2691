"""The kernel launchers' own input checks.

The launchers also run straight from ``torch.ops.depthrewrite.*`` (a compiled graph, or a
caller of the op), where no Python wrapper has checked the inputs. A source of another
dtype, a ``heads`` that does not divide the width, a saved output of the wrong dtype or
a gradient list one entry short would otherwise be reinterpreted or read out of bounds by
the kernels: garbage, or a crash, not an error. Each case here passed silently (or
crashed the process) before the launchers checked it. Without a GPU the kernels run in
Triton's interpreter.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton.jit code

triton = pytest.importorskip("triton")

from depthrewrite.kernels import route_many_triton, route_merge_triton, route_triton  # noqa: E402
from tests.kernels.test_route_triton import DEVICE  # noqa: E402

D, TOKENS = 12, 5
DEV = str(torch.empty(0, device=DEVICE).device)  # as the messages print it: "cpu", "cuda:0"
#: how the messages describe the first bf16 source of these tests
BF16 = f"(shape (5, 12), dtype torch.bfloat16, device {DEV})"


def floating(shape) -> str:
    """How the messages ask for a parameter or gradient of ``shape``."""
    return f"a floating-point tensor of shape {shape} on {DEV}"


def _rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _route_args(n=3, dtype=torch.bfloat16):
    return dict(values=[_rnd(TOKENS, D, dtype=dtype) for _ in range(n)], keys=None, query=_rnd(D),
                key_norm_weight=_rnd(D).abs() + 0.5, logit_bias=None, source_scale=None, heads=1, eps=1e-6)


def _forward(a):
    return route_triton.route_forward(a["values"], a["keys"], a["query"], a["key_norm_weight"], a["logit_bias"],
                                      a["source_scale"], a["heads"], a["eps"])


def _raises(message, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(*args, **kwargs)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(heads=5), "route: `heads` must be a positive int dividing the width d=12; found 5"),
    (lambda a: a["values"].__setitem__(1, a["values"][1].half()),
     f"route: `values[1]` must be like values[0] {BF16}; found shape (5, 12), dtype torch.float16"),
    (lambda a: a["values"].__setitem__(2, _rnd(4, D, dtype=torch.bfloat16)),
     f"`values[2]` must be like values[0] {BF16}; found shape (4, 12)"),
    (lambda a: a.update(keys=[a["values"][0]] * 2),
     "route: `keys` must be 3 tensors (one per entry of `values`); found 2"),
    (lambda a: a.update(keys=[v.float() for v in a["values"]]),
     f"`keys[0]` must be like values[0] {BF16}; found shape (5, 12), dtype torch.float32"),
    (lambda a: a.update(logit_bias=_rnd(2)), f"route: `logit_bias` must be None or {floating((3,))}; found shape (2,)"),
    (lambda a: a.update(source_scale=_rnd(3, TOKENS + 1)),
     f"`source_scale` must be None or {floating((3, 5))}; found shape (3, 6)"),
    (lambda a: a.update(query=_rnd(D - 1)), f"route: `query` must be {floating((12,))}; found shape (11,)"),
])
def test_route_forward_refuses_what_the_kernel_would_misread(change, message):
    a = _route_args()
    change(a)
    _raises(message, _forward, a)


def test_route_backward_refuses_a_saved_output_or_gradient_that_does_not_fit():
    a = _route_args()
    out, lse, _ = _forward(a)
    g = torch.randn_like(out)
    rest = (a["values"], None, a["query"], a["key_norm_weight"], None, None, 1, 1e-6)
    # an fp32 output for bf16 sources: the kernel took its pointer type from `out` and
    # read and wrote the bf16 sources through it (a crash, or gradients of 1e23)
    _raises("route (Triton): `out` must be the forward output, shaped, typed and placed like values[0] "
            "((5, 12), torch.bfloat16", route_triton.route_backward, g, out.float(), lse, *rest)
    _raises(f"route (Triton): `grad_out` must be {floating((5, 12))}; found shape (4, 12)",
            route_triton.route_backward, g[:4], out, lse, *rest)
    got = route_triton.route_backward(g.float(), out, lse, *rest)  # a gradient's dtype is free
    assert all(torch.isfinite(t.float()).all() for t in got[0])


def _many_args(s=2, n=3, dtype=torch.bfloat16):
    return ([_rnd(TOKENS, D, dtype=dtype) for _ in range(n)], _rnd(s, D), _rnd(s, D).abs() + 0.5)


def test_route_many_refuses_queries_that_do_not_fit():
    values, queries, weights = _many_args()
    _raises("route_many: `key_norm_weights` must be shaped like queries (2, 12); found shape (1, 12)",
            route_many_triton.route_many_forward, values, queries, weights[:1], 1, 1e-6)
    queries_wanted = f"route_many: `queries` must be a floating-point tensor of shape (S, 12) with S >= 1 on {DEV}"
    _raises(f"{queries_wanted}; found shape (12,)",
            route_many_triton.route_many_forward, values, queries[0], weights, 1, 1e-6)
    _raises(f"{queries_wanted}; found shape (2, 11)",
            route_many_triton.route_many_forward, values, queries[:, :-1], weights[:, :-1], 1, 1e-6)
    _raises(f"route_many: `values[1]` must be like values[0] {BF16}; found shape (5, 12), dtype torch.float32",
            route_many_triton.route_many_forward, [values[0], values[1].float(), values[2]], queries, weights, 1,
            1e-6)


def test_route_many_backward_refuses_saved_outputs_and_gradients_that_do_not_fit():
    values, queries, weights = _many_args()
    out, lse = route_many_triton.route_many_forward(values, queries, weights, 1, 1e-6)
    go, gl = [torch.randn_like(o) for o in out], [torch.randn_like(t) for t in lse]

    def backward(go, gl, out):
        return route_many_triton.route_many_backward(go, gl, out, lse, values, queries, weights, 1, 1e-6)

    _raises("`out[0]` must be the forward output, shaped, typed and placed like values[0]",
            backward, go, gl, [o.float() for o in out])
    # one gradient for two queries: the kernel read past the end of its pointer table
    _raises("route_many (Triton): `out`, `lse`, `grad_out`, `grad_lse` must hold one tensor per query (2); "
            "found {'out': 2, 'lse': 2, 'grad_out': 1, 'grad_lse': 1}", backward, go[:1], gl[:1], out)
    _raises(f"route_many (Triton): `grad_lse[1]` must be {floating((5, 1))}; found shape (3, 1)",
            backward, go, [gl[0], gl[1][:3]], out)
    _raises(f"route_many (Triton): `grad_out[0]` must be {floating((5, 12))}; found shape (5, 6)",
            backward, [go[0][:, :6], go[1]], gl, out)


def _merge_args(j=2, dtype=torch.bfloat16, tokens=TOKENS):
    return dict(outs=[_rnd(tokens, D, dtype=dtype) for _ in range(j)], lses=[_rnd(tokens, 1) for _ in range(j)],
                values=[_rnd(tokens, D, dtype=dtype) for _ in range(j)], keys=None, queries=_rnd(j, D),
                key_norm_weights=_rnd(j, D).abs() + 0.5, mix=_rnd(j).abs(), heads=1, eps=1e-6)


def _merge(a):
    return route_merge_triton.route_merge_forward(*a.values())


@pytest.mark.parametrize("change, message", [
    (lambda a: a["outs"].__setitem__(0, a["outs"][0].float()),
     f"route_merge: `outs[1]` must be like outs[0] {BF16.replace('bfloat16', 'float32')}; found shape (5, 12), "
     "dtype torch.bfloat16"),
    (lambda a: a.update(outs=a["outs"][:1], lses=a["lses"][:1]),
     "route_merge: `values` must be 1 tensors (one per entry of `outs`); found 2"),
    (lambda a: a.update(lses=[t[:3] for t in a["lses"]]),
     f"route_merge: `lses[0]` must be {floating((5, 1))}; found shape (3, 1)"),
    (lambda a: a.update(mix=_rnd(3)), f"route_merge: `mix` must be {floating((2,))}; found shape (3,)"),
    (lambda a: a.update(queries=_rnd(1, D)),
     f"route_merge: `queries` must be {floating((2, 12))}; found shape (1, 12)"),
    (lambda a: a.update(heads=5), "route_merge: `heads` must be a positive int dividing the width d=12; found 5"),
])
def test_route_merge_refuses_what_the_kernel_would_misread(change, message):
    a = _merge_args()
    change(a)
    _raises(message, _merge, a)


def test_route_merge_checks_heads_with_no_tokens_and_the_backward_its_gradient():
    a = _merge_args(tokens=0)
    a["heads"] = 5
    _raises("route_merge: `heads` must be a positive int dividing the width d=12; found 5", _merge, a)
    a = _merge_args()
    x = _merge(a)
    _raises(f"route_merge (Triton): `grad` must be {floating((5, 12))}; found shape (4, 12)",
            route_merge_triton.route_merge_backward, torch.randn_like(x)[:4], *a.values())
