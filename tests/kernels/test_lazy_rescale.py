"""The forwards' lazy rescale (``route_triton.online_softmax_update``): the running sums are
rescaled only when a logit passes the running shift by LAZY_RESCALE_MARGIN. It must give
the softmax of the eager rescale, whatever the order and size of the logits: sources whose
logits climb in steps larger than the margin (a rescale at every source), in steps smaller
than it (the shift lags the maximum by up to the margin), fall after the first (no rescale
after it), and logits of a few hundred (far past exp's fp32 range without a shift).
``route`` and ``route_many`` (several queries and heads) in fp32 against float64, with the
lazy rescale and without."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    # must precede the first import of triton.jit-decorated code
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from depthrewrite.kernels import route_many_triton, route_triton  # noqa: E402
from depthrewrite.ops.route import route_logits_reference  # noqa: E402
from tests.kernels.test_route_triton import DEVICE, TOL, _rel  # noqa: E402

D, TOKENS = 48, 5
#: cosines of each source's row with the query direction, in source order: the logit of a
#: source is about sqrt(D) * |query| * cosine
COSINES = {
    "steep climb": torch.linspace(-0.9, 0.9, 9),  # steps of ~60: a rescale at every source
    "slow climb": torch.linspace(-0.4, 0.4, 24),  # steps of ~5, under the margin of 8
    "fall": torch.linspace(0.9, -0.9, 9),  # the first source is the maximum
}


def _aligned_rows(cosines: torch.Tensor, direction: torch.Tensor, gen: torch.Generator) -> list[torch.Tensor]:
    """One (TOKENS, D) float32 row per cosine: RMS 1, at that cosine with ``direction`` (a
    unit vector) in every token, the rest of the row random and orthogonal to it."""
    rows = []
    for c in cosines.tolist():
        noise = torch.randn(TOKENS, D, generator=gen, dtype=torch.float64)
        noise -= (noise @ direction)[:, None] * direction
        noise /= noise.norm(dim=-1, keepdim=True)
        rows.append(((c * direction + (1 - c * c) ** 0.5 * noise) * D**0.5).float())
    return rows


def _softmax_f64(values, query, heads):
    """Output and log-sum-exp of one query's route over ``values`` in float64."""
    vals = [v.double() for v in values]
    z = route_logits_reference(vals, query=query.double(), key_norm_weight=torch.ones(D, dtype=torch.float64),
                               heads=heads)
    a = torch.softmax(z, 0)  # (N, TOKENS, heads)
    out = (a.unsqueeze(-1) * torch.stack(vals).unflatten(-1, (heads, -1))).sum(0).flatten(-2)
    return out, torch.logsumexp(z, 0)


def _inputs(order: str, scale: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(D, generator=gen, dtype=torch.float64)
    direction /= direction.norm()
    values = _aligned_rows(COSINES[order], direction, gen)
    # the logits reach about +-scale * cosine
    query = (direction * scale / D**0.5).float()
    return values, query


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("scale", [30.0, 400.0])
@pytest.mark.parametrize("order", sorted(COSINES))
def test_route_forward_matches_float64(order, scale, lazy):
    values, query = _inputs(order, scale, 3)
    want_out, want_lse = _softmax_f64(values, query, 1)
    out, lse, _ = route_triton.route_forward([v.to(DEVICE) for v in values], None, query.to(DEVICE),
                                             torch.ones(D, device=DEVICE), None, None, 1, 1e-6,
                                             config={"lazy_rescale": lazy})
    assert _rel(out, want_out) < TOL[torch.float32]
    assert _rel(lse, want_lse) < TOL[torch.float32]


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("order", sorted(COSINES))
def test_route_many_forward_matches_float64(order, heads, lazy):
    """Three queries: along the rows' direction (the order's logits), against it (the order
    reversed) and a small random one (logits near 0), at logits up to about 300."""
    values, query = _inputs(order, 300.0, 5)
    gen = torch.Generator().manual_seed(6)
    queries = torch.stack([query, -query, torch.randn(D, generator=gen) / D])
    out, lse = route_many_triton.route_many_forward([v.to(DEVICE) for v in values], queries.to(DEVICE),
                                                    torch.ones(3, D, device=DEVICE), heads, 1e-6,
                                                    config={"lazy_rescale": lazy})
    for s in range(3):
        want_out, want_lse = _softmax_f64(values, queries[s], heads)
        assert _rel(out[s], want_out) < TOL[torch.float32], s
        assert _rel(lse[s], want_lse) < TOL[torch.float32], s


def test_lazy_rescale_must_be_a_bool():
    values, query = _inputs("fall", 1.0, 1)
    values = [v.to(DEVICE) for v in values]
    message = re.escape("config lazy_rescale must be True or False; found 1")
    with pytest.raises(ValueError, match=r"^route \(Triton\): " + message):
        route_triton.route_forward(values, None, query.to(DEVICE), torch.ones(D, device=DEVICE), None, None, 1, 1e-6,
                                   config={"lazy_rescale": 1})
    with pytest.raises(ValueError, match=r"^route_many \(Triton\): " + message):
        route_many_triton.route_many_forward(values, query[None].to(DEVICE), torch.ones(1, D, device=DEVICE), 1, 1e-6,
                                             config={"lazy_rescale": 1})
