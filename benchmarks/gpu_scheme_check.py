"""Every scheme, compiled with the ``depthrewrite`` backend on the GPU, against eager.

    python3 benchmarks/gpu_scheme_check.py [--device cuda] [--schemes ...] [--inner aot_eager|inductor]
        [--preset tiny --layers 2 --batch 4 64]   (--layers 0: the preset's own)
        [--query-std 0.5] [--precisions fp32 bf16] [--detail K]   (K: each row's K gradients nearest their allowance)
        [--exact-softmax-grad]   (the kernels' backward without the <out, g> shortcut)

For each entry of ``CONFIGS`` (every scheme of ``depthrewrite.SCHEMES``, and option sets
with code paths of their own): the bundled tiny GPT (2 layers) is rewritten, its routing
queries moved off zero (zero queries give uniform weights and symmetric gradients), then

- the reference: eager, with the fused kernels switched off (``set_fused_enabled(False)``:
  the pure-PyTorch routing runs on the GPU too);
- the candidate: ``torch.compile(model, backend=depthrewrite_backend, fullgraph=True,
  options={"inner": "aot_eager"})``: one graph, AOTAutograd's forward and backward, the
  routing ops dispatched to the registered CUDA kernels (the Triton ones). Inductor's
  code generation is left out here to keep 10 schemes x 2 precisions inside a minute; the
  end-to-end benchmark (benchmarks/e2e_throughput.py) compiles with Inductor, and
  ``--inner inductor`` checks the path training takes (Inductor around the kernels, the
  backend's graph passes included), against the model compiled by Inductor alone (the
  routing ops on the reference) and eager, the allowance from the farther of the two:
  Inductor rounds bf16 on a path of its own, and on DAR's cancellation-bound ``mix``
  gradients that alone moves the error against float64 both ways (on the CPU, session 22:
  6.9e-3 eager against 4.3e-2 for Inductor alone and for the backend, identical; 0.31
  against 0.19 on another site; session 24: Inductor alone 49x nearer float64 than eager
  on one), past the rule below measured against either one alone. Up to a minute of
  compilation a row on the CPU.

Compared: the loss and every parameter gradient, as relative L2 errors (a gradient that is
exactly zero in the reference, by a symmetry, relative to its kind's: ``_scales``).

- fp32: both against the float64 truth, as bf16 below: the candidate's error at most 1e-4
  (the kernels sum in a different order than the reference), or 4x the reference's own
  where that is larger. Until session 22 the candidate was measured against the fp32
  reference with 1e-4; at the CPU's ``small`` preset (8 layers) DAR's cancellation-bound
  ``mix`` gradients put the fp32 references themselves up to 1.7e-4 (eager) and 1.0e-4
  (Inductor alone) from float64, where the backend's was 9.3e-6: against its reference
  the more accurate candidate read 9.4e-5, at the limit (docs/benchmarks.md, session 22).
  With ``--inner inductor`` the fp32 references are two, Inductor alone and eager, and the
  allowance is 4x the farther one's error (session 23): at the 350M model (1 x 1024
  tokens, CPU, queries at std 0.0625) Inductor alone, a correct implementation, failed the
  rule against eager on 3 of 390 gradients (DAR's ``transport`` and ``mix`` scalars, up to
  2.0x the allowance): which of two correct roundings lands nearer the truth on one
  cancellation-bound scalar is chance, and one draw as the yardstick fails correct code.
- bf16 autocast: both against the float64 truth (the same model in float64, reference
  routing). Comparing two bf16 runs with each other is not a test: some gradients are
  small sums with heavy cancellation (DAR's scalar ``mix`` gate: the difference of two
  nearly equal routed streams), on which bf16 rounding alone moves the REFERENCE by 5-17 %
  from the truth (measured on the CPU, docs/benchmarks.md). Criterion per gradient: the
  candidate's error is at most 4x the reference's own bf16 error, or at most 3e-2. With
  ``--inner inductor`` the bf16 references are two as well, Inductor alone and eager
  (session 24): Inductor skips the bf16 round trips between the ops it fuses (its
  ``emulate_precision_casts`` is off), which on DAR's ``mix`` and ``beta`` scalars put it
  up to 49x nearer float64 than eager (CPU, ``small`` preset; Inductor with eager's round
  trips 41x, near eager's errors), and the kernels, like eager, store their results in bf16.
  Against Inductor alone only, the backend failed at the 350M model on the GPU (those
  scalars 10-80x Inductor alone's error, session 24's run 3). Per gradient, the rule can
  still fail correct code on such a scalar: on the CPU three correct implementations
  spread 6x on one ``mix`` gradient, and Inductor with eager's round trips was over by
  1.06x with both references (docs/benchmarks.md session 24). The fused backward also
  reads the saved bf16 output for its softmax sum, as flash-attention does: on the routing
  parameters that adds errors of 2e-3 to 1e-2, below the ~2e-2 every bf16 gradient
  carries, and up to 4.5x on DAR's scalars (emulated on the CPU at 350M);
  ``--exact-softmax-grad`` runs the kernels without it (docs/design.md "The softmax
  backward's shortcut").
- Pooled by kind (session 25, both precisions): a gradient's allowance is also at least
  ``KIND_CEILING`` (2) times the largest error the references make on any gradient of its
  kind (its last name: every ``mix``), and per kind the candidate's median error must be at
  most ``MEDIAN_FACTOR`` (2) times the references' median (or ``TOLERANCE``). On DAR's
  cancellation-bound scalars which correct rounding lands nearest the truth on one gradient
  is chance: at the 350M model in bf16 on the H200, with both references, the per-gradient
  rule of session 24 failed the backend at 2.7x and Inductor with eager's round trips at 1.6x, while
  every kind's median was the same in all five ways of running DAR (0.17-0.32 from float64,
  eager included). The pooled rule passes every one of those ways against every pair of the
  others (at most 0.70x of an allowance), and on the CPU (``small`` preset, every routing
  scheme, bf16 and fp32) the check's pair, the candidate against Inductor alone and eager
  (at most 0.52x). It needs the candidate's rounding path among the references: judged
  against one reference, or two that both keep eager's casts, correct DAR runs still fail
  on the ``small`` preset's 8 ``transport`` and ``beta`` gradients (up to 2.8x). What it
  still catches, measured on the same data as the share of gradients on which an error of
  1.0 (a gradient zeroed) fails the check: 99-100 % on the ``small`` preset in bf16 and fp32,
  100 % at 350M in fp32; at 350M in bf16 it is blind, 42 % for DAR, 0 % for WAV and full
  AttnRes, whose bf16 gradients are 37-63 % from float64 in every way of running them,
  eager included (the session-24 rule caught 6-62 % there). That is the queries: at std
  0.0625 (logits' std 2) those models are ill-conditioned at this depth; at std 0.0156
  (logits' std 0.5, as trained routers) their eager bf16 errors are 2-3e-2 (CPU), so the
  350M bf16 rows are meant to run with ``--query-std 0.0156`` (docs/benchmarks.md,
  session 25).

The ``*_fm`` rows (the second phase through ``route_merge``) run the backend's
``fuse_output_norms`` in fp32, where the report must show norms fused, and leave it off in
bf16: fused, the branch norm reads the merge before its rounding to bf16 (a different
rounding path, not a less accurate one: on the CPU over 8 seeds DAR's gradient errors were
0.75x the unfused ones on the scalar parameters and 0.98x on the others, geometric means),
and the rule above, which measures a candidate against the reference's own rounding, fails
it on DAR's cancellation-bound scalars in 2 seeds of 8 (at 1.01x and 1.09x the allowance;
``benchmarks/norm_fusion_accuracy.py``, docs/benchmarks.md session 20). The fused path's bf16 accuracy is tested on
the CPU instead (tests/compile/test_norm_fusion.py).

The lowering report must show the routing ops and which implementation they ran: on CUDA,
for a scheme that routes, every call on the Triton kernels.
Prints one line per scheme and precision; returns rows for gpu_suite.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import depthrewrite  # noqa: E402
from depthrewrite import backend  # noqa: E402
from depthrewrite.kernels import set_exact_softmax_grad, set_fused_enabled  # noqa: E402
from depthrewrite.models.gpt import gpt_from_preset  # noqa: E402

#: what is checked: every scheme with its defaults, plus option sets with a code path of
#: their own: full AttnRes site by site (its default groups 4 sites), grouped full routing
#: in groups of 3 over the 4 sites and the readout (every kind of phase 2; phase 1
#: recomputed for attnres, kept for mhar)
CONFIGS = {**{scheme: (scheme, {}) for scheme in sorted(depthrewrite.SCHEMES)},
           "attnres_site": ("attnres", {"group_size": None}),
           "attnres_g3": ("attnres", {"group_size": 3, "recompute": True}),
           "mhar_g3": ("mhar", {"group_size": 3, "recompute": False}),
           # block MHAR in blocks of 2 sites: its 16-head merges by Inductor's ops (session 71)
           "mhar_block": ("mhar", {"block_size": 2}),
           # grouped full MHAR in pairs of sites, each site's one entry merged by route_merge
           "mhar_g2_fm": ("mhar", {"group_size": 2, "recompute": False, "fused_merge": True}),
           # two-phase WAV in blocks of 2 sites: the second block's merges weigh three phase-1
           # results and three partial sources, two of them scaled per token (source_logit's
           # scaled form, session 69)
           "wav_2p": ("wav", {"two_phase": True, "block_size": 2}),
           # the backend's recompute_partial_sums (the partial sums recomputed in the backward;
           # WAV in one block of 4 sites: its default blocks of 2 sites have no sums to recompute)
           "wav_recompute": ("wav", {"block_size": 4}), "dar_recompute": ("dar", {}),
           # the backend's accumulate_in_place off (running sums as new tensors; on by default
           # since session 14: route_backward_into_ writes them in place), on the two schemes
           # that route site by site with running sums by default
           "wav_newsums": ("wav", {}), "mhar_newsums": ("mhar", {}),
           # the backend's recompute_branch_outputs (the branch matmuls run again in the backward)
           "wav_branch": ("wav", {"block_size": 4}), "dar_branch": ("dar", {}),
           # the second phase through depthrewrite::route_merge (the scheme option fused_merge;
           # until session 27 set for these as the module flag two_phase.FUSED_MERGE: the same path)
           "block_attnres_fm": ("block_attnres", {"fused_merge": True}),
           "mhar_block_fm": ("mhar", {"block_size": 2, "fused_merge": True}),
           "dar_fm": ("dar", {"fused_merge": True}),
           # both: DAR block's lowest-memory form (session 26)
           "dar_fm_branch": ("dar", {"fused_merge": True}),
           # recompute_branch_outputs="narrow": the attention projections' outputs only (session 43)
           "wav_narrow": ("wav", {"block_size": 4}), "dar_narrow": ("dar", {})}
#: the schemes that route (the others add no routing op to the graph)
ROUTING_SCHEMES = ("attnres", "block_attnres", "dar", "mhar", "wav")
#: configurations with the fused merge: their route_merge calls must be lowered
FUSED_MERGE_CONFIGS = tuple(name for name, (_, options) in CONFIGS.items() if options.get("fused_merge"))
#: backend options per configuration, besides ``inner`` (default: none)
BACKEND_OPTIONS = {"wav_recompute": {"recompute_partial_sums": True}, "dar_recompute": {"recompute_partial_sums": True},
                   "wav_newsums": {"accumulate_in_place": False}, "mhar_newsums": {"accumulate_in_place": False},
                   "wav_branch": {"recompute_branch_outputs": True}, "dar_branch": {"recompute_branch_outputs": True},
                   "dar_fm_branch": {"recompute_branch_outputs": True},
                   "wav_narrow": {"recompute_branch_outputs": "narrow"}, "dar_narrow": {"recompute_branch_outputs": "narrow"}}
#: configurations whose backward must have routing backward calls written in place (the
#: default): route_backward's, and route_many_backward's since session 48 (full AttnRes)
IN_PLACE_EXPECTED = ("wav", "mhar", "attnres")
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
#: the routing queries' default std. The routing logits are ``query . RMSNorm(key)``, so
#: their spread is the query's std times sqrt(d): 4 for the tiny GPT at 0.5. Sharp routing
#: over many layers makes the gradients themselves ill-conditioned: at the 350M model
#: (d = 1024, 24 layers; logits' std 16 at 0.5) DAR's fp32 gradients in eager on the
#: reference ops are a median 7.6 % (CPU, 128 tokens) to 62 % (H200, 2 x 1024 tokens) from
#: float64, up to 13x their own norm, so no implementation can be judged there. At 0.0625
#: (logits' std 2) the median is 1.6e-5 (docs/benchmarks.md, session 23).
QUERY_STD = 0.5

#: the candidate's error against float64 may be this many times the reference's
FACTOR = 4.0
#: ... or this many times the largest error the references make on any gradient of its kind
#: (session 25; module docstring, "Pooled by kind")
KIND_CEILING = 2.0
#: per kind, the candidate's median error may be this many times the references' median
MEDIAN_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Setup:
    """How every row runs: the compiler behind the backend (``inner``), the bundled GPT
    (``preset``, with ``layers`` of them, None: the preset's) and the token ids' ``batch``
    (rows, tokens). The default is the quick check; ``--inner inductor --preset medium
    --layers 0 --query-std 0.0625`` is the 350M model of the end-to-end benchmark as it
    trains. ``query_std``: the routing queries' standard deviation (QUERY_STD)."""
    inner: str = "aot_eager"
    preset: str = "tiny"
    layers: int | None = 2
    batch: tuple[int, int] = (4, 64)
    query_std: float = QUERY_STD


def _model(name: str, device: str, setup: Setup = Setup()):
    scheme, options = CONFIGS[name]
    torch.manual_seed(0)
    overrides = {} if setup.layers is None else {"n_layer": setup.layers}
    model = depthrewrite.rewrite(gpt_from_preset(setup.preset, **overrides), scheme, **options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0.0, setup.query_std)
    return model.to(device).train()


def _loss_and_grads(model, fn, idx, precision: str):
    model.zero_grad(set_to_none=True)
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        _, loss = fn(idx, idx)
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """``|a - b| / |b|``, or over ``scale`` where given (:func:`_scales`)."""
    return float((a - b).norm() / (b.norm() if scale is None else torch.tensor(scale)).clamp_min(1e-30))


def kind_of(name: str) -> str:
    """A gradient's kind: its parameter's last name (every ``mix``, every ``weight``)."""
    return name.rsplit(".", 1)[-1]


def group_by_kind(values: dict) -> dict[str, list]:
    """``values`` (per gradient name) grouped by the gradient's kind (:func:`kind_of`)."""
    kinds: dict[str, list] = {}
    for name, value in values.items():
        kinds.setdefault(kind_of(name), []).append(value)
    return kinds


def _scales(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per gradient, the norm its error is divided by: its own, or, where it is exactly zero,
    that of all gradients of its kind (the same last name: every ``mix``). An exact zero is a
    symmetry, not a scale: at DAR's first site both streams are the same tensor, so ``mix``'s
    gradient, the difference of two equal sums, is 0.0 in the reference, and a kernel that
    forms the two sums separately leaves their rounding (session 21 on the H200: 1.2e-10,
    against ~3e-4 at the other sites), which a relative error makes 1e20."""
    kinds = group_by_kind({name: g.flatten() for name, g in grads.items()})
    kind_norm = {kind: float(torch.cat(gs).norm()) for kind, gs in kinds.items()}
    return {name: float(g.norm()) or kind_norm[kind_of(name)] for name, g in grads.items()}


def errors_against(grads: dict, exact_grads: dict) -> dict:
    """Per gradient of ``exact_grads``, the relative error of ``grads``'s against it
    (over :func:`_scales`)."""
    scales = _scales(exact_grads)
    return {n: _rel(grads[n], exact_grads[n], scales[n]) for n in exact_grads if n in grads}


def gradient_errors(grads: dict, ref_grads: dict | list[dict], exact_grads: dict,
                    precision: str) -> tuple[dict, dict, "Judgment"]:
    """Per gradient, the candidate's error against the float64 truth and the references'
    (with several, a list, the farthest one's); and the rule's :class:`Judgment` of them."""
    references = ref_grads if isinstance(ref_grads, list) else [ref_grads]
    errors = errors_against(grads, exact_grads)
    ref_errors = reference_errors(references, exact_grads)
    ref_errors = {n: ref_errors[n] for n in errors}
    return errors, ref_errors, judge(errors, ref_errors, precision)


def reference_errors(references: list[dict], exact_grads: dict) -> dict:
    """Per gradient, the largest error of the references against the float64 truth."""
    return farthest([errors_against(r, exact_grads) for r in references])


def farthest(per_reference: list[dict]) -> dict:
    """Per gradient, the largest of the references' errors (each ``{gradient: error}``)."""
    return {n: max(e[n] for e in per_reference) for n in per_reference[0]}


def allowances(ref_errors: dict, precision: str) -> dict:
    """Per gradient, the error a candidate may have: the largest of ``TOLERANCE[precision]``,
    ``FACTOR`` times the reference's own error and ``KIND_CEILING`` times the reference's
    largest error on a gradient of the same kind (module docstring)."""
    kind_largest = {kind: max(values) for kind, values in group_by_kind(ref_errors).items()}
    return {n: max(TOLERANCE[precision], FACTOR * e, KIND_CEILING * kind_largest[kind_of(n)])
            for n, e in ref_errors.items()}


def kind_medians(errors: dict, ref_errors: dict, precision: str) -> dict[str, tuple[float, float, float]]:
    """Per kind: the candidate's median error, the reference's, and the median the candidate
    may have, ``MEDIAN_FACTOR`` times the reference's or ``TOLERANCE[precision]``."""
    ours, theirs = group_by_kind(errors), group_by_kind({n: ref_errors[n] for n in errors})
    return {kind: (statistics.median(ours[kind]), statistics.median(theirs[kind]),
                   max(TOLERANCE[precision], MEDIAN_FACTOR * statistics.median(theirs[kind]))) for kind in ours}


@dataclasses.dataclass(frozen=True)
class Judgment:
    """The rule applied to one candidate: every gradient's ``allowed`` error, every kind's
    ``medians`` (:func:`kind_medians`), the gradient and the kind nearest their allowance."""
    errors: dict
    allowed: dict
    medians: dict
    worst: str
    worst_kind: str

    @property
    def gradient_ratio(self) -> float:
        """The worst gradient's error over its allowance (over 1: it fails)."""
        return self.errors[self.worst] / self.allowed[self.worst]

    @property
    def median_ratio(self) -> float:
        """The worst kind's median error over the median allowed (over 1: it fails)."""
        ours, _, limit = self.medians[self.worst_kind]
        return ours / limit

    @property
    def ok(self) -> bool:
        return self.gradient_ratio <= 1.0 and self.median_ratio <= 1.0


def judge(errors: dict, ref_errors: dict, precision: str) -> Judgment:
    """The rule for ``precision``: the candidate's ``errors`` against float64, given the
    references' ``ref_errors`` on the same gradients (:func:`allowances`, :func:`kind_medians`)."""
    allowed = allowances(ref_errors, precision)
    medians = kind_medians(errors, ref_errors, precision)
    return Judgment(errors=errors, allowed=allowed, medians=medians,
                    worst=max(errors, key=lambda n: errors[n] / allowed[n]),
                    worst_kind=max(medians, key=lambda k: medians[k][0] / medians[k][2]))


def float64_truth(model, idx) -> tuple[torch.Tensor, dict]:
    """The loss and gradients of ``model`` copied to float64, on the reference ops."""
    exact = copy.deepcopy(model).double()
    previous = set_fused_enabled(False)
    try:
        return _loss_and_grads(exact, exact, idx, "fp32")
    finally:
        set_fused_enabled(previous)


def lowered_to_kernels(config: str, device: str, ops: dict[str, int]) -> bool:
    """Whether the lowering report ``ops`` (``backend.lowered_ops()``) shows what ``config``
    must run: on CUDA, for a scheme that routes, routing calls, every one on the Triton
    kernels (none on the reference, none split between the two); elsewhere anything."""
    if torch.device(device).type != "cuda" or CONFIGS[config][0] not in ROUTING_SCHEMES:
        return True
    return bool(ops) and all(op.endswith(" (triton)") for op in ops)


def check_scheme(scheme: str, precision: str, device: str, setup: Setup = Setup()) -> dict:
    model = _model(scheme, device, setup)
    idx = torch.randint(0, model.config.vocab_size, setup.batch, generator=torch.Generator().manual_seed(1)).to(device)
    previous = set_fused_enabled(False)
    try:
        reference = model
        if setup.inner == "inductor":  # Inductor without the backend: the same rounding path (docstring)
            torch._dynamo.reset()
            reference = torch.compile(model, backend="inductor", fullgraph=True)
        ref_loss, ref_grads = _loss_and_grads(model, reference, idx, precision)
        references = [ref_grads]
        if setup.inner == "inductor":  # eager too (module docstring)
            references.append(_loss_and_grads(model, model, idx, precision)[1])
        truth_loss, exact_grads = float64_truth(model, idx)
    finally:
        set_fused_enabled(previous)
    backend.clear_reports()
    torch._dynamo.reset()
    options = {"inner": setup.inner, **BACKEND_OPTIONS.get(scheme, {})}
    if scheme in FUSED_MERGE_CONFIGS and precision == "bf16":  # module docstring
        options["fuse_output_norms"] = False
    compiled = torch.compile(model, backend=backend.depthrewrite_backend, fullgraph=True, options=options)
    loss, grads = _loss_and_grads(model, compiled, idx, precision)
    missing = sorted(set(ref_grads) ^ set(grads))
    errors, ref_errors, verdict = gradient_errors(grads, references, exact_grads, precision)
    allowed, worst = verdict.allowed, verdict.worst
    ranked = sorted(errors, key=lambda n: errors[n] / allowed[n], reverse=True)
    loss_ref = truth_loss if precision == "bf16" else ref_loss
    ops = backend.lowered_ops()
    loss_err = abs(float(loss) - float(loss_ref)) / abs(float(loss_ref))
    ok = not missing and loss_err <= TOLERANCE[precision] and verdict.ok
    if any(BACKEND_OPTIONS.get(scheme, {}).get(k) for k in ("recompute_partial_sums", "recompute_branch_outputs")):
        ok = ok and all(r.recompute_marked for r in backend.reports())  # the option really marked sums
    fused_norms = sum(r.fused_norms or 0 for r in backend.reports())
    ok = ok and lowered_to_kernels(scheme, device, ops)
    if scheme in FUSED_MERGE_CONFIGS:  # the op really ran (in fp32 with the branch norms fused into it)
        ok = ok and any(op.startswith("depthrewrite::route_merge ") for op in ops)
        ok = ok and (fused_norms > 0 if precision == "fp32" else fused_norms == 0)
    if scheme in IN_PLACE_EXPECTED:
        ok = ok and any(r.in_place.get("backward") for r in backend.reports())  # calls really written in place
    return dict(scheme=scheme, precision=precision, ok=ok, loss_err=loss_err, worst_grad=worst,
                worst_grad_err=errors[worst], worst_grad_allowed=allowed[worst], missing_grads=missing,
                worst_kind=verdict.worst_kind, kind_medians=verdict.medians,
                graphs=len(backend.reports()), ops=ops, fused_norms=fused_norms,
                ranked=[(n, errors[n], ref_errors[n], allowed[n]) for n in ranked])


def run(schemes: list[str], device: str, say=print, setup: Setup = Setup(), detail: int = 0,
        precisions: tuple[str, ...] = ("fp32", "bf16"), json_path: pathlib.Path | None = None) -> list[dict]:
    """Checks every scheme in every precision; ``json_path``: every row, each gradient's
    errors included, rewritten as each row ends (for rules worked out afterwards)."""
    rows = []
    for scheme in schemes:
        for precision in precisions:
            try:
                row = check_scheme(scheme, precision, device, setup)
            except Exception as exc:  # report and go on: one scheme must not hide the others
                row = dict(scheme=scheme, precision=precision, ok=False, error=f"{type(exc).__name__}: {exc}")
            say(f"scheme-check {row['scheme']:14s} {row['precision']} ok={row['ok']} "
                + (row.get("error") or f"loss {row['loss_err']:.1e} worst grad {row['worst_grad_err']:.1e} "
                   f"(allowed {row['worst_grad_allowed']:.1e}) "
                   f"({row['worst_grad']}) {_median_summary(row)} "
                   f"graphs {row['graphs']} ops {row['ops']} fused norms {row['fused_norms']}"))
            for name, err, ref_err, allowed in row.get("ranked", [])[:detail]:
                say(f"    {name:50s} error {err:.2e} (reference's {ref_err:.2e}; allowed {allowed:.2e})")
            rows.append(row)
            if json_path:
                json_path.write_text(json.dumps(rows, indent=1))
    return rows


def _median_summary(row: dict) -> str:
    ours, theirs, allowed = row["kind_medians"][row["worst_kind"]]
    return f"median {ours:.1e} on {row['worst_kind']} (reference's {theirs:.1e}; allowed {allowed:.1e})"


def apply_patches(variant: str) -> list[str]:
    """Set the module constants of ``e2e_throughput.py``'s ``variant`` (its
    ``LAUNCH_PATCHES``) for the rest of the process; returns ``module.CONSTANT = value`` for
    each. A name without patches is refused (ValueError): checking it would check the
    defaults under another name."""
    if str(ROOT / "benchmarks") not in sys.path:  # loaded as a module (tests), not run as the script
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from e2e_throughput import LAUNCH_PATCHES, apply_launch_patches

    if not LAUNCH_PATCHES.get(variant):
        raise ValueError(f"--patches: {variant!r} is not one of e2e_throughput.py's variants with patches "
                         "(LAUNCH_PATCHES)")
    return [f"{module.__name__}.{constant} = {getattr(module, constant)!r}"
            for module, constant, _ in apply_launch_patches(variant)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--schemes", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--inner", default="aot_eager", choices=("aot_eager", "inductor"),
                    help="the compiler behind the backend (inductor: as training runs it, minutes per scheme)")
    ap.add_argument("--preset", default="tiny", help="the bundled GPT's preset (medium: the 350M model)")
    ap.add_argument("--layers", type=int, default=2, help="its layers (0: the preset's own)")
    ap.add_argument("--batch", type=int, nargs=2, default=(4, 64), metavar=("ROWS", "TOKENS"))
    ap.add_argument("--query-std", type=float, default=QUERY_STD, help="the routing queries' std (QUERY_STD)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    ap.add_argument("--detail", type=int, default=0, metavar="K",
                    help="also print each row's K gradients nearest their allowance")
    ap.add_argument("--json", type=pathlib.Path, help="write every row here, each gradient's errors included")
    ap.add_argument("--exact-softmax-grad", action="store_true",
                    help="the kernels' backward forms sum_j a_j <v_j, g> from the sources (set_exact_softmax_grad)")
    ap.add_argument("--patches", metavar="VARIANT",
                    help="check with an e2e_throughput.py variant's module constants set (its LAUNCH_PATCHES, "
                         "e.g. dar_block_rowsums: dar.PER_TOKEN_SCALARS)")
    args = ap.parse_args()
    if args.layers < 0 or args.detail < 0 or min(args.batch) < 1 or args.query_std <= 0:
        ap.error(f"--layers and --detail must be >= 0, --batch and --query-std positive; found {args.layers}, "
                 f"{args.detail}, {args.batch} and {args.query_std}")
    setup = Setup(inner=args.inner, preset=args.preset, layers=args.layers or None, batch=tuple(args.batch),
                  query_std=args.query_std)
    set_exact_softmax_grad(args.exact_softmax_grad)
    if args.patches:
        try:
            patched = apply_patches(args.patches)
        except ValueError as exc:
            ap.error(str(exc))
        for line in patched:
            print(f"patched: {line}")
    rows = run(args.schemes, args.device, setup=setup, detail=args.detail, precisions=tuple(args.precisions),
               json_path=args.json)
    bad = [f"{r['scheme']}/{r['precision']}" for r in rows if not r["ok"]]
    print(f"scheme-check: {len(rows) - len(bad)}/{len(rows)} OK; failing: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
