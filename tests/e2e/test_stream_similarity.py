"""DAR's cross-stream CKA: linear CKA's defining properties, the two histories recorded at
the final readout (count and shapes), selfkv with symmetric beta keeping the streams
identical through training (CKA 1) while dar's asymmetric init separates them, and
``compare`` writing ``streams_dar.png`` and the mean CKA line."""

from __future__ import annotations

import math

import pytest
import torch

import depthrewrite
from depthrewrite.models import gpt_from_preset
from depthrewrite.train import DataConfig, TrainConfig
from depthrewrite.train.compare import CompareConfig, compare
from depthrewrite.train.stream_similarity import linear_cka, record_dar_streams, stream_similarity
from tests.conftest import corpus_bytes, png_size


# ------------------------------------------------------------------------- linear CKA
def _direct_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """CKA through the centred Gram matrices: HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)),
    HSIC(K, L) = tr(K H L H) with H the centring matrix (the n-dependent factors cancel)."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    k, l = x @ x.T, y @ y.T

    def hsic(a, b):
        return torch.trace(a @ h @ b @ h)

    return (hsic(k, l) / torch.sqrt(hsic(k, k) * hsic(l, l))).item()


def test_linear_cka_properties():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=g)
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    y = (x.double() @ q) * 3.7 + 5.0  # orthogonal transform, isotropic scaling, and a shift (centred away)
    assert linear_cka(x, y) == pytest.approx(1.0, abs=1e-10)
    # a non-isotropic scaling is not an invariance: the value must move
    stretched = x * torch.linspace(0.1, 10.0, 16)
    assert linear_cka(x, stretched) < 0.9
    # independent features: E[CKA] ~ p q / n-ish scale, far from 1 for n >> p
    independent = torch.randn(2000, 16, generator=g)
    assert linear_cka(torch.randn(2000, 16, generator=g), independent) < 0.05
    # the feature-space formula equals the Gram-matrix (HSIC) formula, also for p != q
    a, b = torch.randn(50, 8, generator=g), torch.randn(50, 5, generator=g)
    b = b + a[:, :5]  # partly shared features: a value strictly between 0 and 1
    direct = _direct_cka(a, b)
    assert 0.1 < direct < 0.99
    assert linear_cka(a, b) == pytest.approx(direct, rel=1e-10)
    assert linear_cka(a, b) == pytest.approx(linear_cka(b, a), rel=1e-12)


def test_linear_cka_rejects_bad_input():
    with pytest.raises(ValueError, match="same number of tokens"):
        linear_cka(torch.randn(4, 3), torch.randn(5, 3))
    with pytest.raises(ValueError, match="constant"):
        linear_cka(torch.ones(4, 3), torch.randn(4, 3))


# ------------------------------------------------------------------ recorded histories
def _trained(variant: str, steps: int = 3, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "dar", variant=variant, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        _, loss = model(x, targets=torch.roll(x, -1, dims=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_histories_have_one_entry_per_block_plus_e():
    model = _trained("dar", steps=1)
    x = torch.randint(0, 256, (3, 10))
    h0, h1 = record_dar_streams(model, x)
    assert len(h0) == len(h1) == 3  # e, then one entry per layer (K = 1)
    for a, b in zip(h0, h1):
        assert a.shape == b.shape == (3, 10, 64)
    assert torch.equal(h0[0], h1[0])  # H^0_0 = H^1_0 = e
    assert model.training  # the mode is restored
    assert "read" not in vars(model.norm_final.depth_route["readout"])  # the shadow is removed
    torch.manual_seed(0)
    two = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=4), "dar", layers_per_block=2)
    h0, _ = record_dar_streams(two, x)
    assert len(h0) == 3  # e, then one entry per 2 layers
    plain = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "attnres")
    assert record_dar_streams(plain, x) is None and stream_similarity(plain, x, "attnres") is None


def test_recording_leaves_the_forward_pass_unchanged():
    model = _trained("dar", steps=2)
    x = torch.randint(0, 256, (2, 12))
    model.eval()
    with torch.no_grad():
        before = model(x)
    history = record_dar_streams(model, x)
    with torch.no_grad():
        after = model(x)
    assert torch.equal(before, after)
    again = record_dar_streams(model, x)
    for a, b in zip(history[0] + history[1], again[0] + again[1]):
        assert torch.equal(a, b)
    # the readout mixes the recorded state into the logits: changing the last entry changes them
    readout = model.norm_final.depth_route["readout"]
    with torch.no_grad():
        h = torch.zeros(2, 12, 64)
        # (history, partial, phase-1 result): None, the readout routes the entries itself
        x0 = readout.read((history, None, None), h)
        x1 = readout.read((((*history[0][:-1], history[0][-1] + 1.0), history[1]), None, None), h)
    assert not torch.allclose(x0, x1)


def test_selfkv_symmetric_streams_stay_identical_and_dar_separates_them():
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    same = _trained("selfkv", beta_init=(1.0, 1.0))
    h0, h1 = record_dar_streams(same, x)
    for a, b in zip(h0, h1):
        assert torch.equal(a, b)  # symmetric parameters and symmetric gradients: one stream twice
    sim = stream_similarity(same, x, "dar")
    assert sim.labels == ["e", "1", "2"]
    assert all(c == pytest.approx(1.0, abs=1e-12) for c in sim.cka)
    dar = stream_similarity(_trained("dar"), x, "dar")
    assert dar.cka[0] == pytest.approx(1.0, abs=1e-12)  # e is shared
    assert min(dar.cka[1:]) < 0.999  # beta^0 != beta^1 from site 1 on: the streams differ
    assert all(0.0 <= c <= 1.0 + 1e-12 for c in dar.cka)
    assert dar.mean_written() == pytest.approx(sum(dar.cka[1:]) / 2)


# -------------------------------------------------------------------------- compare
def test_compare_writes_streams_figure_for_dar_only(tmp_path):
    text = tmp_path / "shakespeare.txt"
    text.write_bytes(corpus_bytes("tinyshakespeare.txt", 200_000))
    train = TrainConfig(model="gpt:tiny", layers=2, data=DataConfig(source=str(text)), steps=2, batch_size=2,
                        seq_len=16, warmup_steps=1, eval_every=0, eval_batches=1, progress=False, threads=1)
    out = tmp_path / "cmp"
    result = compare(CompareConfig(schemes=("attnres", "dar"), train=train, out=str(out)))
    width, height = png_size(out / "streams_dar.png")
    assert width >= 300 and height >= 200
    assert not (out / "streams_attnres.png").exists()
    rows = {r.scheme: r for r in result.rows}
    assert rows["attnres"].stream_cka is None and rows["attnres"].streams is None
    mean = rows["dar"].stream_cka
    assert mean is not None and 0.0 <= mean < 1.0 and not math.isnan(mean)
    md = result.results_path.read_text()
    assert f"- dar: mean cross-stream CKA {mean:.4f}" in md
    assert "](streams_dar.png)" in md and "attnres: mean cross-stream" not in md
