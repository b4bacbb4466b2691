"""Tiny hand-written models, one per residual shape of docs/spec.md section 1, for the analysis
tests. Each block's forward is the shape under test, written out literally."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TokenMixer(nn.Module):
    """A minimal causal mixer (cumulative mean): mixes tokens like attention does."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        steps = torch.arange(1, x.shape[-2] + 1, device=x.device, dtype=x.dtype)[:, None]
        return self.proj(x.cumsum(-2) / steps)


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TupleMoE(nn.Module):
    """Returns ``(out, router_logits)`` like HF's older MoE blocks."""

    def __init__(self, d, n_experts=3):
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(Mlp(d) for _ in range(n_experts))

    def forward(self, x):
        logits = self.router(x)
        weights = logits.softmax(-1)
        out = sum(weights[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))
        return out, logits


class ToyBlock(nn.Module):
    """``shape`` picks the residual form written in forward."""

    def __init__(self, d, shape, norm="rms"):
        super().__init__()
        make = (lambda: nn.RMSNorm(d)) if norm == "rms" else (lambda: nn.LayerNorm(d))
        self.shape = shape
        self.n1, self.n2 = make(), make()
        self.post1, self.post2 = make(), make()
        self.mix = TokenMixer(d)
        self.mlp = TupleMoE(d) if shape.startswith("moe_tuple") else Mlp(d)

    def forward(self, h):
        s = self.shape
        if s == "plain":
            h = h + self.mix(self.n1(h))
            h = h + self.mlp(self.n2(h))
        elif s == "reversed":
            h = self.mix(self.n1(h)) + h
            h = self.mlp(self.n2(h)) + h
        elif s == "inplace":
            h += self.mix(self.n1(h))
            h = h.add_(self.mlp(self.n2(h)))
        elif s == "torch_add":
            h = torch.add(h, self.mix(self.n1(h)))
            h = h.add(self.mlp(self.n2(h)))
        elif s == "sandwich":
            h = h + self.post1(self.mix(self.n1(h)))
            h = h + self.post2(self.mlp(self.n2(h)))
        elif s == "moe_tuple":
            h = h + self.mix(self.n1(h))
            out, _ = self.mlp(self.n2(h))
            h = h + out
        elif s == "moe_tuple_checked":  # Qwen2-MoE in transformers 4.x: branches on the MLP's output type
            h = h + self.mix(self.n1(h))
            out = self.mlp(self.n2(h))
            if isinstance(out, tuple):
                out, _ = out
            h = h + out
        elif s == "scaled":  # Granite: h + c * f(h), c belongs to the branch
            h = h + 0.5 * self.mix(self.n1(h))
            h = h + 0.5 * self.mlp(self.n2(h))
        elif s == "parallel_two_adds":
            n = self.n1(h)
            h = h + self.mix(n) + self.mlp(n)
        elif s == "parallel_sum":
            h = h + (self.mix(self.n1(h)) + self.mlp(self.n2(h)))
        elif s == "post_norm":  # OLMo 2: h + norm(f(h))
            h = h + self.post1(self.mix(h))
            h = h + self.post2(self.mlp(h))
        elif s == "post_ln":  # original Transformer: norm(h + f(h))
            h = self.n1(h + self.mix(h))
            h = self.n2(h + self.mlp(h))
        elif s == "no_norm":
            h = h + self.mix(h)
        else:
            raise ValueError(s)
        return h


class TupleBlock(ToyBlock):
    """Returns ``(stream, extra)`` (blocks that return tuples)."""

    def forward(self, h):
        h = super().forward(h)
        return h, h.mean()


class ToyLM(nn.Module):
    def __init__(self, vocab=50, d=16, n_layer=3, shape="plain", norm="rms", emb_scale=False,
                 block_cls=ToyBlock, final_norm=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(block_cls(d, shape, norm) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d) if final_norm else nn.Identity()
        self.head = nn.Linear(d, vocab, bias=False)
        self.emb_scale = math.sqrt(d) if emb_scale else None

    def forward(self, ids):
        h = self.embed(ids)
        if self.emb_scale is not None:
            h = h * self.emb_scale
        for block in self.blocks:
            out = block(h)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(h))


class NoStack(nn.Module):
    """An MLP classifier: no stack of residual blocks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, ids):
        return self.head(self.embed(ids))
