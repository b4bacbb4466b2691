"""Models written the way other codebases write them, not by the rewriter's authors: a
nanoGPT-style GPT (karpathy/nanoGPT's model.py layout) and a torchtitan-style Llama (layers
in a ModuleDict, complex RoPE frequencies passed to every block)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


# ----------------------------------------------------------------------------- nanoGPT
class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias (nanoGPT)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 128
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 32
    bias: bool = True


class NanoGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# ----------------------------------------------------------------------- torchtitan
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        # -1 heads, as torchtitan writes it: under tensor parallelism a rank holds some of them
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, dim, n_heads):
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, 4 * dim)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)
        self.layer_id = layer_id

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class TitanLlama(nn.Module):
    def __init__(self, vocab_size=128, dim=32, n_layers=3, n_heads=4, max_seq_len=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len * 2), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, dim, n_heads) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h)
        return self.output(h)


def titan_init(model: TitanLlama) -> None:
    """Deterministic values for every TitanLlama weight (it has no ``init_weights``; the
    routing's are left alone) and its RoPE table: the init after ``to_empty`` for a model
    built on the meta device. A sharded parameter (FSDP2's DTensor) gets its shard of the
    same values."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".depth_route." in name:
                continue
            value = torch.ones(p.shape) if p.dim() == 1 else 0.02 * torch.randn(p.shape, generator=gen)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, p.device_mesh, p.placements)
            p.copy_(value)
        model.freqs_cis.copy_(precompute_freqs_cis(model.freqs_cis.shape[1] * 2, model.freqs_cis.shape[0]))


# ------------------------------------------------ blocks checkpointed from the model's loop
class ArgsBlock(nn.Module):
    """A block called with an attention mask and a cache slot (None here), returning a tuple."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = FeedForward(dim, 2 * dim)
        self.n_heads = n_heads

    def attn(self, x, attn_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x, attn_mask, cache=None):
        x = x + self.attn(self.norm1(x), attn_mask)
        x = x + self.mlp(self.norm2(x))
        return x, cache


class CheckpointedLM(nn.Module):
    """Activation checkpointing as hand-written training code does it: the model's loop
    wraps each block's call in ``torch.utils.checkpoint.checkpoint`` in training mode."""

    def __init__(self, vocab_size=128, dim=32, n_layers=3, n_heads=4, use_reentrant=None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([ArgsBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.use_reentrant = use_reentrant  # None: no checkpointing

    def forward(self, ids):
        T = ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        x, cache = self.embed(ids), None
        for block in self.blocks:
            if self.training and self.use_reentrant is not None:
                x, cache = torch.utils.checkpoint.checkpoint(block, x, mask, cache, use_reentrant=self.use_reentrant)
            else:
                x, cache = block(x, mask, cache)
        return self.head(self.norm(x))


class PythonListLM(CheckpointedLM):
    """A common slip: the blocks held in a plain Python list, which nn.Module does not register."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        blocks = list(self.blocks)
        del self.blocks
        self.blocks = blocks


class FirstLayerSkipLM(CheckpointedLM):
    """A skip from the embedding into every block's input (modded-nanogpt's x0 mix, written in
    the model's loop): the blocks do not pass the stream on, so it is not a residual stream."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.skip = nn.Parameter(torch.full((len(self.blocks),), 0.5))

    def forward(self, ids):
        T = ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        x = x0 = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x, _ = block(x + self.skip[i] * x0, mask)
        return self.head(self.norm(x))


class CachedAttention(nn.Module):
    """Meta Llama's reference attention: a KV cache in buffers, written at the int
    ``start_pos`` the model passes down while decoding."""

    def __init__(self, dim, n_heads, max_batch=2, max_len=64):
        super().__init__()
        self.n_heads = n_heads
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        shape = (max_batch, max_len, n_heads, dim // n_heads)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, start_pos, mask):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).unbind(2)
        self.cache_k[:B, start_pos:start_pos + T] = k
        self.cache_v[:B, start_pos:start_pos + T] = v
        keys, values = (c[:B, :start_pos + T].transpose(1, 2) for c in (self.cache_k, self.cache_v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class StartPosBlock(nn.Module):
    """``forward(x, start_pos, mask)`` with ``start_pos`` an int. ``branch_on_start=True``:
    the block's own code branches on it too (it then cannot be a traced input)."""

    def __init__(self, dim, n_heads, branch_on_start=False):
        super().__init__()
        self.attention, self.feed_forward = CachedAttention(dim, n_heads), FeedForward(dim, 2 * dim)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.branch_on_start = branch_on_start

    def forward(self, x, start_pos, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, mask)
        if self.branch_on_start and start_pos == 0:  # the prompt: the same computation, another branch
            return h + self.feed_forward(self.ffn_norm(h)) * 1.0
        return h + self.feed_forward(self.ffn_norm(h))


class StartPosLM(nn.Module):
    """Meta Llama's reference model: ``forward(tokens, start_pos)``, a causal mask for the
    prompt and none for one decoded token, and greedy decoding with the int position."""

    def __init__(self, vocab_size=128, dim=32, n_layers=3, n_heads=4, branch_on_start=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([StartPosBlock(dim, n_heads, branch_on_start) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens, start_pos: int = 0):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        mask = None
        if T > 1:
            mask = torch.full((T, T), float("-inf"), device=tokens.device).triu(1)
            mask = torch.hstack([torch.zeros(T, start_pos, device=tokens.device), mask])
        for layer in self.layers:
            h = layer(h, start_pos, mask)
        return self.output(self.norm(h))

    @torch.no_grad()
    def generate(self, prompt, steps):
        """The logits of every step of greedy decoding."""
        logits, tokens, pos = [], prompt, 0
        for _ in range(steps):
            out = self(tokens, pos)
            logits.append(out)
            pos += tokens.shape[1]
            tokens = out[:, -1:].argmax(-1)
        return logits
