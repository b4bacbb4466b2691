"""Mixture-of-Experts GPT: the GPT of gpt.py with the MLP sublayer replaced by a top-k
routed mixture of SwiGLU experts (plus an optional always-on shared expert).

The block stays plain PreNorm, ``x = x + self.moe(self.norm_mlp(x))``: the router's
load-balancing loss is not returned through the stream but stored on the MoE module
(``self.aux_loss``), and ``MoEGPT.forward`` adds ``aux_loss_coef *`` their sum to the loss.

Token dispatch (per MoE layer, N tokens, E experts, top-k):

    router -> softmax (float32) -> top-k, weights renormalised to sum to 1
    the N*k (token, slot) pairs are sorted by expert id (argsort), counted per expert,
    the experts run as one grouped matmul over the contiguous per-expert slices,
    outputs go back to (token, slot) order and are summed with the routing weights.

Expert matmuls use ``torch._grouped_mm`` where its fast kernel exists (CUDA, sm90+, bf16,
16-byte aligned dims); elsewhere a loop over experts on the sorted slices. Shapes on the
grouped path are static (N*k rows whatever the routing), so ``torch.compile(fullgraph=True)``
works there. The fallback loop needs each expert's row count on the host
(``counts.tolist()`` in ``Experts._forward_loop``): a device sync and data-dependent sizes,
so under torch.compile it is a graph break (use ``fullgraph=False`` on that path, or force
``Experts.use_grouped_mm = True`` where torch supports ``_grouped_mm`` on the device).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import (
    GPT,
    GPTConfig,
    CausalSelfAttention,
    Rope,
    SwiGLU,
    _check_positive_int,
    _config_from_preset,
    make_norm,
)

log = logging.getLogger(__name__)


@dataclass
class MoEConfig(GPTConfig):
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int | None = None  # each expert's SwiGLU hidden size; None means mlp_hidden
    shared_expert: bool = False  # an always-on SwiGLU expert of size expert_hidden, added to the output
    aux_loss_coef: float = 0.01

    def _resolve_defaults(self) -> None:
        super()._resolve_defaults()
        if self.expert_hidden is None:
            self.expert_hidden = self.mlp_hidden

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        for name in ("n_experts", "top_k", "expert_hidden"):
            _check_positive_int(owner, name, getattr(self, name))
        if self.top_k > self.n_experts:
            raise ValueError(
                f"{owner}: top_k must be in [1, n_experts={self.n_experts}], found top_k={self.top_k}"
            )
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"{owner}: aux_loss_coef must be >= 0, found {self.aux_loss_coef!r}")


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax router with top-k selection.

    Returns ``probs`` (N, E) float32, ``weights`` (N, k) float32 renormalised to sum to 1
    per token, and ``expert_idx`` (N, k). With top_k=1 the renormalised weight is 1, so the
    router then learns only from the load-balancing loss.
    """
    probs = router_logits.float().softmax(dim=-1)  # float32: bf16 softmax biases routing
    weights, expert_idx = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, expert_idx


def expert_counts(expert_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Number of (token, slot) assignments per expert, shape (n_experts,), int64.

    ``torch.bincount(expert_idx.flatten(), minlength=n_experts)`` written as a scatter-add:
    bincount's output length depends on the largest id, which torch.compile cannot know.
    """
    flat = expert_idx.reshape(-1)
    return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e``: fraction of the N*k (token, slot) assignments that went to expert e (no
    gradient: it is a count); ``P_e``: mean router probability of expert e over the N
    tokens. Equals 1 for perfectly uniform routing, E for collapse onto one expert.
    """
    n_experts = probs.shape[-1]
    f = expert_counts(expert_idx, n_experts).to(probs.dtype) / expert_idx.numel()
    p = probs.reshape(-1, n_experts).mean(dim=0)
    return n_experts * (f * p).sum()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` has its fast (CUTLASS) kernel for these operands:
    CUDA sm90+, bf16 compute, and every matrix dim a multiple of 8 (16-byte aligned rows)."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or _compute_dtype(x) != torch.bfloat16:
        return False
    if x.shape[-1] % 8 != 0 or any(w.shape[-1] % 8 != 0 or w.shape[-2] % 8 != 0 for w in weights):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


class Experts(nn.Module):
    """E SwiGLU experts stored as stacked weights in nn.Linear layout (out, in) per expert,
    so that one grouped matmul runs them all."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, init_std: float = 0.02):
        super().__init__()
        self.n_experts = n_experts
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        # Initialised here (torch.empty is garbage) so that the module works on its own;
        # GPT.init_weights re-initialises it with the depth-scaled output std.
        self.reset_parameters(init_std, init_std)
        # None: torch._grouped_mm where grouped_mm_supported() says so, else the loop.
        # True/False force one path (tests, or torch builds with _grouped_mm on other devices).
        self.use_grouped_mm: bool | None = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (M, d) rows sorted by expert; counts: (E,) rows per expert, summing to M."""
        use = self.use_grouped_mm
        if use is None:
            use = grouped_mm_supported(x, self.w_gate, self.w_up, self.w_down)
        if use:
            return self._forward_grouped(x, counts)
        return self._forward_loop(x, counts)

    def _forward_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # offs[e] is the end row of expert e; an expert with no rows is an empty group.
        offs = counts.cumsum(0, dtype=torch.int32)
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        # (E, out, in).transpose -> (E, in, out) column-major: the layout the kernel wants.
        w_gate, w_up, w_down = (w.to(dtype).transpose(-2, -1) for w in (self.w_gate, self.w_up, self.w_down))
        h = F.silu(torch._grouped_mm(x, w_gate, offs=offs)) * torch._grouped_mm(x, w_up, offs=offs)
        return torch._grouped_mm(h, w_down, offs=offs)

    def _forward_loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Host sync and data-dependent sizes: this is where torch.compile breaks the graph.
        sizes = counts.tolist()
        outs = []
        for e, xe in enumerate(x.split(sizes)):
            h = F.silu(xe @ self.w_gate[e].T) * (xe @ self.w_up[e].T)
            outs.append(h @ self.w_down[e].T)
        return torch.cat(outs)

    def reset_parameters(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.w_gate, std=init_std)
        nn.init.normal_(self.w_up, std=init_std)
        nn.init.normal_(self.w_down, std=out_std)

    def extra_repr(self) -> str:
        e, hidden, d = self.w_gate.shape
        return f"n_experts={e}, d_model={d}, hidden={hidden}"


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert). After each forward,
    ``self.aux_loss`` holds this call's load-balancing loss (a scalar tensor)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = Experts(config.n_experts, config.d_model, config.expert_hidden, config.init_std)
        self.shared_expert = SwiGLU(config.d_model, config.expert_hidden) if config.shared_expert else None
        self.drop = nn.Dropout(config.dropout)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d)
        probs, weights, expert_idx = route(self.router(x), self.top_k)
        self.aux_loss = load_balancing_loss(probs, expert_idx)

        # Sort the N*k (token, slot) pairs by expert so each expert's rows are contiguous.
        # Stable sort: rows keep token order within an expert (reproducible results).
        flat_expert = expert_idx.reshape(-1)
        order = flat_expert.argsort(stable=True)
        counts = expert_counts(flat_expert, self.n_experts)
        y_sorted = self.experts(x[order // self.top_k], counts)

        # Back to (token, slot) order. A permutation, so index_copy writes each row once:
        # deterministic, unlike an index_add of the weighted rows.
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
        out = (y.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.drop(out.to(x.dtype)).view(shape)

    def reset_parameters(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, std=init_std)
        self.experts.reset_parameters(init_std, out_std)
        if self.shared_expert is not None:
            self.shared_expert.reset_parameters(init_std, out_std)


class MoEBlock(nn.Module):
    """Sequential PreNorm block with an MoE sublayer in place of the MLP."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.norm_attn = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm_mlp = make_norm(config)
        self.moe = MoEFeedForward(config)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), rope)
        x = x + self.moe(self.norm_mlp(x))
        return x


class ParallelMoEBlock(nn.Module):
    """GPT-J style parallel block with an MoE sublayer."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.norm = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.moe = MoEFeedForward(config)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        n = self.norm(x)
        x = x + self.attn(n, rope) + self.moe(n)
        return x


class MoEGPT(GPT):
    """GPT with MoE sublayers. ``forward(input_ids, targets=None)`` returns the logits, or
    ``(logits, loss)`` where loss = cross-entropy + aux_loss_coef * sum of the layers'
    load-balancing losses."""

    def __init__(self, config: MoEConfig):
        if not isinstance(config, MoEConfig):
            raise ValueError(f"{type(self).__name__}: config must be a MoEConfig, found {type(config).__name__}")
        super().__init__(config)

    def _make_block(self, config: MoEConfig, layer_idx: int) -> nn.Module:
        return ParallelMoEBlock(config) if config.parallel_block else MoEBlock(config)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        out = super().forward(input_ids, targets)
        if targets is None:
            return out
        logits, loss = out
        return logits, loss + self.config.aux_loss_coef * self.aux_loss()

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' load-balancing losses from the last forward. Found by
        walking the modules rather than ``block.moe``, so that it still works after the
        blocks were rewritten or wrapped."""
        return sum(m.aux_loss for m in self.modules() if isinstance(m, MoEFeedForward))

    def num_active_parameters(self) -> int:
        """Parameters used per token: all but the (n_experts - top_k) unchosen experts."""
        c = self.config
        per_expert = 3 * c.d_model * c.expert_hidden
        return self.num_parameters() - c.n_layer * (c.n_experts - c.top_k) * per_expert


# Presets (counts at the byte-level vocabulary, total / active per token).
MOE_PRESETS: dict[str, dict] = {
    # ~0.6M / 0.4M: CPU unit tests.
    "tiny": dict(
        d_model=64, n_layer=4, n_head=4, max_seq_len=256,
        n_experts=4, top_k=2, expert_hidden=128, shared_expert=True,
    ),
    # ~31M / 12M: CPU smoke training, quick GPU runs.
    "small": dict(
        d_model=256, n_layer=8, n_head=8, max_seq_len=512,
        n_experts=8, top_k=2, expert_hidden=512, shared_expert=True,
    ),
    # ~348M / 150M.
    "medium": dict(
        d_model=1024, n_layer=12, n_head=16, max_seq_len=1024,
        n_experts=8, top_k=2, expert_hidden=896, shared_expert=True,
    ),
}  # fmt: skip


def moe_from_preset(name: str, **overrides) -> MoEGPT:
    """``MoEGPT(MoEConfig(**MOE_PRESETS[name], **overrides))``."""
    return MoEGPT(_config_from_preset(MoEConfig, MOE_PRESETS, name, overrides))
