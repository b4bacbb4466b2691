"""The ``depthrewrite`` torch.compile backend.

    model = torch.compile(model, backend="depthrewrite")      # after pip install

The backend counts the routing ops (``torch.ops.depthrewrite.route*``) in the graph that
Dynamo hands it, records which implementation each will run ('triton': the fused kernels
of :mod:`depthrewrite.kernels`, registered as the ops' CUDA kernels; 'reference': the
pure-PyTorch implementation, on CPU or for float64), and hands the graph to Inductor.
Inductor calls the custom ops through the dispatcher, so on CUDA the compiled graph runs
the fused kernels for the routing and Inductor's own kernels for everything else.

Options (``torch.compile(..., options={...})``), each measured on one H200 at 350M where a
figure is given (docs/benchmarks.md has the runs):

- ``inner``: the compiler behind the backend, ``"inductor"`` (default) or ``"aot_eager"``
  (AOTAutograd with no code generation: the same graphs, no C++/Triton build; the CPU tests
  use it to stay fast).
- ``max_sum_terms`` (default 4; None turns it off): how many terms of a long gradient sum
  Inductor may fuse into one kernel (:mod:`depthrewrite.sum_fences`). Without it, the sum
  of the gradients a source gets from every later routing call is one kernel at the end of
  the backward, which holds every term in memory until then.
- ``accumulate_grads`` (default True; :mod:`depthrewrite.grad_accumulation`): each
  ``route_backward`` (and ``route_many_backward`` of one head, no keys and at most
  ``grad_accumulation.ROUTE_MANY_MAX_QUERIES`` queries) adds its source gradients into
  running sums instead of leaving a term to sum. DAR block and WAV steps 14 % shorter than
  with the fences alone, full AttnRes 3 %, each with less memory; full AttnRes's grouped
  calls 0.8 % more (session 36).
- ``accumulate_max_heads`` (default None: no limit): only calls with at most that many
  heads get running sums (an A/B knob; 16-head MHAR is faster with them).
- ``accumulate_in_place`` (default True): each call writes its new running sums into the
  old ones (``depthrewrite::route_backward_into_`` and, since session 48,
  ``depthrewrite::route_many_backward_into_``, :mod:`depthrewrite.ops.route_into`) where no
  later reader can see the overwrite, so that old and new do not exist side by side while
  it runs. Peak 1.185x -> 1.158x the plain model's for WAV, 1.259x -> 1.189x for full
  MHAR, step time level (session 14); ``False`` keeps new tensors.
- ``recompute_partial_sums`` (default True; :mod:`depthrewrite.recompute`): the partial
  sums that WAV and DAR make at every site are recomputed in the backward from the branch
  outputs instead of saved for it. Peak 1.27x -> 1.19x for WAV, 1.29x -> 1.24x for DAR
  block, step time level to 2 % longer (session 13).
- ``recompute_branch_outputs`` (default False; needs ``recompute_partial_sums``): the
  branch outputs those sums are rebuilt from are not saved either; their linear layers'
  matmuls run again in the backward (one activation a site less for one matmul a site
  more). Peak 1.158x -> 1.091x for WAV, 1.175x -> 1.107x for DAR block, each step about
  3 % longer (sessions 14-15). ``"narrow"``: only the outputs of linear layers no wider at
  their input than at their output (attention's output projection, not the MLP's down
  projection), the cheapest matmuls per activation (:mod:`depthrewrite.recompute`): peak
  1.158x -> 1.118x for WAV, 1.148x -> 1.107x for DAR block, about 1.1 ms of kernels a
  step; with DAR's ``fused_merge=True`` 1.089x (session 44), and recorded as CUDA graphs
  (``"triton.cudagraphs": True`` in ``options``) 1.093x of the reserved memory, steps
  0.8-0.9 % longer than the defaults' so recorded (session 45).
- ``fuse_output_norms`` (default True; :mod:`depthrewrite.norm_fusion`): where the second
  phase runs through ``route_merge`` (the scheme option ``fused_merge=True``, or
  ``two_phase.FUSED_MERGE``), the branch's RMSNorm that alone reads a merge's result is
  fused into it, which then never writes the result.
- Every other key is an Inductor config patch, applied to this compilation only
  (``config_patches``, never a global assignment). A key that is neither is refused
  before Inductor runs, naming the nearest option (``max_sum_term``: ``max_sum_terms``).
  Inductor's ``cpp_wrapper`` (here or set globally) works: the routing calls whose
  results hold lists, which its C++ wrapper cannot call, get flat companions
  (:mod:`depthrewrite.cpp_wrapper`; ``LoweringReport.flattened`` counts them).
- Where a scheme's graph calls for Inductor settings of its own (:mod:`depthrewrite.graph_hints`:
  DAR's gets ``max_fusion_size=16``, 1.4-1.9 % shorter steps at 350M), the backend adds
  them unless the caller set them; ``last_report().config_patches`` shows what applied.

``mode=`` takes Inductor's modes ("max-autotune", ...); ``mode="reduce-overhead"`` records
the compiled graphs as CUDA graphs with the fused routing kernels inside
(:mod:`depthrewrite.kernels.pointer_tables`), which removes the host's per-call time.

``last_report()`` returns the :class:`LoweringReport` of the most recent compilation;
``lowered_ops()`` sums the routing calls per implementation over every graph.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import logging
import operator
import types
import typing
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from .cpp_wrapper import check_cpp_wrapper_supported, cpp_wrapper_on, define_flat_companions
from .grad_accumulation import MAX_HEADS
from .graph_hints import inductor_defaults
from .kernels import implementation_for
from .inductor_pass import backend_pass, rewrite_gradient_sums
from .norm_fusion import fuse_output_norms
from .recompute import mark_recomputable
from .sum_fences import DEFAULT_MAX_TERMS, check_max_terms
from .tensor_parallel import check_graph_inputs

__all__ = ["depthrewrite_backend", "LoweringReport", "last_report", "reports", "clear_reports", "lowered_ops",
           "saved_for_backward"]

log = logging.getLogger(__name__)

_INNER = ("inductor", "aot_eager")


@dataclasses.dataclass
class LoweringReport:
    """What the backend saw and chose for one compiled graph.

    ``ops``: routing op name (``"depthrewrite::route"``) -> number of calls in the graph
    Dynamo handed over. ``implementation``: op name -> ``'triton'`` or ``'reference'``
    (``'triton+reference'`` if calls differ). ``aot_graphs``: the same counts per graph
    after AOTAutograd split forward and backward ('forward', 'backward', 'inference'),
    filled in as each is compiled (the backward at the first backward call); a graph
    served from Inductor's caches without recompiling does not appear here.
    ``fences``: fences the long-sum pass put in each graph compiled here, ``accumulated``:
    source gradients moved into ``route_backward`` and ``route_many_backward`` calls (same
    caveat).
    ``recomputed``: the names of the operations marked for recomputation in the backward
    (``recompute_partial_sums``; None with the option off, empty where nothing was tagged;
    they also key the backend pass's caches), ``recompute_marked`` how many.
    ``saved_for_backward``: the tensors the backward graph takes besides the output
    gradients (what the forward keeps for it, the parameters it reads included),
    ``{"tensors": n, "bytes": b}``, filled in when the backward graph is compiled (with
    ``"bytes_formula"`` where sizes are symbolic: :func:`saved_for_backward`).
    ``dynamic``: whether the graph's sizes are symbolic, so that one compilation serves
    every batch size and sequence length (Dynamo makes a graph dynamic when a call brings
    new sizes, or from the start with ``torch.compile(..., dynamic=True)``).
    """

    device: str
    inner: str
    ops: dict[str, int]
    implementation: dict[str, str]
    aot_graphs: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    config_patches: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the ``max_sum_terms`` option; ``fences``: graph kind -> fences inserted
    max_sum_terms: int | None = DEFAULT_MAX_TERMS
    fences: dict[str, int] = dataclasses.field(default_factory=dict)
    accumulate_grads: bool = True
    accumulate_max_heads: int | None = MAX_HEADS
    accumulated: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the ``accumulate_in_place`` option; ``in_place``: graph kind -> route_backward and
    #: route_many_backward calls that write their running sums in place
    accumulate_in_place: bool = True
    in_place: dict[str, int] = dataclasses.field(default_factory=dict)
    recomputed: tuple[str, ...] | None = dataclasses.field(default=None, repr=False)
    #: graph kind -> routing calls given flat results for Inductor's C++ wrapper (where
    #: ``cpp_wrapper`` is on: :mod:`depthrewrite.cpp_wrapper`)
    flattened: dict[str, int] = dataclasses.field(default_factory=dict)
    #: branch norms fused into route_merge calls (``fuse_output_norms``; None with it off)
    fused_norms: int | None = None
    saved_for_backward: dict[str, int | str | None] = dataclasses.field(default_factory=dict)
    dynamic: bool = False
    compiling: str = ""  # the AOT graph being compiled now ('forward', 'backward', 'inference')

    @property
    def recompute_marked(self) -> int | None:
        return None if self.recomputed is None else len(self.recomputed)

    def record_graph(self, kind: str, graph: fx.Graph) -> None:
        """What an AOT graph about to be compiled holds: its routing calls, and for the
        backward what it takes from the forward."""
        self.aot_graphs[kind] = count_routing_ops(graph)[0]
        if kind == "backward":
            self.saved_for_backward = saved_for_backward(graph)

    @property
    def rewrites(self) -> bool:
        """Whether the backend rewrites the graphs it compiles (long sums, accumulation)."""
        return self.max_sum_terms is not None or self.accumulate_grads

    def record_rewrites(self, accumulated: int, fences: int, in_place: int = 0, flattened: int = 0) -> None:
        """What the backend's rewrites that are on did to the graph being compiled (``compiling``)."""
        if flattened:
            self.flattened[self.compiling] = flattened
        if self.accumulate_grads:
            self.accumulated[self.compiling] = accumulated
        if self.accumulate_grads and self.accumulate_in_place:
            self.in_place[self.compiling] = in_place
        if self.max_sum_terms is not None:
            self.fences[self.compiling] = fences

    @property
    def num_routing_ops(self) -> int:
        return sum(self.ops.values())


_REPORTS: list[LoweringReport] = []


def last_report() -> LoweringReport | None:
    """The report of the most recent graph compiled by the backend (None before any)."""
    return _REPORTS[-1] if _REPORTS else None


def reports() -> list[LoweringReport]:
    """Reports of every graph compiled since the last :func:`clear_reports`, oldest first."""
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()


def lowered_ops() -> dict[str, int]:
    """Routing calls summed over every graph since :func:`clear_reports`, keyed
    ``"<op> (<implementation>)"``, e.g. ``{"depthrewrite::route (triton)": 49}``."""
    counts: dict[str, int] = {}
    for rep in _REPORTS:
        for op, n in rep.ops.items():
            key = f"{op} ({rep.implementation.get(op, '?')})"
            counts[key] = counts.get(key, 0) + n
    return counts


# ------------------------------------------------------------------ graph reading


def _routing_op_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = node.target
    schema = getattr(target, "_schema", None)
    name = schema.name if schema is not None else getattr(target, "_qualified_op_name", None)
    if isinstance(name, str) and name.startswith("depthrewrite::route"):
        return name
    return None


def _meta_value(arg: Any):
    if isinstance(arg, fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    return arg


def _node_implementation(node: fx.Node) -> str:
    """Device and dtypes of a routing call, read from the fake values Dynamo/AOT recorded."""
    tensors = []
    for arg in node.args:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        tensors += [v for v in map(_meta_value, items) if isinstance(v, torch.Tensor)]
    if not tensors:
        return "reference"
    # source_scale is cast to fp32 by the kernel, so every tensor's dtype matters alike
    return implementation_for(tensors[0].device, *(t.dtype for t in tensors))


def count_routing_ops(graph: fx.Graph) -> tuple[dict[str, int], dict[str, str]]:
    """Routing op name -> count and -> implementation, for one graph, counting the calls
    inside the subgraphs it calls (:func:`_graph_nodes`) once per call."""
    counts: dict[str, int] = collections.Counter()
    impls: dict[str, set[str]] = collections.defaultdict(set)
    for node in _graph_nodes(graph):
        name = _routing_op_name(node)
        if name is not None:
            counts[name] += 1
            impls[name].add(_node_implementation(node))
    return dict(counts), {k: "+".join(sorted(v, reverse=True)) for k, v in impls.items()}


def _graph_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    """The graph's nodes, each followed by the nodes of the subgraphs it calls (the bodies
    of higher-order ops such as activation checkpointing), once per call."""
    owner = graph.owning_module
    for node in graph.nodes:
        yield node
        if node.op == "call_function" and owner is not None:
            for arg in node.args:
                if isinstance(arg, fx.Node) and arg.op == "get_attr":
                    body = operator.attrgetter(arg.target)(owner)
                    if isinstance(body, fx.GraphModule):
                        yield from _graph_nodes(body.graph)


def saved_for_backward(graph: fx.Graph) -> dict[str, int | str | None]:
    """Count and bytes of a backward graph's tensor inputs other than the output gradients.

    ``bytes`` is an int at the sizes the graph was compiled for. Where sizes are symbolic
    (Dynamo makes a graph dynamic when a call brings new sizes), ``bytes_formula`` gives
    the same bytes in the graph's size symbols (``s70``, ...) as text."""
    tensors = [node.meta.get("val") for node in graph.nodes
               if node.op == "placeholder" and not node.name.startswith("tangents")]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    if isinstance(total, torch.SymInt):
        # the hint: the value at the example inputs this graph was traced with (None only
        # for sizes that depend on data, which the routed models do not make)
        hint = total.node.hint
        return {"tensors": len(tensors), "bytes": None if hint is None else int(hint),
                "bytes_formula": str(total.node.expr)}
    return {"tensors": len(tensors), "bytes": total}


def _has_symbolic_sizes(example_inputs) -> bool:
    """Dynamo hands a dynamic graph its size symbols as inputs of their own (SymInts)."""
    return any(isinstance(x, torch.SymInt) for x in example_inputs)


def _graph_device(example_inputs) -> str:
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return "cuda" if "cuda" in devices else (devices.pop() if len(devices) == 1 else "cpu")


# ------------------------------------------------------------------ the backend


def _counting(compile_fn, report: LoweringReport):
    """Wrap an inner compiler so that each AOT graph's routing ops land in ``report``
    (and, through ``report.compiling``, what the backend pass did: :func:`_pass_patch`)."""

    def inner(gm: fx.GraphModule, example_inputs, *args, **kwargs):
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        report.record_graph(kind, gm.graph)
        report.compiling = kind
        if cpp_wrapper_on():
            define_flat_companions(gm.graph)
        return compile_fn(gm, example_inputs, *args, **kwargs)

    return inner


def _pass_patch(patches: dict[str, Any], report: LoweringReport) -> dict[str, Any]:
    """Inductor config patches with the backend's post-grad pass (the user's own, if any,
    runs after it): a pass Inductor runs, so that its settings are in the cache keys (the
    recomputation marks included: node metadata is not). Installed whatever the options:
    where Inductor's wrapper is C++ (``cpp_wrapper``, an Inductor setting the user may make
    globally) the pass makes the routing calls callable from it."""
    the_pass = backend_pass(report.max_sum_terms, report.accumulate_grads,
                            then=patches.get("post_grad_custom_post_pass"), on_done=report.record_rewrites,
                            accumulate_max_heads=report.accumulate_max_heads, recomputed=report.recomputed,
                            accumulate_in_place=report.accumulate_in_place)
    return {**patches, "post_grad_custom_post_pass": the_pass}


def _aot_eager(gm, example_inputs, report: LoweringReport):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def prepare(g, kind):
        report.record_graph(kind, g.graph)
        if not report.rewrites:
            return
        # the graph runs as it is: no Inductor pass, the same rewrites here
        report.compiling = kind
        done = rewrite_gradient_sums(g.graph, report.max_sum_terms, report.accumulate_grads,
                                     report.accumulate_max_heads, report.accumulate_in_place)
        report.record_rewrites(*done)
        if any(done):
            g.recompile()

    def fw(g, _inputs):
        prepare(g, "forward")
        return make_boxed_func(g.forward)

    def bw(g, _inputs):
        prepare(g, "backward")
        return make_boxed_func(g.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)


#: the backend's own option keys (module docstring); every other key is an Inductor setting
BACKEND_OPTIONS = ("inner", "max_sum_terms", "accumulate_grads", "accumulate_max_heads", "accumulate_in_place",
                   "recompute_partial_sums", "recompute_branch_outputs", "fuse_output_norms")


def check_inductor_settings(options: dict[str, Any], owner: str = "depthrewrite_backend: options") -> None:
    """Refuse keys that are neither the backend's options nor Inductor settings, and values
    of the wrong type. Inductor would fail on them deep inside the compilation, naming only
    its own config; a typo of one of ours (``max_sum_term``) deserves a pointer to the
    option meant. ``owner`` names the caller's argument in the message."""
    from torch._inductor import config as inductor_config

    # hasattr: the config module answers dotted names ('triton.cudagraphs') and settings that
    # its copy leaves out ('force_disable_caches')
    unknown = sorted(key for key in options if not hasattr(inductor_config, key))
    if unknown:
        known = [*BACKEND_OPTIONS, *inductor_config.get_config_copy()]
        hints = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
        found = ", ".join(f"{key!r}" + (f" (did you mean {hints[key][0]!r}?)" if hints[key] else "")
                          for key in unknown)
        raise ValueError(f"{owner} must be the backend's own {BACKEND_OPTIONS} or Inductor settings "
                         f"(torch._inductor.config, e.g. 'triton.cudagraphs'); found {found}")
    for key, value in options.items():
        allowed = _setting_types(inductor_config, key)
        if allowed and not _is_instance(value, allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{owner}[{key!r}] must be {names} (torch._inductor.config.{key}); found {value!r}")


def _setting_types(inductor_config, key: str) -> tuple[type, ...]:
    """The types an Inductor setting declares, where they are plain (bool, int, float, str,
    optionally None); () where they are not, or where this torch does not say (the
    declared types are in the config module's private table)."""
    entry = getattr(inductor_config, "_config", {}).get(key)
    declared = getattr(entry, "value_type", None)
    members = typing.get_args(declared) if isinstance(declared, types.UnionType) else (declared,)
    plain = (bool, int, float, str, type(None))
    # a setting declared only as None (a hook left unset, its type not annotated) takes anything
    known = all(t in plain for t in members) and any(t is not type(None) for t in members)
    return tuple(members) if known else ()


def _is_instance(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, not to a setting
        return bool in allowed
    return isinstance(value, allowed) or (float in allowed and isinstance(value, int))


def _config_patches(mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    patches.update(options)
    return patches


def _pop_flag(options: dict[str, Any], key: str, default: bool) -> bool:
    """``options[key]`` (removed from ``options``), checked to be a bool."""
    value = options.pop(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"depthrewrite_backend: options['{key}'] must be True or False; found {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """The backend's options as checked by :func:`check_options`; ``inductor``: the other
    keys, Inductor settings."""

    inner: str
    max_sum_terms: int | None
    accumulate_grads: bool
    accumulate_max_heads: int | None
    accumulate_in_place: bool
    recompute_partial_sums: bool
    asked_to_recompute: bool  # recompute_partial_sums given (it is on by default)
    recompute_branch_outputs: bool | str
    fuse_output_norms: bool
    inductor: dict[str, Any]


def check_options(options: dict[str, Any] | None) -> BackendSettings:
    """``torch.compile(..., backend="depthrewrite", options=...)``'s options, checked as the
    backend checks them on its first call (a ``ValueError`` naming the option), so that a
    caller such as ``depthrewrite train`` can refuse a typo before it trains."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"depthrewrite_backend: options must be a dict such as {{'inner': 'aot_eager'}}; "
                         f"found {type(options).__name__} {options!r}")
    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    if inner not in _INNER:
        raise ValueError(f"depthrewrite_backend: options['inner'] must be one of {_INNER}; found {inner!r}")
    max_sum_terms = options.pop("max_sum_terms", DEFAULT_MAX_TERMS)
    if max_sum_terms is not None:
        check_max_terms(max_sum_terms, "depthrewrite_backend: options['max_sum_terms'] (None turns it off)")
    accumulate_grads = _pop_flag(options, "accumulate_grads", True)
    max_heads = options.pop("accumulate_max_heads", MAX_HEADS)
    if max_heads is not None and (isinstance(max_heads, bool) or not isinstance(max_heads, int) or max_heads < 1):
        raise ValueError(f"depthrewrite_backend: options['accumulate_max_heads'] must be a positive int "
                         f"or None (no limit); found {max_heads!r}")
    in_place = _pop_flag(options, "accumulate_in_place", True)
    asked_to_recompute = "recompute_partial_sums" in options
    recompute = _pop_flag(options, "recompute_partial_sums", True)
    branch_outputs = options.pop("recompute_branch_outputs", False)
    if not (isinstance(branch_outputs, bool) or branch_outputs == "narrow"):
        raise ValueError(f"depthrewrite_backend: options['recompute_branch_outputs'] must be True, False or "
                         f"'narrow'; found {branch_outputs!r}")
    if branch_outputs and not recompute:
        raise ValueError("depthrewrite_backend: options['recompute_branch_outputs'] needs recompute_partial_sums "
                         "(the branch outputs are saved for the partial sums' recomputation); found "
                         "recompute_partial_sums=False")
    fuse_norms = _pop_flag(options, "fuse_output_norms", True)
    check_inductor_settings(options)
    if options and inner != "inductor":  # kept, not refused: switching inner alone is how one bisects a bug
        log.warning("depthrewrite_backend: options %s are Inductor settings, which inner=%r does not use",
                    sorted(options), inner)
    return BackendSettings(inner, max_sum_terms, accumulate_grads, max_heads, in_place, recompute,
                           asked_to_recompute, branch_outputs, fuse_norms, options)


def depthrewrite_backend(gm: fx.GraphModule, example_inputs, *, mode: str | None = None,
                         options: dict[str, Any] | None = None, **kwargs):
    """torch.compile backend: report the routing ops, then compile with Inductor."""
    if kwargs:
        raise ValueError(f"depthrewrite_backend: unexpected arguments {sorted(kwargs)}; "
                         "pass settings as torch.compile(..., options={...})")
    settings = check_options(options)
    fused_norms = fuse_output_norms(gm.graph) if settings.fuse_output_norms else None
    if fused_norms:
        gm.recompile()
    ops, impls = count_routing_ops(gm.graph)
    check_graph_inputs(gm, example_inputs, sum(ops.values()))
    patches = _config_patches(mode, settings.inductor)
    patches.update(inductor_defaults(_graph_nodes(gm.graph), patches))
    recomputed = (mark_recomputable(gm.graph, settings.recompute_branch_outputs)
                  if settings.recompute_partial_sums else None)
    report = LoweringReport(_graph_device(example_inputs), settings.inner, ops, impls, config_patches=patches,
                            max_sum_terms=settings.max_sum_terms, accumulate_grads=settings.accumulate_grads,
                            accumulate_max_heads=settings.accumulate_max_heads, recomputed=recomputed,
                            accumulate_in_place=settings.accumulate_in_place, fused_norms=fused_norms,
                            dynamic=_has_symbolic_sizes(example_inputs))
    _REPORTS.append(report)
    log.info("depthrewrite backend: %s routing ops %s, implementations %s, inner compiler %s%s",
             report.num_routing_ops, ops, impls, settings.inner, ", symbolic sizes" if report.dynamic else "")
    if settings.asked_to_recompute and report.recompute_marked == 0:
        # on by default: only a caller who asked for it is told that nothing was tagged
        log.warning("depthrewrite backend: recompute_partial_sums is on but no partial sums were tagged in this "
                    "graph (WAV and DAR tag theirs, inside blocks: WAV's blocks of 2 sites have none; the tags "
                    "need torch.fx.traceback.annotate)")
    try:
        if report.inner == "inductor" and report.num_routing_ops and cpp_wrapper_on(patches):
            check_cpp_wrapper_supported()
        return _compile(gm, example_inputs, report, patches)
    except BaseException:
        # a compilation that does not finish lowers nothing, so its report goes: either the
        # error reaches the caller, or Dynamo traces the frame again and calls the backend
        # anew (RestartAnalysis: under dynamic=True, AOTAutograd specializes a float such as
        # WAV's rho and asks for a restart; lowered_ops() counted such graphs twice)
        _REPORTS.remove(report)
        raise


def _compile(gm: fx.GraphModule, example_inputs, report: LoweringReport, patches: dict[str, Any]):
    if report.inner == "aot_eager":
        return _aot_eager(gm, example_inputs, report)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    # config_patches: Inductor applies them for this compilation only
    with _companions_defined_on_cache_hits(patches):
        return compile_fx(gm, example_inputs, inner_compile=_counting(compile_fx_inner, report),
                          config_patches=_pass_patch(patches, report))


def _companions_defined_on_cache_hits(patches: dict[str, Any]):
    """With Inductor's C++ wrapper, AOTAutograd's own cache off for this compilation: a hit
    there skips the inner compiler, where the flat companions that the cached graphs call
    are defined (:func:`depthrewrite.cpp_wrapper.define_flat_companions`); in a new process
    nothing else would define them. Inductor's per-graph cache, behind the inner compiler,
    still serves the compiled graphs."""
    from torch._functorch import config as functorch_config

    if not cpp_wrapper_on(patches):
        return contextlib.nullcontext()
    return functorch_config.patch(enable_autograd_cache=False)
