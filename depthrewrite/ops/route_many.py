"""Several queries routing over the same sources: ``depthrewrite::route_many``.

The first phase of the two-phase Block AttnRes computation (docs/spec.md section 3; the Attention
Residuals paper's inference/training trick): all S sites of a block read the same completed
block summaries ``b_0 .. b_{n-1}``, so their softmaxes over those summaries are computed in
ONE pass that reads each summary once, and each site later merges its block's partial sum
into its result by online softmax (:func:`merge_partial`, or :func:`merge_routes` for several
groups of sources: WAV). DAR's phase 1 routes values with separate keys. For query ``s``
(with its own key RMSNorm weight ``g_s``), as in ``depthrewrite::route`` without bias or
scale::

    z[s, i, h] = sum_{c in head h} w_s[c] * RMSNorm_{g_s}(k_i)[c]   (k_i = keys[i], else v_i)
    lse[s, h]  = logsumexp_i z[s, i, h]              (the real one, also for one source)
    out[s]     = sum_i softmax_i(z[s, :, h]) * v_i   (per head h)

Unlike ``route``'s ``lse`` (a saved statistic), this ``lse`` is differentiable: the merge
uses it. Outputs are lists of S tensors (``out[s]`` shaped like a source, ``lse[s]`` of
shape ``(*batch, H)`` in the compute dtype: float32, or float64 when an input is),
separate allocations, so that each site's gradient arrives as its own tensor (no
select/scatter of a stacked buffer in the backward). A third output, ``stats``, is a saved
statistic for the fused backward: per token and source the S * H logits and the key's
``rstd`` (``(T, N, S * H + 1)`` in the compute dtype; empty where the fused backward reads
none, :func:`saves_stats`).

The pure-PyTorch implementation registered here (CPU, float64, and CUDA when the kernels
are off) computes what :func:`route_many_reference` computes; its backward recomputes the
forward statistics and writes the gradients out by hand, ignoring the saved ``out``,
``lse`` and ``stats`` that the fused backward uses (:mod:`depthrewrite.kernels.route_many_triton`),
so it stays an independent check of it (tests: float64 gradcheck, and against autograd through
the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..recompute import recomputable
from .flat_autograd import register_autograd
from .route import _check_acc, _check_eps, _check_sources, _compute_dtype, _describe, _split_fresh
from .source_logit import source_logit

__all__ = ["route_many", "route_many_reference", "merge_partial", "merge_routes"]

#: :func:`merge_routes` weighs its terms by a softmax written term by term (elementwise ops
#: on each term's logit, no stack). As one ``torch.softmax`` over ``torch.stack`` of the
#: logits, Inductor stores the stacked logits (in the backward, the stacked row sums) in a
#: buffer that its consumers read at offsets other than those each reduction wrote, so the
#: logits' row reductions and the weighted sum of the rows go to separate kernels, each
#: reading the merge's rows. Term by term (H100, 350M GPT, session 70): two-phase WAV's
#: Inductor kernels 3.8 ms a step less, 361 kernel launches fewer, its step 3.0 % shorter;
#: full AttnRes (merges of two results) level. False: the stacked softmax, as before
MERGE_SOFTMAX_BY_TERMS = True

ROUTE_MANY_SCHEMA = (
    "(Tensor[] values, Tensor queries, Tensor key_norm_weights, int heads, float eps, Tensor[]? keys) "
    "-> (Tensor[] out, Tensor[] lse, Tensor stats)"
)
ROUTE_MANY_BACKWARD_SCHEMA = (
    "(Tensor[] grad_out, Tensor[] grad_lse, Tensor[] out, Tensor[] lse, Tensor stats, Tensor[] values, Tensor queries, "
    "Tensor key_norm_weights, int heads, float eps, Tensor[]? keys, Tensor?[]? grad_values_acc=None, "
    "Tensor?[]? grad_keys_acc=None) "
    "-> (Tensor[] grad_values, Tensor[] grad_keys, Tensor grad_queries, Tensor grad_key_norm_weights)"
)


# --------------------------------------------------------------------------- math


def _forward_parts(values, keys, queries, key_norm_weights, heads, eps, dtype):
    """``src (N, *batch, d)`` (the values), the key norm before its weight ``norm``, ``rstd
    (N, *batch, 1)`` (of the keys: the values unless ``keys``) and the logits
    ``z (S, N, *batch, H)``, in ``dtype`` (differentiable torch ops)."""
    src = torch.stack([v.to(dtype) for v in values])
    key = src if keys is None else torch.stack([k.to(dtype) for k in keys])
    rstd = torch.rsqrt(key.square().mean(-1, keepdim=True) + eps)  # the key statistic: over the full width
    norm = key * rstd
    per_query = queries.to(dtype) * key_norm_weights.to(dtype)  # the rows w_s * g_s
    d = norm.shape[-1]
    shape = (per_query.shape[0], 1) + (1,) * (norm.dim() - 2) + (heads, d // heads)
    logits = (norm.unflatten(-1, (heads, -1)).unsqueeze(0) * per_query.reshape(shape)).sum(-1)
    return src, norm, rstd, logits


def _reference(values: Sequence[Tensor], queries: Tensor, key_norm_weights: Tensor, heads: int, eps: float,
               keys: Sequence[Tensor] | None = None):
    """Differentiable torch ops: ``(out (S, *batch, d) in the values' dtype, lse (S, *batch, H)
    in the compute dtype)``, computed in float32 (float64 if any input is)."""
    dtype = _compute_dtype(values[0], queries, key_norm_weights)
    src, _, _, logits = _forward_parts(values, keys, queries, key_norm_weights, heads, eps, dtype)
    return _routed(src, logits, heads, values[0].dtype)


def _routed(src: Tensor, logits: Tensor, heads: int, act: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(out (S, *batch, d) in ``act``, lse (S, *batch, H))`` from :func:`_forward_parts`'
    sources and logits."""
    lse = torch.logsumexp(logits, dim=1)
    weights = torch.softmax(logits, dim=1)
    out = (weights.unsqueeze(-1) * src.unflatten(-1, (heads, -1)).unsqueeze(0)).sum(1).flatten(-2)
    return out.to(act), lse


# ------------------------------------------------------------ saved statistics

#: the forward keeps each source's logits and key ``rstd`` for the backward (the op's
#: ``stats`` output: ``(T, N, S * H + 1)`` float32, 4 (S + 1) bytes a token and source) where
#: the fused backward reads them instead of two of its three row sums a source: one head
#: without separate keys (the calls of its per-token kernel), at most STATS_MAX_QUERIES
#: queries. Session 34 (H200, bf16, 16384 tokens, d = 1024, docs/benchmarks.md): full
#: AttnRes's group calls' backward 0.570 / 1.165 / 1.759 ms against 0.617 / 1.270 / 1.922 at
#: 4 queries over N = 13 / 29 / 45, the readout's 1.056 against 1.084, the forwards 0-1.5 %
#: slower for the stores; at 350M the table is about 100 MB a step for full AttnRes
SAVE_STATS = True
#: the most queries a call keeps the table for: the measured calls (1-4 queries). With more
#: (Block AttnRes's 6-7, padded to 8) the per-token backward already spills, and in the sm_90
#: code of the device's Triton the table's loads raise its spills (184 bytes against 108 at
#: 6 queries, kernel_registers.py), unmeasured on the GPU. Since session 66 its 6 queries are
#: two tiles of 4 + 2 rows that do not spill (route_many_triton.SPLIT_QUERIES), and with the
#: table they would not either (the sm_90 code of the dev VM's Triton 3.9: 253 registers,
#: 1,512 SASS instructions and 20 barriers against 250, 1,688 and 22). Timed in session 67
#: (H100, 350M, side by side, docs/benchmarks.md): level, Block AttnRes 92.7 ms a step with
#: the table at 6 queries against 92.4 without (its backward kernels 0.09 ms faster, its
#: forwards 0.06 ms slower), so the table stays at 1-4 queries
STATS_MAX_QUERIES = 4


def saves_stats(heads: int, keys, queries: int) -> bool:
    """Whether ``route_many`` keeps its statistics for these arguments (SAVE_STATS,
    STATS_MAX_QUERIES)."""
    return SAVE_STATS and heads == 1 and keys is None and queries <= STATS_MAX_QUERIES


def stats_shape(values: Sequence[Tensor], queries: Tensor, heads: int, keys) -> tuple[int, ...]:
    """The ``stats`` output's shape: ``(T, N, S * H + 1)`` (a token's row of each source: S * H
    logits, then the key's ``rstd``), or ``(0,)`` where none are kept (:func:`saves_stats`)."""
    if not saves_stats(heads, keys, queries.shape[0]):
        return (0,)
    tokens = values[0].numel() // values[0].shape[-1]
    return (tokens, len(values), queries.shape[0] * heads + 1)


def stats_table(values: Sequence[Tensor], queries: Tensor, heads: int, keys) -> Tensor | None:
    """An uninitialized float32 ``stats`` table on the sources' device for a direct call of
    the Triton launchers (``route_many_forward(..., stats=)`` fills it, ``route_many_backward``
    reads it), or None where the op keeps none (:func:`stats_shape`)."""
    shape = stats_shape(values, queries, heads, keys)
    return torch.empty(shape, dtype=torch.float32, device=values[0].device) if len(shape) > 1 else None


def _stats(logits: Tensor, rstd: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The ``stats`` table from :func:`_forward_parts`' logits ``(S, N, *batch, H)`` and
    ``rstd (N, *batch, 1)``; empty unless ``shape`` has rows."""
    if len(shape) == 1:
        return logits.new_empty(shape)
    s, n, h = logits.shape[0], logits.shape[1], logits.shape[-1]
    per_token = logits.reshape(s, n, -1, h).permute(2, 1, 0, 3).reshape(-1, n, s * h)
    return torch.cat([per_token, rstd.reshape(n, -1, 1).transpose(0, 1)], -1).contiguous()


# ---------------------------------------------------------------------- the ops


@torch.library.custom_op("depthrewrite::route_many", mutates_args=(), schema=ROUTE_MANY_SCHEMA)
def _route_many_op(values: list[Tensor], queries: Tensor, key_norm_weights: Tensor, heads: int,
                   eps: float, keys: list[Tensor] | None) -> tuple[list[Tensor], list[Tensor], Tensor]:
    # checked here too: a caller of torch.ops.depthrewrite.route_many skips route_many()'s checks
    _check_inputs(values, queries, key_norm_weights, heads, eps, keys)
    dtype = _compute_dtype(values[0], queries, key_norm_weights)
    src, _, rstd, logits = _forward_parts(values, keys, queries, key_norm_weights, heads, eps, dtype)
    out, lse = _routed(src, logits, heads, values[0].dtype)
    stats = _stats(logits, rstd, stats_shape(values, queries, heads, keys))
    # custom-op outputs may not alias each other: one fresh tensor per query
    return [o.clone() for o in out.unbind(0)], [t.clone() for t in lse.unbind(0)], stats


@_route_many_op.register_fake
def _route_many_fake(values, queries, key_norm_weights, heads, eps, keys):
    lse_shape = values[0].shape[:-1] + (heads,)
    dtype = _compute_dtype(values[0], queries, key_norm_weights)
    s = queries.shape[0]
    # contiguous, as the implementations return them whatever the sources' strides
    return ([values[0].new_empty(values[0].shape) for _ in range(s)],
            [values[0].new_empty(lse_shape, dtype=dtype) for _ in range(s)],
            values[0].new_empty(stats_shape(values, queries, heads, keys), dtype=dtype))


@torch.library.custom_op("depthrewrite::route_many_backward", mutates_args=(), schema=ROUTE_MANY_BACKWARD_SCHEMA)
def _route_many_backward_op(grad_out: list[Tensor], grad_lse: list[Tensor], out: list[Tensor], lse: list[Tensor],
                            stats: Tensor, values: list[Tensor], queries: Tensor, key_norm_weights: Tensor,
                            heads: int, eps: float, keys: list[Tensor] | None,
                            grad_values_acc: list[Tensor | None] | None = None,
                            grad_keys_acc: list[Tensor | None] | None = None,
                            ) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    # the reference recomputes the forward and ignores out, lse and stats (the fused
    # kernel's shortcuts), so that it stays an independent check of the kernel.
    # grad_*_acc: running sums the gradients are added to (depthrewrite.grad_accumulation),
    # checked against the sources once those are
    _check_inputs(values, queries, key_norm_weights, heads, eps, keys)
    _check_acc("grad_values_acc", grad_values_acc, values, "route_many_backward")
    _check_acc("grad_keys_acc", grad_keys_acc, keys, "route_many_backward")
    return reference_backward(grad_out, grad_lse, values, queries, key_norm_weights, heads, eps, keys,
                              grad_values_acc=grad_values_acc, grad_keys_acc=grad_keys_acc)


def reference_backward(grad_out, grad_lse, values, queries, key_norm_weights, heads: int, eps: float, keys,
                       shortcut_out: list[Tensor] | None = None, grad_values_acc=None, grad_keys_acc=None) -> tuple:
    """The reference backward's math (``depthrewrite::route_many_backward``). With
    ``shortcut_out`` (the saved outputs), the softmax backward's ``sum_j a_j <v_j, g>`` is
    taken as ``<out, g>`` as the fused kernels take it: for accuracy studies
    (benchmarks/gradient_accuracy.py's ``shortcut`` run), not for training.
    ``grad_values_acc`` / ``grad_keys_acc``: running sums (None, or None or a tensor per
    source) added to the gradients in the compute dtype, rounded once."""
    dtype = _compute_dtype(values[0], queries, key_norm_weights)
    src, norm, rstd, logits = _forward_parts(values, keys, queries, key_norm_weights, heads, eps, dtype)
    weights = torch.softmax(logits, dim=1)
    g = torch.stack(grad_out).to(dtype).unflatten(-1, (heads, -1)).unsqueeze(1)  # (S, 1, *batch, H, C)
    g_lse = torch.stack(grad_lse).to(dtype).unsqueeze(1)  # (S, 1, *batch, H)
    split = src.unflatten(-1, (heads, -1)).unsqueeze(0)  # (1, N, *batch, H, C)
    d_a = (split * g).sum(-1)  # (S, N, *batch, H)
    if shortcut_out is None:
        mean_d_a = (weights * d_a).sum(1, keepdim=True)
    else:
        mean_d_a = (torch.stack(shortcut_out).to(dtype).unflatten(-1, (heads, -1)).unsqueeze(1) * g).sum(-1)
    # softmax backward over the sources, plus lse's gradient (d lse / d z_i = a_i)
    d_z = weights * (d_a - mean_d_a + g_lse)
    d_src = (weights.unsqueeze(-1) * g).sum(0).flatten(-2)  # (N, *batch, d)
    d_z_wide = d_z.repeat_interleave(src.shape[-1] // heads, dim=-1)  # (S, N, *batch, d)
    r = (d_z_wide * norm.unsqueeze(0)).reshape(d_z.shape[0], -1, src.shape[-1]).sum(1)  # (S, d)
    q, w = queries.to(dtype), key_norm_weights.to(dtype)
    per_query = (q * w).reshape((q.shape[0],) + (1,) * (src.dim() - 1) + (-1,))  # (S, 1, *1, d)
    d_norm = (d_z_wide * per_query).sum(0)  # (N, *batch, d)
    # RMSNorm backward: the statistic couples all d channels of a source
    d_key = rstd * (d_norm - norm * (d_norm * norm).mean(-1, keepdim=True))
    # fresh tensors: custom-op outputs may not alias each other (unbind gives views)
    act = values[0].dtype
    if keys is None:
        grad_values, grad_keys = _split_fresh(d_src + d_key, act, grad_values_acc), []
    else:
        grad_values = _split_fresh(d_src, act, grad_values_acc)
        grad_keys = _split_fresh(d_key, act, grad_keys_acc)
    return grad_values, grad_keys, (r * w).to(queries.dtype), (r * q).to(key_norm_weights.dtype)


@_route_many_backward_op.register_fake
def _route_many_backward_fake(grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, heads, eps,
                              keys, grad_values_acc=None, grad_keys_acc=None):
    grad_keys = [] if keys is None else [k.new_empty(k.shape) for k in keys]
    return ([v.new_empty(v.shape) for v in values], grad_keys, torch.empty_like(queries),
            torch.empty_like(key_norm_weights))


def _setup_context(ctx, inputs, output) -> None:
    values, queries, key_norm_weights, heads, eps, keys = inputs
    out, lse, stats = output
    ctx.num_sources, ctx.num_queries, ctx.has_keys = len(values), len(out), keys is not None
    ctx.heads, ctx.eps = heads, eps
    ctx.save_for_backward(*out, *lse, *values, *(keys or ()), queries, key_norm_weights, stats)


def _backward(ctx, grad_out, grad_lse, grad_stats):
    # stats is a saved statistic, not a result: no gradient flows through it
    s, n = ctx.num_queries, ctx.num_sources
    saved = ctx.saved_tensors
    out, lse, values = list(saved[:s]), list(saved[s : 2 * s]), list(saved[2 * s : 2 * s + n])
    keys = list(saved[2 * s + n : 2 * s + 2 * n]) if ctx.has_keys else None
    queries, key_norm_weights, stats = saved[-3:]
    # an output nobody used arrives as None: its gradient is zero
    grad_out = [g if g is not None else torch.zeros_like(o) for g, o in zip(grad_out, out)]
    grad_lse = [g if g is not None else torch.zeros_like(t) for g, t in zip(grad_lse, lse)]
    grad_values, grad_keys, grad_queries, grad_weights = _route_many_backward_op(
        grad_out, grad_lse, out, lse, stats, values, queries, key_norm_weights, ctx.heads, ctx.eps, keys)
    return grad_values, grad_queries, grad_weights, None, None, grad_keys if ctx.has_keys else None


register_autograd(_route_many_op, _backward, _setup_context)


# ---------------------------------------------------------------- input checks


def _fail(arg: str, expected: str, found: object) -> ValueError:
    return ValueError(f"route_many: `{arg}` must be {expected}; found {found}")


def _check_inputs(values, queries, key_norm_weights, heads, eps, keys=None) -> None:
    values = _check_sources("values", values, None, None, op="route_many")
    if keys is not None:
        _check_sources("keys", keys, len(values), values[0], op="route_many")
    d, device = values[0].shape[-1], values[0].device
    for arg, t in (("queries", queries), ("key_norm_weights", key_norm_weights)):
        if not isinstance(t, Tensor):
            raise _fail(arg, "a tensor of shape (S, d)", type(t).__name__)
        if not t.is_floating_point() or t.dim() != 2 or t.shape[1] != d or t.shape[0] < 1 or t.device != device:
            raise _fail(arg, f"a floating-point tensor of shape (S, {d}) with S >= 1 on {device}", _describe(t))
    if key_norm_weights.shape != queries.shape:
        raise _fail("key_norm_weights", f"shaped like queries {tuple(queries.shape)}", _describe(key_norm_weights))
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d % heads != 0:
        raise _fail("heads", f"a positive int dividing the width d={d}", repr(heads))
    _check_eps("eps", eps, op="route_many")


# ------------------------------------------------------------------- public API


def route_many(values: Sequence[Tensor], keys: Sequence[Tensor] | None = None, *, queries: Tensor,
               key_norm_weights: Tensor, heads: int = 1, eps: float = 1e-6) -> tuple[list[Tensor], list[Tensor]]:
    """Route ``values`` (N tensors of shape ``(*batch, d)``) once for each of S queries.

    ``queries`` and ``key_norm_weights`` have shape ``(S, d)`` (row ``s``: one site's
    pseudo-query and key-norm weight). ``keys``: N tensors like the values whose RMSNorm
    gives the logits instead of the values' (DAR's reciprocal keys); None: the values.
    Returns ``(out, lse)``: S tensors shaped and typed like the values, and S log-sum-exps
    of shape ``(*batch, heads)``, float32 (float64 for float64 inputs); both
    differentiable. ``route_many(v, k, queries=q[None], key_norm_weights=g[None])[0][0]``
    is ``route(v, k, query=q, key_norm_weight=g)``."""
    _check_inputs(values, queries, key_norm_weights, heads, eps, keys)
    out, lse, _ = torch.ops.depthrewrite.route_many(list(values), queries, key_norm_weights, heads, float(eps),
                                                    None if keys is None else list(keys))
    return list(out), list(lse)


def route_many_reference(values: Sequence[Tensor], keys: Sequence[Tensor] | None = None, *, queries: Tensor,
                         key_norm_weights: Tensor, heads: int = 1, eps: float = 1e-6
                         ) -> tuple[list[Tensor], list[Tensor]]:
    """``route_many`` written with plain differentiable torch ops (the test oracle)."""
    _check_inputs(values, queries, key_norm_weights, heads, eps, keys)
    out, lse = _reference(values, queries, key_norm_weights, heads, eps, keys)
    return list(out.unbind(0)), list(lse.unbind(0))


# ------------------------------------------------------------- the second phase


def merge_partial(out: Tensor, lse: Tensor, partial: Tensor, *, query: Tensor, key_norm_weight: Tensor,
                  heads: int = 1, eps: float = 1e-6, partial_key: Tensor | None = None) -> Tensor:
    """Add one more source, ``partial``, to a finished routing result by online softmax.

    ``out`` and ``lse`` are one query's result over some sources (from :func:`route_many`);
    the return value is what ``route`` over those sources plus ``partial`` gives with the
    same ``query`` and ``key_norm_weight``: with the partial's logit ``z`` (per head), its
    weight is ``sigmoid(z - lse)`` and ``result = out + sigmoid(z - lse) * (partial - out)``.
    ``partial_key``: the partial's key, when the logit comes from another tensor (DAR);
    None: the partial itself. Plain torch ops (Inductor fuses them with their neighbours),
    float32 math, the result in ``out``'s dtype."""
    _check_merge_inputs(out, lse, partial, query, key_norm_weight, heads, eps)
    if partial_key is not None:
        _check_merge_inputs(out, lse, partial_key, query, key_norm_weight, heads, eps, partial_name="partial_key")
    dtype = _compute_dtype(out, partial, query, key_norm_weight)
    p = partial.to(dtype)
    if partial_key is None:
        z = source_logit(p, partial, query, key_norm_weight, heads, eps)
    else:
        z = source_logit(partial_key.to(dtype), partial_key, query, key_norm_weight, heads, eps)
    weight = torch.sigmoid(z - lse.to(dtype)).unsqueeze(-1)  # (*batch, H, 1)
    # the float32 copy of `out` made again in the backward from `out` itself (recompute.py,
    # with the backend's recompute_partial_sums): saved, it is twice the bytes (DAR block,
    # CPU saved set at d = 128, 12 layers: 16 activations of 243.9 units)
    with recomputable():
        o = out.to(dtype).unflatten(-1, (heads, -1))
    return (o + weight * (p.unflatten(-1, (heads, -1)) - o)).flatten(-2).to(out.dtype)


def merge_routes(results: Sequence[tuple], sources: Sequence[tuple] = (), *, query: Tensor, key_norm_weight: Tensor,
                 heads: int = 1, eps: float = 1e-6) -> Tensor:
    """One query's routing result over several groups of sources, from each group's result,
    plus more sources routed directly: the general second phase (WAV's, docs/spec.md section 5).

    ``results``: ``(out, lse, bias)`` per group, ``out`` and ``lse`` one query's
    :func:`route_many` result over that group, ``bias`` None or a scalar tensor added to
    the logit of every source of the group. A softmax over the union of the groups is the
    softmax over the groups' ``lse + bias`` times each group's own softmax (a bias that is
    the same for a whole group cancels inside it), so WAV's per-basis detail biases need no
    bias in phase 1. ``sources``: ``(value, bias, scale)`` per extra source (the partial
    block's), ``bias`` as above, ``scale`` None or a per-token factor of shape ``(*batch,)``
    applied to value and key as ``route``'s ``source_scale``. Returns what ``route`` over
    all those sources gives (up to rounding), in the first ``out``'s dtype. Plain torch ops
    in float32 (Inductor fuses them with their neighbours)."""
    if not results:
        raise ValueError("merge_routes: `results` must hold at least one (out, lse, bias); found none")
    _check_triples(results, "results", "(out, lse, bias)")
    _check_triples(sources, "sources", "(value, bias, scale)")
    for k, (out, lse, bias) in enumerate(results):
        _check_merge_inputs(results[0][0], lse, out, query, key_norm_weight, heads, eps, "merge_routes",
                            f"results[{k}] out")
        _check_bias(bias, f"results[{k}]")
    for k, (value, bias, scale) in enumerate(sources):
        _check_merge_inputs(results[0][0], results[0][1], value, query, key_norm_weight, heads, eps, "merge_routes",
                            f"sources[{k}] value")
        _check_bias(bias, f"sources[{k}]")
        if scale is not None and (not isinstance(scale, Tensor) or tuple(scale.shape) != tuple(value.shape[:-1])
                                  or scale.device != value.device):
            raise ValueError(f"merge_routes: a source's `scale` must be None or of shape {tuple(value.shape[:-1])} "
                             f"on {value.device}; "
                             f"found {_describe(scale) if isinstance(scale, Tensor) else type(scale).__name__}")
    first = results[0][0]
    dtype = _compute_dtype(first, query, key_norm_weight)
    logits, values = [], []
    for out, lse, bias in results:
        logits.append(lse.to(dtype) if bias is None else lse.to(dtype) + bias.to(dtype))
        values.append(out.to(dtype))
    for value, bias, scale in sources:
        factor = None if scale is None else scale.to(dtype)
        v = value.to(dtype) if factor is None else value.to(dtype) * factor.unsqueeze(-1)
        z = source_logit(v, value, query, key_norm_weight, heads, eps, scale=factor)
        logits.append(z if bias is None else z + bias.to(dtype))
        values.append(v)
    weights = _softmax_terms(logits) if MERGE_SOFTMAX_BY_TERMS else torch.softmax(torch.stack(logits), dim=0).unbind(0)
    merged = sum(w.unsqueeze(-1) * v.unflatten(-1, (heads, -1)) for w, v in zip(weights, values))
    return merged.flatten(-2).to(first.dtype)


def _softmax_terms(logits: Sequence[Tensor]) -> list[Tensor]:
    """The softmax over ``logits`` (same-shaped tensors, one a term) as elementwise ops,
    one weight tensor a term (why: :data:`MERGE_SOFTMAX_BY_TERMS`). The shift by the
    largest logit is detached: the softmax does not depend on it, so its gradient is zero
    in exact arithmetic, and autograd need not form it."""
    top = logits[0]
    for z in logits[1:]:
        top = torch.maximum(top, z)
    top = top.detach()
    exps = [torch.exp(z - top) for z in logits]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    inverse = 1.0 / total
    return [e * inverse for e in exps]


def _check_triples(entries: Sequence, arg: str, form: str) -> None:
    for k, entry in enumerate(entries):
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            found = f"{len(entry)} items" if isinstance(entry, (tuple, list)) else type(entry).__name__
            raise ValueError(f"merge_routes: `{arg}[{k}]` must be a triple {form}; found {found}")


def _check_bias(bias: object, where: str) -> None:
    if bias is not None and not (isinstance(bias, Tensor) and bias.dim() == 0 and bias.is_floating_point()):
        found = _describe(bias) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"merge_routes: the bias of {where} must be None or a floating-point scalar tensor; "
                         f"found {found}")


def _check_merge_inputs(out, lse, partial, query, key_norm_weight, heads, eps, op="merge_partial",
                        partial_name="partial") -> None:
    def fail(arg, expected, found):
        return ValueError(f"{op}: `{arg}` must be {expected}; found {found}")

    for arg, t in (("out", out), (partial_name, partial), ("lse", lse), ("query", query),
                   ("key_norm_weight", key_norm_weight)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise fail(arg, "a floating-point tensor", type(t).__name__ if not isinstance(t, Tensor) else _describe(t))
    if out.dim() == 0 or partial.shape != out.shape or partial.device != out.device:
        raise fail(partial_name, f"shaped like out ({_describe(out)})", _describe(partial))
    for arg, t in (("lse", lse), ("query", query), ("key_norm_weight", key_norm_weight)):
        if t.device != out.device:
            raise fail(arg, f"on out's device {out.device}", _describe(t))
    d = out.shape[-1]
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d % heads != 0:
        raise fail("heads", f"a positive int dividing the width d={d}", repr(heads))
    if tuple(lse.shape) != tuple(out.shape[:-1]) + (heads,):
        raise fail("lse", f"of shape {tuple(out.shape[:-1]) + (heads,)} (out's batch, heads)", _describe(lse))
    for arg, t in (("query", query), ("key_norm_weight", key_norm_weight)):
        if tuple(t.shape) != (d,):
            raise fail(arg, f"of shape ({d},)", _describe(t))
    _check_eps("eps", eps, op=op)
