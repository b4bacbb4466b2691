"""Property-test the rewrite of your own model with hypothesis.

    python examples/property_test_your_model.py            # runs the property, prints one line
    python -m pytest -q examples/property_test_your_model.py

``MiniGPT`` below stands for your model: a nanoGPT-style PreNorm decoder written from scratch
(no config object, so ``rewrite`` needs ``example_inputs``). The property: for random widths,
depths, head counts and inputs, the ``residual`` rewrite and every listed scheme with
``preserve_identity=True`` compute exactly what the original computes, bit for bit. Put your
own class in place of ``MiniGPT`` and your schemes in ``SCHEMES``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import depthrewrite

SCHEMES = ["attnres", "block_attnres", "wav", "dar"]  # checked with preserve_identity=True


# ------------------------------------------------------------------ your model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MiniGPT(nn.Module):
    def __init__(self, vocab: int = 64, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, block_size: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        for name, p in self.named_parameters():  # nanoGPT's init, scaled residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ------------------------------------------------------------------ the property
@st.composite
def models_and_inputs(draw):
    n_head = draw(st.sampled_from([1, 2, 4]))
    n_embd = n_head * draw(st.sampled_from([4, 8, 16]))
    n_layer = draw(st.integers(1, 4))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = MiniGPT(vocab=64, n_embd=n_embd, n_head=n_head, n_layer=n_layer).eval()
    ids = torch.randint(0, 64, (draw(st.integers(1, 3)), draw(st.integers(2, 16))))
    return model, ids


def check_rewrite_is_bit_identical(model_and_ids) -> None:
    model, ids = model_and_ids
    capture = (torch.randint(0, 64, (2, 8)),)  # your model has no config: show rewrite a batch
    with torch.no_grad():
        reference = model(ids)
        for scheme, options in [("residual", {})] + [(s, {"preserve_identity": True}) for s in SCHEMES]:
            rewritten = depthrewrite.rewrite(model, scheme, example_inputs=capture, inplace=False, **options)
            out = rewritten(ids)
            assert torch.equal(out, reference), f"{scheme} {options}: max |diff| {(out - reference).abs().max()}"
        assert torch.equal(model(ids), reference)  # inplace=False left the original untouched


def rewrite_property(max_examples: int):
    """The hypothesis test: ``check_rewrite_is_bit_identical`` over ``max_examples`` random models."""
    return settings(max_examples=max_examples, deadline=None)(given(models_and_inputs())(check_rewrite_is_bit_identical))


# collected by pytest; also called directly by main()
test_rewrite_of_your_model_is_bit_identical = rewrite_property(5)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=10, help="random models hypothesis tries")
    parser.add_argument("--tiny", action="store_true", help="a few-second run: 2 examples")
    args = parser.parse_args(argv)
    examples = 2 if args.tiny else args.examples
    rewrite_property(examples)()
    print(f"property holds on {examples} random models: residual and "
          f"{', '.join(SCHEMES)} with preserve_identity=True are bit-identical to MiniGPT")


if __name__ == "__main__":
    main()
