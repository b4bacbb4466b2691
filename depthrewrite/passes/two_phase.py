"""The two-phase computation of depth routing (the Attention Residuals paper's; docs/spec.md section 3),
shared by the schemes whose sites read a common set of earlier entries: Block AttnRes and
block MHAR (the completed blocks), WAV (summaries and detail bases), DAR (one list per
stream) and grouped full routing (the entries made before a group of sites).

Phase 1 routes those entries once for all routers of a group (``route_many``); each
router's phase 2, in its scheme's module, adds what its group made since.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops import route_many
from .. import fsdp2, tensor_parallel
from .base import check_bool

log = logging.getLogger(__name__)

#: with ``recompute``, phase 1 of the groups of the last site and of the readout is kept
#: instead of recomputed. The backward starts with those groups, so their recomputation
#: would run before its peak (the last layers' backward) and their outputs would be alive
#: there either way: the same peak for one ``route_many`` forward per group less (H200, 350M,
#: docs/benchmarks.md session 15: peaks unchanged, Block AttnRes 0.4 % and DAR block 1.0 %
#: faster). A model whose peak is at its loss (a large vocabulary over a shallow stack) keeps
#: those outputs through it: False recomputes every group but the ``keep_groups`` a
#: scheme asks to keep.
KEEP_LAST_PHASE_ONE = True

#: phase 2 of Block AttnRes, block MHAR, WAV's readout and DAR (one new entry merged into a
#: site's phase-1 result, and DAR's gate) through ``depthrewrite::route_merge``, one op with
#: fused CUDA kernels, instead of ``merge_partial``'s torch ops that Inductor compiles. Same
#: function (up to rounding: the merged result is rounded once, to the activation dtype).
#: Off: timed on the H200 in session 21 (``e2e_throughput.py``'s ``*_fm`` configurations,
#: device phase ``fusedmerge``) it made Block AttnRes slower (0.851x of the baseline against
#: 0.878x) and DAR block no faster (0.680x against 0.675x); docs/design.md "The second phase
#: in one op" says why. A scheme's ``fused_merge`` option overrides it per model
#: (:func:`merges_fused`). Read when a model is rewritten (:func:`resolve_fused_merge`):
#: changing it later leaves rewritten models as they are
FUSED_MERGE = False

#: phase 2 of grouped full routing (``group_size``): a site whose group has made 2 to this
#: many entries since phase 1 adds them by ``merge_routes``' plain torch ops (each entry's
#: logit and the softmax merge, which Inductor compiles and fuses), not by a one-query
#: ``route_many`` call and ``merge_routes``. Same function. Full AttnRes makes 24 such calls a
#: step at 350M (groups of 4: sites 3 and 4 of each group), each costing the host 0.2-0.8 ms a
#: direction, and its host is within 10 % of setting the step's pace (docs/design.md "The
#: host's share of full AttnRes's step", session 35). 1 (the default: every call kept): at 3
#: the host's step was 25 ms shorter but Inductor's merge kernels 5.2 ms longer for 2.3 ms
#: less of route_many's, the step 1.5 % slower, also as CUDA graphs (H200, 350M GPT,
#: ``e2e_throughput.py``'s ``attnres_direct3``, docs/benchmarks.md session 36; then with
#: ``merge_routes``' stacked softmax, whose kernels session 70's softmax term by term
#: shortened for two-phase WAV: not measured again)
DIRECT_MERGE_ENTRIES = 1


def merges_fused(choice: bool | None) -> bool:
    """Whether a router's phase 2 goes through ``route_merge``: its scheme's ``fused_merge``
    option, or :data:`FUSED_MERGE` where that is None."""
    return FUSED_MERGE if choice is None else choice


def resolve_fused_merge(options, plan: "TwoPhasePlan | None"):
    """``options`` with ``fused_merge`` as the rewrite uses it: the option, or
    :data:`FUSED_MERGE` now where it is None; False without a second phase to merge in. The
    routers read this, and ``save_pretrained`` and checkpoints record it, so that a model
    rebuilt from the record computes as it did whatever the flag is then."""
    used = merges_fused(options.fused_merge) if plan is not None else False
    return dataclasses.replace(options, fused_merge=used)


class TwoPhasePlan:
    """The two-phase Block AttnRes computation (the Attention Residuals paper's; docs/spec.md section 3).

    Every site of a block reads the same completed block summaries plus its own block's
    partial sum. Phase 1 routes the summaries for ALL sites of the block at once, when the
    previous block closes (for the first block: when the state starts), with
    ``route_many``: each summary is read once per block instead of once per site, and the
    backward sums the sites' gradients of a summary on chip. Phase 2, at each site, adds the
    partial sum by online softmax (``merge_partial``). Same function as one route per site
    (up to rounding: the phase-1 result is stored in the activation dtype).

    WAV (``two_phase=True``), DAR and grouped full routing use the same plan (design.md
    "Two-phase WAV and DAR", "Grouped full routing"): WAV with three source lists per block
    (the summaries and each detail basis, whose per-site logit bias is added in phase 2 by
    :func:`merge_routes`), DAR with one list per stream, its keys from the stream the
    variant names and one row of each router's ``(2, d)`` query per list, grouped full
    routing (``attnres`` / ``mhar`` ``group_size``) with the entries made before a group
    of consecutive sites.

    The plan knows each group of routers (the sites of one block, then the readout, in
    order); the state carries the phase-1 result of the current group as its last entry
    (Block AttnRes, block MHAR and DAR: the third; grouped full routing: the second; WAV:
    the fourth), ``None`` where phase 1 was skipped, and the routers then route per site:
    - when a group's routing parameters are shards that phase 1 cannot gather. FSDP2
      gathers a block's parameters only when that block runs, and phase 1 for block
      ``k + 1`` runs inside block ``k``: phase 1 gathers FSDP2's shards itself and reduces
      their gradients as FSDP2 does (:mod:`depthrewrite.fsdp2`); any other DTensor is not
      gathered;
    - while ``enabled`` is False (the routing-weight recorder needs each site's route).

    ``recompute`` (default True) trades time for activation memory: phase 1 runs under
    non-reentrant activation checkpointing, so the backward recomputes it (one more
    ``route_many`` forward per block) from the block summaries it keeps anyway instead of
    keeping every site's phase-1 output. Measured at 350M (docs/benchmarks.md): peak memory
    1.06x the baseline instead of 1.14x, 0.844x its throughput instead of 0.867-0.870x
    (separate runs). The groups of the last site and of the readout keep theirs
    (``KEEP_LAST_PHASE_ONE``: recomputed, they would be alive at the backward's peak
    anyway), and so do ``keep_groups`` more, the last ones before them (a scheme option:
    each costs its sites' phase-1 outputs of peak memory for one ``route_many`` forward a
    step less). Checkpointing the merges too saved 0.6 GiB more (a float32 copy per block
    that the partitioner keeps inside the merge) but cost 4 ms more, and checkpointing only
    the merges was worse than either: neither is offered.
    """

    def __init__(self, recompute: bool = True, keep_groups: int = 0):
        self.groups: dict[int, list] = {}
        self.enabled = True
        self.recompute = recompute
        self.keep_groups = keep_groups
        self._told_sharded = False

    def add(self, router: nn.Module, group: int, position: int) -> None:
        members = self.groups.setdefault(group, [])
        if position != len(members):
            raise RuntimeError(f"two-phase routing: router {position} of block {group} was made out of order "
                               f"(block has {len(members)} so far)")
        members.append(router)

    def first_phase(self, group: int, *source_lists: tuple, key_lists: tuple | None = None,
                    query_rows: tuple | None = None) -> tuple | None:
        """Phase 1 for ``group``: for each list of sources (Block AttnRes: one, the completed
        blocks; WAV: summaries, then each detail basis; DAR: one per stream),
        ``(outputs, lses)``, one per router of the group, all routed with the group's
        queries; or None (class docstring). ``key_lists``: per list, its keys or None (the
        sources themselves); ``query_rows``: per list, the row of each router's 2-D query
        that routes it (DAR: one row per stream), or None for 1-D queries."""
        routers = self.groups.get(group)
        if not self.enabled or not routers:
            return None
        params = _routing_parameters(self, group)
        if params is None:
            if not self._told_sharded and not torch.compiler.is_compiling():  # logging would break a graph
                self._told_sharded = True
                log.info("two-phase routing: the routing parameters of block %d are sharded, and not as plain "
                         "FSDP2 parameters this torch's FSDP2 lets us read (depthrewrite.fsdp2); its sites route "
                         "one by one (same function, more bytes moved)", group)
            return None
        first = routers[0]
        queries = torch.stack([q for q, _ in params])
        weights = torch.stack([w for _, w in params])
        key_lists = key_lists or (None,) * len(source_lists)
        query_rows = query_rows or (None,) * len(source_lists)
        # (values, keys, query row) per list; the tensors go to the checkpoint flat
        layout = tuple((len(v), len(k or ()), row) for v, k, row in zip(source_lists, key_lists, query_rows))
        sources = [t for v, k in zip(source_lists, key_lists) for t in (*v, *(k or ()))]
        phase = functools.partial(_phase_one, layout=layout, heads=first.heads, eps=first.eps)
        if self.recompute and group not in self._kept_groups():
            return _seen_outside(checkpoint(phase, queries, weights, *sources, use_reentrant=False))
        return phase(queries, weights, *sources)

    def _kept_groups(self) -> set[int]:
        """The groups whose phase 1 is kept with ``recompute``: with KEEP_LAST_PHASE_ONE
        those of the last two routers (the last site's and the readout's: the readout is
        the last router, and joins the last site's group when that block is unfinished),
        then ``keep_groups`` more, the last ones before them."""
        routers = [g for g in sorted(self.groups) for _ in self.groups[g]]
        last = set(routers[-2:]) if KEEP_LAST_PHASE_ONE else set()
        earlier = sorted((g for g in self.groups if g not in last), reverse=True)  # `last` are the highest
        return last | set(earlier[:self.keep_groups])


def _routing_parameters(plan: TwoPhasePlan, group: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each router's ``(query, key_norm_weight)`` for phase 1, whole: those FSDP2 holds as
    shards gathered (:mod:`depthrewrite.fsdp2`: one collective for all of them that share
    a process group), or None where some cannot be (the sites then route one by one)."""
    routers = plan.groups[group]
    params = [(r.query, r.key_norm_weight) for r in routers]
    if not any(_is_sharded(p) for pair in params for p in pair):
        return params
    if not GATHER_SHARDS:
        return None
    plans, batches = _gather_plans(*(r._depth_key for r in routers))
    if any(_is_sharded(p) and q is None for pair, pq in zip(params, plans) for p, q in zip(pair, pq)):
        return None
    whole = {}
    for tap, members in batches:
        tensors = fsdp2.gathered([params[i][j] for i, j in members], [plans[i][j] for i, j in members],
                                 getattr(routers[members[0][0]], fsdp2.tap_name(tap)))
        whole.update(zip(members, tensors))
    return [tuple(whole.get((i, j), p) for j, p in enumerate(pair)) for i, pair in enumerate(params)]


#: the routing parameters phase 1 reads from each router of a group
ROUTING_PARAMETERS = ("query", "key_norm_weight")
#: whether phase 1 gathers FSDP2's shards of the routing parameters it reads (session 59);
#: False routes those groups' sites one by one, as before (an A/B switch, read when phase 1
#: runs: compiled, when the graph is made)
GATHER_SHARDS = True


@torch.compiler.assume_constant_result
def _gather_plans(*keys: str) -> tuple:
    """``(plans, batches)`` for a group's routers (by their :func:`fsdp2.register` keys).
    ``plans``: per router, the :class:`fsdp2.GatherPlan` of each of its ROUTING_PARAMETERS
    (None: a plain tensor, or a shard that cannot be gathered). ``batches``: per process
    group of those that can, ``(tap name, ((router, parameter) positions))``, gathered
    together, their tap (:func:`fsdp2.tap_for`) made on the first one's router. Compiled,
    read once as the graph is made: it walks FSDP2's state, which Dynamo must not trace."""
    routers = [fsdp2.module_of(key) for key in keys]
    plans = tuple(fsdp2.gather_plans([getattr(r, name) for name in ROUTING_PARAMETERS], tensor_parallel.reads_shares(r))
                  for r in routers)
    by_key: dict[tuple, list] = {}
    for i, found in enumerate(plans):
        for j, q in enumerate(found):
            if q is not None:
                by_key.setdefault(fsdp2.batch_key(q), []).append((i, j))
    batches = []
    for n, members in enumerate(by_key.values()):
        tap = f"gathered{n}"
        fsdp2.tap_for(routers[members[0][0]], tap, [getattr(routers[i], ROUTING_PARAMETERS[j]) for i, j in members],
                      [plans[i][j] for i, j in members])
        batches.append((tap, tuple(members)))
    return plans, tuple(batches)


def _seen_outside(results: tuple) -> tuple:
    """Phase 1's checkpointed results as the block goes on to use them. Where the block's
    whole call is checkpointed too (``checkpoint(block, x, ...)`` in the model's loop,
    torchtitan's ``checkpoint_wrapper``) and compiled, which Dynamo traces only with
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (the call
    updates the depth runtime), Dynamo (torch 2.13, on the CPU) failed on the inner
    checkpoint's outputs reaching the depth state ("Argument 'child_4' of Node 'output' does
    not belong to this Graph"); a view of each, taken outside the inner checkpoint, traces.
    Only then: every other graph stays as measured."""
    if not (torch.compiler.is_compiling() and torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint):
        return results
    return tuple((tuple(o.view_as(o) for o in outs), tuple(lse.view_as(lse) for lse in lses)) for outs, lses in results)


def _phase_one(queries: torch.Tensor, key_norm_weights: torch.Tensor, *sources: torch.Tensor, layout: tuple,
               heads: int, eps: float) -> tuple:
    """``route_many`` per list of ``layout`` ``(values, keys, query row)`` counts, taking
    consecutive runs of ``sources``: ``((outs, lses), ...)``."""
    results, start = [], 0
    for num_values, num_keys, row in layout:
        values, keys = sources[start:start + num_values], sources[start + num_values:start + num_values + num_keys]
        start += num_values + num_keys
        q, w = (queries, key_norm_weights) if row is None else (queries[:, row], key_norm_weights[:, row])
        outs, lses = route_many(values, keys or None, queries=q, key_norm_weights=w, heads=heads, eps=eps)
        results.append((tuple(outs), tuple(lses)))
    return tuple(results)


def join_plan(router: nn.Module, plan: TwoPhasePlan | None, group: int, position: int | None = None) -> None:
    """Give ``router`` its ``_plan``, ``group`` and ``position`` (None: the next of its
    group) and make it a member of ``plan``'s group. ``_plan`` is a plain attribute: the
    plan holds the other routers, which are not submodules of this one."""
    if position is None and plan is not None:
        position = len(plan.groups.get(group, ()))
    router._plan, router.group, router.position = plan, group, position
    if plan is not None:
        plan.add(router, group, position)
        fsdp2.register(router)  # the key phase 1 asks FSDP2's state about it by


def two_phase_plan(scheme: str, two_phase: object, recompute: object, keep_groups: object,
                   fused_merge: object = None) -> TwoPhasePlan | None:
    """The plan of a block scheme's ``two_phase``, ``recompute``, ``keep_groups`` and
    ``fused_merge`` options (checked), None when two-phase is off."""
    if fused_merge is not None and not isinstance(fused_merge, bool):
        raise ValueError(f"{scheme}: fused_merge must be True, False or None (two_phase.FUSED_MERGE), "
                         f"found {fused_merge!r}")
    if fused_merge and not two_phase:
        raise ValueError(f"{scheme}: fused_merge=True applies only to two-phase or grouped routing (the second "
                         f"phase's merges through route_merge); found no two-phase or grouped routing")
    check_bool(scheme, "two_phase", two_phase)
    check_bool(scheme, "recompute", recompute)
    if isinstance(keep_groups, bool) or not isinstance(keep_groups, int) or keep_groups < 0:
        raise ValueError(f"{scheme}: keep_groups must be an int >= 0, found {keep_groups!r}")
    if keep_groups and not (two_phase and recompute):
        raise ValueError(f"{scheme}: keep_groups={keep_groups} applies only to two-phase or grouped routing with "
                         f"recompute=True (phase 1 kept for some groups instead of recomputed); found "
                         f"{'recompute=False' if two_phase else 'no two-phase or grouped routing'}")
    return TwoPhasePlan(recompute, keep_groups) if two_phase else None


def block_plan(scheme: str, options) -> "TwoPhasePlan | None":
    """:func:`two_phase_plan` of a block scheme's options (``two_phase``, ``recompute``,
    ``keep_groups``, ``fused_merge``)."""
    return two_phase_plan(scheme, options.two_phase, options.recompute, options.keep_groups, options.fused_merge)


def _is_sharded(param: torch.Tensor) -> bool:
    # a DTensor (FSDP2, tensor parallel) outside its module's forward holds only a shard
    return fsdp2.is_sharded(param)
