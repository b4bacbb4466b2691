"""Analysis: read-only. Finds the residual stream of a captured model and returns it as
plain dataclasses (:class:`ResidualStream`), plus the per-block graphs the rewrite passes
work on (:class:`BlockPlan`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from ..capture import Capture, capture, eval_mode
from ..errors import NotPreNormError
from .probes import norm_type
from .residual import BlockSiteFinder, SiteGraph
from .trace import CallSpec, TracedBlock, call_spec, trace_block

log = logging.getLogger(__name__)

__all__ = ["Site", "ResidualStream", "BlockPlan", "analyze", "analyze_block_call"]


@dataclass(frozen=True)
class Site:
    """One point where a branch reads the residual stream (SPEC section 1)."""

    index: int  # 1-based over the whole model: sources are numbered 0 (embedding) .. L
    block: int  # 0-based index of the block in the stack
    position: int  # 1-based position inside its block
    kind: str  # 'attention' (token-mixing), 'mlp' (per token) or 'parallel'
    norm_type: str  # 'rmsnorm' or 'layernorm'
    norm_eps: float | None
    norm_paths: tuple[str, ...]
    branch_paths: tuple[str, ...]  # modules on the branch between the norm and the add
    parts: tuple[str, ...] = ()  # kinds of the parts of a parallel site, when exposed


@dataclass(frozen=True)
class ResidualStream:
    """What :func:`depthrewrite.inspect` returns. ``print()`` it for a table."""

    model: str
    stack_path: str
    block_paths: tuple[str, ...]
    stream_argument: str
    sites: tuple[Site, ...]
    final_norm_path: str
    final_norm_type: str
    d_model: int

    @property
    def num_sites(self) -> int:
        return len(self.sites)

    def sites_per_block(self) -> list[int]:
        counts = [0] * len(self.block_paths)
        for s in self.sites:
            counts[s.block] += 1
        return counts

    def __str__(self) -> str:
        head = (
            f"{self.model}: residual stream of width {self.d_model} through "
            f"{len(self.block_paths)} blocks of '{self.stack_path}' ({self.stream_argument}), "
            f"{self.num_sites} sites, final norm '{self.final_norm_path}' ({self.final_norm_type})"
        )
        rows = [("site", "block", "pos", "kind", "norm", "norm module(s)", "branch modules")]
        for s in self.sites:
            kind = s.kind + (f" ({'+'.join(s.parts)})" if s.parts else "")
            rows.append((str(s.index), self.block_paths[s.block], str(s.position), kind, s.norm_type,
                         ", ".join(s.norm_paths), ", ".join(s.branch_paths)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(2, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


@dataclass
class BlockPlan:
    """A block's traced graph and its sites (nodes of that graph); internal to the passes."""

    index: int
    path: str
    module: nn.Module
    traced: TracedBlock
    stream_placeholder: fx.Node
    sites: list[SiteGraph]
    forward: Any  # the block's original (unbound) forward
    finder: BlockSiteFinder  # the graph queries the sites were found with


@dataclass
class Analysis:
    stream: ResidualStream
    capture: Capture
    blocks: list[BlockPlan] = field(default_factory=list)


def _stream_placeholder(traced: TracedBlock, capture_: Capture) -> fx.Node:
    arg = capture_.stream_arg
    try:
        index = traced.spec.input_index(arg.position, arg.keyword)
    except ValueError:
        raise NotPreNormError(f"the stream argument ({arg.describe()}) is not a traced tensor input") from None
    return [n for n in traced.graph.nodes if n.op == "placeholder"][index]


def analyze_block_call(cap: Capture, index: int, block: nn.Module, forward, spec: CallSpec,
                       norm_cache: dict, probe_values: list | None = None) -> BlockPlan:
    """Trace one call spec of a block and find its sites. With ``probe_values`` (the traced
    inputs of a real call) the token-mixing probe labels each site's kind."""
    path = cap.block_paths[index]
    traced = trace_block(block, forward, spec)
    stream = _stream_placeholder(traced, cap)
    finder = BlockSiteFinder(traced.gm, block, path, stream, cap.d_model, norm_cache)
    sites = finder.find()
    if probe_values is not None:
        finder.classify_parts(probe_values, sites)
    return BlockPlan(index=index, path=path, module=block, traced=traced, stream_placeholder=stream,
                     sites=sites, forward=forward, finder=finder)


def analyze(model: nn.Module, example_inputs: Any = None) -> Analysis:
    """Capture the model and analyse every block of its stack (in eval mode: the probes run
    the model and must be deterministic; each module's mode is restored afterwards)."""
    with eval_mode(model):
        return _analyze(model, example_inputs)


def _analyze(model: nn.Module, example_inputs: Any) -> Analysis:
    cap = capture(model, example_inputs)
    norm_cache: dict = {}
    plans, sites = [], []
    for i, (block, call) in enumerate(zip(cap.blocks, cap.block_calls)):
        spec = call_spec(call.args, call.kwargs, training=False)
        plan = analyze_block_call(cap, i, block, type(block).forward, spec, norm_cache,
                                  probe_values=spec.input_values(call.args, call.kwargs))
        plans.append(plan)
        for pos, sg in enumerate(plan.sites, start=1):
            sites.append(_public_site(plan, sg, len(sites) + 1, pos))
    final_type = norm_type(cap.final_norm, cap.d_model)
    if final_type is None:
        raise NotPreNormError(
            f"the module that reads the last block's output, '{cap.final_norm_path}' "
            f"({type(cap.final_norm).__name__}), is not a normalisation (it is not invariant to "
            "scaling its input); depthrewrite expects a final norm before the head"
        )
    stream = ResidualStream(
        model=type(model).__name__,
        stack_path=cap.stack_path,
        block_paths=tuple(cap.block_paths),
        stream_argument=cap.stream_arg.describe(),
        sites=tuple(sites),
        final_norm_path=cap.final_norm_path,
        final_norm_type=final_type,
        d_model=cap.d_model,
    )
    log.info("analysed %s: %d blocks, %d sites", stream.model, len(plans), stream.num_sites)
    return Analysis(stream=stream, capture=cap, blocks=plans)


def _public_site(plan: BlockPlan, sg: SiteGraph, index: int, position: int) -> Site:
    ntype, eps = plan.finder.norm_info(sg)
    parts = tuple("attention" if m else "mlp" for m in sg.part_mixes) if sg.kind == "parallel" and len(sg.parts) > 1 else ()
    return Site(
        index=index,
        block=plan.index,
        position=position,
        kind=sg.kind,
        norm_type=ntype,
        norm_eps=eps,
        norm_paths=tuple(f"{plan.path}.{n.target}" for n in sg.norms),
        branch_paths=tuple(f"{plan.path}.{t}" for t in plan.finder.branch_modules(sg)),
        parts=parts,
    )
