"""Models nobody here wrote (nanoGPT- and torchtitan-style) are captured, rewritten with
every scheme, identical at initialisation with preserve_identity, and they train."""

import pytest
import torch

import depthrewrite
from tests.handwritten_models import GPTConfig, NanoGPT, TitanLlama

IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
IDENTITY = [s for s, cls in depthrewrite.SCHEMES.items() if cls.delta_applies]


def build(kind, seed=0):
    torch.manual_seed(seed)
    return (NanoGPT(GPTConfig()) if kind == "nanogpt" else TitanLlama()).eval()


def logits(model):
    with torch.no_grad():
        out = model(IDS)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind, stack, final", [("nanogpt", "transformer.h", "transformer.ln_f"),
                                                ("titan", "layers", "norm")])
def test_the_stream_is_found(kind, stack, final):
    stream = depthrewrite.inspect(build(kind), example_inputs=(IDS,))
    assert stream.stack_path == stack and stream.final_norm_path == final
    assert stream.sites_per_block() == [2, 2, 2]
    assert [s.kind for s in stream.sites[:2]] == ["attention", "mlp"]


@pytest.mark.parametrize("kind", ["nanogpt", "titan"])
@pytest.mark.parametrize("scheme", IDENTITY + ["residual"])
def test_identity_at_init(kind, scheme):
    model = build(kind)
    ref = logits(model)
    options = {} if scheme == "residual" else {"preserve_identity": True}
    if scheme == "mhar" and kind == "titan":
        options["heads"] = 4  # no config to read the head count from: MHAR asks for it
    depthrewrite.rewrite(model, scheme, example_inputs=(IDS,), **options)
    assert torch.equal(logits(model), ref)


def test_mhar_without_a_config_asks_for_heads():
    with pytest.raises(ValueError, match="heads"):
        depthrewrite.rewrite(build("titan"), "mhar", example_inputs=(IDS,))


@pytest.mark.parametrize("kind", ["nanogpt", "titan"])
@pytest.mark.parametrize("scheme", ["attnres", "block_attnres", "dar", "mhc"])
def test_rewritten_handwritten_models_train(kind, scheme):
    model = depthrewrite.rewrite(build(kind), scheme, example_inputs=(IDS,)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    targets = torch.roll(IDS, -1, dims=1)
    losses = []
    for _ in range(30):
        out = model(IDS)
        out = out[0] if isinstance(out, tuple) else out
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
