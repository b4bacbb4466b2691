"""A hand-written Attention Residuals GPT: the test oracle for the rewriter.

Written from docs/spec.md sections 2-3 alone, independently of depthrewrite: it walks the bundled
GPT's blocks and calls their norms and branches directly, keeping the list of sources by
hand. Only plain torch is used (no depthrewrite op)."""

from __future__ import annotations

import torch


def depth_mix(sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor,
              eps: float = 1e-6) -> torch.Tensor:
    """x = sum_i softmax_i(w . RMSNorm_g(v_i)) v_i, softmax over the sources."""
    v = torch.stack([s.float() for s in sources])
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * key_norm_weight.float()
    weights = (keys * query.float()).sum(-1).softmax(dim=0)
    return (weights.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


def branches(block, rope):
    """The (norm, branch) pairs of a bundled GPT block, in site order."""
    if hasattr(block, "norm_attn"):
        return [(block.norm_attn, lambda n: block.attn(n, rope)), (block.norm_mlp, block.mlp)]
    return [(block.norm, lambda n: block.attn(n, rope) + block.mlp(n))]


def attnres_gpt_logits(gpt, params: list[tuple], ids: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """Logits of ``gpt`` with Attention Residuals. ``params[l-1]`` is (query, key_norm_weight)
    of site l; ``params[-1]`` is the final readout's. ``block_size=None`` is full AttnRes."""
    T = ids.shape[1]
    rope = (gpt.rope_cos[:T], gpt.rope_sin[:T])
    e = gpt.drop(gpt.embed(ids) * gpt.config.embed_scale)
    completed, partial, site = [e], None, 0  # full AttnRes: every update completes at once
    for block in gpt.blocks:
        for norm, branch in branches(block, rope):
            query, key_norm_weight = params[site]
            x = depth_mix(completed + ([partial] if partial is not None else []), query, key_norm_weight)
            u = branch(norm(x))
            site += 1
            partial = u if partial is None else partial + u
            if block_size is None or site % block_size == 0:
                completed.append(partial)
                partial = None
    query, key_norm_weight = params[-1]
    x = depth_mix(completed + ([partial] if partial is not None else []), query, key_norm_weight)
    return gpt.lm_head(gpt.norm_final.forward(x))  # forward: the norm itself, not a routed call
