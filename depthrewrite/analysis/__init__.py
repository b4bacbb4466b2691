"""Analysis: read-only. Finds the residual stream of a captured model and returns it as
plain dataclasses (:class:`ResidualStream`), plus the per-block graphs the rewrite passes
work on (:class:`BlockPlan`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture import Capture, capture, eval_mode
from ..errors import CaptureError, DepthRewriteError, NoResidualStreamError, NotAdditiveStreamError, NotPreNormError
from .diagnose import not_additive_reason
from .probes import leaf_output_patterns, norm_type
from .residual import BlockSiteFinder, SiteGraph
from .trace import CallSpec, TracedBlock, TraceHints, call_spec, forward_param_names, trace_block

log = logging.getLogger(__name__)

__all__ = ["Site", "ResidualStream", "BlockPlan", "analyze", "analyze_block_call"]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Site:
    """One point where a branch reads the residual stream (docs/spec.md section 1)."""

    index: int  # 1-based over the whole model: sources are numbered 0 (embedding) .. L
    block: int  # 0-based index of the block in the stack
    position: int  # 1-based position inside its block
    kind: str  # 'attention' (token-mixing), 'mlp' (per token) or 'parallel'
    norm_type: str  # 'rmsnorm', 'layernorm', or 'identity' (an nn.Identity norm slot at the first site)
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
    #: for a rewritten model (``inspect`` of it): the scheme and every option as used
    rewritten_with: tuple[str, dict] | None = None

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
            f"{_count(len(self.block_paths), 'block')} of '{self.stack_path}' ({self.stream_argument}), "
            f"{_count(self.num_sites, 'site')}, final norm '{self.final_norm_path}' ({self.final_norm_type})"
        )
        if self.rewritten_with is not None:
            scheme, options = self.rewritten_with
            listed = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
            head += f"\nrewritten with {scheme!r}" + (f" ({listed})" if listed else "")
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


#: how many times a block whose residual adds live inside its children is traced again,
#: one level of children deeper each time, before the analysis gives up
MAX_INLINE_ROUNDS = 4


def analyze_block_call(cap: Capture, index: int, block: nn.Module, forward, spec: CallSpec,
                       norm_cache: dict, probe_values: list | None = None,
                       hints: TraceHints | None = None) -> BlockPlan:
    """Trace one call spec of a block and find its sites. With ``probe_values`` (the traced
    inputs of a real call) the token-mixing probe labels each site's kind. ``hints``: what
    the analysis of an earlier call spec of the same block learnt (children to trace
    through...); when None it is learnt here, from the block's own code first."""
    if hints is None:
        traced, finder, sites = _discover_sites(cap, index, block, forward, spec, norm_cache, probe_values,
                                                TraceHints())
    else:
        traced, finder = _trace(cap, index, block, forward, spec, norm_cache, hints)
        sites = finder.find()
    if probe_values is not None:
        sized = _sized_arguments(cap, spec, forward, probe_values)
        try:
            finder.classify_parts(probe_values, sites, sized)
        except DepthRewriteError:
            raise
        except Exception as exc:  # noqa: BLE001 - the graph does not replay the recorded call
            traced, finder, sites = _retrace_with_leaf_outputs(cap, index, block, forward, spec, norm_cache,
                                                               probe_values, traced.hints, sized, exc)
    return BlockPlan(index=index, path=cap.block_paths[index], module=block, traced=traced,
                     stream_placeholder=finder.stream0, sites=sites, forward=forward, finder=finder)


def _trace(cap: Capture, index: int, block: nn.Module, forward, spec: CallSpec, norm_cache: dict,
           hints: TraceHints) -> tuple[TracedBlock, BlockSiteFinder]:
    traced = trace_block(block, forward, spec, hints)
    stream = _stream_placeholder(traced, cap)
    finder = BlockSiteFinder(traced.gm, block, cap.block_paths[index], stream, cap.d_model, norm_cache,
                             identity_norm_ok=index == 0)
    return traced, finder


def _sized_arguments(cap: Capture, spec: CallSpec, forward, values: list) -> tuple[str, ...]:
    """The block's arguments, other than the stream, that may be sized or valued for the
    example's sequence: every other traced input (a tensor, a tuple of them, a mask, a
    cache) and every number baked in as a constant (a length, a position). Without them the
    token-mixing probe may run the block on a longer stream than the example's."""
    params = forward_param_names(forward)
    stream = spec.input_index(cap.stream_arg.position, cap.stream_arg.keyword)
    found = [f"'{name}' ({type(value).__name__})"
             for i, (name, value) in enumerate(zip(spec.input_names(params), values)) if i != stream]
    constants = [(params[i] if i < len(params) else f"argument {i}", value)
                 for i, (mode, value) in enumerate(spec.positional) if mode == "const"]
    constants += [(name, value) for name, (mode, value) in spec.keywords if mode == "const"]
    found += [f"'{name}' ({value!r})" for name, value in constants
              if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return tuple(found)


def _retrace_with_leaf_outputs(cap: Capture, index: int, block: nn.Module, forward, spec: CallSpec,
                               norm_cache: dict, probe_values: list, hints: TraceHints, sized: tuple[str, ...],
                               error: Exception):
    """The traced graph failed on the recorded inputs. A leaf child that returned a tuple
    (read as one tensor by the trace, or with ``None`` entries read as tensors) is the one
    cause fixed here; any other is reported with the recorded inputs that are objects (a
    KV cache the capture run filled makes the recorded call unrepeatable)."""
    try:
        patterns = leaf_output_patterns(block, forward, spec, probe_values)
    except Exception:  # noqa: BLE001 - the block itself does not replay either: report the graph's error
        patterns = ()
    if patterns:
        hints = TraceHints(inline=hints.inline, leaf_outputs=patterns)
        traced, finder = _trace(cap, index, block, forward, spec, norm_cache, hints)
        sites = finder.find()
        try:
            finder.classify_parts(probe_values, sites, sized)
            log.info("block %r: traced again knowing which children return tuples: %s",
                     cap.block_paths[index], [p for p, _ in patterns])
            return traced, finder, sites
        except DepthRewriteError:
            raise
        except Exception as exc:  # noqa: BLE001
            error = exc
    raise CaptureError(_replay_failure(cap.block_paths[index], spec, forward, probe_values, error)) from error


def _replay_failure(path: str, spec: CallSpec, forward, values: list, error: Exception) -> str:
    names = spec.input_names(forward_param_names(forward))
    objects = [f"'{n}' ({type(v).__name__})" for n, v in zip(names, values)
               if not isinstance(v, (torch.Tensor, tuple, list))]
    why = ""
    if objects:
        why = (f"; its argument(s) {', '.join(objects)} are objects that the capture run may have "
               "changed (a KV cache filled during the example call: pass use_cache=False in example_inputs)")
    return (f"block {path!r}: running its traced graph again on the arguments recorded at capture "
            f"failed{why}: {type(error).__name__}: {' '.join(str(error).split())[:300]}")


def _discover_sites(cap: Capture, index: int, block: nn.Module, forward, spec: CallSpec, norm_cache: dict,
                    probe_values: list | None, hints: TraceHints):
    """Sites from the block's own code; where the walk along the stream stops at a child
    module that receives the stream (BLOOM's attention and MLP add the residual
    themselves), trace again with those children traced through, one level at a time."""
    inline = hints.inline
    traced, finder = _trace(cap, index, block, forward, spec, norm_cache, hints)
    try:
        return traced, finder, finder.find()
    except (NoResidualStreamError, NotPreNormError) as exc:
        error = exc
    for _ in range(MAX_INLINE_ROUNDS):
        more = finder.raw_readers(finder.last_stream) - inline if finder.incomplete else frozenset()
        if not more:
            break
        inline = inline | more
        try:
            traced_in, finder_in = _trace(cap, index, block, forward, spec, norm_cache,
                                          TraceHints(inline=inline, leaf_outputs=hints.leaf_outputs))
        except CaptureError as exc:  # the child's code does not trace: say so with the first finding
            error = type(error)(f"{error}; the stream goes into {', '.join(sorted(more))}, whose code could "
                                f"not be traced through to look for the add inside ({exc.__cause__!r:.200})")
            break
        traced, finder = traced_in, finder_in
        try:
            sites = finder.find()
        except (NoResidualStreamError, NotPreNormError) as exc:
            error = exc
            continue
        log.info("block %r: residual adds found inside its children %s (traced through)",
                 cap.block_paths[index], ", ".join(sorted(inline)))
        return traced, finder, sites
    reason = not_additive_reason(finder, probe_values)
    if reason is not None:
        raise NotAdditiveStreamError(
            f"{finder.where()}: {reason}; depthrewrite needs one stream updated by h + u (docs/spec.md section 1)"
        ) from error
    raise error


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
            if sg.identity_norm:
                log.info("site %d (block %r): the norm slot %s is nn.Identity; the branch reads the "
                         "embedding output as the model does", len(sites), plan.path, sites[-1].norm_paths)
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
