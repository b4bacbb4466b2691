"""Identity-preserving conversion of a trained checkpoint (docs/spec.md section 7): a Hugging Face model is
trained, saved with ``save_pretrained``, loaded back, converted with
``preserve_identity=True`` and trained on: its first loss equals the original model's
exactly, and the converted model saves and loads back bit-identically."""

import pytest
import torch

import depthrewrite
from tests.conftest import corpus_bytes, hf_model

transformers = pytest.importorskip("transformers")


def batch(seed: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(corpus_bytes("tinystories_sample.txt", 100_000)), dtype=torch.uint8).long()
    starts = torch.randint(0, len(data) - 25, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.stack([data[s:s + 25] for s in starts])


def train(model, steps: int, seed: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids = batch(seed + step)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("trained")
    model = hf_model("llama", layers=2, vocab_size=256).train()
    train(model, steps=20, seed=0)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("scheme", ["attnres", "block_attnres", "mhar", "wav", "dar", "hyperconn"])
def test_converted_checkpoint_continues_without_a_loss_spike(trained_checkpoint, scheme, tmp_path):
    original = transformers.AutoModelForCausalLM.from_pretrained(trained_checkpoint).train()
    converted = depthrewrite.rewrite(
        transformers.AutoModelForCausalLM.from_pretrained(trained_checkpoint), scheme, preserve_identity=True).train()
    ids = batch(1000)
    assert torch.equal(converted(ids, labels=ids).loss, original(ids, labels=ids).loss)
    first_original = train(original, steps=1, seed=2000)[0]
    losses = train(converted, steps=10, seed=2000)
    assert losses[0] == first_original  # the first step's loss, exactly
    gates = [p for n, p in converted.named_parameters() if n.endswith(".gate")]
    assert gates and any(g.abs().sum() > 0 for g in gates)  # the routed path opened while training

    converted.eval().save_pretrained(tmp_path)
    loaded = depthrewrite.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, converted(ids).logits)
