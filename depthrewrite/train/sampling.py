"""Text from a trained byte-level model: :func:`generate` continues token ids, sampling each
next token from the model's softmax (at a temperature, among the ``top_k`` likeliest),
or taking the likeliest at temperature 0. ``depthrewrite sample RUN_DIR`` runs it on a
trained run (``trained_model.load_trained``) with the run's bytes as tokens.

The model is called on the whole window of the last ``context`` tokens for each new token
(the bundled models keep no KV cache), so a token costs one forward pass over the window:
fine for the bundled models, slow for long texts from large ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: byte-level models: token ids are bytes (``data.to_tokens``)
BYTE_TOKENS = 256


def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, context: int | None = None, token_limit: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """``prompt`` ((T,) or (B, T) int64 ids, T >= 1, on the model's device) with
    ``max_new_tokens`` ids appended to each row.

    - ``temperature``: the logits are divided by it before the softmax; 0 takes the
      likeliest token (no sampling).
    - ``top_k``: sample among the k likeliest tokens only (None: all).
    - ``context``: the model sees the last ``context`` tokens (None: all of them); a model
      trained on windows of T tokens has seen no position past T.
    - ``token_limit``: only ids below it are candidates (a byte-level model whose vocabulary
      is larger than the bytes it was trained on: 256).
    - ``generator``: a CPU ``torch.Generator``; the draws happen on the CPU, so one seed
      gives the same draws from the same probabilities on any device.

    The model is called in eval mode without gradients (its mode is restored); it returns the
    logits ``(B, T, vocab)``, or an object whose ``.logits`` they are (Hugging Face)."""
    _check_arguments(prompt, max_new_tokens, temperature, top_k, context, token_limit, generator)
    ids = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                window = ids if context is None else ids[:, -context:]
                logits = _last_logits(model(window), token_limit, top_k)
                ids = torch.cat([ids, _next_tokens(logits, temperature, top_k, generator).to(ids.device)], dim=1)
    finally:
        model.train(was_training)
    return ids if prompt.dim() == 2 else ids.squeeze(0)


def _check_arguments(prompt, max_new_tokens, temperature, top_k, context, token_limit, generator) -> None:
    if not isinstance(prompt, torch.Tensor) or prompt.dim() not in (1, 2) or prompt.dtype != torch.long:
        found = (f"a {prompt.dim()}-d {prompt.dtype} tensor" if isinstance(prompt, torch.Tensor)
                 else type(prompt).__name__)
        raise ValueError(f"generate: prompt must be a (T,) or (B, T) int64 tensor of token ids, found {found}")
    if prompt.shape[-1] < 1:
        raise ValueError("generate: prompt must hold at least one token per row (the model predicts from it), "
                         "found none")
    for name, value, least in (("max_new_tokens", max_new_tokens, 0), ("top_k", top_k, 1),
                               ("context", context, 1), ("token_limit", token_limit, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            or_none = "" if name == "max_new_tokens" else " or None"
            raise ValueError(f"generate: {name} must be an int >= {least}{or_none}, found {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0: the likeliest token), "
                         f"found {temperature!r}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generate: generator must be a CPU torch.Generator (the draws happen on the CPU), found "
                         f"one on {generator.device}")


def _last_logits(output, token_limit: int | None, top_k: int | None) -> torch.Tensor:
    """The last position's logits in float32, (B, vocab), cut to ``token_limit`` ids."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"generate: the model must return logits (B, T, vocab) or an object with .logits, found "
                         f"{type(output).__name__}" + (f" of shape {tuple(logits.shape)}"
                                                       if isinstance(logits, torch.Tensor) else ""))
    if token_limit is not None and token_limit > logits.shape[-1]:
        raise ValueError(f"generate: token_limit={token_limit} is more than the model's {logits.shape[-1]} tokens")
    candidates = logits.shape[-1] if token_limit is None else token_limit
    if top_k is not None and top_k > candidates:
        raise ValueError(f"generate: top_k={top_k} is more than the {candidates} candidate tokens")
    return logits[:, -1, :candidates].float()


def _next_tokens(logits: torch.Tensor, temperature: float, top_k: int | None,
                 generator: torch.Generator | None) -> torch.Tensor:
    """(B, 1) ids: the likeliest at temperature 0, else drawn from the softmax of the top k."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:  # exactly k candidates, ties at the k-th broken by topk
        values, indices = logits.topk(top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, indices, values)
    probs = torch.softmax(logits, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator)


def encode(text: str) -> torch.Tensor:
    """The UTF-8 bytes of ``text`` as (T,) int64 token ids, as the harness tokenizes its data."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """Byte ids back to text; bytes that are not valid UTF-8 (a character cut short, a
    sequence the model invented) become U+FFFD."""
    values = ids.tolist()
    outside = [v for v in values if not 0 <= v < BYTE_TOKENS]
    if outside:
        raise ValueError(f"decode: ids must be bytes (0-{BYTE_TOKENS - 1}), found {outside[0]}")
    return bytes(values).decode("utf-8", errors="replace")
