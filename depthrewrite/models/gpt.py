"""A plain PreNorm decoder-only GPT: RMSNorm (or LayerNorm), RoPE, grouped-query causal
attention, SwiGLU MLP, byte-level vocabulary by default.

This is the model the rewriter is validated on, so the residual stream is written the
most literal way: every block's forward reads the stream only through its norms and the
residual adds, with no Python control flow on tensor values (the rewriter traces each
block with torch.fx, its children being leaf modules):

    x = x + self.attn(self.norm_attn(x), rope)        # sequential (GPT-2 / Llama)
    x = x + self.mlp(self.norm_mlp(x))

    n = self.norm(x)                                  # parallel (GPT-J / NeoX)
    x = x + self.attn(n, rope) + self.mlp(n)

Blocks return the stream tensor alone (no tuple, no cache). Everything outside the blocks
(embedding, RoPE tables, final norm, head, loss) lives in ``GPT.forward``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor]


def _default_hidden(d_model: int) -> int:
    """SwiGLU hidden size with about the parameters of a 4*d GELU MLP (8/3 * d), rounded up
    to a multiple of 64 so matmuls tile well; tiny models round to 8 to stay tiny."""
    multiple = 64 if d_model >= 256 else 8
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def _check_positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, found {value!r}")


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # grouped-query attention; None means n_head (plain MHA)
    mlp_hidden: int | None = None  # SwiGLU hidden size; None means ~8/3 d, see _default_hidden
    max_seq_len: int = 1024
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (nn.LayerNorm)
    norm_eps: float = 1e-6
    parallel_block: bool = False  # GPT-J style: attention and MLP read one norm of the stream
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    dropout: float = 0.0
    init_std: float = 0.02
    embed_scale: float = 1.0  # multiplies the embedding output (Gemma uses sqrt(d_model))

    def __post_init__(self) -> None:
        # Resolve the derived defaults here so that a config, once built, says exactly
        # which model it describes (and round-trips through dataclasses.asdict).
        self._resolve_defaults()
        self.validate()

    def _resolve_defaults(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_hidden is None and isinstance(self.d_model, int) and self.d_model > 0:
            self.mlp_hidden = _default_hidden(self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Called on construction and again by
        the model, since a dataclass can be edited after it was built."""
        owner = type(self).__name__
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "mlp_hidden", "max_seq_len"):
            _check_positive_int(owner, name, getattr(self, name))
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"{owner}: d_model must be divisible by n_head, found d_model={self.d_model}, n_head={self.n_head}"
            )
        if self.head_dim % 2 != 0:
            # RoPE rotates pairs of channels.
            raise ValueError(
                f"{owner}: head_dim = d_model / n_head must be even for RoPE, found "
                f"d_model={self.d_model}, n_head={self.n_head}, head_dim={self.head_dim}"
            )
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"{owner}: n_head must be divisible by n_kv_head (grouped-query attention), found "
                f"n_head={self.n_head}, n_kv_head={self.n_kv_head}"
            )
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"{owner}: norm must be 'rms' or 'layer', found {self.norm!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"{owner}: norm_eps must be > 0, found {self.norm_eps!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{owner}: dropout must be in [0, 1), found {self.dropout!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"{owner}: rope_theta must be > 0, found {self.rope_theta!r}")
        if not self.init_std > 0:
            raise ValueError(f"{owner}: init_std must be > 0, found {self.init_std!r}")
        if not self.embed_scale > 0:
            raise ValueError(f"{owner}: embed_scale must be > 0, found {self.embed_scale!r}")


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel weight (no bias), statistics in float32 so that
    bf16 activations do not lose the mean square."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rms":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> Rope:
    """cos and sin of shape (max_seq_len, head_dim // 2) for the rotate-half convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (B, H, T, head_dim) by position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # One matmul for q, k and v; k and v have n_kv_head heads each (GQA).
        self.qkv = nn.Linear(config.d_model, (config.n_head + 2 * config.n_kv_head) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.d_model, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        y = y.transpose(1, 2).reshape(B, T, q_size)
        return self.resid_drop(self.o_proj(y))

    def reset_parameters(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.qkv.weight, std=init_std)
        nn.init.normal_(self.o_proj.weight, std=out_std)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w_down(F.silu(self.w_gate(x)) * self.w_up(x)))

    def reset_parameters(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.w_gate.weight, std=init_std)
        nn.init.normal_(self.w_up.weight, std=init_std)
        nn.init.normal_(self.w_down.weight, std=out_std)


class Block(nn.Module):
    """Sequential PreNorm block: attention then MLP, each with its own norm and add."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm_attn = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm_mlp = make_norm(config)
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden, config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), rope)
        x = x + self.mlp(self.norm_mlp(x))
        return x


class ParallelBlock(nn.Module):
    """GPT-J style block: attention and MLP read the same norm of the stream and their
    outputs are added to it at once (one residual site per block)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden, config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        n = self.norm(x)
        x = x + self.attn(n, rope) + self.mlp(n)
        return x


def _reset_module(module: nn.Module, init_std: float, out_std: float) -> None:
    """Re-initialise one block's child: norms to identity, linears to normal(init_std),
    residual output projections to normal(out_std)."""
    if isinstance(module, (RMSNorm, nn.LayerNorm)):
        module.reset_parameters()
    else:
        module.reset_parameters(init_std, out_std)


class GPT(nn.Module):
    """Decoder-only PreNorm transformer. ``forward(input_ids, targets=None)`` returns the
    logits (B, T, vocab_size), or ``(logits, loss)`` when targets are given (targets equal
    to -1 are ignored, as in nanoGPT)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"{type(self).__name__}: config must be a GPTConfig, found {type(config).__name__}")
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(self._make_block(config, i) for i in range(config.n_layer))
        self.norm_final = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # RoPE tables are a pure function of the config: non-persistent, so they are not in
        # the state_dict, and they follow .to(device) like any buffer.
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()
        log.debug("%s: %.2fM parameters", type(self).__name__, self.num_parameters() / 1e6)

    def _make_block(self, config: GPTConfig, layer_idx: int) -> nn.Module:
        return ParallelBlock(config) if config.parallel_block else Block(config)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight and recompute the RoPE tables. Also the way to finish a
        model built on the meta device: ``model.to_empty(device=...); model.init_weights()``.

        Normal(0, init_std) everywhere; the projections that write into the residual stream
        get init_std / sqrt(2 * n_layer) (GPT-2), so that the stream's variance does not
        grow with depth at init.
        """
        config = self.config
        out_std = config.init_std / math.sqrt(2 * config.n_layer)
        nn.init.normal_(self.embed.weight, std=config.init_std)
        if config.tie_embeddings:
            # to_empty gives each place of a shared parameter one of its own: tie them again
            self.lm_head.weight = self.embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=config.init_std)
        for block in self.blocks:
            for child in block.children():
                if hasattr(child, "reset_parameters"):  # not a rewrite's routers: those are the rewrite's to set
                    _reset_module(child, config.init_std, out_std)
        self.norm_final.reset_parameters()
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters (a tied head counts once). ``non_embedding`` leaves out the
        token embedding and an untied head, the usual convention for scaling laws."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        if input_ids.dim() != 2:
            raise ValueError(
                f"{type(self).__name__}.forward: input_ids must have shape (batch, seq_len), "
                f"found shape {tuple(input_ids.shape)}"
            )
        T = input_ids.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(
                f"{type(self).__name__}.forward: sequence length must be <= max_seq_len="
                f"{self.config.max_seq_len}, found {T}"
            )
        rope = (self.rope_cos[:T], self.rope_sin[:T])
        h = self.embed(input_ids)
        if self.config.embed_scale != 1.0:
            h = h * self.config.embed_scale
        h = self.drop(h)
        for block in self.blocks:
            h = block(h, rope)
        logits = self.lm_head(self.norm_final(h))
        if targets is None:
            return logits
        return logits, self._loss(logits, targets)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.shape != logits.shape[:-1]:
            raise ValueError(
                f"{type(self).__name__}.forward: targets must have the shape of input_ids "
                f"{tuple(logits.shape[:-1])}, found {tuple(targets.shape)}"
            )
        # float32 for the softmax: bf16 logits lose the small probabilities.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


# Presets. Parameter counts are at the default byte-level vocabulary (256); the names follow
# the GPT-2 size classes, whose advertised counts include a 50257-token embedding: with a
# GPT-2 sized vocabulary (vocab_size=50304, tie_embeddings=True) "base" is ~124M and
# "medium" ~355M. tests/unit/test_models.py checks both.
GPT_PRESETS: dict[str, dict] = {
    # ~0.2M: CPU unit tests.
    "tiny": dict(d_model=64, n_layer=4, n_head=4, max_seq_len=256),
    # ~6.6M: CPU smoke training, quick GPU runs.
    "small": dict(d_model=256, n_layer=8, n_head=8, max_seq_len=512),
    # ~85M at vocab 256 (GPT-2 small shape: 124M with vocab 50304).
    "base": dict(d_model=768, n_layer=12, n_head=12, max_seq_len=1024),
    # ~304M at vocab 256 (GPT-2 medium shape: 355M with vocab 50304).
    "medium": dict(d_model=1024, n_layer=24, n_head=16, max_seq_len=1024),
}


def _config_from_preset(config_cls: type, presets: dict[str, dict], name: str, overrides: dict):
    if name not in presets:
        raise ValueError(f"preset name must be one of {sorted(presets)}, found {name!r}")
    fields = set(config_cls.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"overrides must be fields of {config_cls.__name__}, found unknown {unknown}")
    return config_cls(**{**presets[name], **overrides})


def gpt_from_preset(name: str, **overrides) -> GPT:
    """``GPT(GPTConfig(**GPT_PRESETS[name], **overrides))``; e.g.
    ``gpt_from_preset("tiny", parallel_block=True, norm="layer")``."""
    return GPT(_config_from_preset(GPTConfig, GPT_PRESETS, name, overrides))
