"""``depthrewrite.train.sampling.generate``: what it feeds the model, how it draws from the
logits (greedy, temperature, top-k, a token limit), and the refusals."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import depthrewrite
from depthrewrite.models import gpt_from_preset
from depthrewrite.train.sampling import BYTE_TOKENS, decode, encode, generate


class FixedLogits(nn.Module):
    """Returns the same last-position logits whatever it reads, and records the windows."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.windows: list[torch.Tensor] = []

    def forward(self, ids):
        self.windows.append(ids.clone())
        return self.logits.expand(ids.shape[0], ids.shape[1], -1)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(3)
    gpt = gpt_from_preset("tiny", n_layer=2)
    return depthrewrite.rewrite(gpt, "attnres").eval()


def _greedy_by_hand(model, ids: torch.Tensor, steps: int, context: int | None) -> torch.Tensor:
    for _ in range(steps):
        window = ids if context is None else ids[:, -context:]
        with torch.no_grad():
            ids = torch.cat([ids, model(window)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("context", [None, 5])
def test_temperature_zero_takes_the_likeliest_token_of_the_window_it_was_given(model, context):
    prompt = torch.randint(0, 256, (2, 7))
    got = generate(model, prompt, 12, temperature=0, context=context)
    assert torch.equal(got, _greedy_by_hand(model, prompt, 12, context))
    if context is not None:  # the window matters: the full history predicts otherwise
        assert not torch.equal(got, _greedy_by_hand(model, prompt, 12, None))


def test_top_k_one_is_greedy_and_draws_stay_among_the_k_likeliest(model):
    prompt = torch.randint(0, 256, (3, 4))
    assert torch.equal(generate(model, prompt, 6, temperature=1.0, top_k=1, generator=torch.Generator()),
                       generate(model, prompt, 6, temperature=0))
    got = generate(model, prompt, 10, temperature=5.0, top_k=3, generator=torch.Generator().manual_seed(1))
    for t in range(prompt.shape[1], got.shape[1]):
        with torch.no_grad():
            top = model(got[:, :t])[:, -1].topk(3, dim=-1).indices
        assert (top == got[:, t:t + 1]).any(dim=1).all()


def test_draws_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    rows, temperature = 20_000, 1.7
    got = generate(FixedLogits(logits), torch.zeros(rows, 1, dtype=torch.long), 1, temperature=temperature,
                   generator=torch.Generator().manual_seed(0))[:, 1]
    want = torch.softmax(logits / temperature, dim=0)
    freq = torch.bincount(got, minlength=5).double() / rows
    sigma = (want * (1 - want) / rows).sqrt()
    assert ((freq - want).abs() < 5 * sigma).all(), (freq, want)
    # and at a lower temperature the likeliest token gains
    cold = generate(FixedLogits(logits), torch.zeros(rows, 1, dtype=torch.long), 1, temperature=0.3,
                    generator=torch.Generator().manual_seed(0))[:, 1]
    assert (cold == 0).double().mean() > freq[0] + 0.2


def test_a_seed_repeats_its_draws_and_another_seed_does_not(model):
    prompt = torch.randint(0, 256, (1, 5))
    a, b, c = (generate(model, prompt, 30, generator=torch.Generator().manual_seed(s)) for s in (4, 4, 5))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :5], prompt)


def test_token_limit_keeps_ids_below_it():
    logits = torch.zeros(300)
    logits[256:] = 10.0  # the untrained ids are the likeliest
    fixed = FixedLogits(logits)
    got = generate(fixed, torch.zeros(500, 1, dtype=torch.long), 1, token_limit=BYTE_TOKENS,
                   generator=torch.Generator().manual_seed(0))
    assert got.max() < BYTE_TOKENS and got[:, 1].unique().numel() > 200
    assert generate(fixed, torch.zeros(1, 1, dtype=torch.long), 1, temperature=0)[0, 1] >= BYTE_TOKENS


def test_one_dimensional_prompts_and_the_models_mode_given_back(model):
    model.train()
    prompt = torch.tensor([1, 2, 3])
    got = generate(model, prompt, 4, temperature=0)
    assert got.shape == (7,) and torch.equal(got, generate(model, prompt[None], 4, temperature=0)[0])
    assert model.training  # its mode is given back
    model.eval()


def test_hugging_face_style_outputs_are_read_through_logits():
    class Output:
        def __init__(self, logits):
            self.logits = logits

    class Wrapped(FixedLogits):
        def forward(self, ids):
            return Output(super().forward(ids))

    got = generate(Wrapped(torch.tensor([0.0, 3.0, 1.0])), torch.zeros(1, 2, dtype=torch.long), 2, temperature=0)
    assert got.tolist() == [[0, 0, 1, 1]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=torch.zeros(1, 3)), "int64 tensor of token ids, found a 2-d torch.float32"),
    (dict(prompt=torch.zeros(1, 0, dtype=torch.long)), "at least one token per row"),
    (dict(prompt=[1, 2]), "found list"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0, found -1"),
    (dict(top_k=0), "top_k must be an int >= 1 or None, found 0"),
    (dict(top_k=6), "top_k=6 is more than the 5 candidate tokens"),
    (dict(context=0), "context must be an int >= 1 or None, found 0"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
    (dict(token_limit=6), "token_limit=6 is more than the model's 5 tokens"),
    (dict(top_k=4, token_limit=3), "top_k=4 is more than the 3 candidate tokens"),
])
def test_bad_arguments_are_named(kwargs, message):
    args = dict(prompt=torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match="^generate: .*" + re.escape(message)):
        generate(FixedLogits(torch.zeros(5)), args.pop("prompt"), args.pop("max_new_tokens"), **args)


def test_a_model_without_logits_is_refused():
    class Pair(nn.Module):
        def forward(self, ids):
            return torch.zeros(ids.shape[0], ids.shape[1], 4), torch.zeros(())

    with pytest.raises(ValueError, match=r"must return logits \(B, T, vocab\) or an object with .logits, found tuple"):
        generate(Pair(), torch.zeros(1, 1, dtype=torch.long), 1)


def test_bytes_round_trip_and_invalid_utf8_is_replaced():
    text = "ROMEO: Wherefore, café?\n"
    assert decode(encode(text)) == text and encode(text).numel() == len(text.encode("utf-8"))
    assert decode(torch.tensor([0x41, 0xC3])) == "A\ufffd"  # a character cut short
    with pytest.raises(ValueError, match="ids must be bytes .0-255., found 300"):
        decode(torch.tensor([65, 300]))
