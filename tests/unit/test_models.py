"""Bundled GPT and MoE models: shapes, causality, training signal, MoE dispatch against a
dense reference, config validation, presets, state_dict round trip, and the block shape
the rewriter relies on (literal residual adds, traceable with children as leaves)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from depthrewrite.models import (
    GPT,
    GPT_PRESETS,
    MOE_PRESETS,
    Block,
    GPTConfig,
    MoEBlock,
    MoEConfig,
    MoEFeedForward,
    MoEGPT,
    ParallelBlock,
    ParallelMoEBlock,
    RMSNorm,
    expert_counts,
    gpt_from_preset,
    load_balancing_loss,
    moe_from_preset,
    route,
)





SMALL = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=32)

GPT_VARIANTS = {
    f"{'par' if par else 'seq'}-{norm}-{'tied' if tied else 'untied'}": dict(
        SMALL, parallel_block=par, norm=norm, tie_embeddings=tied
    )
    for par in (False, True)
    for norm in ("rms", "layer")
    for tied in (False, True)
}
GPT_VARIANTS["seq-rms-gqa"] = dict(SMALL, n_kv_head=2)
GPT_VARIANTS["seq-rms-embedscale"] = dict(SMALL, embed_scale=32**0.5)

MOE_VARIANTS = {
    "seq-top2-shared": dict(SMALL, n_experts=4, top_k=2, expert_hidden=48, shared_expert=True),
    "seq-top1": dict(SMALL, n_experts=4, top_k=1, expert_hidden=48),
    "par-top2-layer": dict(SMALL, n_experts=3, top_k=2, expert_hidden=40, parallel_block=True, norm="layer"),
}


def build(kind: str, kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig(**kwargs))
    return MoEGPT(MoEConfig(**kwargs))


ALL_VARIANTS = [("gpt", k, v) for k, v in GPT_VARIANTS.items()] + [("moe", k, v) for k, v in MOE_VARIANTS.items()]
ALL_IDS = [f"{kind}-{name}" for kind, name, _ in ALL_VARIANTS]


def random_ids(vocab: int, shape=(2, 12), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- shapes and causality


@pytest.mark.parametrize("kind,name,kwargs", ALL_VARIANTS, ids=ALL_IDS)
def test_shapes_and_causal(kind, name, kwargs):
    model = build(kind, kwargs).eval()
    ids = random_ids(kwargs["vocab_size"])
    logits = model(ids)
    assert logits.shape == (2, 12, kwargs["vocab_size"])
    assert torch.isfinite(logits).all()

    logits2, loss = model(ids, ids)
    assert torch.equal(logits, logits2)
    assert loss.shape == () and torch.isfinite(loss)

    # Changing token 7 must leave positions 0..6 untouched and change position 7.
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % kwargs["vocab_size"]
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7], b[:, 7])


def test_ignore_index_and_loss_value():
    model = build("gpt", GPT_VARIANTS["seq-rms-untied"]).eval()
    ids = random_ids(64)
    targets = ids.clone()
    targets[:, :3] = -1
    logits, loss = model(ids, targets)
    expected = F.cross_entropy(logits[:, 3:].reshape(-1, 64), ids[:, 3:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_forward_input_errors():
    model = build("gpt", GPT_VARIANTS["seq-rms-untied"])
    with pytest.raises(ValueError, match="input_ids must have shape"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len=32, found 33"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must have the shape"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))


# ---------------------------------------------------------------- training signal


@pytest.mark.parametrize("kind", ["gpt", "moe"])
def test_loss_decreases_memorisation(kind):
    model = gpt_from_preset("tiny") if kind == "gpt" else moe_from_preset("tiny")
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(20):
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Start near ln(256) = 5.55; memorising 124 random tokens drives it well down.
    assert abs(losses[0] - 5.55) < 0.3, losses
    assert losses[-1] < losses[0] - 1.5, losses


# ---------------------------------------------------------------- MoE dispatch


def naive_moe(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; a (N, E) gate that is zero outside the top-k."""
    d = x.shape[-1]
    xf = x.reshape(-1, d)
    probs = moe.router(xf).float().softmax(-1)
    top_w, top_i = probs.topk(moe.top_k, dim=-1)
    gate = torch.zeros_like(probs).scatter(1, top_i, top_w / top_w.sum(-1, keepdim=True))
    ex = moe.experts
    outs = []
    for e in range(moe.n_experts):
        h = F.silu(xf @ ex.w_gate[e].T) * (xf @ ex.w_up[e].T)
        outs.append(h @ ex.w_down[e].T)
    out = (gate.unsqueeze(-1) * torch.stack(outs, dim=1)).sum(1)
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(xf)
    return out.view(x.shape)


def _cpu_grouped_mm_works() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(6, 8, requires_grad=True)
        b = torch.randn(2, 8, 8, requires_grad=True)
        out = torch._grouped_mm(a, b, offs=torch.tensor([2, 6], dtype=torch.int32))
        out.backward(torch.ones_like(out).contiguous())
    except (RuntimeError, NotImplementedError):
        return False
    return True


GROUPED_PATHS = [
    False,
    pytest.param(
        True, marks=pytest.mark.skipif(not _cpu_grouped_mm_works(), reason="torch._grouped_mm not on CPU here")
    ),
]


@pytest.mark.parametrize("use_grouped_mm", GROUPED_PATHS, ids=["loop", "grouped_mm"])
@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_moe_matches_dense_reference(name, use_grouped_mm):
    cfg = MoEConfig(**MOE_VARIANTS[name])
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    moe.reset_parameters(0.3, 0.3)  # large weights: routing far from uniform, outputs O(1)
    moe.experts.use_grouped_mm = use_grouped_mm
    x = torch.randn(3, 7, cfg.d_model, requires_grad=True)

    out = moe(x)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *moe.parameters()], grad_out)

    ref = naive_moe(moe, x)
    ref_grads = torch.autograd.grad(ref, [x, *moe.parameters()], grad_out)

    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # Gradients sum over tokens in another order (per expert vs all at once) and reach
    # O(10) with these weights: a relative tolerance too.
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for n, g, r in zip(names, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"grad of {n}: {m}")


def test_moe_expert_with_no_tokens():
    cfg = MoEConfig(**MOE_VARIANTS["seq-top1"])
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    with torch.no_grad():  # the router sends everything to expert 2
        moe.router.weight.zero_()
        moe.router.weight[2].fill_(1.0)
    x = torch.rand(2, 5, cfg.d_model) + 0.1
    assert torch.isfinite(moe(x)).all()
    _, _, idx = route(moe.router(x.reshape(-1, cfg.d_model)), cfg.top_k)
    assert (idx == 2).all()
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=0, atol=1e-5)


def test_route_renormalises_top_k():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(0))
    probs, weights, idx = route(logits, top_k=3)
    torch.testing.assert_close(probs, logits.softmax(-1))
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    chosen = probs.gather(1, idx)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    # The chosen experts are the k most probable.
    assert (chosen.min(-1).values >= probs.sort(-1, descending=True).values[:, 2] - 1e-7).all()


def test_load_balancing_loss_hand_made():
    probs = torch.tensor(
        [
            [0.7, 0.1, 0.1, 0.1],
            [0.6, 0.2, 0.1, 0.1],
            [0.1, 0.6, 0.2, 0.1],
            [0.1, 0.1, 0.1, 0.7],
        ]
    )
    # top-1: experts [0, 0, 1, 3] -> f = [1/2, 1/4, 0, 1/4]; P = column means
    # = [0.375, 0.25, 0.125, 0.25]; loss = 4 * (0.1875 + 0.0625 + 0 + 0.0625) = 1.25
    idx1 = torch.tensor([[0], [0], [1], [3]])
    torch.testing.assert_close(load_balancing_loss(probs, idx1), torch.tensor(1.25))
    # top-2: assignments [0,1], [0,1], [1,2], [3,0] -> counts [3, 3, 1, 1] / 8
    idx2 = torch.tensor([[0, 1], [0, 1], [1, 2], [3, 0]])
    assert expert_counts(idx2, 4).tolist() == [3, 3, 1, 1]
    expected = 4 * (3 / 8 * 0.375 + 3 / 8 * 0.25 + 1 / 8 * 0.125 + 1 / 8 * 0.25)
    torch.testing.assert_close(load_balancing_loss(probs, idx2), torch.tensor(expected))
    # Uniform routing gives exactly 1.
    uniform = torch.full((4, 4), 0.25)
    torch.testing.assert_close(load_balancing_loss(uniform, torch.arange(4).view(4, 1)), torch.tensor(1.0))


def test_moe_aux_loss_stored_and_added():
    model = build("moe", MOE_VARIANTS["seq-top2-shared"])
    ids = random_ids(64)
    logits, loss = model(ids, ids)
    moes = [b.moe for b in model.blocks]
    for m in moes:
        assert m.aux_loss.shape == () and m.aux_loss.requires_grad
    # Each layer's aux loss is the formula on its own router output.
    h = model.embed(ids)
    rope = (model.rope_cos[:12], model.rope_sin[:12])
    block = model.blocks[0]
    n = block.norm_mlp(h + block.attn(block.norm_attn(h), rope))
    probs, _, idx = route(block.moe.router(n.reshape(-1, 32)), 2)
    torch.testing.assert_close(moes[0].aux_loss, load_balancing_loss(probs, idx))

    ce = F.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1))
    aux = sum(m.aux_loss for m in moes)
    torch.testing.assert_close(model.aux_loss(), aux)
    torch.testing.assert_close(loss, ce + model.config.aux_loss_coef * aux)
    loss.backward()
    assert model.blocks[0].moe.router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- config validation

BAD_CONFIGS = [
    (GPTConfig, dict(d_model=65, n_head=4), "d_model must be divisible by n_head"),
    (GPTConfig, dict(d_model=12, n_head=4), "head_dim .* must be even"),
    (GPTConfig, dict(n_head=4, n_kv_head=3), "n_head must be divisible by n_kv_head"),
    (GPTConfig, dict(norm="batch"), "norm must be 'rms' or 'layer', found 'batch'"),
    (GPTConfig, dict(d_model=0), "d_model must be a positive int, found 0"),
    (GPTConfig, dict(n_layer=2.0), "n_layer must be a positive int"),
    (GPTConfig, dict(dropout=1.0), "dropout must be in"),
    (GPTConfig, dict(norm_eps=0.0), "norm_eps must be > 0"),
    (GPTConfig, dict(init_std=-0.02), "init_std must be > 0"),
    (MoEConfig, dict(n_experts=4, top_k=5), r"top_k must be in \[1, n_experts=4\], found top_k=5"),
    (MoEConfig, dict(n_experts=0), "n_experts must be a positive int"),
    (MoEConfig, dict(top_k=0), "top_k must be a positive int"),
    (MoEConfig, dict(aux_loss_coef=-0.1), "aux_loss_coef must be >= 0"),
    (MoEConfig, dict(d_model=30, n_head=4), "d_model must be divisible by n_head"),
]


@pytest.mark.parametrize("cls,kwargs,match", BAD_CONFIGS, ids=[m.split(" ")[0] + str(i) for i, (_, _, m) in enumerate(BAD_CONFIGS)])
def test_config_errors(cls, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        cls(**kwargs)
    assert str(info.value).startswith(cls.__name__ + ":")


def test_config_defaults_and_revalidation():
    c = GPTConfig(d_model=64, n_head=4)
    assert c.n_kv_head == 4 and c.mlp_hidden == 176 and c.vocab_size == 256
    assert GPTConfig(d_model=768, n_head=12).mlp_hidden == 2048
    assert GPTConfig(d_model=1024, n_head=16).mlp_hidden % 64 == 0
    assert MoEConfig(d_model=64, n_head=4).expert_hidden == 176
    c.n_head = 5  # edited after construction: the model checks again
    with pytest.raises(ValueError, match="d_model must be divisible by n_head"):
        GPT(c)
    with pytest.raises(ValueError, match="config must be a MoEConfig, found GPTConfig"):
        MoEGPT(GPTConfig())
    with pytest.raises(ValueError, match="preset name must be one of"):
        gpt_from_preset("huge")
    with pytest.raises(ValueError, match=r"unknown \['d_modle'\]"):
        gpt_from_preset("tiny", d_modle=32)


# ---------------------------------------------------------------- presets and init


def _meta_count(factory, name, **overrides):
    with torch.device("meta"):  # counts without allocating or initialising 350M floats
        return factory(name, **overrides)


@pytest.mark.parametrize(
    "factory,name,overrides,low,high",
    [
        (gpt_from_preset, "tiny", {}, 0.15e6, 0.3e6),
        (gpt_from_preset, "small", {}, 5e6, 8e6),
        (gpt_from_preset, "base", {}, 80e6, 90e6),
        (gpt_from_preset, "medium", {}, 290e6, 320e6),
        # The GPT-2 size classes, whose advertised counts include a GPT-2 vocabulary.
        (gpt_from_preset, "base", dict(vocab_size=50304, tie_embeddings=True), 120e6, 130e6),
        (gpt_from_preset, "medium", dict(vocab_size=50304, tie_embeddings=True), 340e6, 370e6),
        (moe_from_preset, "tiny", {}, 0.4e6, 0.8e6),
        (moe_from_preset, "small", {}, 25e6, 35e6),
        (moe_from_preset, "medium", {}, 330e6, 370e6),
    ],
)
def test_preset_parameter_counts(factory, name, overrides, low, high):
    n = _meta_count(factory, name, **overrides).num_parameters()
    assert low <= n <= high, f"{name}: {n / 1e6:.2f}M not in [{low / 1e6}, {high / 1e6}]M"


def test_preset_shapes():
    assert set(GPT_PRESETS) >= {"tiny", "small", "base", "medium"}
    assert set(MOE_PRESETS) >= {"tiny", "small", "medium"}
    tiny = gpt_from_preset("tiny").config
    assert (tiny.d_model, tiny.n_layer, tiny.n_head) == (64, 4, 4)
    mt = moe_from_preset("tiny").config
    assert (mt.d_model, mt.n_layer, mt.n_experts, mt.top_k, mt.shared_expert) == (64, 4, 4, 2, True)
    assert moe_from_preset("tiny", top_k=1).config.top_k == 1


def test_num_parameters_tied_and_active():
    untied = build("gpt", GPT_VARIANTS["seq-rms-untied"])
    tied = build("gpt", GPT_VARIANTS["seq-rms-tied"])
    assert untied.num_parameters() - tied.num_parameters() == 64 * 32
    assert untied.num_parameters(non_embedding=True) == tied.num_parameters(non_embedding=True)
    moe = moe_from_preset("tiny")
    c = moe.config
    assert moe.num_parameters() - moe.num_active_parameters() == c.n_layer * 2 * 3 * 64 * 128


def test_init_scales_residual_projections():
    model = gpt_from_preset("tiny", n_layer=8)
    out_std = 0.02 / (2 * 8) ** 0.5
    for block in model.blocks:
        assert abs(block.attn.o_proj.weight.std().item() / out_std - 1) < 0.1
        assert abs(block.mlp.w_down.weight.std().item() / out_std - 1) < 0.1
        assert abs(block.attn.qkv.weight.std().item() / 0.02 - 1) < 0.1
        assert torch.equal(block.norm_attn.weight, torch.ones(64))
    moe = moe_from_preset("tiny")
    out_std = 0.02 / (2 * 4) ** 0.5
    assert abs(moe.blocks[0].moe.experts.w_down.std().item() / out_std - 1) < 0.1


def test_meta_init_then_materialise():
    ref = gpt_from_preset("tiny")
    with torch.device("meta"):
        model = gpt_from_preset("tiny")
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)
    model.load_state_dict(ref.state_dict())
    ids = random_ids(256)
    assert torch.equal(model(ids), ref(ids))


# ---------------------------------------------------------------- save / load


@pytest.mark.parametrize(
    "kind,name", [("gpt", "seq-rms-untied"), ("gpt", "par-layer-tied"), ("moe", "seq-top2-shared")]
)
def test_state_dict_round_trip_bit_identical(kind, name):
    kwargs = GPT_VARIANTS[name] if kind == "gpt" else MOE_VARIANTS[name]
    src = build(kind, kwargs, seed=0).eval()
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = build(kind, kwargs, seed=123).eval()
    dst.load_state_dict(torch.load(buf, weights_only=True))
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert "rope_cos" not in src.state_dict()  # derived from the config, not saved
    if kwargs.get("tie_embeddings"):
        assert dst.lm_head.weight is dst.embed.weight
    ids = random_ids(64)
    assert torch.equal(src(ids), dst(ids))


# ---------------------------------------------------------------- what the rewriter relies on


class _ChildrenAreLeaves(torch.fx.Tracer):
    def __init__(self, root):
        super().__init__()
        self.leaves = set(root.children())

    def is_leaf_module(self, m, qualname):
        return m in self.leaves or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize(
    "block_cls,kind,kwargs",
    [
        (Block, "gpt", GPT_VARIANTS["seq-rms-untied"]),
        (ParallelBlock, "gpt", GPT_VARIANTS["par-layer-untied"]),
        (MoEBlock, "moe", MOE_VARIANTS["seq-top2-shared"]),
        (ParallelMoEBlock, "moe", MOE_VARIANTS["par-top2-layer"]),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_block_traces_with_literal_residual_adds(block_cls, kind, kwargs):
    model = build(kind, kwargs)
    block = model.blocks[0]
    assert isinstance(block, block_cls)
    graph = _ChildrenAreLeaves(block).trace(block)
    ops = [n for n in graph.nodes if n.op == "call_function"]
    # Two adds, nothing else outside the children: the stream is only normed and added to.
    assert [n.target.__name__ for n in ops] == ["add", "add"]
    x = next(n for n in graph.nodes if n.op == "placeholder")
    readers = {u.op for u in x.users}
    assert readers == {"call_module", "call_function"}  # the norm and the first add
    norms = [u for u in x.users if u.op == "call_module"]
    assert len(norms) == 1 and norms[0].target.startswith("norm")
    # The traced block computes what the block computes.
    gm = torch.fx.GraphModule(block, graph)
    h = torch.randn(2, 5, 32)
    rope = (model.rope_cos[:5], model.rope_sin[:5])
    assert torch.equal(gm(h, rope), block(h, rope))


def test_rmsnorm_matches_formula():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    x = torch.randn(3, 8)
    expected = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * torch.arange(8.0)
    torch.testing.assert_close(norm(x), expected)


def test_dense_gpt_compiles_fullgraph():
    model = build("gpt", GPT_VARIANTS["seq-rms-gqa"]).eval()
    ids = random_ids(64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    logits, loss = compiled(ids, ids)
    expected, expected_loss = model(ids, ids)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(loss, expected_loss)


@pytest.mark.skipif(not _cpu_grouped_mm_works(), reason="torch._grouped_mm not on CPU here")
def test_moe_grouped_path_compiles_fullgraph():
    # The grouped path has no data-dependent shapes. torch._grouped_mm's fake (meta)
    # implementation accepts bf16 only, as its fast kernel does.
    model = build("moe", MOE_VARIANTS["seq-top2-shared"]).to(torch.bfloat16).eval()
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            m.experts.use_grouped_mm = True
    ids = random_ids(64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    logits, loss = compiled(ids, ids)
    expected, expected_loss = model(ids, ids)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(loss, expected_loss)
