"""Behavioural probes: questions answered by running a module, not by reading its name.

- :func:`norm_type` -- is this module a normalisation of its input, and which one? A norm
  is invariant to scaling its input (RMSNorm and LayerNorm both are, up to eps); LayerNorm
  is also invariant to adding a constant to every channel.
- :func:`mixes_tokens` -- does a branch's output at one position depend on the input at
  another? Attention and state-space mixers do; MLPs and MoE feed-forwards do not. Only a
  sequence of at least :data:`MIN_PROBE_TOKENS` tokens can show it (:func:`shows_mixing`);
  :func:`two_token_copy` makes one from a one-token stream.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

# Relative change under which two probe outputs count as equal. Norm outputs under a 3.7x
# input scale differ only through eps (about 1e-6 relative for unit-scale inputs); a
# non-norm module changes by O(1).
_INVARIANCE_TOL = 1e-3
#: input scales a norm's output must not depend on
_PROBE_SCALES = (3.7, 41.0)


def _module_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters(recurse=False):
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / (b.norm() + 1e-30))


@torch.no_grad()
def norm_type(module: nn.Module, d_model: int) -> str | None:
    """'layernorm', 'rmsnorm' or None (not a norm) for a module called as ``module(x)``."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 3, d_model, generator=gen, dtype=torch.float64)
    x = x.to(device=_module_device(module), dtype=_module_dtype(module))
    try:
        y = module(x)
        # two scales: a block ``x + f(norm(x))`` whose branch output dwarfs ``x`` (large
        # random weights) passes the small one, but not 40x
        y_scaled = [module(scale * x) for scale in _PROBE_SCALES]
        y_shifted = module(x + 1.3)
    except Exception:  # not callable on a plain stream tensor: not a norm
        return None
    if not all(isinstance(t, torch.Tensor) and t.shape == x.shape for t in (y, *y_scaled, y_shifted)):
        return None
    tol = max(_INVARIANCE_TOL, 50 * torch.finfo(x.dtype).eps)
    if y.abs().max() == 0 or any(_rel_diff(t, y) > tol for t in y_scaled):
        return None
    return "layernorm" if _rel_diff(y_shifted, y) <= tol else "rmsnorm"


def norm_eps(module: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


class _PerturbingInterpreter(fx.Interpreter):
    """Runs the block graph, adding ``delta`` to one node's value as it is produced."""

    def __init__(self, gm: fx.GraphModule, target: fx.Node | None, delta: torch.Tensor | None):
        super().__init__(gm, garbage_collect_values=False)
        self.target, self.delta = target, delta

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if n is self.target and self.delta is not None:
            value = value + self.delta
        return value


@torch.no_grad()
def run_block_graph(gm: fx.GraphModule, inputs: list, perturb: fx.Node | None = None,
                    delta: torch.Tensor | None = None) -> dict[fx.Node, object]:
    """Every node's value for one run of the graph (the interpreter's environment)."""
    interp = _PerturbingInterpreter(gm, perturb, delta)
    interp.run(*inputs)
    return interp.env


#: the fewest tokens that can show token mixing: one to perturb, one to watch
MIN_PROBE_TOKENS = 2


def shows_mixing(stream: torch.Tensor) -> bool:
    """Can the token-mixing probe run on this stream (sequence on dim -2, as in (B, T, d))?"""
    return stream.dim() >= 2 and stream.shape[-2] >= MIN_PROBE_TOKENS


def two_token_copy(stream: torch.Tensor) -> torch.Tensor:
    """A one-token stream repeated to :data:`MIN_PROBE_TOKENS` tokens: values the block
    has seen, at the shortest length that shows mixing (the least likely to outgrow a
    position table inside the block)."""
    if stream.dim() < 2 or stream.shape[-2] != 1:
        raise ValueError(f"two_token_copy: expected a stream of one token on dim -2, found shape {tuple(stream.shape)}")
    return stream.expand(*stream.shape[:-2], MIN_PROBE_TOKENS, stream.shape[-1]).clone()


@torch.no_grad()
def mixes_tokens(gm: fx.GraphModule, inputs: list, stream: fx.Node, outputs: list[fx.Node],
                 baseline: dict) -> list[bool]:
    """For each node in ``outputs``: does its value at positions 1.. change when the stream
    entering the site changes at position 0 only? (sequence on dim -2, as in (B, T, d))."""
    ref = baseline[stream]
    if not shows_mixing(ref):  # no answer rather than a silent "no": the caller must probe longer
        raise ValueError(f"mixes_tokens: the stream has shape {tuple(ref.shape)}; the probe needs at least "
                         f"{MIN_PROBE_TOKENS} tokens on dim -2")
    delta = torch.zeros_like(ref)
    gen = torch.Generator().manual_seed(4321)
    noise = torch.randn(delta[..., :1, :].shape, generator=gen, dtype=torch.float32)
    delta[..., :1, :] = (noise.to(ref.device) * (ref.float().std() + 1.0)).to(ref.dtype)
    env = run_block_graph(gm, inputs, perturb=stream, delta=delta)
    result = []
    for node in outputs:
        before, after = _as_stream(baseline[node], ref), _as_stream(env[node], ref)
        before, after = before[..., 1:, :].double(), after[..., 1:, :].double()
        scale = before.abs().max().item() + 1e-12
        result.append(bool((after - before).abs().max().item() > 1e-4 * scale))
    return result


def _as_stream(value: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """A branch output in the stream's (..., T, d) layout: some blocks work on a flattened
    view (OPT's MLP reads ``h.reshape(-1, d)``)."""
    if value.shape != stream.shape and value.numel() == stream.numel():
        return value.reshape(stream.shape)
    return value


@torch.no_grad()
def leaf_output_patterns(block: nn.Module, forward, spec, inputs: list) -> tuple:
    """Run the block once on a copy of its recorded inputs and note, for every submodule
    that returns a tuple, its length and where its ``None`` entries are (see ``TraceHints``)."""
    import copy

    try:
        inputs = copy.deepcopy(inputs)  # a KV cache among them must not be extended
    except Exception:  # noqa: BLE001 - not copyable: run on the originals
        pass
    names = {m: n for n, m in block.named_modules() if n}
    patterns: dict[str, tuple] = {}

    def hook(module, args, output):
        if isinstance(output, tuple) and names[module] not in patterns:
            patterns[names[module]] = tuple(None if o is None else True for o in output)

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        args, kwargs = spec.call_arguments(inputs)
        forward(block, *args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return tuple(sorted(patterns.items()))
