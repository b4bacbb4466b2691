"""WAV v1: multiresolution Block AttnRes (docs/spec.md section 5).

Every block of S sites carries, next to its summary ``C = sum u_i``, two zero-sum detail
bases accumulated online:

    Dphase = sum a_i u_i   (a_i = +1 attention, -1 MLP; parallel: +attention part -MLP part, or 0)
    Dsplit = sum r_i u_i   (r_i = +1 on the first ceil(S/2) positions of the block, -1 after)

A site routes over ``e`` and, per completed block and for the partial block, the summary
and both details. Details are RMS-matched to their block's summary with a detached factor
``min(rho, rms(C) / (rms(D) + eps))`` and carry a learned logit bias per site and basis.
A finished block's details are multiplied by their factor once, when the block closes; the
partial block's, whose factor changes at every site, through the route op's
``source_scale`` (no gradient to the factor either way).

With ``two_phase=True`` the sites of a block route as Block AttnRes's two-phase computation
(``two_phase.TwoPhasePlan``): phase 1 reads the finished blocks' summaries and details once
per block (three ``route_many`` calls, one per list: a detail bias is the same for a whole
list, so it is added in phase 2), phase 2 merges them with the partial block per site
(``merge_routes``). Same function; off by default because it measured slower (H200, 350M
GPT, docs/benchmarks.md session 7: 133.8 ms a step against 127.0 site by site; H100,
session 69: 131.9 against 119.8; session 70, with the merge's softmax term by term: 0.648x
the baseline against site by site's 0.687x on another H100): each site's merge weighs three
phase-1 results and the partial block's three sources in Inductor's kernels, which cost
more (+24.8 ms a step over the baseline's against site by site's +4.4) than phase 1 saves
(the routing kernels 17.1 ms against 32.5). Neither form can meet issue 4's throughput goal
at this model: the HBM floor of what they move is over its budget (docs/benchmarks.md,
"What the floors allow").
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..analysis import Site
from ..ops import merge_routes
from ..recompute import recomputable
from .attnres import (
    AttnResOptions, BlockReadout, BlockRouter, DepthQuery, add_group_entries, block_place, check_block_size,
    default_block_size, initial_block_state, warn_if_block_exceeds,
)
from .base import Scheme, State, check_bool, finite_number, is_number, zero_from
from .two_phase import TwoPhasePlan, block_plan, join_plan, resolve_fused_merge


@dataclasses.dataclass(frozen=True)
class WavOptions(AttnResOptions):
    block_size: int | None = None  # sites per block; None: as block_attnres (even S, at most 8 blocks)
    rho: float = 2.0  # cap of the detail RMS-matching factor (docs/spec.md section 5, our choice)
    detail_bias_init: float = -2.0  # initial logit bias of every detail source; -inf: block_attnres
    details: bool = True  # False: exactly block_attnres with the same two_phase (same routers, same parameters)
    # the two-phase computation of Block AttnRes (two_phase.TwoPhasePlan), per source list;
    # off by default: measured slower for WAV (its merge weighs six terms per site; module docstring)
    two_phase: bool = False
    recompute: bool = True  # two-phase: the backward recomputes phase 1


def rms_match(summary: torch.Tensor, detail: torch.Tensor, rho: float, eps: float) -> torch.Tensor:
    """Per-token factor ``min(rho, sg(rms(C)) / (sg(rms(D)) + eps))``, shape ``(*batch,)``;
    in float32 at least, since a bf16 mean square loses the small details."""
    dtype = torch.promote_types(detail.dtype, torch.float32)

    def rms(t):
        return t.detach().to(dtype).square().mean(-1).sqrt()

    return torch.clamp(rms(summary) / (rms(detail) + eps), max=rho)


class _PlanMember(DepthQuery):
    """A WAV router that may belong to a :class:`TwoPhasePlan` (its ``group`` and
    ``position``); the state then carries the group's phase-1 result as a fourth entry."""

    heads = 1
    reads_details = True

    def __init__(self, scheme: "WavScheme", group: int, position: int):
        super().__init__(scheme)
        join_plan(self, scheme.plan, group, position)

    def _first(self, state: State) -> tuple | None:
        return state[3] if self._plan is not None else None


class WavRouter(_PlanMember):
    """A WAV site. State: ``(e, completed, partial[, phase 1])``; ``completed`` holds one
    ``(C, ~Dphase, ~Dsplit)`` per finished block (the details RMS-matched when the block
    closed: the detached factors are fixed from then on), ``partial`` is ``None`` or
    ``(P, Pphase, Psplit)``. ``detail_bias`` = (phase bias, split bias).

    Two-phase: phase 1 routes the summaries ``(e, C_0, ..)``, the phase details and the
    split details of the completed blocks as three lists for all sites of the block; each
    site merges the three results, its detail biases and its partial block's three sources
    by softmax (:func:`merge_routes`)."""

    wants_parts = True

    def __init__(self, scheme: "WavScheme", site: Site, group: int, position: int):
        super().__init__(scheme, group, position)
        self.detail_bias = scheme.param(2, fill=float(scheme.options.detail_bias_init))
        self.rho = float(scheme.options.rho)
        size = scheme.block_size
        self.closes_block = position + 1 == size
        self.split_sign = 1 if position + 1 <= math.ceil(size / 2) else -1
        self.kind, self.part_kinds = site.kind, site.parts

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        e, completed, partial = state[:3]
        first = self._first(state)
        return self._route(e, completed, partial) if first is None else self._merge(first, partial)

    def _route(self, e, completed, partial) -> torch.Tensor:
        """Site by site: one route over every source."""
        if not completed and partial is None:  # only e: one source, nothing to weigh
            # e's logit, 0, made from the detail biases: they take part in the backward (zero_from)
            bias = zero_from(self.detail_bias).reshape(1)
            return self.route([e], logit_bias=bias)
        values = [e] + [t for block in completed for t in block]
        scale = None
        if partial is not None:
            P, Pphase, Psplit = partial
            values += [P, Pphase, Psplit]
            # 1 for every source but the partial details: padding the two factors with
            # ones is one fused kernel (a stack of n ones rows was one kernel per row:
            # ~500 launches a step at 350M, session 8's profile)
            factors = torch.stack([self._match(P, Pphase), self._match(P, Psplit)])
            scale = F.pad(factors, (0, 0) * (P.dim() - 1) + (len(values) - 2, 0), value=1.0)
        # logits: 0 for e and every summary, the learned bias for each detail
        per_block = F.pad(self.detail_bias, (1, 0))
        blocks = len(completed) + (partial is not None)
        bias = torch.cat([per_block.new_zeros(1), per_block.repeat(blocks)])
        return self.route(values, logit_bias=bias, source_scale=scale)

    def _merge(self, first: tuple, partial) -> torch.Tensor:
        """Two-phase: the phase-1 results of this site, plus its partial block."""
        phase_bias, split_bias = self.detail_bias.unbind(0)
        results = [(outs[self.position], lses[self.position], bias)
                   for (outs, lses), bias in zip(first, (None, phase_bias, split_bias))]
        sources = []
        if partial is not None:
            P, Pphase, Psplit = partial
            sources = [(P, None, None), (Pphase, phase_bias, self._match(P, Pphase)),
                       (Psplit, split_bias, self._match(P, Psplit))]
        if len(results) == 1 and not sources:  # only e (the first site): the detail biases add 0 (zero_from)
            return results[0][0] + zero_from(self.detail_bias).to(results[0][0].dtype)
        return merge_routes(results, sources, query=self.query, key_norm_weight=self.key_norm_weight, eps=self.eps)

    def write(self, state: State, u, x, h, parts: tuple | None = None) -> State:
        e, completed, partial = state[:3]
        # three new sums per site, recomputable from u in the backward (recompute.py)
        with recomputable(partial=not self.closes_block):
            phase = self._phase(u, parts)
            split = u if self.split_sign > 0 else -u
            if partial is None:
                partial = (u, torch.zeros_like(u) if phase is None else phase, split)
            else:
                P, Pphase, Psplit = partial
                partial = (P + u, Pphase if phase is None else Pphase + phase, Psplit + split)
        if not self.closes_block:
            return (e, completed, partial) + tuple(state[3:])
        P, Pphase, Psplit = partial
        completed = completed + ((P, self._matched(P, Pphase), self._matched(P, Psplit)),)
        if self._plan is None:
            return e, completed, None
        return e, completed, None, first_phase(self._plan, self.group + 1, e, completed)

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

    def _matched(self, summary: torch.Tensor, detail: torch.Tensor) -> torch.Tensor:
        """``~D``: the detail times its detached matching factor, in the detail's dtype."""
        return (detail * self._match(summary, detail).unsqueeze(-1)).to(detail.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, split_sign={self.split_sign:+d}, closes_block={self.closes_block}"


def first_phase(plan: TwoPhasePlan, group: int, e: torch.Tensor, completed: tuple) -> tuple | None:
    """WAV's phase 1 for ``group``: the summaries ``(e, C_0, ..)``, then (when a router of
    the group reads details and a block is complete) the phase and split details."""
    summaries = (e,) + tuple(block[0] for block in completed)
    if not completed or not any(r.reads_details for r in plan.groups.get(group, ())):
        return plan.first_phase(group, summaries)
    return plan.first_phase(group, summaries, tuple(b[1] for b in completed), tuple(b[2] for b in completed))


class WavReadout(_PlanMember):
    """Conservative readout: ``{e, C_0, .., P}`` only, no details (docs/spec.md section 5)."""

    reads_details = False

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        e, completed, partial = state[:3]
        first = self._first(state)
        if first is None:
            sources = [e] + [block[0] for block in completed] + ([] if partial is None else [partial[0]])
            return self.route(sources)
        return add_group_entries(self, first[0], () if partial is None else (partial[0],))


class WavScheme(Scheme):
    """``wav``: WAV v1. Block AttnRes whose sites also route over two RMS-matched detail
    bases per block (attention-minus-MLP and first-half-minus-second-half), each with a
    learned logit bias; the final readout routes over ``{e, C_0, .., P}`` only.

    Options: ``block_size`` (sites per block; default as block_attnres), ``rho`` (cap of
    the detached RMS-matching factor, 2.0), ``detail_bias_init`` (-2.0), ``details``
    (False: exactly block_attnres with the same ``two_phase``), ``eps`` (key RMSNorm and
    matching, 1e-6), ``two_phase`` (False: measured slower for WAV, see the module docstring),
    ``recompute`` (True), ``keep_groups`` (0) and ``fused_merge`` (None; with details the
    readout's merge only, with ``details=False`` every merge) as for block_attnres. New
    parameters: ``2 d (L + 1) + 2 L`` (``2 d (L + 1)`` with ``details=False``).
    """

    name = "wav"
    Options = WavOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints=hints)
        size = options.block_size if options.block_size is not None else default_block_size(stream.num_sites)
        warn_if_block_exceeds(self.name, "block_size", size, stream.num_sites)
        self.block_size = size
        self.plan = block_plan(self.name, options)
        self.options = resolve_fused_merge(options, self.plan)

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        check_block_size("wav", options.block_size)
        finite_number("wav", "rho", options.rho, positive=True)
        bias = options.detail_bias_init
        if bias != -math.inf and not (is_number(bias) and math.isfinite(bias)):  # -inf: the details weigh 0
            raise ValueError(f"wav: detail_bias_init must be a finite number or -inf (the details weighed 0: "
                             f"block_attnres exactly), found {bias!r}")
        check_bool("wav", "details", options.details)
        block_plan(cls.name, options)

    def unused_options(self, options) -> list[tuple[str, str]]:
        unused = super().unused_options(options)
        if not options.details:
            defaults = WavOptions()
            unused += [(f"{name}={getattr(options, name)!r}", "it shapes the detail sources, which details=False "
                        "leaves out (block_attnres exactly)") for name in ("rho", "detail_bias_init")
                       if getattr(options, name) != getattr(defaults, name)]
        return unused

    def init_state(self, e):
        if not self.options.details:
            return initial_block_state(e, self.plan)
        if self.plan is None:
            return e, (), None
        return e, (), None, first_phase(self.plan, 0, e, ())

    def site_router(self, site: Site) -> nn.Module:
        group, position = block_place(site.index, self.block_size)
        if not self.options.details:
            return BlockRouter(self, closes_block=site.index % self.block_size == 0, plan=self.plan, group=group,
                               position=position)
        return WavRouter(self, site, group, position)

    def readout_router(self) -> nn.Module:
        group, position = block_place(self.stream.num_sites + 1, self.block_size)
        if not self.options.details:
            return BlockReadout(self, plan=self.plan, group=group, position=position)
        return WavReadout(self, group, position)

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.block_size}
