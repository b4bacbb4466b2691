"""The identity rewrite and Attention Residuals, full and block (SPEC sections 2, 3, 8).

Sources are numbered as in SPEC: source 0 is the embedding output ``e``, source ``l`` is
the update ``u_l`` of site ``l`` (the branch output, never the running sum).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..analysis import Site
from ..ops import route
from .base import PassThrough, Scheme, SchemeOptions, State


# --------------------------------------------------------------------------- residual
class ResidualScheme(Scheme):
    """``residual``: the identity rewrite. The rewritten model runs the original graph
    through the rewriter's machinery and must be bit-identical to it. New parameters: 0."""

    name = "residual"
    delta_applies = False

    def init_state(self, e):
        return ()

    def site_router(self, site):
        return PassThrough()

    def readout_router(self):
        return PassThrough()


# --------------------------------------------------------------------------- AttnRes
@dataclasses.dataclass(frozen=True)
class AttnResOptions(SchemeOptions):
    eps: float = 1e-6  # eps of the key RMSNorm (SPEC 2)


class DepthQuery(nn.Module):
    """A site's routing parameters: pseudo-query ``w`` (zeros: uniform weights at start)
    and the key RMSNorm weight ``g`` (ones)."""

    reads_stream = False
    replaces_stream = True

    def __init__(self, scheme: Scheme):
        super().__init__()
        self.query = scheme.param(scheme.d, fill=0.0)
        self.key_norm_weight = scheme.param(scheme.d, fill=1.0)
        self.eps = scheme.options.eps

    def route(self, sources) -> torch.Tensor:
        return route(sources, query=self.query, key_norm_weight=self.key_norm_weight, eps=self.eps)


class FullRouter(DepthQuery):
    """Full AttnRes: the state is the tuple of all sources so far ``(e, u_1, ..., u_{l-1})``."""

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        return self.route(state)

    def write(self, state: State, u, x, h) -> State:
        return state + (u,)


class AttnResScheme(Scheme):
    """``attnres``: each site reads a softmax over depth of all earlier sources,
    ``x_l = sum_i a_{l,i} v_i`` with ``a = softmax(w_l . RMSNorm_{g_l}(v_i))``.
    New parameters: ``2 d (L + 1)``."""

    name = "attnres"
    Options = AttnResOptions

    def init_state(self, e):
        return (e,)

    def site_router(self, site: Site):
        return FullRouter(self)

    def readout_router(self):
        return FullRouter(self)


# --------------------------------------------------------------------- Block AttnRes
@dataclasses.dataclass(frozen=True)
class BlockAttnResOptions(AttnResOptions):
    block_size: int | None = None  # sites per block; None: the even S giving at most 8 blocks


def default_block_size(num_sites: int, max_blocks: int = 8) -> int:
    """The smallest even block size that gives at most ``max_blocks`` blocks (SPEC 3)."""
    size = max(2, math.ceil(num_sites / max_blocks))
    return size + (size % 2)


class BlockRouter(DepthQuery):
    """Block AttnRes. State: ``(completed block summaries (b_0 = e, b_1, ...), partial)``,
    ``partial`` being the sum of the updates of the unfinished block or ``None``."""

    def __init__(self, scheme: Scheme, closes_block: bool):
        super().__init__(scheme)
        self.closes_block = closes_block

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        blocks, partial = state
        return self.route(blocks if partial is None else blocks + (partial,))

    def write(self, state: State, u, x, h) -> State:
        blocks, partial = state
        partial = u if partial is None else partial + u
        if self.closes_block:
            return blocks + (partial,), None
        return blocks, partial

    def extra_repr(self) -> str:
        return f"closes_block={self.closes_block}"


class BlockReadout(BlockRouter):
    def __init__(self, scheme: Scheme):
        super().__init__(scheme, closes_block=False)


class BlockAttnResScheme(Scheme):
    """``block_attnres``: sites grouped in blocks of ``block_size`` consecutive sites; a site
    reads the completed block summaries plus the partial sum of its own block. The final
    readout reads all summaries plus an unfinished last block. ``block_size=1`` is full
    AttnRes. New parameters: ``2 d (L + 1)``."""

    name = "block_attnres"
    Options = BlockAttnResOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints)
        size = options.block_size if options.block_size is not None else default_block_size(stream.num_sites)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"block_attnres: block_size must be a positive integer, found {size!r}")
        self.block_size = size

    def init_state(self, e):
        return (e,), None

    def site_router(self, site: Site):
        return BlockRouter(self, closes_block=site.index % self.block_size == 0)

    def readout_router(self):
        return BlockReadout(self)

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.block_size}
