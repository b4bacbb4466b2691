"""Model-zoo coverage: which decoder-only causal-LM families of the installed transformers
does depthrewrite rewrite?

    /work/venv/bin/python benchmarks/zoo_coverage.py --write docs/coverage.md

Every family of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from a shrunken default
config with random weights (no download), in its own subprocess with a timeout (a hang or
crash of one family cannot stop the survey), two at a time. Each buildable family is
inspected and rewritten four ways (attnres and dar, each with and without
``preserve_identity``); the identity rewrites must reproduce the original logits bit for
bit. Status per family (STATUSES; details in docs/coverage.md):

- ``rewritten``: all four rewrites ran and both identity rewrites are bit-identical;
- ``refused: not PreNorm`` / ``refused: not an additive stream``: the library raised
  ``NotPreNormError`` / ``NotAdditiveStreamError`` and the family is in the reviewed table
  (REVIEWED_NOT_PRENORM / REVIEWED_NOT_ADDITIVE) with evidence from its decoder layer;
- ``refused: unsupported``: any other ``DepthRewriteError`` (a gap of depthrewrite);
- ``disputed``: the library's verdict and the reviewed tables disagree;
- ``failed``: any other exception, or an identity rewrite that changed the logits;
- ``timed out``: the family's subprocess ran past the timeout;
- ``not buildable``: the small config or the model could not be constructed;
- ``skipped``: not decoder-only, too large from a small config, needs an optional package,
  or not a standalone causal LM.

Coverage = rewritten / (rewritten + unsupported + disputed + failed + timed out): only the
reviewed refusals are left out, so the number does not rest on the library's own verdict.

``check_family`` is the single implementation of the per-family check; tests/zoo imports it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

#: families above this many parameters (counted on the meta device) are not built
MAX_PARAMS = 30_000_000
#: the shrunken sizes, and every config field name we know for each
SMALL = {
    ("hidden_size", "n_embd", "d_model", "embed_dim", "n_embed", "model_dim", "dim", "hidden_dim"): 64,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("num_attention_heads", "n_head", "num_heads", "n_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "multi_query_group_num"): 2,
    ("head_dim", "kv_channels", "attention_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
     "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "d_head"): 16,
    ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "moe_intermediate_size",
     "shared_expert_intermediate_size", "expert_intermediate_size", "dense_intermediate_size",
     "ffn_hidden_dim", "mlp_dim"): 128,
    ("vocab_size",): 128,
    ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts", "moe_k"): 2,
    ("rotary_dim",): 8,
    ("num_kv_shared_layers",): 0,  # KV sharing across the last layers needs more than two
    ("hidden_size_per_layer_input",): 16,
    ("vocab_size_per_layer_input", "encoder_hash_byte_group_vocab"): 128,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"): 256,
    ("q_lora_rank",): 32,
    ("kv_lora_rank",): 32,
    ("n_group", "topk_group"): 1,
    ("num_key_value_groups",): 2,
    ("linear_num_key_heads", "linear_num_value_heads"): 2,
    ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"): 0,
}
#: fields where the default's value "None" means "off" and must stay off
_KEEP_NONE = {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "q_lora_rank",
              "head_dim", "n_inner", "sliding_window"}
#: Qwen4-Exp text: its sparse-attention indexer has no defaults (all None); the n-gram embedding
#: table is sized from a 20M base, the hyper-connection and per-layer-embedding widths from the
#: full model
_QWEN4_TEXT = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
               "indexer_compress_ratio": 2, "ngram_vocab_size_base": 128, "hc_lowrank": 16, "ple_embed_dim": 64}
#: Gemma 4 draft models validate that their text config has no per-layer inputs, no MoE block
#: and no double-wide MLP (the Gemma 4 text defaults have per-layer inputs)
_ASSISTANT_TEXT = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
                   "use_double_wide_mlp": False}
#: per-family fixes applied after SMALL, each needed because the shrunken default config is
#: not valid for that family (the comment says why; found by reading its config/modeling
#: file). A dict value for a sub-config changes only the fields it names.
OVERRIDES: dict[str, dict] = {
    # grouped routing uses num_expert_group and num_experts_per_token, names SMALL does not know
    "bailing_hybrid": {"num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 2},
    # the byte-level encoder/decoder project to the global transformer's width, hidden_size_global
    "blt": {"encoder_config": {"hidden_size_global": 64}, "decoder_config": {"hidden_size_global": 64}},
    # RoPE parameters are per layer type and the default config has none
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # DbrxAttention reads attn_config.rope_theta, a field DbrxAttentionConfig does not declare, and
    # clamps q/k/v unconditionally, which fails with the default clip_qkv=None (dbrx-instruct uses 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the MoE block always builds a shared expert, sized by n_shared_experts (default None)
    "dots1": {"n_shared_experts": 1},
    # the sparse-attention indexer scores keys with index_num_heads (default 12) of the query
    # heads that share key head 0, at most num_attention_heads // num_key_value_heads (2 here)
    "kolibri1_1": {"index_num_heads": 2},
    # MLA: a sliding layer's head_dim must equal qk_nope + qk_rope (16 = 8 + 8); the vision and
    # audio adapters must map their width to the text width
    "dots3_note": {"text_config": {"qk_nope_head_dim": 8, "qk_rope_head_dim": 8},
                   "vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64},
                   "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64}},
    "dots3_note_text": {"qk_nope_head_dim": 8, "qk_rope_head_dim": 8},
    "gemma4_assistant": {"text_config": _ASSISTANT_TEXT},
    "gemma4_unified_assistant": {"text_config": _ASSISTANT_TEXT},
    # the default stack is all Mamba, whose forward then fails (get_seq_length on a cache with no
    # attention layer): one Mamba and one attention layer, as in the released hybrids; the
    # Mamba width 2 x 64 in 4 heads of 32
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 32, "mamba_d_state": 16, "mamba_chunk_size": 16},
    # the attention reads config.head_dim, whose default None (kept None by _KEEP_NONE) it does
    # not fall back from; 16 = hidden 64 / 4 heads
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "ministral": {"head_dim": 16},
    # top-k is num_experts_per_token here, a name SMALL does not know (8 > 4 experts); the
    # linear-attention width (32 heads x 128) shrunk like the others
    "kimi_linear": {"num_experts_per_token": 2, "linear_num_heads": 4, "linear_head_dim": 16},
    # layer_types has no default (None): one short-conv and one attention layer; one dense
    # layer first so that the second one is mixture-of-experts
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # the SSM width hidden * expand (128) must equal num_heads * head_dim (4 x 32); groups divide heads
    "mamba2": {"head_dim": 32, "n_groups": 1, "state_size": 16, "time_step_rank": 8},
    "qwen4_exp": {"text_config": _QWEN4_TEXT, "vision_config": {"depth": 2, "out_hidden_size": 64}},
    "qwen4_exp_text": _QWEN4_TEXT,
    # the LM head needs is_decoder=True (causal); the axial position embedding factors the
    # 256 positions (16 x 16) and splits the width 64 (16 + 48); heads are 16 wide
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 16], "axial_pos_embds_dim": [16, 48],
                 "attention_head_size": 16, "feed_forward_size": 128},
    # the forward needs a language for its adapters (set_default_language on a checkpoint), and
    # is_decoder=True, as its causal-LM head asks, for a causal mask
    "xmod": {"default_language": "en_XX", "is_decoder": True},
    # the hybrid layers share one attention block, tied by a pattern that needs two hybrid
    # layers; that attention reads [h, embeddings], 2 x 64 wide, in 4 heads of 32
    "zamba": {"layers_block_type": ["hybrid", "hybrid"], "attention_hidden_size": 128, "attention_head_dim": 32,
              "mamba_dt_rank": 8, "use_mamba_kernels": False},
    # too large otherwise (137.6M): routed top-k is moe_topk (12 > 4 experts), plus 256 "zero"
    # (identity) experts and 2048-wide experts, names SMALL does not know
    "longcat_flash": {"moe_topk": 2, "zero_expert_num": 2, "expert_ffn_hidden_size": 128},
    # too large otherwise (101.5M): the width is emb_dim, a name SMALL does not know; causal=True
    # for a causal LM (the default is a masked-LM encoder)
    "xlm": {"emb_dim": 64, "causal": True},
    # ZAYA validates num_experts_per_tok == 1 (top-1 routing only)
    "zaya": {"num_experts_per_tok": 1},
}
#: families that need a package the survey does not install
NEEDS_PACKAGE = {"gemma3n": "timm"}  # its audio/vision towers are timm models
#: families that build but are not a causal LM of their own: skipped, with the reason
NOT_STANDALONE = {
    fam: "builds, but is a speculative-decoding draft model: its forward ignores input_ids and needs the "
         "target model's inputs_embeds and shared KV states (raises without them)"
    for fam in ("gemma4_assistant", "gemma4_unified_assistant")
}
#: families whose default config itself fails validation: built with OVERRIDES applied
FIX_DEFAULTS = {"gemma4_assistant", "gemma4_unified_assistant"}

# Reviewed refusals. The coverage number must not trust the library's own verdict: a refusal
# as "not PreNorm" or "not an additive stream" is excluded from coverage only when the family
# is listed here, with one line of evidence from reading its decoder layer in transformers
# 5.24 (the modeling file named by the family). Anything else the library refuses counts
# against coverage; a listed family that the library rewrites, or refuses for the other
# reason, is "disputed" (counts against too) until a person looks at it again.
_POST_LN_BERT = "post-LN: {cls}SelfOutput/{cls}Output return LayerNorm(hidden_states + input_tensor)"
REVIEWED_NOT_PRENORM: dict[str, str] = {
    **{fam: _POST_LN_BERT.format(cls=cls) for fam, cls in [
        ("bert", "Bert"), ("bert-generation", "BertGeneration"), ("big_bird", "BigBird"),
        ("camembert", "Camembert"), ("data2vec-text", "Data2VecText"), ("electra", "Electra"),
        ("ernie", "Ernie"), ("git", "Git"), ("rembert", "RemBert"), ("roberta", "Roberta"),
        ("roc_bert", "RoCBert"), ("roformer", "RoFormer"), ("xlm-roberta", "XLMRoberta")]},
    "xmod": "post-LN with the default pre_norm=False: XmodSelfOutput adds, then XmodAttention applies "
            "output.LayerNorm to the sum",
    "openai-gpt": "post-LN: Block computes n = ln_1(x + a), h = ln_2(n + m)",
    "xlm": "post-LN: XLMModel computes layer_norm1[i](tensor + attn), then layer_norm2[i](tensor + ffns[i](tensor)) "
           "(layers are parallel ModuleLists, no block modules)",
    "trocr": "post-LN: TrOCRDecoderLayer adds residual + self_attn(h), then self_attn_layer_norm (and "
             "final_layer_norm after the MLP add)",
    "xlnet": "post-LN: post_attention returns layer_norm(attn_out + h), XLNetFeedForward layer_norm(output + inp)",
    **{fam: f"post-norm: {cls}DecoderLayer has no input norm; post_attention_layernorm is applied to the "
            "attention output before the add, h + norm(attn(h))" for fam, cls in [
        ("olmo2", "Olmo2"), ("olmo3", "Olmo3"), ("flex_olmo", "FlexOlmo"), ("exaone4", "Exaone4"),
        ("olmo_hybrid", "OlmoHybridAttention")]},
    **{fam: "a third residual sublayer reads the raw stream: h + post_per_layer_input_norm(per_layer_projection("
            "act(per_layer_input_gate(h)) * per_layer_input)) (Gemma4TextDecoderLayer)"
       for fam in ("gemma4", "gemma4_text")},
    **{fam: f"the Mamba branch normalises h + t, not h: {cls}MambaDecoderLayer computes input_layernorm("
            "hidden_states + transformer_hidden_states), t the shared attention block's output, so the "
            "branch reads the raw stream before its norm" for fam, cls in [("zamba", "Zamba"), ("zamba2", "Zamba2")]},
    "minimax": "the stream itself is normalised: MiniMaxDecoderLayer sets residual = input_layernorm(h) "
               "and the next stream is post_attention_layernorm(residual * alpha + attn * beta)",
}
REVIEWED_NOT_ADDITIVE: dict[str, str] = {
    "ergo": "rescaled stream: ErgoResidualGate returns sigmoid(w) * branch + sqrt(1 + sigmoid(w)) * "
            "exp(-softplus(w) / 2) * residual (a learned per-channel scale of h)",
    "doge": "rescaled stream: DogeDecoderLayer computes input_residual * residual + attn (a learned "
            "per-channel scale of h)",
    "minimax": "rescaled stream: residual * attn_alpha_factor + hidden_states * attn_beta_factor",
    "beam": "rescaled stream: depth_scaled_residual_add returns u / sqrt(k) + h * sqrt((k - 1) / k)",
    "zaya": "rescaled stream: ZayaResidualScaling returns (u + b_u) * s_u + (h + b_h) * s_h",
    **{fam: "rescaled stream: the decoder layer ends with hidden_states *= self.layer_scalar (a loaded "
            "buffer) after both residual adds"
       for fam in ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")},
    "deepseek_v4": "hyper-connections: attn_hc/ffn_hc mix hc_mult parallel streams, "
                   "post * u + comb^T @ H",
    "hy_v4": "hyper-connections: attn_hc/ffn_hc give (post, collapsed input); the update is "
             "post * u + residual over the hc streams",
    **{fam: "hyper-connections: attn_hyper_connection/mlp_hyper_connection over hc_count streams, "
            "hyper_input + injection_weights * u" for fam in ("qwen4_exp", "qwen4_exp_text")},
    "gemma3n_text": "AltUp: the layer predicts and corrects altup_num_inputs parallel streams "
                    "(altup.predict / altup.correct), with a Laurel branch scaled by 1/sqrt(2)",
    "inkling2_text": "multi-stream: block boundaries push the stream onto block_states and attention_input/"
                     "mlp_input route over that stack (the model already routes over depth)",
    "inkling2_loop_text": "multi-stream block_states as inkling2, and the loop layers run loop_num_passes "
                          "times per forward",
    "dory": "block reuse: DoryModel runs layers[recurrent_start:recurrent_end] n_loops times per forward",
    "hrm_text": "block reuse: HrmTextModel runs its L stack L_cycles times and its H stack once in each of "
                "H_cycles cycles, on two coupled streams",
    "reformer": "reversible residual: two half streams, y1 = x1 + attn(norm(x2)) and "
                "y2 = x2 + ff(norm(y1)); each branch reads the other stream",
}
#: refusals of families reviewed as PreNorm with an additive stream: a refusal of these is a
#: gap of depthrewrite and counts against coverage (kept for the report, not for the number)
REVIEWED_PRENORM: dict[str, str] = {
    "bloom": "input_layernorm before attention; the add is inside the attention/MLP (dropout_add)",
    "cpmant": "layernorm_before_attention/_ffn; the add is inside CpmAntSelfAttentionBlock/FFNBlock",
    "dbrx": "norm_1 before attention; that add is inside DbrxNormAttentionNorm",
    "mamba": "norm before the mixer, residual + mixer(norm(h)) (the residual cast to fp32)",
    "falcon_mamba": "as mamba: residual + mixer(norm(h))",
    "nemotron_h": "residual + mixer(norm(h.to(norm.weight.dtype)))",
    "opt": "do_layer_norm_before=True by default: residual + attn(ln(h)); the MLP add is viewed back to shape",
    "mpt": "norm_1/norm_2 before attention/MLP; the MLP add is inside MptMLP",
    "megatron-bert": "ln before attention/MLP; the adds are in MegatronBertSelfOutput/Output",
    "roberta-prelayernorm": "LayerNorm before attention/MLP; the adds are in the Output modules",
    "xlm-roberta-xl": "self_attn_layer_norm/LayerNorm before attention/MLP; the adds are in the Output modules",
    "longcat_flash": "every branch reads a norm and adds: h + attn(input_layernorm[i](h)), h + mlps[i]("
                     "post_attention_layernorm[i](h)); the shortcut MoE mlp(post_attention_layernorm[0](h)) "
                     "is added at the end of the layer, one sublayer pair later",
    "rwkv": "hidden + attention(ln1(hidden)), hidden + feed_forward(ln2(hidden)) (block 0 applies pre_ln)",
    "gpt_neox_japanese": "input_layernorm before attention; the add is bias_dropout_add with a bias expand_as(h)",
    "llama4": "residual + attn(input_layernorm(h)); the MoE output is viewed to residual.shape",
    "llama4_text": "as llama4",
    "modernbert-decoder": "attn_norm/mlp_norm before each branch (layer 0's attn_norm is Identity: the "
                          "embeddings are already LayerNormed)",
    "nanochat": "residual + attn(input_layernorm(h)); model.norm is applied to the embeddings and reused "
                "as the final norm",
}
STATUSES = ("rewritten", "refused: not PreNorm", "refused: not an additive stream", "refused: unsupported",
            "disputed", "failed", "timed out", "not buildable", "skipped")
#: the statuses that count against coverage (the denominator is these plus rewritten)
AGAINST = ("refused: unsupported", "disputed", "failed", "timed out")


_REVIEWED_ERRORS = ("NotPreNormError", "NotAdditiveStreamError")


def classify_refusal(family: str, error: str) -> tuple[str, str]:
    """(status, note) of a refusal with the DepthRewriteError subclass named ``error``."""
    reviewed = {"NotPreNormError": (REVIEWED_NOT_PRENORM, "refused: not PreNorm"),
                "NotAdditiveStreamError": (REVIEWED_NOT_ADDITIVE, "refused: not an additive stream")}
    if error not in reviewed:
        evidence = REVIEWED_NOT_PRENORM.get(family) or REVIEWED_NOT_ADDITIVE.get(family)
        # still counts against: the library did not say what it found
        return "refused: unsupported", (f"reviewed as not rewritable, but refused as {error}" if evidence else "")
    table, status = reviewed[error]
    if family in table:
        return status, ""
    return "disputed", f"{error} for a family not reviewed as such"


def classify_rewritten(family: str) -> tuple[str, str]:
    """(status, note) of a family whose four rewrites all passed."""
    evidence = REVIEWED_NOT_PRENORM.get(family) or REVIEWED_NOT_ADDITIVE.get(family)
    if evidence:
        return "disputed", f"rewritten, but reviewed as not rewritable ({evidence})"
    return "rewritten", ""


SCHEME_RUNS = (("attnres", False), ("attnres", True), ("dar", False), ("dar", True))
#: per family; generous, because two families share two cores with whatever else runs there
TIMEOUT_S = 180
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    family: str
    status: str
    sites: int | None = None
    params: int | None = None
    detail: str = ""
    cause: str = ""  # the failing step, for grouping failures
    seconds: float = 0.0
    runs: dict = field(default_factory=dict)


def causal_lm_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink_fields(defaults: dict, mha: bool = False) -> dict:
    """The SMALL values for the fields ``defaults`` (a config's to_dict) has, plus per-layer
    lists cut to the new layer count."""
    fields = {}
    for names, value in SMALL.items():
        for name in names:
            if name in defaults and not (defaults[name] is None and name in _KEEP_NONE) \
                    and not isinstance(defaults[name], (dict, list, bool)):
                fields[name] = value
    layers = next((defaults[n] for n in SMALL_LAYER_FIELDS if isinstance(defaults.get(n), int)), None)
    sized = {name: value for names, value in SMALL.items() for name in names}
    for name, value in defaults.items():
        # per-layer lists (layer_types, block types...) must match the new depth
        if isinstance(value, list) and layers and len(value) == layers and value:
            fields[name] = [sized[name]] * 2 if name in sized else _two_layers(value)
        # per-layer overrides keyed by layer index: keep those of the first two layers
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            fields[name] = {k: v for k, v in value.items() if int(k) < 2}
    if mha:
        fields.update({n: 4 for n in KV_HEAD_FIELDS if n in fields})
    return fields


def _two_layers(values: list) -> list:
    """Two entries of a per-layer list, of two different kinds where it has them (a
    sliding and a full attention layer, say), so that both kinds get built."""
    first = values[0]
    other = next((v for v in values if v != first), first)
    return [first, other] if values.index(other) > 0 else [first, first]


SMALL_LAYER_FIELDS = next(names for names in SMALL if "num_hidden_layers" in names)
KV_HEAD_FIELDS = next(names for names in SMALL if "num_key_value_heads" in names)


def small_config(family: str, mha: bool = False):
    """The default config of ``family`` with its text (and any sub-) configs shrunk;
    ``mha``: as many key/value heads as query heads (some attentions, e.g. MLA, need it)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    # a few default configs do not validate as they are; they are built with their fix applied
    defaults = cls(**copy.deepcopy(OVERRIDES[family]) if family in FIX_DEFAULTS else {}).to_dict()
    fields = _shrink_fields(defaults, mha)
    for key, value in defaults.items():
        # composite configs (text_config, vision_config...): shrink each sub-config too
        if isinstance(value, dict) and "model_type" in value:
            sub = dict(value)
            sub.update(_shrink_fields(value, mha))
            fields[key] = sub
    for key, value in copy.deepcopy(OVERRIDES.get(family, {})).items():
        # a dict override of a sub-config changes only the fields it names
        if isinstance(value, dict) and isinstance(fields.get(key, defaults.get(key)), dict):
            fields[key] = {**fields.get(key, defaults[key]), **value}
        else:
            fields[key] = value
    return cls(**fields)


def _count_params_meta(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _last_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.relpath(f.filename, REPO) if f.filename.startswith(REPO) else f.filename.split('site-packages/')[-1]}:{f.lineno} in {f.name}"


def _describe(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:400]} [{_last_frame(exc)}]"


def _build(family: str, mha: bool = False):
    """(model, params) or a Result saying why not."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = small_config(family, mha)
    except Exception as e:  # noqa: BLE001 - any config error makes the family not buildable
        return Result(family, "not buildable", detail="config: " + _describe(e), cause="config")
    if getattr(config, "is_encoder_decoder", False):
        return Result(family, "skipped", detail="not decoder-only (encoder-decoder)", cause="encoder-decoder")
    try:
        params = _count_params_meta(config)
    except Exception as e:  # noqa: BLE001
        return Result(family, "not buildable", detail="model (meta): " + _describe(e), cause="model")
    if params > MAX_PARAMS:
        return Result(family, "skipped", params=params,
                      detail=f"too large from a small config ({params / 1e6:.1f}M parameters)", cause="too large")
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    except Exception as e:  # noqa: BLE001
        return Result(family, "not buildable", params=params, detail="model: " + _describe(e), cause="model")
    return model, params


def _logits(model, args, kwargs):
    import torch
    from depthrewrite.capture import first_tensor

    with torch.no_grad():
        return first_tensor(model(*args, **kwargs))


def check_model(family: str, model, params: int | None = None) -> Result:
    """Inspect ``model`` and rewrite copies of it four ways; classify the outcome."""
    import torch
    import depthrewrite
    from depthrewrite.capture import default_example_inputs

    start = time.perf_counter()
    result = Result(family, "rewritten", params=params)
    try:
        args, kwargs = default_example_inputs(model)
        reference = _logits(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the original model itself does not run
        return _finish(result, "not buildable", "forward: " + _describe(e), "forward", start)
    step = "inspect"
    try:
        result.sites = depthrewrite.inspect(model).num_sites
        for scheme, identity in SCHEME_RUNS:
            step = f"{scheme}{' preserve_identity' if identity else ''}"
            rewritten = depthrewrite.rewrite(copy.deepcopy(model), scheme, preserve_identity=identity)
            out = _logits(rewritten, args, kwargs)
            if identity and not torch.equal(out, reference):
                diff = (out.double() - reference.double()).abs().max().item()
                return _finish(result, "failed", f"{step}: logits differ from the original by up to {diff:.3g}",
                               "identity broken", start)
            if not torch.isfinite(out).all():
                return _finish(result, "failed", f"{step}: non-finite logits", "non-finite", start)
            result.runs[step] = "ok"
    except depthrewrite.DepthRewriteError as e:
        # the library's own verification failing is a bug, not a declared limitation
        if str(e).startswith("verification:"):
            return _finish(result, "failed", f"{step}: " + _describe(e), type(e).__name__, start)
        # a subclass of a reviewed error class is classified as that class
        name = next((c.__name__ for c in type(e).__mro__ if c.__name__ in _REVIEWED_ERRORS), type(e).__name__)
        status, note = classify_refusal(family, name)
        return _finish(result, status, (f"[{note}] " if note else "") + f"{step}: " + _describe(e),
                       type(e).__name__, start)
    except Exception as e:  # noqa: BLE001 - every other exception is a failure to report
        return _finish(result, "failed", f"{step}: " + _describe(e), type(e).__name__, start)
    status, note = classify_rewritten(family)
    detail = f"{result.sites} sites; 4 rewrites ok, identity bit-exact"
    return _finish(result, status, (f"[{note}] " if note else "") + detail, "", start)


def _finish(result: Result, status: str, detail: str, cause: str, start: float) -> Result:
    result.status, result.detail, result.cause = status, detail, cause
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def check_family(family: str) -> Result:
    """The whole per-family check, in this process: build, then ``check_model``."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    package = NEEDS_PACKAGE.get(family)
    if package and importlib.util.find_spec(package) is None:
        return Result(family, "skipped", detail=f"needs the optional package {package!r}, not installed",
                      cause="needs a package")
    result = None
    for mha in (False, True):  # grouped kv heads first; plain multi-head if that does not build
        built = _build(family, mha)
        if isinstance(built, Result):
            result = built
        elif family in NOT_STANDALONE:
            return Result(family, "skipped", params=built[1], detail=NOT_STANDALONE[family], cause="not standalone")
        else:
            result = check_model(family, *built)
        if result.status != "not buildable":
            break
    return result


def _run_one_subprocess(family: str, timeout: float) -> Result:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", family],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Result(family, "timed out", detail=f"timed out after {timeout:.0f} s", cause="timeout",
                      seconds=round(time.perf_counter() - start, 1))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-400:]
        return Result(family, "failed", detail=f"subprocess exited {proc.returncode}: {tail}",
                      cause="crash", seconds=round(time.perf_counter() - start, 1))
    return Result(**json.loads(lines[-1]))


def survey(families: list[str], workers: int, timeout: float) -> list[Result]:
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run_one_subprocess, f, timeout): f for f in families}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            print(f"{r.family:28s} {r.status:31s} {r.detail[:150]}", flush=True)
            results.append(r)
    return sorted(results, key=lambda r: r.family)


def coverage(results: list[Result]) -> dict:
    """Counts per status, and coverage = rewritten / (rewritten + every status in AGAINST)."""
    count = {status: sum(r.status == status for r in results) for status in STATUSES}
    denominator = count["rewritten"] + sum(count[s] for s in AGAINST)
    count["coverage"] = count["rewritten"] / denominator if denominator else float("nan")
    return count


def coverage_line(c: dict) -> str:
    denominator = c["rewritten"] + sum(c[s] for s in AGAINST)
    counts = ", ".join(f"{s} {c[s]}" for s in STATUSES)
    return f"coverage: {c['rewritten']}/{denominator} = {c['coverage']:.1%} ({counts})"


def markdown(results: list[Result], command: str) -> str:
    import torch
    import transformers

    c = coverage(results)
    denominator = c["rewritten"] + sum(c[s] for s in AGAINST)
    lines = [
        "# Model-zoo coverage",
        "",
        f"Regenerate (8 min on an idle 2-core machine, about 20 min when it is shared): `{command}`",
        "",
        "One family, in this process: `/work/venv/bin/python benchmarks/zoo_coverage.py --one FAMILY`. "
        "The CI sample: `/work/venv/bin/python -m pytest -q tests/zoo` (a fixed sample, about 2 min). "
        "The whole survey as a test, printing this coverage line and asserting coverage >= 95% and no "
        "failure: `DEPTHREWRITE_ZOO_FULL=1 /work/venv/bin/python -m pytest -q -s tests/zoo -k full_survey`.",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU ({platform.system()})",
        f"- date: {time.strftime('%Y-%m-%d', time.gmtime())}",
        f"- transformers {transformers.__version__}, torch {torch.__version__}",
        f"- families: {len(results)} keys of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (all of them in a full run), each built "
        "from its default config shrunk to hidden 64, 2 layers, 4 heads (2 kv), head_dim 16, "
        "intermediate 128, vocab 128, 4 experts top-2, plus the per-family fixes of `OVERRIDES` in "
        "benchmarks/zoo_coverage.py; random weights; one subprocess each",
        "- check: `inspect`, then `rewrite` with attnres and dar, each with and without "
        "`preserve_identity` (identity rewrites must give bit-identical logits, `torch.equal`)",
        "",
        "Statuses:",
        "",
        "- `rewritten`: all four rewrites ran, both identity rewrites bit-identical;",
        "- `refused: not PreNorm` / `refused: not an additive stream`: the library raised "
        "`NotPreNormError` / `NotAdditiveStreamError` **and** the family is in the reviewed table "
        "(`REVIEWED_NOT_PRENORM` / `REVIEWED_NOT_ADDITIVE`, one line of evidence each from its decoder "
        "layer); excluded from coverage;",
        "- `refused: unsupported`: any other `DepthRewriteError` (a gap of depthrewrite); counts against;",
        "- `disputed`: the library's verdict and the reviewed tables disagree (refused as not PreNorm / not "
        "additive but not reviewed as such, or rewritten although reviewed as not rewritable); counts against;",
        "- `failed`: any other exception, a crash, or an identity rewrite that changed the logits; counts against;",
        "- `timed out`: the family's subprocess ran past the timeout; counts against;",
        "- `not buildable` / `skipped`: the small model could not be built or run, or is out of scope "
        "(encoder-decoder, too large, needs an optional package, not a standalone LM); not counted.",
        "",
        f"**Coverage** (rewritten / (rewritten + {' + '.join(AGAINST)})): "
        f"{c['rewritten']} / {denominator} = {c['coverage']:.1%}",
        "",
        "Counts: " + ", ".join(f"{s} {c[s]}" for s in STATUSES) + ".",
        "",
        "| family | status | sites | detail |",
        "|---|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.family} | {r.status} | {'' if r.sites is None else r.sites} | {detail} |")
    lines += ["", "## Reviewed refusals (evidence read from each family's decoder layer)", "",
              "| family | reviewed as | evidence |", "|---|---|---|"]
    for title, table in (("not PreNorm", REVIEWED_NOT_PRENORM), ("not an additive stream", REVIEWED_NOT_ADDITIVE),
                         ("PreNorm, additive (a refusal is a gap)", REVIEWED_PRENORM)):
        lines += [f"| {fam} | {title} | {ev} |" for fam, ev in sorted(table.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", metavar="FAMILY", help="check one family in this process, print JSON")
    parser.add_argument("--families", nargs="*", help="survey only these families")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--update", metavar="JSON", help="merge into the results of an earlier --json run")
    parser.add_argument("--write", metavar="PATH", help="write the markdown report here")
    parser.add_argument("--json", metavar="PATH", help="write the raw results here")
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        sys.path.insert(0, REPO)
        print(json.dumps(asdict(check_family(args.one))), flush=True)
        return 0
    families = args.families or causal_lm_families()
    results = survey(families, args.workers, args.timeout)
    if args.update:
        # re-survey some families and keep the earlier results of the others
        with open(args.update) as f:
            earlier = {r["family"]: Result(**r) for r in json.load(f)}
        earlier.update({r.family: r for r in results})
        results = sorted(earlier.values(), key=lambda r: r.family)
        args.json = args.json or args.update
    print("\n" + coverage_line(coverage(results)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    if args.write:
        command = "/work/venv/bin/python benchmarks/zoo_coverage.py --write " + args.write
        with open(args.write, "w") as f:
            f.write(markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
