"""WAV v1: multiresolution Block AttnRes (SPEC section 5).

Every block of S sites carries, next to its summary ``C = sum u_i``, two zero-sum detail
bases accumulated online:

    Dphase = sum a_i u_i   (a_i = +1 attention, -1 MLP; parallel: +attention part -MLP part, or 0)
    Dsplit = sum r_i u_i   (r_i = +1 on the first ceil(S/2) positions of the block, -1 after)

A site routes over ``e`` and, per completed block and for the partial block, the summary
and both details. Details are RMS-matched to their block's summary with a detached factor
``min(rho, rms(C) / (rms(D) + eps))`` (the route op's ``source_scale``, which gets no
gradient) and carry a learned logit bias per site and basis.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..analysis import Site
from ..ops import route
from .attnres import AttnResOptions, BlockReadout, BlockRouter, DepthQuery, default_block_size
from .base import Scheme, State


@dataclasses.dataclass(frozen=True)
class WavOptions(AttnResOptions):
    block_size: int | None = None  # sites per block; None: as block_attnres (even S, at most 8 blocks)
    rho: float = 2.0  # cap of the detail RMS-matching factor (SPEC 5, our choice)
    detail_bias_init: float = -2.0  # initial logit bias of every detail source
    details: bool = True  # False: exactly block_attnres (same routers, same parameters)


def rms_match(summary: torch.Tensor, detail: torch.Tensor, rho: float, eps: float) -> torch.Tensor:
    """Per-token factor ``min(rho, sg(rms(C)) / (sg(rms(D)) + eps))``, shape ``(*batch,)``;
    in float32 at least, since a bf16 mean square loses the small details."""
    dtype = torch.promote_types(detail.dtype, torch.float32)

    def rms(t):
        return t.detach().to(dtype).square().mean(-1).sqrt()

    return torch.clamp(rms(summary) / (rms(detail) + eps), max=rho)


class WavRouter(DepthQuery):
    """A WAV site. State: ``(e, completed, partial)``; ``completed`` holds one
    ``(C, Dphase, Dsplit, scale_phase, scale_split)`` per finished block (the detached
    matching factors are fixed once the block is finished), ``partial`` is ``None`` or
    ``(P, Pphase, Psplit)``. ``detail_bias`` = (phase bias, split bias)."""

    wants_parts = True

    def __init__(self, scheme: "WavScheme", site: Site):
        super().__init__(scheme)
        self.detail_bias = scheme.param(2, fill=float(scheme.options.detail_bias_init))
        self.rho = float(scheme.options.rho)
        size = scheme.block_size
        position = (site.index - 1) % size + 1
        self.closes_block = position == size
        self.split_sign = 1 if position <= math.ceil(size / 2) else -1
        self.kind, self.part_kinds = site.kind, site.parts

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        e, completed, partial = state
        groups = list(completed)
        if partial is not None:
            P, Pphase, Psplit = partial
            groups.append((P, Pphase, Psplit, self._match(P, Pphase), self._match(P, Psplit)))
        if not groups:  # only e: one source, nothing to weigh
            return route([e], query=self.query, key_norm_weight=self.key_norm_weight, eps=self.eps)
        values = [e] + [t for C, Dp, Ds, _, _ in groups for t in (C, Dp, Ds)]
        one = torch.ones_like(groups[0][3])
        scale = torch.stack([one] + [t for _, _, _, fp, fs in groups for t in (one, fp, fs)])
        # logits: 0 for e and every summary, the learned bias for each detail
        per_group = F.pad(self.detail_bias, (1, 0))
        bias = torch.cat([per_group.new_zeros(1), per_group.repeat(len(groups))])
        return route(values, query=self.query, key_norm_weight=self.key_norm_weight, logit_bias=bias,
                     source_scale=scale, eps=self.eps)

    def write(self, state: State, u, x, h, parts: tuple | None = None) -> State:
        e, completed, partial = state
        phase = self._phase(u, parts)
        split = u if self.split_sign > 0 else -u
        if partial is None:
            partial = (u, torch.zeros_like(u) if phase is None else phase, split)
        else:
            P, Pphase, Psplit = partial
            partial = (P + u, Pphase if phase is None else Pphase + phase, Psplit + split)
        if self.closes_block:
            P, Pphase, Psplit = partial
            return e, completed + ((P, Pphase, Psplit, self._match(P, Pphase), self._match(P, Psplit)),), None
        return e, completed, partial

    def _phase(self, u: torch.Tensor, parts: tuple | None) -> torch.Tensor | None:
        """``a_i u_i``; ``None`` for a parallel site whose parts the graph does not expose (0)."""
        if self.kind == "attention":
            return u
        if self.kind == "mlp":
            return -u
        if parts is None or len(parts) != len(self.part_kinds):
            return None
        signed = [p if kind == "attention" else -p for p, kind in zip(parts, self.part_kinds)]
        return sum(signed[1:], signed[0])

    def _match(self, summary: torch.Tensor, detail: torch.Tensor) -> torch.Tensor:
        return rms_match(summary, detail, self.rho, self.eps)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, split_sign={self.split_sign:+d}, closes_block={self.closes_block}"


class WavReadout(DepthQuery):
    """Conservative readout: ``{e, C_0, .., P}`` only, no details (SPEC 5)."""

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        e, completed, partial = state
        sources = [e] + [group[0] for group in completed] + ([] if partial is None else [partial[0]])
        return self.route(sources)


class WavScheme(Scheme):
    """``wav``: WAV v1. Block AttnRes whose sites also route over two RMS-matched detail
    bases per block (attention-minus-MLP and first-half-minus-second-half), each with a
    learned logit bias; the final readout routes over ``{e, C_0, .., P}`` only.

    Options: ``block_size`` (sites per block; default as block_attnres), ``rho`` (cap of
    the detached RMS-matching factor, 2.0), ``detail_bias_init`` (-2.0), ``details``
    (False: exactly block_attnres), ``eps`` (key RMSNorm and matching, 1e-6). New
    parameters: ``2 d (L + 1) + 2 L`` (``2 d (L + 1)`` with ``details=False``).
    """

    name = "wav"
    Options = WavOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints=hints)
        size = options.block_size if options.block_size is not None else default_block_size(stream.num_sites)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"wav: block_size must be a positive int, found {size!r}")
        if isinstance(options.rho, bool) or not isinstance(options.rho, (int, float)) or not options.rho > 0:
            raise ValueError(f"wav: rho must be a positive number, found {options.rho!r}")
        bias = options.detail_bias_init
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise ValueError(f"wav: detail_bias_init must be a number, found {bias!r}")
        if not isinstance(options.details, bool):
            raise ValueError(f"wav: details must be True or False, found {options.details!r}")
        self.block_size = size

    def init_state(self, e):
        return ((e,), None) if not self.options.details else (e, (), None)

    def site_router(self, site: Site) -> nn.Module:
        if not self.options.details:
            return BlockRouter(self, closes_block=site.index % self.block_size == 0)
        return WavRouter(self, site)

    def readout_router(self) -> nn.Module:
        return WavReadout(self) if self.options.details else BlockReadout(self)

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.block_size}
