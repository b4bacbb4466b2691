"""Dual Attention Residuals (docs/spec.md section 6).

Two depth streams j = 0, 1, each a history of completed entries ``H^j`` (``H^j_0 = e``) and
a partial entry ``P^j``. A site routes each stream (keys and values taken from the streams
the variant names), mixes the two results with a learned gate, and writes its update into
both partial entries through a doubly stochastic transport. Blocks are counted in layers
(blocks of the stack): a DAR block ends after the last site of every K-th layer.

By default the sites of a DAR block route as Block AttnRes's two-phase computation
(``two_phase.TwoPhasePlan``): when a block closes, phase 1 routes each stream's completed
entries (values and keys from the streams the variant names) once for all sites of the
next block, one ``route_many`` call per stream; each site then adds the partial entries by
online softmax (``merge_partial``). ``two_phase=False`` routes every site over all its
entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import nn

from .. import fsdp2
from ..analysis import Site
from ..graph_hints import hinted
from ..ops import merge_partial, route, route_merge
from ..recompute import recomputable
from .attnres import AttnResOptions, warn_if_block_exceeds
from . import two_phase
from .two_phase import TwoPhasePlan, block_plan, join_plan
from .base import Scheme, State, finite_number, is_number, zero_from

#: for each variant and target stream j: (stream giving the values, stream giving the keys)
VARIANTS = {
    "dar": lambda j: (j, 1 - j),
    "selfkv": lambda j: (j, j),
    "crossv": lambda j: (1 - j, j),
    "fixedkv": lambda j: (1, 0),
}


#: How the gate ``s r^0 + (1 - s) r^1`` and the transport ``rho q^0 + (1 - rho) q^1`` are
#: written as torch ops. "weights" (the spec's form, the default): both weights applied.
#: "difference": ``r^1 + s (r^0 - r^1)`` and ``q^1 + rho (q^0 - q^1)``, so that autograd
#: forms one sum over the tokens per scalar use (the gate 1, not 2; a write with its betas
#: 3, not 6), since those sums are Inductor's split reductions that read their tensors
#: again (1.4-2.0 TB/s in DAR block's step). Measured in session 43 (docs/benchmarks.md):
#: Inductor then fused the step's backward differently and its kernels took longer, so it
#: stays an option. The two agree up to rounding.
MIX_FORM = "weights"
MIX_FORMS = ("weights", "difference")
#: Whether the transport's products at a site that closes its block are tagged for
#: recomputation (:func:`recomputable`), as every other site's partial sums are; only the
#: block's completed entries they add up to are kept. Untagged (before session 43), the
#: partitioner kept a float32 copy of that site's routed input for the branch's norm
#: instead: two activations a block (at 350M, 0.44 GiB of DAR block's peak, session 43).
TAG_CLOSING_TRANSPORT = True
#: Whether the gate's, the transport's and the betas' scalars multiply the streams as a
#: per-token factor (a view of the scalar expanded to ``(*batch, 1)``), so that autograd
#: sums each product's gradient over each token's row first and then over the tokens: the
#: row sums are reductions over the rows that Inductor can fold into the passes over the
#: same rows (as the merges' sums in session 68), where a sum over every element at once is
#: a split reduction of its own that reads its tensors again. True (the default since
#: session 69): DAR block's step 1.2 % shorter on an H100, Inductor's kernels 2.1 ms a step
#: less (docs/benchmarks.md session 69); the gradients agree up to rounding. False: the
#: scalars as they are (``e2e_throughput.py``'s ``dar_block_wholesums``).
PER_TOKEN_SCALARS = True


def _weights_form() -> bool:
    if MIX_FORM not in MIX_FORMS:
        raise ValueError(f"dar.MIX_FORM must be one of {', '.join(MIX_FORMS)}, found {MIX_FORM!r}")
    return MIX_FORM == "weights"


def _per_token(scalar: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``scalar`` (one element) as the factor it multiplies ``like`` by: itself, or with
    :data:`PER_TOKEN_SCALARS` a view expanded to one value per token, ``(*batch, 1)``."""
    if not PER_TOKEN_SCALARS:
        return scalar
    return scalar.reshape((1,) * like.dim()).expand(*like.shape[:-1], 1)


def _times(scalar: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``scalar * t``, the scalar as :func:`_per_token` makes it."""
    return _per_token(scalar, t) * t


def _mix(weight: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``weight first + (1 - weight) second`` in the form :data:`MIX_FORM` names."""
    weight = _per_token(weight, first)
    if _weights_form():
        return weight * first + (1 - weight) * second
    return second + weight * (first - second)


def _transport(rho: torch.Tensor, q0: torch.Tensor, q1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``M(rho) [q^0, q^1]``, ``M = [[rho, 1 - rho], [1 - rho, rho]]``, in the form
    :data:`MIX_FORM` names (as differences, ``rho`` multiplies one tensor, ``q^0 - q^1``),
    tagged for recomputation where :data:`TAG_CLOSING_TRANSPORT` says (the caller tags a
    site that does not close its block)."""
    rho = _per_token(rho, q0)
    with recomputable() if TAG_CLOSING_TRANSPORT else contextlib.nullcontext():
        if _weights_form():
            return rho * q0 + (1 - rho) * q1, (1 - rho) * q0 + rho * q1
        moved = rho * (q0 - q1)
        return q1 + moved, q0 - moved


@dataclasses.dataclass(frozen=True)
class DarOptions(AttnResOptions):
    variant: str = "dar"  # 'dar', 'selfkv', 'crossv' or 'fixedkv' (see VARIANTS)
    layers_per_block: int = 1  # K: layers per DAR block; 1 is full DAR
    # beta^j starts at beta_init[0] where (site index + j) is even, else beta_init[1]: the
    # streams must start different or they stay identical (docs/spec.md section 6, our choice)
    beta_init: tuple[float, float] = (1.0, 0.5)
    transport_init: float = 2.0  # c; rho = sigmoid(c) is the share a stream keeps of itself
    # the two-phase computation of Block AttnRes (two_phase.TwoPhasePlan), one list per stream
    two_phase: bool = True
    recompute: bool = True  # two-phase: the backward recomputes phase 1


class DualRoute(fsdp2.Keyed, nn.Module):
    """Route both streams and mix them: ``x = s r^0 + (1 - s) r^1``, ``s = sigmoid(mix)``.
    ``query`` and ``key_norm_weight`` hold one row per target stream. State:
    ``(history, partial)``, with a :class:`TwoPhasePlan` a third entry: the phase-1 result
    of the current group (DAR block) for both streams."""

    reads_stream = False
    replaces_stream = True
    heads = 1

    def __init__(self, scheme: "DarScheme", group: int = 0):
        super().__init__()
        self.query = scheme.param(2, scheme.d, fill=0.0)
        self.key_norm_weight = scheme.param(2, scheme.d, fill=1.0)
        self.mix = scheme.param(1, fill=0.0)
        self.eps = scheme.options.eps
        self.fused_merge = scheme.options.fused_merge
        self.variant = scheme.options.variant
        join_plan(self, scheme.plan, group)  # in the order the rewriter makes the routers

    def read(self, state: State, h: torch.Tensor) -> torch.Tensor:
        history, partial = state[:2]
        first = state[2] if self._plan is not None else None
        if first is None:
            streams = [history[j] + (() if partial is None else (partial[j],)) for j in (0, 1)]
            r0, r1 = (self._route(streams, j) for j in (0, 1))
        elif partial is not None and two_phase.merges_fused(self.fused_merge):
            return self._fused_merge(first, partial)
        else:
            r0, r1 = (self._merge(first[j], partial, j) for j in (0, 1))
        return _mix(torch.sigmoid(self.mix), r0, r1)

    def _route(self, streams, j: int) -> torch.Tensor:
        values, keys = self.route_inputs(streams, j)
        return route(values, keys, query=self.query[j], key_norm_weight=self.key_norm_weight[j], eps=self.eps)

    def route_inputs(self, streams, j: int) -> tuple[tuple, tuple | None]:
        """Target stream j's ``(values, keys)`` among ``streams`` (each a stream's entries),
        as the variant names them; keys None where they are the values."""
        value_stream, key_stream = VARIANTS[self.variant](j)
        return streams[value_stream], (None if key_stream == value_stream else streams[key_stream])

    def _merge(self, first: tuple, partial, j: int) -> torch.Tensor:
        """Two-phase: stream j's phase-1 result for this router, plus the partial entries."""
        outs, lses = first
        out, lse = outs[self.position], lses[self.position]
        if partial is None:
            return out
        value_stream, key_stream = VARIANTS[self.variant](j)
        key = None if key_stream == value_stream else partial[key_stream]
        return merge_partial(out, lse, partial[value_stream], partial_key=key, query=self.query[j],
                             key_norm_weight=self.key_norm_weight[j], eps=self.eps)

    def _fused_merge(self, first: tuple, partial: tuple) -> torch.Tensor:
        """Two-phase, both streams merged and mixed in one ``route_merge`` (``fused_merge``)."""
        streams = [VARIANTS[self.variant](j) for j in (0, 1)]  # (value stream, key stream) per target
        values = [partial[value] for value, _ in streams]
        keys = None if streams[0][0] == streams[0][1] else [partial[key] for _, key in streams]
        outs = [first[j][0][self.position] for j in (0, 1)]
        lses = [first[j][1][self.position] for j in (0, 1)]
        # the weights [s, 1 - s] made outside recomputable() (two numbers: kept) and as one
        # pointwise op, sigmoid([a, -a]), not torch.cat([s, 1 - s]): until session 22 the cat
        # was tagged and recomputed in the backward, where Inductor (torch 2.13) wrote it into
        # views of one buffer, reused a view in place for the mix gradient, then reused the
        # whole buffer while that gradient was still to be returned, overwriting it
        # (docs/design.md "The second phase in one op"; tests/compile/test_backend.py)
        mix = torch.sigmoid(self.mix * self.mix.new_tensor([1.0, -1.0]))
        with recomputable():  # the branch's RMSNorm backward needs the result: made again, not saved
            return route_merge(outs, lses, values, keys, queries=self.query, key_norm_weights=self.key_norm_weight,
                               mix=mix, eps=self.eps)

    def extra_repr(self) -> str:
        return f"variant={self.variant}"


class DarRouter(DualRoute):
    """A DAR site: routing as :class:`DualRoute`, plus the gated write with transport
    ``[P^0, P^1] <- M(sigmoid(transport)) [P^0, P^1] + beta u``."""

    def __init__(self, scheme: "DarScheme", site: Site, closes_block: bool):
        super().__init__(scheme, group=site.block // scheme.layers_per_block)
        self.transport = scheme.param(1, fill=float(scheme.options.transport_init))
        even, odd = scheme.options.beta_init
        self.beta = nn.Parameter(torch.tensor(
            [even if (site.index + j) % 2 == 0 else odd for j in (0, 1)], dtype=scheme.dtype, device=scheme.device))
        self.closes_block = closes_block

    def write(self, state: State, u, x, h) -> State:
        history, partial = state[:2]
        # two new entries per site, recomputable from u in the backward (recompute.py); the
        # hint gives the graph Inductor settings that suit the transport chain (graph_hints.py)
        with recomputable(partial=not self.closes_block), hinted("dar_transport"):
            if partial is None:  # a fresh block: nothing to transport yet (a zero from it, for DDP)
                beta = self.beta + zero_from(self.transport)
                p0, p1 = _times(beta[0], u), _times(beta[1], u)
            else:
                rho = torch.sigmoid(self.transport)
                q0, q1 = partial
                p0, p1 = _transport(rho, q0, q1)
                p0, p1 = p0 + _times(self.beta[0], u), p1 + _times(self.beta[1], u)
            # the scalars are float32 parameters: keep the streams in the sources' dtype
            # (bf16 under autocast), as routing reads all sources in one dtype
            p0, p1 = p0.to(u.dtype), p1.to(u.dtype)
        if not self.closes_block:
            return (history, (p0, p1)) + tuple(state[2:])
        history = (history[0] + (p0,), history[1] + (p1,))
        if self._plan is None:
            return history, None
        return history, None, first_phase(self._plan, self.group + 1, history, self.variant)

    def extra_repr(self) -> str:
        return f"variant={self.variant}, closes_block={self.closes_block}"


def first_phase(plan: TwoPhasePlan, group: int, history: tuple, variant: str) -> tuple | None:
    """DAR's phase 1 for ``group``: per target stream j, its completed entries routed with
    every router's query row j (values and keys from the streams the variant names)."""
    values, keys = [], []
    for j in (0, 1):
        value_stream, key_stream = VARIANTS[variant](j)
        values.append(history[value_stream])
        keys.append(None if key_stream == value_stream else history[key_stream])
    return plan.first_phase(group, *values, key_lists=tuple(keys), query_rows=(0, 1))


class DarScheme(Scheme):
    """``dar``: Dual Attention Residuals. Two streams of depth entries; each site reads
    ``s r^0 + (1 - s) r^1`` where ``r^j`` routes stream j's entries (keys and values from
    the streams the variant names: ``dar`` keys 1-j / values j, ``selfkv`` j / j,
    ``crossv`` j / 1-j, ``fixedkv`` 0 / 1), then writes ``beta^j u`` into both partial
    entries after mixing them with ``[[rho, 1-rho], [1-rho, rho]]``, ``rho = sigmoid(c)``.
    The final readout routes and mixes with its own parameters.

    Options: ``variant`` ('dar'), ``layers_per_block`` K (1: full DAR, one entry per
    layer), ``beta_init`` ((1.0, 0.5): the value where site index + j is even / odd),
    ``transport_init`` (c, 2.0), ``eps`` (key RMSNorm, 1e-6), ``two_phase`` (True),
    ``recompute`` (True), ``keep_groups`` (0) and ``fused_merge`` (None) as for
    block_attnres. Init: queries 0, key norm weights 1, mixing gate a = 0. New parameters:
    ``(4 d + 4) L + 4 d + 1``.
    """

    name = "dar"
    Options = DarOptions

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints=hints)
        k = options.layers_per_block
        self._sites_per_layer = stream.sites_per_block()
        warn_if_block_exceeds(self.name, "layers_per_block", k, len(self._sites_per_layer), unit="layers")
        self.layers_per_block = k
        self.plan = block_plan(self.name, options)
        self.options = two_phase.resolve_fused_merge(options, self.plan)

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        if not isinstance(options.variant, str) or options.variant not in VARIANTS:
            raise ValueError(f"dar: variant must be one of {', '.join(VARIANTS)}, found {options.variant!r}")
        k = options.layers_per_block
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"dar: layers_per_block must be a positive int, found {k!r}")
        beta = options.beta_init
        if not (isinstance(beta, (tuple, list)) and len(beta) == 2
                and all(is_number(b) and math.isfinite(b) for b in beta)):
            raise ValueError(f"dar: beta_init must be a pair of finite numbers, found {beta!r}")
        finite_number("dar", "transport_init", options.transport_init)
        block_plan(cls.name, options)

    def init_state(self, e):
        history = ((e,), (e,))
        if self.plan is None:
            return history, None
        return history, None, first_phase(self.plan, 0, history, self.options.variant)

    def site_router(self, site: Site) -> nn.Module:
        last_of_layer = site.position == self._sites_per_layer[site.block]
        closes = last_of_layer and (site.block + 1) % self.layers_per_block == 0
        return DarRouter(self, site, closes_block=closes)

    def readout_router(self) -> nn.Module:
        # after the last layer: with the sites of an unfinished last block, else alone
        return DualRoute(self, group=len(self._sites_per_layer) // self.layers_per_block)
