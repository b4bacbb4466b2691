"""Bundled models the rewriter is validated on: a plain PreNorm GPT and its MoE variant.

    from depthrewrite.models import gpt_from_preset, moe_from_preset
    model = gpt_from_preset("tiny")                  # GPT(GPTConfig(d_model=64, ...))
    logits, loss = model(input_ids, targets)
"""

from .gpt import (
    GPT,
    GPT_PRESETS,
    Block,
    CausalSelfAttention,
    GPTConfig,
    ParallelBlock,
    RMSNorm,
    SwiGLU,
    apply_rope,
    gpt_from_preset,
    rope_tables,
)
from .moe import (
    MOE_PRESETS,
    Experts,
    MoEBlock,
    MoEConfig,
    MoEFeedForward,
    MoEGPT,
    ParallelMoEBlock,
    expert_counts,
    grouped_mm_supported,
    load_balancing_loss,
    moe_from_preset,
    route,
)

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "ParallelBlock",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "gpt_from_preset",
    "rope_tables",
    "MOE_PRESETS",
    "Experts",
    "MoEBlock",
    "MoEConfig",
    "MoEFeedForward",
    "MoEGPT",
    "ParallelMoEBlock",
    "expert_counts",
    "grouped_mm_supported",
    "load_balancing_loss",
    "moe_from_preset",
    "route",
]
