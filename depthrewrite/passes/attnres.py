"""The identity rewrite and Attention Residuals, full and block (docs/spec.md sections 2, 3, 8).

Sources are numbered as in docs/spec.md: source 0 is the embedding output ``e``, source ``l`` is
the update ``u_l`` of site ``l`` (the branch output, never the running sum).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from .. import fsdp2
from ..analysis import Site
from ..ops import merge_partial, merge_routes, route, route_many, route_merge
from ..recompute import recomputable
from .base import PassThrough, Scheme, SchemeOptions, State
from . import two_phase
from .two_phase import TwoPhasePlan, block_plan, join_plan, two_phase_plan

log = logging.getLogger(__name__)

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
    eps: float = 1e-6  # eps of the key RMSNorm (docs/spec.md section 2)
    # two-phase or grouped routing with ``recompute``: phase 1 of this many more groups, the
    # last ones before the last site's, keeps its outputs for the backward instead of
    # recomputing them: each group costs its sites' phase-1 outputs (sites x tokens x d) of
    # peak memory and saves one route_many forward a step (two_phase.TwoPhasePlan)
    keep_groups: int = 0
    # two-phase or grouped routing: each site merges its new entry into its phase-1 result
    # through route_merge (one op, fused CUDA kernels; the branch norm fused in by the
    # backend) instead of torch ops that Inductor compiles. Same function, less memory
    # (DAR block at 350M: 1.129x the plain model's peak against 1.175x; 1.062x with the
    # backend's recompute_branch_outputs), step time within 3 % either way (docs/benchmarks.md
    # sessions 21 and 26). None: two_phase.FUSED_MERGE (off by default) when the model is
    # rewritten, recorded as the True or False it gave (two_phase.resolve_fused_merge)
    fused_merge: bool | None = None


class DepthQuery(fsdp2.Keyed, nn.Module):
    """A site's routing parameters: pseudo-query ``w`` (zeros: uniform weights at start)
    and the key RMSNorm weight ``g`` (ones)."""

    reads_stream = False
    replaces_stream = True

    def __init__(self, scheme: Scheme):
        super().__init__()
        self.query = scheme.param(scheme.d, fill=0.0)
        self.key_norm_weight = scheme.param(scheme.d, fill=1.0)
        self.eps = scheme.options.eps
        self.fused_merge = scheme.options.fused_merge

    def route(self, sources, logit_bias=None, source_scale=None) -> torch.Tensor:
        return route(sources, query=self.query, key_norm_weight=self.key_norm_weight, logit_bias=logit_bias,
                     source_scale=source_scale, eps=self.eps)


class FullRouter(DepthQuery):
    """Full AttnRes: the state is the tuple of all sources so far ``(e, u_1, ..., u_{l-1})``;
    with a :class:`TwoPhasePlan` (``group_size``), ``(sources, phase 1)``: the phase-1
    result of the current group of sites over the entries made before it."""

    heads = 1

    def __init__(self, scheme: Scheme, plan: TwoPhasePlan | None = None, group: int = 0, position: int = 0,
                 closes_group: bool = False):
        super().__init__(scheme)
        self.closes_group = closes_group
        join_plan(self, plan, group, position)

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        if self._plan is None:
            return self.route(state)
        sources, first = state
        if first is None:
            return self.route(sources)
        # the group's own entries so far: one per router before this one in the group
        return add_group_entries(self, first[0], sources[len(sources) - self.position:])

    def write(self, state: State, u, x, h) -> State:
        if self._plan is None:
            return state + (u,)
        sources = state[0] + (u,)
        if not self.closes_group:
            return sources, state[1]
        return sources, self._plan.first_phase(self.group + 1, sources)

    def extra_repr(self) -> str:
        return f"closes_group={self.closes_group}" if self._plan is not None else ""


def add_group_entries(router: DepthQuery, result: tuple, entries: tuple) -> torch.Tensor:
    """Phase 2 of a :class:`TwoPhasePlan` for ``router``: its row of the phase-1 ``result``
    ``(outs, lses)``, plus the entries its group made since phase 1 ran (Block AttnRes and
    WAV's readout: the partial block sum; grouped full routing: the group's own entries so
    far). None: the phase-1 output itself; one: by online softmax (``route_merge`` where
    the router's ``fused_merge``, or ``two_phase.FUSED_MERGE``, says so, else
    ``merge_partial``); more: routed together (``route_many``, one query) and the two results merged by their
    log-sum-exps (``merge_routes``), or, up to ``two_phase.DIRECT_MERGE_ENTRIES`` of them,
    merged as ``merge_routes``' own sources (no routing-op call). The same function as one
    route over all the entries."""
    outs, lses = result
    out, lse = outs[router.position], lses[router.position]
    params = dict(key_norm_weight=router.key_norm_weight, heads=router.heads, eps=router.eps)
    if not entries:
        return out
    if len(entries) == 1:
        if two_phase.merges_fused(router.fused_merge):
            with recomputable():  # the branch's RMSNorm backward needs the result: made again, not saved
                return route_merge([out], [lse], [entries[0]], queries=router.query[None],
                                   key_norm_weights=router.key_norm_weight[None], mix=router.query.new_ones(1),
                                   heads=router.heads, eps=router.eps)
        return merge_partial(out, lse, entries[0], query=router.query, **params)
    if len(entries) <= two_phase.DIRECT_MERGE_ENTRIES:
        return merge_routes([(out, lse, None)], [(e, None, None) for e in entries], query=router.query, **params)
    (fresh,), (fresh_lse,) = route_many(entries, queries=router.query[None],
                                        key_norm_weights=router.key_norm_weight[None], heads=router.heads,
                                        eps=router.eps)
    return merge_routes([(out, lse, None), (fresh, fresh_lse, None)], query=router.query, **params)


@dataclasses.dataclass(frozen=True)
class FullAttnResOptions(AttnResOptions):
    # the two-phase computation over groups of this many consecutive sites (TwoPhasePlan):
    # phase 1 routes the entries made before a group once for all of its sites
    # (route_many), each site adds its group's own entries so far (add_group_entries).
    # The same function, fewer bytes moved. None: one route per site over every entry.
    # Default 4, phase 1 kept: the fastest measured (H200, 350M GPT, bf16, side by side:
    # 0.689x the baseline's throughput against 0.618 site by site, G = 6 / 8 / 12: 0.666 /
    # 0.675 / 0.625; docs/benchmarks.md session 9; again in session 31, with the kernels
    # of then: 0.696 against G = 6 / 8: 0.660 / 0.672).
    group_size: int | None = 4
    # grouped: the backward recomputes phase 1 (TwoPhasePlan) instead of keeping its
    # outputs. Off by default: recomputing gave back the speed (G = 6: 0.621x, as site by
    # site) for 1.1 GiB less peak memory (1.19x the baseline's, kept 1.28x, site by site 1.26x)
    recompute: bool = False


def full_routing_plan(scheme: str, group_size: object, recompute: object, keep_groups: object,
                      fused_merge: object = None) -> TwoPhasePlan | None:
    """The plan of a full scheme's ``group_size``, ``recompute``, ``keep_groups`` and
    ``fused_merge`` options (checked)."""
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"{scheme}: group_size must be None (one route per site) or a positive int, "
                         f"found {group_size!r}")
    return two_phase_plan(scheme, group_size is not None, recompute, keep_groups, fused_merge)


def full_router(scheme: Scheme, index: int, cls: type = FullRouter) -> nn.Module:
    """The full-routing router of site ``index`` (1-based; the readout is ``num_sites +
    1``), placed in its group when ``scheme.plan`` groups the sites."""
    if scheme.plan is None:
        return cls(scheme)
    size = scheme.options.group_size
    group, position = block_place(index, size)
    closes = index % size == 0 and index <= scheme.stream.num_sites
    return cls(scheme, scheme.plan, group, position, closes_group=closes)


def full_initial_state(e: torch.Tensor, plan: TwoPhasePlan | None) -> State:
    return (e,) if plan is None else ((e,), plan.first_phase(0, (e,)))


class AttnResScheme(Scheme):
    """``attnres``: each site reads a softmax over depth of all earlier sources,
    ``x_l = sum_i a_{l,i} v_i`` with ``a = softmax(w_l . RMSNorm_{g_l}(v_i))``.
    Options: ``eps`` (key RMSNorm, 1e-6), ``group_size`` (4: the two-phase computation
    over groups of 4 consecutive sites, see :class:`FullAttnResOptions`; None: one route per
    site), ``recompute`` (False; True: phase 1 recomputed in the backward, less memory),
    ``keep_groups`` (0; with ``recompute``, this many more groups keep phase 1: see
    :class:`AttnResOptions`), ``fused_merge`` (None; grouped: see :class:`AttnResOptions`).
    New parameters: ``2 d (L + 1)``."""

    name = "attnres"
    Options = FullAttnResOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints)
        self.plan = full_routing_plan(self.name, options.group_size, options.recompute, options.keep_groups,
                                      options.fused_merge)
        self.options = two_phase.resolve_fused_merge(options, self.plan)

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        full_routing_plan(cls.name, options.group_size, options.recompute, options.keep_groups, options.fused_merge)

    def init_state(self, e):
        return full_initial_state(e, self.plan)

    def site_router(self, site: Site):
        return full_router(self, site.index)

    def readout_router(self):
        return full_router(self, self.stream.num_sites + 1)


# --------------------------------------------------------------------- Block AttnRes
@dataclasses.dataclass(frozen=True)
class BlockAttnResOptions(AttnResOptions):
    block_size: int | None = None  # sites per block; None: the even S giving at most 8 blocks
    # the two-phase computation (TwoPhasePlan): the same function, fewer bytes moved
    two_phase: bool = True
    # two-phase: the backward recomputes phase 1 instead of keeping its outputs
    # (TwoPhasePlan): 1.06x the baseline's peak memory instead of 1.14x at 350M, ~3 % slower
    recompute: bool = True


def check_block_size(scheme: str, size: object, none_means: str = "the default") -> None:
    """A block size given: a positive int (None: ``none_means``)."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"{scheme}: block_size must be None ({none_means}) or a positive int, found {size!r}")


def warn_if_block_exceeds(scheme: str, name: str, size: int, count: int, unit: str = "routing sites") -> None:
    """Say so when a block is larger than the whole model (``count`` sites, or layers): the
    model is then one block that never closes, routing over its partial sum alone. The math
    is well defined, and options made for a deeper model are reused on small ones on
    purpose (a depth sweep, a quick test), so this is reported, not refused; nor is the
    size clamped: the recipe records what was given. (A full scheme's ``group_size`` is not
    checked: it groups the computation of the same function.)"""
    if size > count:
        log.warning("%s: %s=%d is more than the model's %d %s: the whole model is one block that never closes "
                    "(its sites route over e and the partial sum only); %d or less makes blocks that close",
                    scheme, name, size, count, unit, count)


def default_block_size(num_sites: int, max_blocks: int = 8) -> int:
    """The smallest even block size that gives at most ``max_blocks`` blocks (docs/spec.md section 3)."""
    size = max(2, math.ceil(num_sites / max_blocks))
    return size + (size % 2)


def initial_block_state(e: torch.Tensor, plan: TwoPhasePlan | None) -> State:
    """The Block AttnRes state after the embedding: ``e`` is the first completed block; with
    a plan, phase 1 of the first block follows."""
    if plan is None:
        return (e,), None
    return (e,), None, plan.first_phase(0, (e,))


class BlockRouter(DepthQuery):
    """Block AttnRes. State: ``(completed block summaries (b_0 = e, b_1, ...), partial)``,
    ``partial`` being the sum of the updates of the unfinished block or ``None``; with a
    :class:`TwoPhasePlan`, a third entry: the phase-1 result of the current block."""

    heads = 1

    def __init__(self, scheme: Scheme, closes_block: bool, plan: TwoPhasePlan | None = None, group: int = 0,
                 position: int = 0):
        super().__init__(scheme)
        self.closes_block = closes_block
        join_plan(self, plan, group, position)

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        blocks, partial = state[:2]
        first = state[2] if self._plan is not None else None
        if first is None:
            return self.route(blocks if partial is None else blocks + (partial,))
        return add_group_entries(self, first[0], () if partial is None else (partial,))

    def write(self, state: State, u, x, h) -> State:
        blocks, partial = state[:2]
        partial = u if partial is None else partial + u
        if not self.closes_block:
            return (blocks, partial) + tuple(state[2:])
        blocks = blocks + (partial,)
        if self._plan is None:
            return blocks, None
        return blocks, None, self._plan.first_phase(self.group + 1, blocks)

    def extra_repr(self) -> str:
        return f"closes_block={self.closes_block}"


class BlockReadout(BlockRouter):
    def __init__(self, scheme: Scheme, plan: TwoPhasePlan | None = None, group: int = 0, position: int = 0):
        super().__init__(scheme, closes_block=False, plan=plan, group=group, position=position)


def block_place(index: int, block_size: int) -> tuple[int, int]:
    """(block, position in it) of site ``index`` (1-based, docs/spec.md's numbering); the readout is
    ``index = num_sites + 1``."""
    return (index - 1) // block_size, (index - 1) % block_size


class BlockAttnResScheme(Scheme):
    """``block_attnres``: sites grouped in blocks of ``block_size`` consecutive sites; a site
    reads the completed block summaries plus the partial sum of its own block. The final
    readout reads all summaries plus an unfinished last block. ``block_size=1`` is full
    AttnRes. Options: :class:`BlockAttnResOptions` (``keep_groups`` and ``fused_merge``:
    :class:`AttnResOptions`). New parameters: ``2 d (L + 1)``."""

    name = "block_attnres"
    Options = BlockAttnResOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints)
        size = options.block_size if options.block_size is not None else default_block_size(stream.num_sites)
        warn_if_block_exceeds(self.name, "block_size", size, stream.num_sites)
        self.block_size = size
        self.plan = block_plan(self.name, options)
        self.options = two_phase.resolve_fused_merge(options, self.plan)

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        check_block_size(cls.name, options.block_size)
        block_plan(cls.name, options)

    def init_state(self, e):
        return initial_block_state(e, self.plan)

    def site_router(self, site: Site):
        group, position = block_place(site.index, self.block_size)
        return BlockRouter(self, closes_block=site.index % self.block_size == 0, plan=self.plan, group=group,
                           position=position)

    def readout_router(self):
        group, position = block_place(self.stream.num_sites + 1, self.block_size)
        return BlockReadout(self, plan=self.plan, group=group, position=position)

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.block_size}
