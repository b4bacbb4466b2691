"""Every scheme trains on the HF Llama and Mixtral configs of the core issue: 30 AdamW
steps on real text lower the loss, every new parameter receives a gradient (except the
ones that structurally cannot: docs/spec.md section 2's ``x_1 = e``), and the model saves and loads back
bit-identically."""

import io

import pytest
import torch

import depthrewrite
from tests.conftest import corpus_bytes, hf_model

LAYERS = 3
#: AdamW steps: 30 lower every case's held-out loss by 1.99-2.10 nats (session 65; the test
#: asks for 1.0); 50 until then
STEPS = 30
OPTIONS = {"dar": {"layers_per_block": 2}, "mhar": {"block_size": 2}}


def structurally_dead(scheme: str, options: dict) -> set[str]:
    """Site 1 routes over the single source e: a softmax over one element is 1, so its
    query and key-norm weight (WAV: its detail bias; DAR: its mixing gate, which mixes e
    with e) get exactly zero gradient; a DAR site that opens a block has nothing to
    transport yet."""
    first = "model.layers.0.depth_route.site1."
    if scheme not in ("attnres", "block_attnres", "mhar", "wav", "dar"):
        return set()
    dead = {first + "query", first + "key_norm_weight"}
    if scheme == "wav":
        dead.add(first + "detail_bias")
    if scheme == "dar":
        dead.add(first + "mix")
        k = options.get("layers_per_block", 1)
        dead |= {f"model.layers.{b}.depth_route.site1.transport" for b in range(0, LAYERS, k)}
    return dead


def batches(steps: int, seed: int):
    data = torch.frombuffer(bytearray(corpus_bytes("tinyshakespeare.txt", 200_000)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 33, (8,), generator=gen).tolist()
        yield torch.stack([data[s:s + 33] for s in starts])


def loss_of(model, chunk):
    logits = model(chunk[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("scheme", sorted(depthrewrite.SCHEMES))
def test_scheme_trains_on_hf_models(family, scheme):
    options = OPTIONS.get(scheme, {})
    model = depthrewrite.rewrite(hf_model(family, layers=LAYERS, vocab_size=256), scheme, **options).train()
    new = {n: p for n, p in model.named_parameters() if "depth_route" in n}
    held_out = next(batches(1, seed=99))
    with torch.no_grad():
        before = loss_of(model, held_out).item()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    got_grad = {n: False for n in new}
    for chunk in batches(STEPS, seed=0):
        opt.zero_grad(set_to_none=True)
        loss_of(model, chunk).backward()
        for n, p in new.items():
            got_grad[n] |= bool(p.grad is not None and p.grad.abs().sum() > 0)
        opt.step()
    with torch.no_grad():
        after = loss_of(model, held_out).item()
    assert after < before - 1.0, (before, after)  # bytes start near ln(256) = 5.5 nats
    assert {n for n, seen in got_grad.items() if not seen} == structurally_dead(scheme, options) & set(new)

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = depthrewrite.rewrite(hf_model(family, layers=LAYERS, vocab_size=256, seed=7), scheme, **options)
    loaded.load_state_dict(torch.load(buffer))
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(held_out).logits, model(held_out).logits)
