"""Build the model a run trains: a bundled preset, then ``depthrewrite.rewrite``.

``model`` names a preset as ``family:size``: ``gpt:tiny``, ``gpt:small``, ``gpt:base``,
``gpt:medium``, ``moe:tiny``, ``moe:small``, ... (``depthrewrite.models.GPT_PRESETS`` and
``MOE_PRESETS``). Scheme ``none`` means no rewrite at all (the plain model);
``residual`` is the identity rewrite (same function, through the rewriter's machinery).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..models import GPT_PRESETS, MOE_PRESETS, gpt_from_preset, moe_from_preset

log = logging.getLogger(__name__)

FAMILIES = {"gpt": (GPT_PRESETS, gpt_from_preset), "moe": (MOE_PRESETS, moe_from_preset)}
NO_REWRITE = "none"


def preset_names() -> list[str]:
    return [f"{family}:{size}" for family, (presets, _) in FAMILIES.items() for size in presets]


def parse_model_name(name: str) -> tuple[str, str]:
    family, _, size = name.partition(":")
    if family not in FAMILIES or size not in FAMILIES[family][0]:
        raise ValueError(f"model must be one of {preset_names()}, found {name!r}")
    return family, size


def model_overrides(model_options: dict, layers: int | None, d_model: int | None) -> dict:
    """The preset's config fields a run changes: its ``model_options`` with ``layers`` and
    ``d_model`` (``TrainConfig``'s shortcuts) on top where given."""
    overrides = dict(model_options)
    overrides.update({k: v for k, v in (("n_layer", layers), ("d_model", d_model)) if v is not None})
    return overrides


@dataclass
class BuiltModel:
    model: nn.Module
    params: int  # all parameters after the rewrite
    new_params: int  # parameters the rewrite added


def build_model(name: str, overrides: dict, scheme: str, options: dict, seq_len: int, seed: int,
                device: torch.device) -> BuiltModel:
    """The preset with ``overrides`` (config fields), seeded with ``seed`` so that every
    scheme starts from the same base weights, moved to ``device`` and rewritten."""
    family, size = parse_model_name(name)
    presets, factory = FAMILIES[family]
    overrides = dict(overrides)
    if seq_len > overrides.get("max_seq_len", presets[size]["max_seq_len"]):
        # the RoPE tables must cover the training windows; this only lengthens them
        log.info("model: max_seq_len raised to seq_len=%d", seq_len)
        overrides["max_seq_len"] = seq_len
    torch.manual_seed(seed)
    model = factory(size, **overrides).to(device)
    base = sum(p.numel() for p in model.parameters())
    if scheme != NO_REWRITE:
        import depthrewrite

        model = depthrewrite.rewrite(model, scheme, **options)
    params = sum(p.numel() for p in model.parameters())
    return BuiltModel(model, params, params - base)
