"""Single-stream baselines of docs/spec.md section 8: DenseFormer, ReZero and LayerScale.

All three are, by construction, what docs/spec.md section 7 asks of ``preserve_identity``, or one
initial value away from it, so they do not wrap their routers in the gated delta form
(wrapping would be a no-op for DenseFormer and would drop the update scaling of ReZero and
LayerScale). ``preserve_identity=True`` instead picks the initial values that make the
rewritten model compute exactly what the original computed (see each class), and keeps
``delta_applies`` so that ``rewrite(verify=True)`` checks that bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..analysis import Site
from .base import PassThrough, Scheme, SchemeOptions, State, finite_number

#: CaiT's LayerScale rule (Touvron et al. 2021): 0.1 up to this many layers, small beyond
LAYERSCALE_SHALLOW_LAYERS = 18


class _IdentityPreservingByInit(Scheme):
    """Schemes whose ``preserve_identity`` is an initial value, not the docs/spec.md section 7 gate."""

    def make_site_router(self, site: Site) -> nn.Module:
        return self.site_router(site)

    def make_readout_router(self) -> nn.Module:
        return self.readout_router()


# ------------------------------------------------------------------------ DenseFormer
class _RecordBlockInput(PassThrough):
    """First site of the first block: its stream input ``e`` is the first DWA source."""

    def write(self, state: State, u, x, h) -> State:
        return state + (h,)


class DepthWeightedAverage(nn.Module):
    """First site of block ``b >= 1`` (or the readout): the branch reads, and the block's
    residual continues from, ``sum_j alpha_j X_j`` over the block outputs ``X_0 = e, ...,
    X_b``. ``X_b`` is the stream ``h`` the block was called with (the previous block's
    actual output), the others come from the state. ``alpha`` starts one-hot on ``X_b``."""

    reads_stream = True
    replaces_stream = True

    def __init__(self, scheme: Scheme, sources: int):
        super().__init__()
        self.weights = scheme.param(sources, fill=0.0)
        with torch.no_grad():
            self.weights[-1] = 1.0

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        if len(state) + 1 != self.weights.numel():
            raise ValueError(f"DenseFormer: {self.weights.numel()} weights for {len(state) + 1} sources")
        # current state first, then the older outputs, one add at a time: with the weights
        # at their initial values every term but the first is an exact zero, so the result
        # is h bit for bit
        x = self.weights[-1] * h
        for w, source in zip(self.weights[:-1], state):
            x = x + w * source
        return x

    def write(self, state: State, u, x, h) -> State:
        return state + (h,)


class DenseFormerScheme(_IdentityPreservingByInit):
    """``denseformer`` (Pagliardini et al. 2024): after every layer (a block of the stack) a
    depth-weighted average (DWA) of the embedding and all block outputs so far,
    ``Y_b = sum_{j<=b} alpha_{b,j} X_j``, feeds the next block; the final norm reads the
    last DWA. Static learned scalars, initialised to 1 on the current state ``X_b`` and 0
    elsewhere, so that the rewritten model equals the original bit for bit at init
    (``preserve_identity`` changes nothing). No dilation or period (our choice: every
    block, every earlier output). New parameters: ``B (B + 3) / 2`` for ``B`` blocks."""

    name = "denseformer"

    def init_state(self, e):
        return ()

    def site_router(self, site: Site):
        if site.position != 1:
            return PassThrough()
        if site.block == 0:
            return _RecordBlockInput()
        return DepthWeightedAverage(self, sources=site.block + 1)

    def readout_router(self):
        return DepthWeightedAverage(self, sources=len(self.stream.block_paths) + 1)


# --------------------------------------------------------------- ReZero, LayerScale
class UpdateScale(PassThrough):
    """``h + scale * u``: a scalar (ReZero) or per-channel (LayerScale) scale."""

    scales_update = True

    def __init__(self, scale: nn.Parameter):
        super().__init__()
        self.scale = scale

    def scale_update(self, u: torch.Tensor) -> torch.Tensor:
        return self.scale * u


@dataclasses.dataclass(frozen=True)
class ScaleOptions(SchemeOptions):
    #: initial scale; None: the scheme's default (see the class docstring)
    init: float | None = None


class _ScaleScheme(_IdentityPreservingByInit):
    Options = ScaleOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints=hints)
        self.init = self._initial_value(options)

    @classmethod
    def check_options(cls, options: ScaleOptions) -> None:
        super().check_options(options)
        init = options.init
        if init is not None:
            finite_number(cls.name, "init", init)
        if options.preserve_identity and init is not None and init != 1.0:
            raise ValueError(
                f"{cls.name}: preserve_identity=True starts the scale at 1 (the original model); "
                f"it cannot be combined with init={init!r}"
            )

    def default_init(self) -> float:
        raise NotImplementedError

    def _initial_value(self, options: ScaleOptions) -> float:
        if options.preserve_identity:
            return 1.0  # the scale that keeps the original update: 1 * u is u exactly
        return float(self.default_init() if options.init is None else options.init)

    def init_state(self, e):
        return ()

    def readout_router(self):
        return PassThrough()

    def describe(self) -> dict:
        return {**super().describe(), "init": self.init}


class ReZeroScheme(_ScaleScheme):
    """``rezero`` (Bachlechner et al. 2020): ``h + alpha_l u_l`` with one learned scalar per
    site. ``init`` (default 0): every layer is the identity map at init, so the rewritten
    model computes ``head(norm(e))`` exactly (``h + 0 * u`` is ``h``), not the original
    model. ``preserve_identity=True`` starts alpha at 1 instead: the original model, bit for
    bit. New parameters: ``L``."""

    name = "rezero"

    def default_init(self) -> float:
        return 0.0

    def site_router(self, site: Site):
        return UpdateScale(self.param(1, fill=self.init))


class LayerScaleScheme(_ScaleScheme):
    """``layerscale`` (Touvron et al. 2021): ``h + diag(lambda_l) u_l`` with a learned
    per-channel scale per site. ``init`` default (our choice, CaiT's rule): 0.1 for models
    of at most 18 layers (blocks), 1e-4 deeper. ``init=0`` makes every layer the identity
    map (the model computes ``head(norm(e))`` exactly); ``preserve_identity=True`` starts
    lambda at 1: the original model, bit for bit. New parameters: ``L d``."""

    name = "layerscale"

    def default_init(self) -> float:
        return 0.1 if len(self.stream.block_paths) <= LAYERSCALE_SHALLOW_LAYERS else 1e-4

    def site_router(self, site: Site):
        return UpdateScale(self.param(self.d, fill=self.init))


__all__ = ["DenseFormerScheme", "ReZeroScheme", "LayerScaleScheme"]
