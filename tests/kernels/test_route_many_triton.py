"""The fused Triton ``route_many`` kernels against float64: every output, every log-sum-exp
and every gradient (sources, queries, key-norm weights), with gradients on both outputs.

As for ``route`` (tests/kernels/test_route_triton.py), the backward kernels take
``sum_j a_j da_j`` as ``<g, out>`` from the output saved in the activation dtype; its
gradients are compared with a float64 oracle that uses the kernel's saved output the same
way (``saved_out``), at the tolerances of the returned dtypes, and in float32 also with the
exact float64 gradients. With ``exact_softmax_grad`` the backward forms that sum from the
sources, and its gradients are compared with the exact float64 ones in bf16 too. Without a
GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # must precede the first import of triton.jit-decorated code
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from depthrewrite.kernels import route_many_triton  # noqa: E402
from depthrewrite.kernels.pointer_tables import pointer_tables  # noqa: E402
from depthrewrite.kernels.route_triton import MAX_ROW  # noqa: E402
route_many_ops = importlib.import_module("depthrewrite.ops.route_many")  # the module (the package exports a function)
from depthrewrite.ops.route_many import stats_table  # noqa: E402
# relative L2 error, and the error allowed against float64 by returned dtype: as for route
from tests.kernels.test_route_triton import DEVICE, TOL, _Launch, _rel, _shifted  # noqa: E402
from tests.conftest import skip_widest_row_in_half_precision  # noqa: E402


def _make(n, s, batch, d, heads, dtype, seed, keys=False):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        values=[torch.randn(*batch, d, generator=gen).to(dtype) for _ in range(n)],
        # large enough queries that the softmaxes are far from uniform
        queries=torch.randn(s, d, generator=gen) * 2.0 / d**0.5 * heads**0.5,
        key_norm_weights=torch.rand(s, d, generator=gen) + 0.5,
        heads=heads,
        # separate keys (DAR), scaled unlike the values: the key statistic is the keys'
        keys=[3.0 * torch.randn(*batch, d, generator=gen).to(dtype) for _ in range(n)] if keys else None,
    )


def _logits_f64(keys, queries, weights, heads):
    d = keys[0].shape[-1]
    norm = F.rms_norm(torch.stack(keys), (d,), eps=1e-6).unflatten(-1, (heads, -1))  # (N, *batch, H, C)
    per_query = (queries * weights).unflatten(-1, (heads, -1))  # (S, H, C)
    shape = (per_query.shape[0], 1) + (1,) * (norm.dim() - 3) + per_query.shape[1:]
    return (norm.unsqueeze(0) * per_query.reshape(shape)).sum(-1)  # (S, N, *batch, H)


def _oracle_f64(inp, grad_out, grad_lse, saved_out=None):
    """Outputs, lses and gradients (sources, queries, weights, then keys if any) in float64 for the loss
    ``sum_s <grad_out_s, out_s> + <grad_lse_s, lse_s>``. With ``saved_out`` the gradients are
    the one-pass backward's given that saved output: the term ``sum_i c_i z_i`` with the
    constant ``c_i = -a_i <g, saved_out - out>`` (per query and head) shifts the logits'
    gradient by exactly that difference."""
    values = [v.detach().double().requires_grad_() for v in inp["values"]]
    keys = [k.detach().double().requires_grad_() for k in inp["keys"] or ()]
    queries = inp["queries"].double().requires_grad_()
    weights = inp["key_norm_weights"].double().requires_grad_()
    heads = inp["heads"]
    z = _logits_f64(keys or values, queries, weights, heads)
    a = torch.softmax(z, dim=1)
    out = (a.unsqueeze(-1) * torch.stack(values).unflatten(-1, (heads, -1)).unsqueeze(0)).sum(1).flatten(-2)
    lse = torch.logsumexp(z, dim=1)
    g = torch.stack([t.double() for t in grad_out])
    loss = (g * out).sum() + (torch.stack([t.double() for t in grad_lse]) * lse).sum()
    if saved_out is not None:
        diff = (g * (torch.stack([t.double() for t in saved_out]) - out.detach())).unflatten(-1, (heads, -1)).sum(-1)
        loss = loss + (-(a.detach() * diff.unsqueeze(1)) * z).sum()
    grads = torch.autograd.grad(loss, [*values, queries, weights, *keys])
    return out.detach(), lse.detach(), list(grads)


def _run(inp, dtype, seed, config=None, fwd_config=None, keep_stats=True):
    """Forward with ``fwd_config`` (default: ``config``), backward with ``config``; the
    forward's statistics kept for the backward where the op keeps them (``keep_stats``)."""
    fwd_config = config if fwd_config is None else fwd_config
    gen = torch.Generator().manual_seed(seed + 1)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    values = [dev(v) for v in inp["values"]]
    keys = None if inp["keys"] is None else [dev(k) for k in inp["keys"]]
    stats = stats_table(values, inp["queries"], inp["heads"], keys) if keep_stats else None
    out, lse = route_many_triton.route_many_forward(values, dev(inp["queries"]), dev(inp["key_norm_weights"]),
                                                    inp["heads"], 1e-6, fwd_config, keys=keys, stats=stats)
    grad_out = [torch.randn(o.shape, generator=gen).to(dtype) for o in out]
    grad_lse = [torch.randn(t.shape, generator=gen) for t in lse]
    grad_v, grad_k, grad_q, grad_w = route_many_triton.route_many_backward(
        [dev(g) for g in grad_out], [dev(g) for g in grad_lse], out, lse, values, dev(inp["queries"]),
        dev(inp["key_norm_weights"]), inp["heads"], 1e-6, config, keys=keys, stats=stats)
    assert len(grad_k) == (0 if keys is None else len(keys))
    flat = [*grad_v, grad_q, grad_w, *grad_k]  # the oracle's order
    return [o.cpu() for o in out], [t.cpu() for t in lse], [t.cpu() for t in flat], grad_out, grad_lse


CASES = [
    # n sources, s queries, batch, d, heads
    (1, 1, (3,), 24, 1),
    (2, 3, (2, 3), 40, 4),
    (9, 6, (5,), 100, 1),  # the e2e shape of Block AttnRes: 6 sites of a block
    (33, 2, (3,), 48, 3),
    (65, 5, (2,), 16, 2),
    (3, 8, (7,), 1000, 1),  # width not a power of two
    (2, 3, (1,), 7186, 1),  # several chunks of queries (a padded row of 8192)
    # one head, 2 and 4 queries: the per-token backward's PER_TOKEN_LAUNCH entries other than
    # 1 and 8 (4 queries: full AttnRes's group calls, under a register cap on the GPU)
    (4, 2, (5,), 56, 1),
    (13, 4, (3,), 72, 1),
    (2, 2, (3,), 32768, 1),  # the widest row the kernels take (MAX_ROW)
    (3, 2, (2,), 32768, 16),
]


#: with separate keys (DAR's phase 1): a few of the shapes above
KEY_CASES = [CASES[0], CASES[1], CASES[2], CASES[3], CASES[4], CASES[5], CASES[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,s,batch,d,heads,keys", [c + (False,) for c in CASES] + [c + (True,) for c in KEY_CASES])
def test_route_many_kernels_match_float64(n, s, batch, d, heads, keys, dtype):
    skip_widest_row_in_half_precision(d, dtype, MAX_ROW)
    seed = n * 100 + s
    inp = _make(n, s, batch, d, heads, dtype, seed, keys)
    out, lse, grads, grad_out, grad_lse = _run(inp, dtype, seed)
    exact_out, exact_lse, exact_grads = _oracle_f64(inp, grad_out, grad_lse)
    tol = TOL[dtype]
    for o, e in zip(out, exact_out.unbind(0)):
        assert o.dtype == dtype and _rel(o, e) < tol
    for t, e in zip(lse, exact_lse.unbind(0)):
        assert t.dtype == torch.float32 and (t.double() - e).abs().max().item() < 1e-4
    _, _, oracle = _oracle_f64(inp, grad_out, grad_lse, saved_out=out)
    names = [f"values[{i}]" for i in range(n)] + ["queries", "key_norm_weights"]
    names += [f"keys[{i}]" for i in range(n)] if keys else []
    assert len(grads) == len(oracle) == len(names)
    for name, got, want in zip(names, grads, oracle):
        # activation gradients are returned in the activation dtype, parameter gradients in fp32
        limit = 1e-5 if name in ("queries", "key_norm_weights") else tol
        assert _rel(got, want) < limit, (name, _rel(got, want))
    if dtype == torch.float32:
        for name, got, want in zip(names, grads, exact_grads):
            assert _rel(got, want) < 2e-5, (name, _rel(got, want))


def test_query_chunks_match_one_launch():
    """Queries taken in chunks (each chunk's programs re-read the sources; the backward's
    chunks add into the source gradients) give the same result as one chunk for all of
    them, up to the order of the fp32 sums (the tile shapes differ): relative L2 difference
    per tensor."""
    inp = _make(4, 7, (3,), 64, 2, torch.float32, 5)
    whole = _run(inp, torch.float32, 5)
    chunked = _run(inp, torch.float32, 5, config={"many_elems": 128})  # 2 queries per chunk
    for a, b in zip(whole[0] + whole[1] + whole[2], chunked[0] + chunked[1] + chunked[2]):
        assert _rel(b, a) < TOL[torch.float32]


@pytest.mark.parametrize("s,keys,tiles,stats", [(6, False, (4, 2), False), (5, False, (4, 1), False),
                                                (3, True, (2, 1), False), (6, True, (4, 2), False),
                                                (7, False, (8, 0), False), (6, False, (4, 2), True)])
def test_queries_in_two_tiles_match_one_padded_tile_and_float64(s, keys, tiles, stats, monkeypatch):
    """The per-token backward holds a call's queries as two tiles where that pads fewer rows
    than one (route_many_triton.SPLIT_QUERIES: 6 as 4 + 2, not 8; 7 stays one tile of 8):
    the same gradients as one tile of padded rows, up to the order of the fp32 sums, and as
    float64 given the saved output; ``stats``: the forward's statistics table kept for 6
    queries too, each tile reading its own logits from it."""
    if stats:
        monkeypatch.setattr(route_many_ops, "STATS_MAX_QUERIES", 8)
    assert route_many_triton._query_tile_pair(s, 8 if s > 4 else 4, {
        "split_queries": True, "exact_softmax_grad": False, "param": "registers"}) == tiles
    inp = _make(4, s, (5,), 48, 1, torch.float32, 60 + s, keys)
    one = _run(inp, torch.float32, 60 + s, config={"backward": "per_token", "split_queries": False})
    split = _run(inp, torch.float32, 60 + s, config={"backward": "per_token"})
    for a, b in zip(one[2], split[2]):
        assert _rel(b, a) < 1e-6
    _, _, oracle = _oracle_f64(inp, split[3], split[4], saved_out=split[0])
    for got, want in zip(split[2], oracle):
        assert _rel(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("keys", [False, True])
def test_forward_program_orders_and_token_runs_give_the_same_bits(keys):
    """One launch holds every chunk of queries; its two program orders (chunks of a token
    side by side, or one chunk's tokens after another) and its runs of consecutive tokens
    per program (1, 2, 4 of 15 tokens: the last run shorter; 32: one run), where the next
    token's first source is loaded during the current token's last, compute each output
    with the same operations: bit-identical outputs and log-sum-exps, with 7 queries in
    chunks of 2 (the last chunk holds one) and of 4, and correct against float64 (a run
    that read another token's rows would differ); the same with the sources copied ahead by
    Triton's software pipeline (``stages``). Three launches per chunk size, each order, run
    length and way of loading at least once (the interpreter takes ~3 s a launch)."""
    inp = _make(5, 7, (3, 5), 40, 2, torch.bfloat16, 11, keys)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    args = ([dev(v) for v in inp["values"]], dev(inp["queries"]), dev(inp["key_norm_weights"]), 2, 1e-6)
    keys_in = None if inp["keys"] is None else [dev(k) for k in inp["keys"]]
    exact_out, exact_lse, _ = _oracle_f64(inp, [torch.zeros(3, 5, 40)] * 7, [torch.zeros(3, 5, 2)] * 7)
    for block_q in (2, 4):
        launches = [("token_major", 1, 0), ("chunk_major", 2 if block_q == 2 else 4, 0),
                    ("token_major", 32 if block_q == 2 else 4, 3 if block_q == 2 else 2)]
        runs = [route_many_triton.route_many_forward(
                    *args, {"block_q": block_q, "order": order, "tokens_per_program": per_program, "stages": stages},
                    keys=keys_in)
                for order, per_program, stages in launches]
        for (out_a, lse_a), (out_b, lse_b) in zip(runs, runs[1:]):
            assert all(torch.equal(a, b) for a, b in zip(out_a + lse_a, out_b + lse_b))
        out, lse = runs[0]
        for o, e, t, el in zip(out, exact_out.unbind(0), lse, exact_lse.unbind(0)):
            assert _rel(o.cpu(), e) < TOL[torch.bfloat16] and (t.cpu().double() - el).abs().max().item() < 1e-4


def test_unknown_forward_order_is_refused():
    inp = _make(2, 3, (2,), 16, 1, torch.float32, 1)
    with pytest.raises(ValueError, match=r"config order must be one of \('token_major', 'chunk_major'\); "
                                         r"found 'random'"):
        route_many_triton.route_many_forward(inp["values"], inp["queries"], inp["key_norm_weights"], 1, 1e-6,
                                             {"order": "random"})


def test_forward_launch_past_the_grid_limit_is_refused(monkeypatch):
    """One launch holds runs x chunks programs; past CUDA's grid limit (lowered here to
    what 3 tokens x 2 chunks exceed) the call is refused with the counts, not launched;
    two tokens a program (2 runs x 2 chunks) fit and give the one-token launch's outputs."""
    inp = _make(2, 3, (3,), 16, 1, torch.float32, 1)
    args = ([v.to(DEVICE) for v in inp["values"]], inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE), 1,
            1e-6)
    one_token = route_many_triton.route_many_forward(*args, {"block_q": 2, "tokens_per_program": 1, "stages": 0})
    monkeypatch.setattr(route_many_triton, "MAX_PROGRAMS", 5)
    with pytest.raises(ValueError, match=r"a forward launch of 3 tokens in 3 runs of at most 1 x 2 chunks of 2 "
                                         r"queries = 6 programs; at most 5 are supported"):
        route_many_triton.route_many_forward(*args, {"block_q": 2, "tokens_per_program": 1})
    two_tokens = route_many_triton.route_many_forward(*args, {"block_q": 2, "tokens_per_program": 2, "stages": 0})
    assert all(torch.equal(a, b) for a, b in zip(one_token[0] + one_token[1], two_tokens[0] + two_tokens[1]))


@pytest.mark.parametrize("per_program", [0, -2, 1.5, True, "4"])
def test_forward_tokens_per_program_must_be_a_positive_int(per_program):
    inp = _make(2, 3, (2,), 16, 1, torch.float32, 1)
    with pytest.raises(ValueError, match=r"config tokens_per_program must be a positive int; found "
                                         + re.escape(repr(per_program))):
        route_many_triton.route_many_forward(inp["values"], inp["queries"], inp["key_norm_weights"], 1, 1e-6,
                                             {"tokens_per_program": per_program})


@pytest.mark.parametrize("stages", [-1, 2.0, False, "3"])
def test_forward_stages_must_be_a_non_negative_int(stages):
    inp = _make(2, 3, (2,), 16, 1, torch.float32, 1)
    with pytest.raises(ValueError, match=r"config stages must be an int >= 0; found " + re.escape(repr(stages))):
        route_many_triton.route_many_forward(inp["values"], inp["queries"], inp["key_norm_weights"], 1, 1e-6,
                                             {"stages": stages})


VARIANTS = [
    {"backward": "per_token"},
    {"backward": "per_token", "many_elems": 256},  # 2 queries per chunk: fp32 partial gradients between chunks
    {"backward": "per_token", "param": "table"},  # parameter gradients through the dz * rstd table
    {"backward": "per_token", "param": "table", "many_elems": 256},  # the table written chunk by chunk
    # one source ahead (two by default up to d = 2048), two ahead (the forward: one), in
    # registers: stages=0, as keyed calls take the pipeline by default
    {"backward": "per_token", "prefetch": True, "stages": 0},
    {"backward": "per_token", "prefetch": 2, "stages": 0},
    {"backward": "per_token", "prefetch": 2, "param": "table", "many_elems": 256},
    {"backward": "per_token", "prefetch": 3, "stages": 0},  # three and four ahead (session 35)
    {"backward": "per_token", "prefetch": 4, "stages": 0, "many_elems": 256},
    # a source's row sums joined in one reduction (the GPU's default, off in the interpreter)
    {"backward": "per_token", "fused_sums": True},
    {"backward": "per_token", "fused_sums": True, "many_elems": 256, "stages": 2},
    {"backward": "per_token", "stages": 3},  # the sources copied ahead by Triton's software pipeline
    {"backward": "per_token", "stages": 2, "param": "table", "many_elems": 256},
    {"backward": "tiled", "block_t": 2, "num_warps": 4},
    {"backward": "tiled", "block_t": 4, "num_warps": 2, "prefetch": False},
    # the parameter reduction's tiles through Triton's software pipeline, one program per SM
    {"backward": "tiled", "param_stages": 3, "param_per_sm": 1},
    # register caps (forward and backward kernels), more per-token programs per SM
    {"backward": "per_token", "maxnreg": 64, "per_sm": 4},
    {"backward": "tiled", "maxnreg": 96},
]


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: "-".join(f"{k}_{v}" for k, v in c.items()))
# one shape of each kind: many sources without keys, several heads with keys, one source
# with keys (each variant's branches for keys and for several heads are reached; CI's suite
# ran all six combinations until session 65, 55 s through the interpreter)
@pytest.mark.parametrize("n,s,batch,d,heads,keys", [(9, 6, (5,), 100, 1, False), (3, 5, (3,), 48, 3, True),
                                                     (1, 3, (5,), 24, 1, True)])
def test_kernel_variants_match_float64(n, s, batch, d, heads, keys, config):
    """Each backward kernel where the default would pick the other (per-token with several
    heads or with separate keys, tiled with one head and no keys), in chunks of queries,
    tile sizes of the tiled one (``block_t``), with odd token counts (partial tiles), in
    bf16: outputs and log-sum-exps against float64, gradients (keys' included) against the
    float64 oracle that uses the saved output."""
    dtype = torch.bfloat16
    inp = _make(n, s, batch, d, heads, dtype, 7, keys)
    # the forward takes one source ahead at most: the backward's prefetch 2-4 stays with it
    fwd_config = {k: v for k, v in config.items() if not (k == "prefetch" and v in (2, 3, 4))}
    out, lse, grads, grad_out, grad_lse = _run(inp, dtype, 7, config=config, fwd_config=fwd_config)
    exact_out, exact_lse, _ = _oracle_f64(inp, grad_out, grad_lse)
    assert all(_rel(o, e) < TOL[dtype] for o, e in zip(out, exact_out.unbind(0)))
    assert all((t.double() - e).abs().max().item() < 1e-4 for t, e in zip(lse, exact_lse.unbind(0)))
    _, _, oracle = _oracle_f64(inp, grad_out, grad_lse, saved_out=out)
    for k, (got, want) in enumerate(zip(grads, oracle)):
        limit = 1e-5 if k in (n, n + 1) else TOL[dtype]  # queries, key-norm weights: fp32
        assert _rel(got, want) < limit, (k, _rel(got, want))


EXACT_CONFIGS = [
    {"backward": "per_token"},
    {"backward": "per_token", "many_elems": 256, "stages": 2},  # chunks of queries, each walking the sources first
    # both walks' row sums joined in one reduction (the GPU's default, off in the interpreter)
    {"backward": "per_token", "fused_sums": True},
    {"backward": "tiled", "block_t": 2, "num_warps": 2},
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", EXACT_CONFIGS, ids=lambda c: "-".join(f"{k}_{v}" for k, v in c.items()))
@pytest.mark.parametrize("n,s,batch,d,heads,keys", [(9, 6, (5,), 100, 1, False), (3, 5, (3,), 48, 3, True),
                                                     (2, 3, (7,), 40, 4, False), (1, 3, (5,), 24, 1, False)])
def test_exact_softmax_grad_gives_the_exact_gradients_in_half_precision(n, s, batch, d, heads, keys, config, dtype):
    """With ``exact_softmax_grad`` the backward forms ``sum_j a_j <v_j, g>`` from the bf16
    (fp16) sources, as the reference does, not from the output saved in that dtype: the fp32
    parameter gradients are the exact float64 ones (not the saved-output oracle's) to fp32
    rounding, the others to the dtype's. The shortcut's parameter gradients are further off
    than that (with several sources; with one, dz is d lse either way and both are exact:
    bit-identical where the shortcut too holds its queries as one tile, as the exact form
    does; on the GPU two tiles' row sums are reduced in another order)."""
    inp = _make(n, s, batch, d, heads, dtype, 11, keys)
    _, _, grads, grad_out, grad_lse = _run(inp, dtype, 11, config={**config, "exact_softmax_grad": True},
                                           fwd_config={})
    _, _, exact = _oracle_f64(inp, grad_out, grad_lse)
    for k, (got, want) in enumerate(zip(grads, exact)):
        limit = 1e-5 if k in (n, n + 1) else TOL[dtype]  # queries, key-norm weights: fp32
        assert _rel(got, want) < limit, (k, _rel(got, want))
    if n > 1:
        shortcut = _run(inp, dtype, 11, config=config, fwd_config={})[2]
        assert min(_rel(shortcut[k], exact[k]) for k in (n, n + 1)) > 1e-5
    else:
        shortcut = _run(inp, dtype, 11, config={**config, "split_queries": False}, fwd_config={})[2]
        assert all(torch.equal(a, b) for a, b in zip(shortcut, grads))


@pytest.mark.parametrize("backward", ["tiled", "per_token"])
def test_exact_softmax_grad_matches_float64_in_fp32(backward):
    inp = _make(9, 6, (5,), 100, 1, torch.float32, 5, keys=backward == "tiled")
    _, _, grads, grad_out, grad_lse = _run(inp, torch.float32, 5,
                                           config={"backward": backward, "exact_softmax_grad": True}, fwd_config={})
    _, _, exact = _oracle_f64(inp, grad_out, grad_lse)
    assert all(_rel(got, want) < 2e-5 for got, want in zip(grads, exact))


@pytest.mark.parametrize("exact", [False, True])
def test_the_package_switch_reaches_the_registered_backward_kernels(exact):
    """``depthrewrite.kernels.set_exact_softmax_grad`` is what the registered CUDA kernels of
    ``route_many_backward`` and ``route_backward`` run with (called here on the interpreter):
    the same bits as the kernels called with the config, and the switch put back."""
    import depthrewrite.kernels as kernels
    from depthrewrite.kernels import route_triton

    inp = _make(4, 3, (5,), 32, 1, torch.bfloat16, 2)
    values, q, w = [v.to(DEVICE) for v in inp["values"]], inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)
    stats = stats_table(values, q, 1, None)
    out, lse = route_many_triton.route_many_forward(values, q, w, 1, 1e-6, stats=stats)
    gen = torch.Generator().manual_seed(3)
    grad_out = [torch.randn(o.shape, generator=gen).to(o.dtype).to(DEVICE) for o in out]
    grad_lse = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in lse]
    route_args = (values, None, q[0], w[0], None, None, 1, 1e-6)
    route_out, route_lse, _ = route_triton.route_forward(*route_args)
    previous = kernels.set_exact_softmax_grad(exact)
    try:
        registered = kernels._route_many_backward_cuda(grad_out, grad_lse, out, lse, stats, values, q, w, 1, 1e-6,
                                                       None)
        registered_route = kernels._route_backward_cuda(grad_out[0], route_out, route_lse, *route_args)
    finally:
        assert kernels.set_exact_softmax_grad(previous) is exact
    direct = route_many_triton.route_many_backward(grad_out, grad_lse, out, lse, values, q, w, 1, 1e-6,
                                                   {"exact_softmax_grad": exact}, stats=stats)
    direct_route = route_triton.route_backward(grad_out[0], route_out, route_lse, *route_args,
                                               config={"exact_softmax_grad": exact})
    flat = lambda grads: [t for g in grads for t in (g if isinstance(g, list) else [g])]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(registered), flat(direct), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(flat(registered_route), flat(direct_route), strict=True))
    other = route_many_triton.route_many_backward(grad_out, grad_lse, out, lse, values, q, w, 1, 1e-6,
                                                  {"exact_softmax_grad": not exact}, stats=stats)
    assert not torch.equal(flat(other)[-2], flat(direct)[-2])  # the query gradients: the switch matters


def test_the_package_switch_takes_a_bool():
    import depthrewrite.kernels as kernels

    with pytest.raises(TypeError, match=r"set_exact_softmax_grad: expected True or False, found 1"):
        kernels.set_exact_softmax_grad(1)


def test_exact_softmax_grad_is_as_accurate_as_the_reference_where_sources_are_nearly_equal():
    """fp32, sources within 1 % of each other (benchmarks/route_many_accuracy.py's inputs):
    against float64, the exact backward's query gradient is within 1.3x of the reference's
    error (geometric mean over 3 seeds; 1.12x over 5 in session 24), the shortcut's beyond
    it (2.09x over 5)."""
    import math

    from tests.benchmark_scripts import load_benchmark

    accuracy = load_benchmark("route_many_accuracy")
    ratios = {True: [], False: []}
    for seed in range(3):
        inp = accuracy._inputs(seed, 0.01, keyed=False)
        truth = accuracy._reference_grads(inp, torch.float64)[2]
        reference = accuracy._rel(accuracy._reference_grads(inp, torch.float32)[2], truth)
        for exact in ratios:
            kernel = accuracy._kernel_grads(inp, DEVICE, exact=exact)[2]
            ratios[exact].append(math.log(accuracy._rel(kernel, truth) / reference))
    mean = {exact: math.exp(sum(logs) / len(logs)) for exact, logs in ratios.items()}
    assert mean[True] < 1.3 < mean[False], mean


def test_unknown_backward_is_refused():
    inp = _make(2, 2, (3,), 16, 1, torch.float32, 1)
    with pytest.raises(ValueError, match=r"config backward must be one of \('tiled', 'per_token'\); found 'fast'"):
        _run(inp, torch.float32, 1, config={"backward": "fast"})
    with pytest.raises(ValueError, match=r"config param must be one of \('registers', 'table'\); found 'shared'"):
        _run(inp, torch.float32, 1, config={"backward": "per_token", "param": "shared"})
    with pytest.raises(ValueError, match=r"config prefetch must be one of \(False, True\) for the tiled backward; "
                                         r"found 2"):
        _run(inp, torch.float32, 1, config={"backward": "tiled", "prefetch": 2}, fwd_config={})
    with pytest.raises(ValueError, match=r"config prefetch must be one of \(False, True, 2, 3, 4\) for the per_token"):
        _run(inp, torch.float32, 1, config={"backward": "per_token", "prefetch": 5}, fwd_config={})
    with pytest.raises(ValueError, match=r"config exact_softmax_grad must be True or False; found 1"):
        _run(inp, torch.float32, 1, config={"exact_softmax_grad": 1}, fwd_config={})
    with pytest.raises(ValueError, match=r"config stages=2 pipelines the per_token backward only; the tiled backward "
                                         r"takes 0 or 1"):
        _run(inp, torch.float32, 1, config={"backward": "tiled", "stages": 2}, fwd_config={})
    with pytest.raises(ValueError, match=r"route_many \(Triton\): config prefetch must be one of \(False, True\); "
                                         r"found 2"):  # the forward's check
        route_many_triton.route_many_forward([v.to(DEVICE) for v in inp["values"]], inp["queries"].to(DEVICE),
                                             inp["key_norm_weights"].to(DEVICE), 1, 1e-6, {"prefetch": 2})


def test_backward_is_deterministic():
    inp = _make(9, 6, (6,), 64, 1, torch.bfloat16, 3)
    first, second = _run(inp, torch.bfloat16, 3), _run(inp, torch.bfloat16, 3)
    assert all(torch.equal(a, b) for a, b in zip(first[2], second[2]))


@pytest.mark.parametrize("n", [2, 3, 9])
def test_per_token_prefetch_depth_changes_no_bit(n):
    """The per-token backward's prefetch depths 0 to 4 and its 3-stage pipeline move loads,
    not arithmetic: the same bits (n = 2, 3: the sources ahead run past the last)."""
    inp = _make(n, 6, (6,), 64, 1, torch.bfloat16, 3)
    loads = [{"prefetch": False}, {"prefetch": True}, {"prefetch": 2}, {"prefetch": 3}, {"prefetch": 4},
             {"stages": 3}]
    runs = [_run(inp, torch.bfloat16, 3, config={"backward": "per_token", **load}, fwd_config={}) for load in loads]
    for other in runs[1:]:
        assert len(other[2]) == len(runs[0][2]) == n + 2
        assert all(torch.equal(a, b) for a, b in zip(runs[0][2], other[2]))


@pytest.mark.parametrize("heads,s", [(2, 6), (1, 9)])
def test_parameter_reduction_matches_float64_and_its_pipeline_changes_no_bit(heads, s):
    """``_param_reduction`` (``r[s, col] = sum over sources i and tokens t of coef[i, s, t,
    head(col)] * v_i[t, col]``) against float64, over enough tokens that each program sums
    several tiles of each source (one program per SM on the GPU; the interpreter runs few
    programs, and fewer tokens do); with 2 and 3 pipeline stages the same bits as without
    (the loads move, not the sums). 9 queries: two chunks of queries."""
    n, tokens, d = 5, 8192 if DEVICE == "cuda" else 512, 64
    gen = torch.Generator().manual_seed(heads + s)
    values = [torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(n)]
    coef = torch.randn(n, s, tokens, heads, generator=gen).to(DEVICE)
    (vtab,) = pointer_tables(values[0].device, values)
    runs = [route_many_triton._param_reduction(vtab, values[0], coef, s, d, heads, tokens, n, True,
                                               {"param_stages": stages, "param_per_sm": 1}) for stages in (0, 2, 3)]
    per_column = coef.double().repeat_interleave(d // heads, dim=3)  # (n, s, tokens, d)
    want = torch.einsum("istc,itc->sc", per_column, torch.stack(values).double())
    assert _rel(runs[0].total().reshape(s, d), want) < 1e-5
    assert all(torch.equal(runs[0].part, other.part) for other in runs[1:])  # the partial sums, bit for bit


@pytest.mark.parametrize("entry,value,message", [
    ("param_stages", -1, "config param_stages must be an int >= 0; found -1"),
    ("param_stages", True, "config param_stages must be an int >= 0; found True"),
    ("param_per_sm", 0, "config param_per_sm must be a positive int; found 0"),
    ("param_per_sm", 2.5, "config param_per_sm must be a positive int; found 2.5"),
    ("maxnreg", 8, "config maxnreg must be an int from 16 to 255 or None; found 8"),
    ("per_sm", 0, "config per_sm must be a positive int; found 0"),
    ("per_sm", "2", "config per_sm must be a positive int; found '2'"),
    ("fused_sums", 1, "config fused_sums must be True or False; found 1"),
])
def test_bad_backward_launch_config_is_refused(entry, value, message):
    inp = _make(2, 2, (3,), 16, 1, torch.float32, 1)
    with pytest.raises(ValueError, match=r"route_many \(Triton\): " + re.escape(message)):
        _run(inp, torch.float32, 1, config={"backward": "tiled", entry: value}, fwd_config={})


def test_per_token_launch_follows_the_queries_a_program_holds(monkeypatch):
    table = {1: (8, None), 4: (3, 168), 8: (2, None)}
    monkeypatch.setattr(route_many_triton, "PER_TOKEN_LAUNCH", table)
    monkeypatch.setattr(route_many_triton, "OTHER_PER_TOKEN_LAUNCH", (5, 96))
    launch = route_many_triton._per_token_launch
    assert [launch(q, 1, 1024) for q in (1, 2, 4, 8, 16)] == [(8, None), (8, None), (3, 168), (2, None), (2, None)]
    # several heads and rows wider than NARROW_ROW were not timed with the table
    assert launch(4, 16, 1024) == launch(4, 1, 2048) == (5, 96)


def test_per_token_prefetch_follows_the_queries_a_program_holds(monkeypatch):
    monkeypatch.setattr(route_many_triton, "PER_TOKEN_PREFETCH", {2: 3, 8: 4})
    depth = route_many_triton._backward_prefetch
    # a block size under the smallest listed takes the smallest entry
    assert [depth("per_token", 1024, q) for q in (1, 2, 4, 8, 16)] == [3, 3, 3, 4, 4]
    # rows wider than PER_TOKEN_PREFETCH2_ROW, and the tiled backward, take one ahead
    assert depth("per_token", 4096, 8) == depth("tiled", 1024, 8) == 1
    # queries held as two tiles take TWO_TILE_PREFETCH, up to PER_TOKEN_PREFETCH2_ROW
    monkeypatch.setattr(route_many_triton, "TWO_TILE_PREFETCH", 3)
    assert depth("per_token", 1024, 8, two_tiles=True) == 3 and depth("per_token", 4096, 8, two_tiles=True) == 1
    # a call's padded queries: 6 queries in one chunk of 8; 16 heads in chunks of 2
    assert route_many_triton._per_token_block_q(6, 1, 1024, {}) == 8
    assert route_many_triton._per_token_block_q(6, 16, 1024, {}) == route_many_triton.MULTI_HEAD_BACKWARD_QUERIES


def test_calls_of_more_queries_than_the_per_token_limit_take_the_tiled_backward(monkeypatch):
    choose = route_many_triton._backward_kernel
    assert choose(1, {"backward": None}, False, 8) == "per_token"  # no limit by default
    monkeypatch.setattr(route_many_triton, "PER_TOKEN_MAX_QUERIES", 4)
    assert [choose(1, {"backward": None}, False, s) for s in (4, 5)] == ["per_token", "tiled"]
    assert choose(1, {"backward": "per_token"}, False, 5) == "per_token"  # a config's choice wins
    assert choose(2, {"backward": None}, False, 1) == choose(1, {"backward": None}, True, 1) == "tiled"


def test_too_wide_a_row_is_refused():
    values = [torch.zeros(1, 2 * MAX_ROW, device=DEVICE)]
    with pytest.raises(ValueError, match="pads to a row of"):
        route_many_triton.route_many_forward(values, torch.zeros(1, 2 * MAX_ROW, device=DEVICE),
                                             torch.ones(1, 2 * MAX_ROW, device=DEVICE), 1, 1e-6)


def test_one_source_without_lse_gradient_gives_exactly_zero_parameter_gradients():
    """With one source the weight is exactly 1 whatever the query: unless lse is used, the
    queries and key-norm weights get exactly zero gradient (as the reference gives; the
    first site of the first block of Block AttnRes is this case)."""
    inp = _make(1, 3, (4, 3), 48, 2, torch.float32, 11)
    values = [v.to(DEVICE) for v in inp["values"]]
    q, w = inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)
    out, lse = route_many_triton.route_many_forward(values, q, w, 2, 1e-6)
    assert all(torch.equal(o, values[0]) for o in out)
    grad_out = [torch.randn_like(o) for o in out]
    grads = route_many_triton.route_many_backward(grad_out, [torch.zeros_like(t) for t in lse], out, lse, values,
                                                  q, w, 2, 1e-6)
    assert grads[1] == []  # no keys
    assert torch.count_nonzero(grads[2]) == 0 and torch.count_nonzero(grads[3]) == 0
    torch.testing.assert_close(grads[0][0], sum(grad_out), rtol=1e-6, atol=1e-6)


def test_backward_refuses_saved_tensors_that_are_not_the_forward_outputs():
    """A mismatch would be read out of bounds by the kernel: it is refused, naming the entry."""
    values = [torch.randn(3, 8, device=DEVICE)]
    q, w = torch.randn(2, 8, device=DEVICE), torch.ones(2, 8, device=DEVICE)
    out, lse = route_many_triton.route_many_forward(values, q, w, 1, 1e-6)
    grads = ([torch.randn_like(o) for o in out], [torch.zeros_like(t) for t in lse])
    with pytest.raises(ValueError, match=r"`out\[1\]` must be the forward output"):
        route_many_triton.route_many_backward(*grads, [out[0], out[1][:, :4]], lse, values, q, w, 1, 1e-6)
    with pytest.raises(ValueError, match=r"`lse\[0\]` must be the forward's float32"):
        route_many_triton.route_many_backward(*grads, out, [lse[0].double(), lse[1]], values, q, w, 1, 1e-6)
    with pytest.raises(ValueError, match="one tensor per query"):
        route_many_triton.route_many_backward(*grads, out[:1], lse, values, q, w, 1, 1e-6)


@pytest.mark.parametrize("backward", ["tiled", "per_token"])
def test_alignment_hint_covers_every_row_read_through_a_table(backward, monkeypatch):
    """The kernels read rows through pointer tables and tell the compiler those rows are
    16-byte aligned (vector loads and stores) only when the launcher checked every tensor
    behind the hinted tables: outputs (forward), output gradients and saved outputs
    (backward). A contiguous view one element into its storage must turn the hint off."""
    calls = []
    for name in ("_route_many_fwd_kernel", "_route_many_bwd_tiled_kernel", "_route_many_bwd_kernel",
                 "_route_many_param_kernel"):
        monkeypatch.setattr(route_many_triton, name, _Launch(calls))
    inp = _make(3, 2, (4,), 64, 1, torch.bfloat16, 3)
    values, q, w = [v.to(DEVICE) for v in inp["values"]], inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)

    out = [torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    lse = [torch.randn(4, 1, device=DEVICE) for _ in range(2)]
    grads = [torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    gl = [torch.zeros(4, 1, device=DEVICE) for _ in range(2)]
    config = {"backward": backward}
    for g, o, aligned in ((grads, out, True), ([_shifted(grads[0]), grads[1]], out, False),
                          (grads, [out[0], _shifted(out[1])], False)):
        calls.clear()
        route_many_triton.route_many_backward(g, gl, o, lse, values, q, w, 1, 1e-6, config)
        assert calls[0]["ALIGNED"] is aligned
    calls.clear()
    route_many_triton.route_many_forward([_shifted(values[0])] + values[1:], q, w, 1, 1e-6)
    assert calls and not calls[0]["ALIGNED"]


@pytest.mark.parametrize("keys", [False, True])
@pytest.mark.parametrize("backward", ["tiled", "per_token"])
def test_no_tokens_gives_empty_outputs_and_zero_parameter_gradients(backward, keys):
    """An empty batch launches nothing: empty outputs and source gradients of the sources'
    shape, zero query and key-norm-weight gradients, from either backward kernel."""
    empty = [torch.randn(0, 16, device=DEVICE) for _ in range(3)]
    key_list = [torch.randn(0, 16, device=DEVICE) for _ in range(3)] if keys else None
    queries, weights = torch.randn(2, 16, device=DEVICE), torch.ones(2, 16, device=DEVICE)
    out, lse = route_many_triton.route_many_forward(empty, queries, weights, 1, 1e-6, keys=key_list)
    assert [o.shape for o in out] == [(0, 16)] * 2 and [t.shape for t in lse] == [(0, 1)] * 2
    grad_v, grad_k, grad_q, grad_w = route_many_triton.route_many_backward(
        [torch.zeros_like(o) for o in out], [torch.zeros_like(t) for t in lse], out, lse, empty, queries, weights,
        1, 1e-6, {"backward": backward}, keys=key_list)
    assert [t.shape for t in grad_v] == [(0, 16)] * 3 and [t.shape for t in grad_k] == [(0, 16)] * (3 if keys else 0)
    assert not grad_q.any() and not grad_w.any() and grad_q.shape == grad_w.shape == (2, 16)


# ------------------------------------------------- the forward's statistics kept for the backward


@pytest.mark.parametrize("config", [None, {"many_elems": 64}], ids=["one_chunk", "chunks_of_2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_keeps_the_reference_statistics(dtype, config):
    """The stats table the forward fills (every chunk of queries its logits, the first chunk
    the keys' rstd) is the reference op's, at odd token counts and 9 sources."""
    from depthrewrite.ops.route_many import _route_many_op

    inp = _make(9, 3, (7,), 32, 1, dtype, 11)
    values = [v.to(DEVICE) for v in inp["values"]]
    q, w = inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)
    stats = stats_table(values, q, 1, None)
    route_many_triton.route_many_forward(values, q, w, 1, 1e-6, config, stats=stats)
    _, _, want = _route_many_op._init_fn(inp["values"], inp["queries"], inp["key_norm_weights"], 1, 1e-6, None)
    assert stats.shape == want.shape == (7, 9, 4)
    assert _rel(stats[..., :3], want[..., :3]) < 1e-5  # the logits of the 3 queries
    assert _rel(stats[..., 3], want[..., 3]) < 1e-6  # the keys' rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,s,batch,d", [(1, 3, (5,), 24), (9, 2, (5,), 100), (33, 4, (3,), 40)])
def test_backward_recomputes_what_it_is_not_given(n, s, batch, d, dtype):
    """Without the stats table the per-token backward forms the logits and rstd from the rows
    (its path where the op keeps none): against float64 as with it (the main test)."""
    inp = _make(n, s, batch, d, 1, dtype, n + s)
    out, _, grads, grad_out, grad_lse = _run(inp, dtype, n + s, keep_stats=False)
    _, _, oracle = _oracle_f64(inp, grad_out, grad_lse, saved_out=out)
    with_stats = _run(inp, dtype, n + s)[2]
    for k, (got, want, kept) in enumerate(zip(grads, oracle, with_stats)):
        limit = 1e-5 if k in (n, n + 1) else TOL[dtype]
        assert _rel(got, want) < limit and _rel(kept, want) < limit, (k, _rel(got, want), _rel(kept, want))


def test_bad_stats_table_is_refused():
    inp = _make(3, 2, (5,), 16, 1, torch.float32, 1)
    values = [v.to(DEVICE) for v in inp["values"]]
    q, w = inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)
    message = re.escape("`stats` must be a contiguous float32 tensor of shape (5, 3, 3) (tokens, sources, "
                        "queries * heads + 1)")
    for bad in (torch.empty(5, 3, 2, device=DEVICE), torch.empty(5, 3, 3, dtype=torch.float64, device=DEVICE),
                torch.empty(3, 5, 3, device=DEVICE).transpose(0, 1)):
        with pytest.raises(ValueError, match=r"^route_many \(Triton\): " + message):
            route_many_triton.route_many_forward(values, q, w, 1, 1e-6, stats=bad)


# ------------------------------------------- running sums added as the gradients are stored


def _running_sums_case(n, s, heads, dtype, seed, keys):
    """``_make``'s inputs (7 tokens, d = 100) and running sums: values' for all sources but
    every third, keys' (with keys) for the odd ones."""
    inp = _make(n, s, (7,), 100, heads, dtype, seed, keys)
    gen = torch.Generator().manual_seed(seed + 1)
    running_v = [None if i % 3 == 1 else torch.randn(7, 100, generator=gen).to(dtype) for i in range(n)]
    running_k = [torch.randn(7, 100, generator=gen).to(dtype) if i % 2 else None for i in range(n)] if keys else None
    return inp, running_v, running_k


def _backward_with_running_sums(inp, dtype, seed, config, running):
    """The backward of ``_run``'s forward with the running sums ``running`` (per source None or
    a tensor; values' and, with keys, keys' lists), the same backward without them, the
    float64 oracle's gradients, and the backward itself (running sums and outputs as
    arguments)."""
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    values = [dev(v) for v in inp["values"]]
    keys = None if inp["keys"] is None else [dev(k) for k in inp["keys"]]
    q, w = dev(inp["queries"]), dev(inp["key_norm_weights"])
    stats = stats_table(values, q, inp["heads"], keys)
    out, lse = route_many_triton.route_many_forward(values, q, w, inp["heads"], 1e-6, config, keys=keys, stats=stats)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = [dev(torch.randn(o.shape, generator=gen).to(dtype)) for o in out]
    grad_lse = [dev(torch.randn(t.shape, generator=gen)) for t in lse]

    def backward(acc_v=None, acc_k=None, out_v=None, out_k=None):
        return route_many_triton.route_many_backward(grad_out, grad_lse, out, lse, values, q, w, inp["heads"], 1e-6,
                                                     config, keys=keys, stats=stats, grad_values_acc=acc_v,
                                                     grad_keys_acc=acc_k, grad_values_out=out_v, grad_keys_out=out_k)

    plain = backward()
    summed = backward(*[None if r is None else [None if t is None else dev(t) for t in r] for r in running])
    oracle = _oracle_f64(inp, [g.cpu() for g in grad_out], [g.cpu() for g in grad_lse],
                         saved_out=[o.cpu() for o in out])[2]
    return plain, summed, oracle, backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backward,keys,config,heads", [
    ("per_token", False, None, 1),
    ("per_token", False, {"many_elems": 200}, 1),  # chunks of 2 queries: the sums added at the last chunk's store
    ("per_token", False, {"prefetch": 0}, 1),  # each source's sum loaded with it, not one ahead
    ("per_token", False, {"stages": 2}, 1),  # the sources and sums through Triton's pipeline
    ("per_token", True, None, 1),
    ("tiled", False, None, 1),
    ("tiled", True, None, 1),
    ("tiled", False, None, 4),  # grouped MHAR's calls (grad_accumulation.ROUTE_MANY_MULTI_HEAD)
], ids=["per_token", "per_token_chunks", "per_token_pf0", "per_token_stages", "per_token_keys", "tiled",
        "tiled_keys", "tiled_heads"])
def test_running_sums_are_added_to_the_gradients_as_they_are_stored(backward, keys, config, heads, dtype):
    """With running sums (depthrewrite.grad_accumulation) each source gradient comes out as
    its running sum plus the gradient, added in float32 and rounded once: in float32 what
    adding the running sum to the plain gradient gives, within one rounding of each (on the
    GPU the add may be fused into the gradient's last multiply, an FMA: the key gradients'
    ``rstd * (...) + acc``), in bf16 within the usual tolerance of the float64 sum; sources
    without one, and the parameter gradients, bit for bit as without running sums. 9
    sources, 5 queries (two chunks of queries with the config), odd tokens."""
    n, s = 9, 5
    inp, running_v, running_k = _running_sums_case(n, s, heads, dtype, 71, keys)
    cfg = {"backward": backward, **(config or {})}
    plain, summed, oracle, _ = _backward_with_running_sums(inp, dtype, 71, cfg, (running_v, running_k))
    pairs = [(f"values[{i}]", plain[0][i], summed[0][i], oracle[i], running_v[i]) for i in range(n)]
    if keys:
        pairs += [(f"keys[{i}]", plain[1][i], summed[1][i], oracle[n + 2 + i], running_k[i]) for i in range(n)]
    for name, without, got, want, acc in pairs:
        assert got.dtype == dtype, name
        if acc is None:
            assert torch.equal(got, without), name
        elif dtype == torch.float32:
            added = without + acc.to(DEVICE)
            one_rounding = 2.0**-23 * (without.abs() + added.abs())
            assert ((got - added).abs() <= one_rounding).all(), (name, (got - added).abs().max().item())
        else:
            assert _rel(got.cpu(), want + acc.double()) < TOL[dtype], (name, _rel(got.cpu(), want + acc.double()))
    assert torch.equal(summed[2], plain[2]) and torch.equal(summed[3], plain[3])


def _in_place_outputs(running, like, dtype):
    """The tensors a ``route_many_backward_into_`` call writes into: each source's running sum
    (a copy, on the device) where it has one, else a NaN-filled buffer (every element must be
    written); and the running sums as the call takes them (the same tensors)."""
    outputs = [torch.full(like.shape, float("nan"), dtype=dtype, device=DEVICE) if r is None else r.to(DEVICE).clone()
               for r in running]
    return outputs, [o if r is not None else None for o, r in zip(outputs, running)]


@pytest.mark.parametrize("backward,keys,config,heads,dtype", [
    ("per_token", False, None, 1, torch.bfloat16),  # full AttnRes's calls: one chunk of queries
    ("per_token", False, {"many_elems": 200}, 1, torch.float32),  # fp32 chunks: the partial sums kept apart
    ("tiled", True, None, 4, torch.bfloat16),
], ids=["per_token", "per_token_chunks_fp32", "tiled_keys_heads"])
def test_running_sums_written_in_place_give_the_new_tensors_bits(backward, keys, config, heads, dtype):
    """Given the tensors to write into, a running sum among them (``route_many_backward_into_``),
    each source gradient lands in its own given tensor, bit for bit what the call writes into
    new tensors, and so do the parameter gradients. In float32 with chunks of queries the
    earlier chunks' parts go to separate buffers: in the running sum itself they would be
    overwritten before the last chunk adds it."""
    n, s = 9, 5
    inp, running_v, running_k = _running_sums_case(n, s, heads, dtype, 81, keys)
    cfg = {"backward": backward, **(config or {})}
    _, summed, _, call = _backward_with_running_sums(inp, dtype, 81, cfg, (running_v, running_k))
    out_v, acc_v = _in_place_outputs(running_v, summed[0][0], dtype)
    out_k, acc_k = _in_place_outputs(running_k, summed[0][0], dtype) if keys else (None, None)
    got = call(acc_v, acc_k, out_v, out_k)
    assert all(a is b for a, b in zip(got[0], out_v)) and all(a is b for a, b in zip(got[1], out_k or []))
    for i in range(n):
        assert torch.equal(got[0][i], summed[0][i]), f"values[{i}]"
        if keys:
            assert torch.equal(got[1][i], summed[1][i]), f"keys[{i}]"
    assert torch.equal(got[2], summed[2]) and torch.equal(got[3], summed[3])


@pytest.mark.parametrize("keys", [False, True], ids=["values", "keys"])
def test_the_in_place_op_writes_what_the_op_returns(keys):
    """``depthrewrite::route_many_backward_into_`` (the backend's ``accumulate_in_place``)
    writes each source gradient into the tensor given for it (its running sum, added to, or
    a buffer), bit for bit what ``route_many_backward`` returns with the same running sums,
    and returns the same parameter gradients: the kernels on the GPU, the reference on the
    CPU. Its bad outputs are refused with the op and the argument named."""
    dtype, n, s = torch.bfloat16, 5, 3
    inp = _make(n, s, (2, 3), 64, 1, dtype, 91, keys)
    values = [v.to(DEVICE) for v in inp["values"]]
    keys_ = [k.to(DEVICE) for k in inp["keys"]] if keys else None
    q, w = inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)
    out, lse, stats = torch.ops.depthrewrite.route_many(values, q, w, 1, 1e-6, keys_)
    gen = torch.Generator().manual_seed(92)
    grad_out = [torch.randn(o.shape, generator=gen).to(dtype).to(DEVICE) for o in out]
    grad_lse = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in lse]
    lists = {"values": values, "keys": keys_ or []}
    index = {name: [i for i in range(len(like)) if i % 2 == odd] for odd, (name, like) in enumerate(lists.items())}
    acc = {name: [torch.randn(t.shape, generator=gen).to(dtype).to(DEVICE) if i in index[name] else None
                  for i, t in enumerate(like)] for name, like in lists.items()}
    expected = torch.ops.depthrewrite.route_many_backward(grad_out, grad_lse, out, lse, stats, values, q, w, 1, 1e-6,
                                                          keys_, acc["values"], acc["keys"] if keys else None)
    given = {name: [a.clone() if a is not None else torch.full_like(t, float("nan")) for a, t in zip(acc[name], like)]
             for name, like in lists.items()}
    pointers = {name: [t.data_ptr() for t in outs] for name, outs in given.items()}
    into = torch.ops.depthrewrite.route_many_backward_into_
    rest = into(grad_out, grad_lse, out, lse, stats, values, q, w, 1, 1e-6, keys_, given["values"], index["values"],
                given["keys"], index["keys"])
    for group, name in enumerate(("values", "keys")):
        assert [t.data_ptr() for t in given[name]] == pointers[name]  # written where given
        for got, want in zip(given[name], expected[group], strict=True):
            assert torch.equal(got, want)
    assert torch.equal(rest[0], expected[2]) and torch.equal(rest[1], expected[3])
    buffers = [torch.zeros_like(v) for v in values]
    with pytest.raises(ValueError, match=r"^route_many_backward_into_: `grad_values` must have one tensor per source "
                                         r"\(5\); found 4"):
        into(grad_out, grad_lse, out, lse, stats, values, q, w, 1, 1e-6, keys_, buffers[:4], [0], given["keys"], [])
    with pytest.raises(ValueError, match=r"^route_many_backward_into_: `grad_values` running-sum indices must be "
                                         r"distinct sources from 0 to 4; found \[1, 1\]"):
        into(grad_out, grad_lse, out, lse, stats, values, q, w, 1, 1e-6, keys_, buffers, [1, 1], given["keys"], [])


def test_in_place_outputs_with_no_tokens_and_bad_outputs():
    """No tokens: the outputs given are the outputs returned (a running sum among them).
    Outputs of the wrong shape or count, or keys' outputs without keys, are refused with the
    argument named."""
    values = [torch.randn(0, 16, device=DEVICE) for _ in range(3)]
    q, w = torch.randn(2, 16, device=DEVICE), torch.ones(2, 16, device=DEVICE)
    out, lse = route_many_triton.route_many_forward(values, q, w, 1, 1e-6)
    grads = [torch.empty(0, 16, device=DEVICE) for _ in out]
    glse = [torch.empty(0, 1, device=DEVICE) for _ in lse]
    outputs = [torch.empty(0, 16, device=DEVICE) for _ in values]
    got = route_many_triton.route_many_backward(grads, glse, out, lse, values, q, w, 1, 1e-6,
                                                grad_values_acc=[None, outputs[1], None], grad_values_out=outputs)
    assert all(a is b for a, b in zip(got[0], outputs))
    vals = [torch.randn(3, 16, device=DEVICE) for _ in range(3)]
    out, lse = route_many_triton.route_many_forward(vals, q, w, 1, 1e-6)
    grads = [torch.randn(3, 16, device=DEVICE) for _ in out]
    glse = [torch.zeros(3, 1, device=DEVICE) for _ in lse]
    with pytest.raises(ValueError, match=r"route_many_backward \(Triton\): `grad_values_out` must be 3 contiguous "
                                         r"tensors shaped \(3, 16\)"):
        route_many_triton.route_many_backward(grads, glse, out, lse, vals, q, w, 1, 1e-6,
                                              grad_values_out=[torch.empty(3, 16, device=DEVICE)] * 2)
    with pytest.raises(ValueError, match=r"`grad_values_out` and `grad_keys_out` come together where there are keys, "
                                         r"the latter empty or None without; found 3 tensors and 1 tensors for 0 keys"):
        route_many_triton.route_many_backward(grads, glse, out, lse, vals, q, w, 1, 1e-6,
                                              grad_values_out=[torch.empty(3, 16, device=DEVICE) for _ in range(3)],
                                              grad_keys_out=[torch.empty(3, 16, device=DEVICE)])


def test_running_sums_take_the_pipeline_by_the_queries_a_program_holds(monkeypatch):
    stages = route_many_triton._backward_stages
    monkeypatch.setattr(route_many_triton, "RUNNING_PER_TOKEN_STAGES", {1: 3, 2: 0, 4: 5})
    # one head, rows up to NARROW_ROW: by the padded queries, only with running sums
    assert [stages("per_token", 1024, False, True, q) for q in (1, 2, 4, 8)] == [3, 0, 5, 5]
    assert [stages("per_token", 1024, False, False, q) for q in (1, 4)] == [0, 0]
    # wider rows and separate keys: WIDE_PER_TOKEN_STAGES either way; the tiled backward: none
    wide = route_many_triton.WIDE_PER_TOKEN_STAGES
    assert stages("per_token", 2048, False, True, 2) == stages("per_token", 1024, True, False, 2) == wide
    assert stages("tiled", 1024, False, True, 4) == 0


@pytest.mark.parametrize("s", [1, 4])
def test_running_sums_at_full_attnres_query_counts_match_float64(s):
    """The default launch with running sums at full AttnRes's query counts
    (RUNNING_PER_TOKEN_STAGES: the sources through Triton's pipeline at 4 queries, the
    register prefetch at 1), bf16, odd tokens: each gradient with a running sum against the
    float64 gradient plus that sum, each without one and the parameter gradients against
    the plain backward's (which takes the register prefetch)."""
    n, dtype = 9, torch.bfloat16
    inp, running, _ = _running_sums_case(n, s, 1, dtype, 73, False)
    plain, summed, oracle, _ = _backward_with_running_sums(inp, dtype, 73, {"backward": "per_token"}, (running, None))
    for i, acc in enumerate(running):
        want = oracle[i] if acc is None else oracle[i] + acc.double()
        assert _rel(summed[0][i].cpu(), want) < TOL[dtype], i
        if acc is None:
            assert _rel(summed[0][i].cpu(), plain[0][i].cpu()) < TOL[dtype], i
    for k in (2, 3):
        assert _rel(summed[k].cpu(), plain[k].cpu()) < 1e-6, k


def test_bad_running_sums_are_refused():
    inp = _make(3, 2, (5,), 16, 1, torch.float32, 1)
    values = [v.to(DEVICE) for v in inp["values"]]
    q, w = inp["queries"].to(DEVICE), inp["key_norm_weights"].to(DEVICE)
    out, lse = route_many_triton.route_many_forward(values, q, w, 1, 1e-6)
    args = ([torch.zeros_like(o) for o in out], [torch.zeros_like(t) for t in lse], out, lse, values, q, w, 1, 1e-6)
    with pytest.raises(ValueError, match=re.escape("route_many_backward: `grad_values_acc` must have one entry per "
                                                   "source (3); found 2")):
        route_many_triton.route_many_backward(*args, grad_values_acc=[None, values[0]])
    with pytest.raises(ValueError, match=re.escape("route_many_backward: `grad_values_acc[1]` must be None or shaped "
                                                   "and typed like source 1")):
        route_many_triton.route_many_backward(*args, grad_values_acc=[None, values[1].double(), None])
    with pytest.raises(ValueError, match=re.escape("route_many_backward: `grad_keys_acc` must be None when there are "
                                                   "no keys")):
        route_many_triton.route_many_backward(*args, grad_keys_acc=[None] * 3)
