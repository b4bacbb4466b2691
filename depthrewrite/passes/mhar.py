"""Multi-Head Attention Residuals (docs/spec.md section 4).

AttnRes (full or block) with the pseudo-query split into H heads, each with its own
softmax over depth. The key RMS statistic stays over the full width (normalise, then
slice), which the route op does when given ``heads``.
"""

from __future__ import annotations

import dataclasses

from ..analysis import Site
from ..ops import route
from .attnres import (
    AttnResOptions, BlockRouter, FullRouter, block_place, check_block_size, full_initial_state, full_router,
    full_routing_plan, initial_block_state, warn_if_block_exceeds,
)
from .base import Scheme, check_bool
from .two_phase import block_plan, resolve_fused_merge


@dataclasses.dataclass(frozen=True)
class MharOptions(AttnResOptions):
    heads: int | None = None  # None: the model's key/value head count (``hints['kv_heads']``)
    block_size: int | None = None  # None: full routing; an int: Block AttnRes blocks of that many sites
    # block form: Block AttnRes's two-phase computation (two_phase.TwoPhasePlan). On by
    # default since session 9: with phase 1 recomputed it meets the block schemes' memory
    # goal (1.061x the baseline's peak against 1.114x site by site) for 2 % of the step
    # (H200, e2e 350M GPT, 16 heads: 98.0 against 95.9 ms; 103.6 against 93.9 in session
    # 4, before the faster route_many kernels; docs/benchmarks.md)
    two_phase: bool = True
    # full form: the two-phase computation over groups of this many sites
    # (attnres.FullAttnResOptions); None: one route per site. Off by default: with 16 heads
    # slower than site by site (H200, 350M GPT: G = 6 0.570x the baseline against 0.608,
    # docs/benchmarks.md session 9), at best level (G = 4, recompute=False,
    # fused_merge=True: 0.630x against 0.631x, 1.31x peak memory against 1.19x; session 40)
    group_size: int | None = None
    # two-phase (block form) or grouped (full form): the backward recomputes phase 1
    recompute: bool = True


class _MultiHead:
    """Mixin over the AttnRes routers: the same parameters, routed with ``heads`` softmaxes."""

    heads: int

    def route(self, sources):
        return route(sources, query=self.query, key_norm_weight=self.key_norm_weight, heads=self.heads, eps=self.eps)


class MharFullRouter(_MultiHead, FullRouter):
    def __init__(self, scheme: "MharScheme", *placement, **kw):
        super().__init__(scheme, *placement, **kw)
        self.heads = scheme.heads

    def extra_repr(self) -> str:
        grouped = super().extra_repr()
        return f"heads={self.heads}" + (f", {grouped}" if grouped else "")


class MharBlockRouter(_MultiHead, BlockRouter):
    def __init__(self, scheme: "MharScheme", closes_block: bool, group: int, position: int):
        super().__init__(scheme, closes_block, plan=scheme.plan, group=group, position=position)
        self.heads = scheme.heads

    def extra_repr(self) -> str:
        return f"heads={self.heads}, closes_block={self.closes_block}"


def _check_heads(heads: object) -> None:
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"mhar: heads must be a positive int, found {heads!r}")


class MharScheme(Scheme):
    """``mhar``: Multi-Head Attention Residuals. Each site (and the final readout) routes
    over depth like AttnRes, but its query ``w`` (d,) is read as H heads of d/H channels,
    each head with its own softmax over the sources and mixing only its own channels.

    Options: ``heads`` (default: the model's key/value head count from its config; a
    ValueError asks for ``heads=`` when the model has none; must divide d),
    ``block_size`` (None: full AttnRes sources; an int S: Block AttnRes sources, blocks of
    S sites), ``two_phase`` (block form: Block AttnRes's two-phase computation; True: less
    memory, 2 % slower at 350M with 16 heads), ``group_size`` (full form: None, or the
    two-phase computation over groups of that many sites, as ``attnres``), ``recompute``
    (two-phase or grouped: recompute phase 1 in the backward instead of keeping its
    outputs, True), ``keep_groups`` (0) and ``fused_merge`` (None) as for block_attnres,
    ``eps`` (key RMSNorm, 1e-6). ``heads=1`` is exactly AttnRes / Block AttnRes with the
    same parameters. New parameters: ``2 d (L + 1)`` (none beyond AttnRes).
    """

    name = "mhar"
    Options = MharOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints=hints)
        self.heads = self._resolve_heads(options.heads)
        self.block_size = size = options.block_size
        self.plan = self._plan(options)
        if size is not None:
            warn_if_block_exceeds(self.name, "block_size", size, stream.num_sites)
        self.options = resolve_fused_merge(options, self.plan)

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        check_bool(cls.name, "two_phase", options.two_phase)  # the full form does not read it, but takes it
        check_block_size(cls.name, options.block_size, none_means="full routing")
        if options.heads is not None:
            _check_heads(options.heads)
        cls._plan(options)

    @classmethod
    def _plan(cls, options):
        """The full form's plan (its sites grouped or not), or the block form's (two-phase or not)."""
        if options.block_size is None:
            return full_routing_plan(cls.name, options.group_size, options.recompute, options.keep_groups,
                                     options.fused_merge)
        if options.group_size is not None:
            raise ValueError(f"mhar: group_size groups the sites of the full form; with block_size="
                             f"{options.block_size} use two_phase=True instead, found group_size={options.group_size!r}")
        return block_plan(cls.name, options)

    def _resolve_heads(self, heads) -> int:
        if heads is None:
            heads = self.hints.get("kv_heads")
            if heads is None:
                raise ValueError(
                    "mhar: heads was not given and the model has no config naming its key/value head "
                    "count; pass heads=<int dividing the width "
                    f"{self.d}>"
                )
        _check_heads(heads)  # again: the model's head count, where heads was not given
        if self.d % heads != 0:
            raise ValueError(f"mhar: heads must divide the model width, found width d={self.d} and heads={heads}")
        return heads

    def init_state(self, e):
        return full_initial_state(e, self.plan) if self.block_size is None else initial_block_state(e, self.plan)

    def site_router(self, site: Site):
        if self.block_size is None:
            return full_router(self, site.index, MharFullRouter)
        return MharBlockRouter(self, site.index % self.block_size == 0, *block_place(site.index, self.block_size))

    def readout_router(self):
        if self.block_size is None:
            return full_router(self, self.stream.num_sites + 1, MharFullRouter)
        return MharBlockRouter(self, False, *block_place(self.stream.num_sites + 1, self.block_size))

    def describe(self) -> dict:
        return {**super().describe(), "heads": self.heads}
