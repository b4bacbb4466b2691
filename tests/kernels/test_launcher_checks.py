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
    (lambda a: a.update(heads=5), "route (Triton): heads must be a positive int dividing the width d=12; found 5"),
    (lambda a: a["values"].__setitem__(1, a["values"][1].half()),
     "route (Triton): `values[1]` must be shaped, typed and placed like the first source ((5, 12), torch.bfloat16"),
    (lambda a: a["values"].__setitem__(2, _rnd(4, D, dtype=torch.bfloat16)), "`values[2]` must be shaped"),
    (lambda a: a.update(keys=[a["values"][0]] * 2), "`keys` must have one tensor per entry of `values` (3); found 2"),
    (lambda a: a.update(keys=[v.float() for v in a["values"]]), "`keys[0]` must be shaped, typed and placed like"),
    (lambda a: a.update(logit_bias=_rnd(2)), "route (Triton): `logit_bias` must be a tensor of shape (3,)"),
    (lambda a: a.update(source_scale=_rnd(3, TOKENS + 1)), "`source_scale` must be a tensor of shape (3, 5)"),
    (lambda a: a.update(query=_rnd(D - 1)), "`query` must be a tensor of shape (12,)"),
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
    _raises("route (Triton): `grad_out` must be a tensor of shape (5, 12)", route_triton.route_backward,
            g[:4], out, lse, *rest)
    got = route_triton.route_backward(g.float(), out, lse, *rest)  # a gradient's dtype is free
    assert all(torch.isfinite(t.float()).all() for t in got[0])


def _many_args(s=2, n=3, dtype=torch.bfloat16):
    return ([_rnd(TOKENS, D, dtype=dtype) for _ in range(n)], _rnd(s, D), _rnd(s, D).abs() + 0.5)


def test_route_many_refuses_queries_that_do_not_fit():
    values, queries, weights = _many_args()
    _raises("route_many (Triton): `key_norm_weights` must be a tensor of shape (2, 12)",
            route_many_triton.route_many_forward, values, queries, weights[:1], 1, 1e-6)
    _raises("route_many (Triton): `queries` must be a (S, d=12) tensor; found shape (12,)",
            route_many_triton.route_many_forward, values, queries[0], weights, 1, 1e-6)
    _raises("route_many (Triton): `queries` must be a tensor of shape (2, 12)",
            route_many_triton.route_many_forward, values, queries[:, :-1], weights[:, :-1], 1, 1e-6)
    _raises("route_many (Triton): `values[1]` must be shaped, typed and placed like the first source",
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
    _raises("route_many (Triton): `grad_lse[1]` must be a tensor of shape (5, 1)",
            backward, go, [gl[0], gl[1][:3]], out)
    _raises("route_many (Triton): `grad_out[0]` must be a tensor of shape (5, 12)",
            backward, [go[0][:, :6], go[1]], gl, out)


def _merge_args(j=2, dtype=torch.bfloat16, tokens=TOKENS):
    return dict(outs=[_rnd(tokens, D, dtype=dtype) for _ in range(j)], lses=[_rnd(tokens, 1) for _ in range(j)],
                values=[_rnd(tokens, D, dtype=dtype) for _ in range(j)], keys=None, queries=_rnd(j, D),
                key_norm_weights=_rnd(j, D).abs() + 0.5, mix=_rnd(j).abs(), heads=1, eps=1e-6)


def _merge(a):
    return route_merge_triton.route_merge_forward(*a.values())


@pytest.mark.parametrize("change, message", [
    (lambda a: a["outs"].__setitem__(0, a["outs"][0].float()),
     "route_merge (Triton): `outs[0]` must be shaped, typed and placed like the first source"),
    (lambda a: a.update(outs=a["outs"][:1], lses=a["lses"][:1]),
     "`values` must have one tensor per entry of `outs` (1); found 2"),
    (lambda a: a.update(lses=[t[:3] for t in a["lses"]]), "`lses[0]` must be a tensor of shape (5, 1)"),
    (lambda a: a.update(mix=_rnd(3)), "route_merge (Triton): `mix` must be a tensor of shape (2,)"),
    (lambda a: a.update(queries=_rnd(1, D)), "`queries` must be a tensor of shape (2, 12)"),
    (lambda a: a.update(heads=5), "route_merge (Triton): heads must be a positive int dividing the width d=12"),
])
def test_route_merge_refuses_what_the_kernel_would_misread(change, message):
    a = _merge_args()
    change(a)
    _raises(message, _merge, a)


def test_route_merge_checks_heads_with_no_tokens_and_the_backward_its_gradient():
    a = _merge_args(tokens=0)
    a["heads"] = 5
    _raises("heads must be a positive int dividing the width d=12; found 5", _merge, a)
    a = _merge_args()
    x = _merge(a)
    _raises("route_merge (Triton): `grad` must be a tensor of shape (5, 12)",
            route_merge_triton.route_merge_backward, torch.randn_like(x)[:4], *a.values())
