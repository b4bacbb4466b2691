"""The rewritten bundled GPT trains on real text: 50 AdamW steps lower the loss and every
new routing parameter receives a non-zero gradient, except the pair of site 1: it routes
over the single source ``e`` (docs/spec.md section 2: ``x_1 = e``), a softmax over one element is exactly 1,
so its query and key-norm weight can never receive a gradient. docs/spec.md counts them in the
``2 d (L + 1)`` new parameters, so they exist; the test asserts their gradient is exactly 0."""

import pytest
import torch

import depthrewrite
from depthrewrite.models import gpt_from_preset
from tests.conftest import corpus_bytes


def byte_batches(data: bytes, batch: int, seq: int, steps: int, seed: int = 0):
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
        window = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


@pytest.mark.parametrize("scheme, options", [("attnres", {}), ("block_attnres", {"block_size": 2})])
def test_fifty_adamw_steps_lower_the_loss(scheme, options):
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=3), scheme, **options).train()
    new = {n: p for n, p in model.named_parameters() if "depth_route" in n}
    assert new
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grad_seen = [], {n: False for n in new}
    for x, y in byte_batches(corpus_bytes("tinyshakespeare.txt", 300_000), batch=8, seq=64, steps=50):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        for n, p in new.items():
            grad_seen[n] |= bool(p.grad is not None and p.grad.abs().sum() > 0)
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # bytes start at ln(256) = 5.5 nats
    sole_source = {n for n in new if n.startswith("blocks.0.depth_route.site1.")}
    assert len(sole_source) == 2
    assert not any(grad_seen[n] for n in sole_source)
    assert all(grad_seen[n] for n in new if n not in sole_source), [n for n, seen in grad_seen.items() if not seen]
