"""Residual shapes of the model zoo that the block's own code does not show as ``h + u``
(issue "Any decoder-only model"), one toy model per shape, each written literally after
the family it stands for. For the shapes that are PreNorm, the identity rewrites must be
bit-identical to the original and the routed rewrite must train; the shapes that are not
``h + u`` must be refused with NotAdditiveStreamError naming what was found."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import depthrewrite
from depthrewrite import NotAdditiveStreamError, NotPreNormError
from depthrewrite.analysis.probes import norm_type
from tests.toy_models import Mlp, TokenMixer

IDS = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
D = 16


class LM(nn.Module):
    """Embedding (optionally normed), a stack of ``make_block(i)`` blocks, final norm, head."""

    def __init__(self, make_block, n_layer=2, embed_norm=False, final_norm=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, D)
        self.embed_norm = nn.LayerNorm(D) if embed_norm else None
        self.blocks = nn.ModuleList(make_block(i) for i in range(n_layer))
        self.norm = final_norm if final_norm is not None else nn.RMSNorm(D)
        self.head = nn.Linear(D, 50)

    def forward(self, ids):
        h = self.embed(ids)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        for block in self.blocks:
            out = block(h)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(h))


def assert_identity_rewrites_exact(model):
    with torch.no_grad():
        reference = model(IDS)
    for scheme in ("attnres", "dar"):
        rewritten = depthrewrite.rewrite(copy.deepcopy(model), scheme, preserve_identity=True, example_inputs=(IDS,))
        with torch.no_grad():
            assert torch.equal(rewritten(IDS), reference), scheme


def routed_gradients(model) -> dict:
    """One training step of the routed attnres rewrite: every parameter's gradient."""
    rewritten = depthrewrite.rewrite(copy.deepcopy(model), "attnres", example_inputs=(IDS,)).train()
    logits = rewritten(IDS)
    F.cross_entropy(logits[:, :-1].reshape(-1, 50), IDS[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad for n, p in rewritten.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None or not torch.isfinite(g).all()]
    return grads


# -- 1. the residual add inside a child module ----------------------------------------


class AddingMixer(nn.Module):
    """BLOOM's attention: receives the residual and adds it itself (``dropout_add``)."""

    def __init__(self, p=0.0):
        super().__init__()
        self.mix, self.p = TokenMixer(D), p

    def forward(self, x, residual):
        return residual + F.dropout(self.mix(x), p=self.p, training=self.training), None


class AddingMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp(D)

    def forward(self, x, residual):
        return self.mlp(x) + residual


class BloomBlock(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = AddingMixer(p), AddingMlp()

    def forward(self, h):
        out, _ = self.attn(self.n1(h), h)
        return self.mlp(self.n2(out), out)


def test_adds_inside_children_are_found_and_rewritten():
    model = LM(lambda i: BloomBlock())
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [2, 2]
    assert [s.kind for s in stream.sites[:2]] == ["attention", "mlp"]
    assert stream.sites[0].norm_paths == ("blocks.0.n1",)
    assert "blocks.0.attn.mix" in stream.sites[0].branch_paths
    assert_identity_rewrites_exact(model)
    grads = routed_gradients(model)
    assert grads["blocks.1.attn.mix.proj.weight"].abs().sum() > 0  # the traced-through child still learns


def test_traced_through_child_keeps_its_dropout_train_and_eval():
    model = LM(lambda i: BloomBlock(p=0.5))
    rewritten = depthrewrite.rewrite(copy.deepcopy(model), "attnres", preserve_identity=True, example_inputs=(IDS,))
    with torch.no_grad():
        rewritten.eval()
        assert torch.equal(rewritten(IDS), model.eval()(IDS))
        rewritten.train()
        torch.manual_seed(1)
        a = rewritten(IDS)
        torch.manual_seed(2)
        b = rewritten(IDS)
    assert not torch.equal(a, b)  # the child's F.dropout(training=self.training) is live in training


class SelfOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(D, D)

    def forward(self, x, input_tensor):
        return self.dense(x) + input_tensor


class PreLNAttention(nn.Module):
    """RoBERTa-PreLayerNorm: the norm and the add are two levels down."""

    def __init__(self):
        super().__init__()
        self.LayerNorm, self.self_attn, self.output = nn.LayerNorm(D), TokenMixer(D), SelfOutput()

    def forward(self, h):
        return self.output(self.self_attn(self.LayerNorm(h)), h), None


class Intermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.LayerNorm, self.dense = nn.LayerNorm(D), nn.Linear(D, 2 * D)

    def forward(self, h):
        return F.gelu(self.dense(self.LayerNorm(h)))


class Output(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(2 * D, D)

    def forward(self, x, input_tensor):
        return self.dense(x) + input_tensor


class RobertaPreLNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.intermediate, self.output = PreLNAttention(), Intermediate(), Output()

    def forward(self, h):
        outputs = self.attention(h)
        attention_output = outputs[0]
        # BERT returns (out,) + rest: a tuple concatenation the trace records as a node
        return (self.output(self.intermediate(attention_output), attention_output),) + outputs[1:]


def test_adds_two_levels_down_in_bert_style_children():
    model = LM(lambda i: RobertaPreLNBlock())
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [2, 2]
    assert [s.norm_paths for s in stream.sites[:2]] == [("blocks.0.attention.LayerNorm",),
                                                       ("blocks.0.intermediate.LayerNorm",)]
    assert_identity_rewrites_exact(model)
    routed_gradients(model)


class MptBlock(nn.Module):
    """MPT: the first add in the block, the second inside the MLP."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2, self.attn, self.ffn = nn.LayerNorm(D), nn.LayerNorm(D), TokenMixer(D), AddingMlp()

    def forward(self, h):
        h = self.attn(self.n1(h)) + h
        return self.ffn(self.n2(h), h)


def test_last_add_inside_a_child():
    model = LM(lambda i: MptBlock())
    assert depthrewrite.inspect(model, example_inputs=(IDS,)).sites_per_block() == [2, 2]
    assert_identity_rewrites_exact(model)
    routed_gradients(model)


# -- 2. casts, views and shape-only reads on the stream path ---------------------------


class CastNorm(nn.RMSNorm):
    """A final norm that reads any dtype (the stream leaves the blocks in float64)."""

    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


class MambaBlock(nn.Module):
    """Mamba's ``residual_in_fp32``, one precision up: the residual is cast up before the
    add and the norm reads the stream cast to its weight's dtype."""

    def __init__(self):
        super().__init__()
        self.norm, self.mixer = nn.RMSNorm(D), TokenMixer(D)

    def forward(self, h):
        residual = h.to(torch.float64)
        x = self.norm(h.to(dtype=self.norm.weight.dtype))
        return residual + self.mixer(x)


def test_casts_on_the_stream_path():
    model = LM(lambda i: MambaBlock(), n_layer=3, final_norm=CastNorm(D))
    assert model(IDS).dtype == torch.float32 and model.blocks[0](model.embed(IDS)).dtype == torch.float64
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [1, 1, 1] and stream.sites[0].kind == "attention"
    assert_identity_rewrites_exact(model)
    routed_gradients(model)


class OptBlock(nn.Module):
    """OPT: the MLP works on ``h.reshape(-1, d)`` and the block returns a view back."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2, self.attn, self.mlp = nn.LayerNorm(D), nn.LayerNorm(D), TokenMixer(D), Mlp(D)

    def forward(self, h):
        h = h + self.attn(self.n1(h))
        shape = h.shape
        h = h.reshape(-1, h.size(-1))
        return (h + self.mlp(self.n2(h))).view(shape)


def test_views_of_the_stream_around_the_add():
    model = LM(lambda i: OptBlock())
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [2, 2]
    assert [s.kind for s in stream.sites[:2]] == ["attention", "mlp"]  # read in the stream's layout
    assert_identity_rewrites_exact(model)
    routed_gradients(model)


class BiasedMixer(nn.Module):
    """Returns ``(out, bias)``; GPT-NeoX-Japanese's attention returns ``None`` as the bias
    in every layer but the last."""

    def __init__(self, with_bias):
        super().__init__()
        self.mix = TokenMixer(D)
        self.bias = nn.Parameter(torch.randn(D)) if with_bias else None

    def forward(self, x):
        return self.mix(x), self.bias


class ShapeReadingBlock(nn.Module):
    """``bias.expand_as(residual)`` (GPT-NeoX-Japanese) and ``u.view(residual.shape)``
    (Llama 4): the stream read for its shape only."""

    def __init__(self, with_bias):
        super().__init__()
        self.n1, self.n2, self.attn, self.mlp = nn.LayerNorm(D), nn.LayerNorm(D), BiasedMixer(with_bias), Mlp(D)

    def forward(self, h):
        out, bias = self.attn(self.n1(h))
        bias = bias.expand_as(h) if bias is not None else bias
        if bias is not None:
            out = out + bias
        h = h + out
        u = self.mlp(self.n2(h).reshape(-1, D))
        return h + u.view(h.shape)


def test_shape_only_reads_and_none_outputs_of_children():
    model = LM(lambda i: ShapeReadingBlock(with_bias=i == 1))
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [2, 2]
    assert_identity_rewrites_exact(model)
    routed_gradients(model)


# -- 3. an nn.Identity in the first norm slot --------------------------------------------


class IdentityFirstNormBlock(nn.Module):
    """ModernBERT-decoder: layer 0's attention norm is nn.Identity (the embeddings are normed)."""

    def __init__(self, index, identity_at=0):
        super().__init__()
        self.n1 = nn.Identity() if index == identity_at else nn.LayerNorm(D)
        self.n2, self.attn, self.mlp = nn.LayerNorm(D), TokenMixer(D), Mlp(D)

    def forward(self, h):
        h = h + self.attn(self.n1(h))
        return h + self.mlp(self.n2(h))


def test_identity_norm_slot_at_the_first_site():
    model = LM(lambda i: IdentityFirstNormBlock(i), embed_norm=True)
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [2, 2]
    assert [s.norm_type for s in stream.sites] == ["identity", "layernorm", "layernorm", "layernorm"]
    assert_identity_rewrites_exact(model)
    grads = routed_gradients(model)
    assert grads["blocks.0.attn.proj.weight"].abs().sum() > 0


def test_identity_norm_slot_past_the_first_site_is_refused():
    model = LM(lambda i: IdentityFirstNormBlock(i, identity_at=1), embed_norm=True)
    with pytest.raises(NotPreNormError, match=r"blocks\.1\.n1.*nn\.Identity in a norm slot"):
        depthrewrite.inspect(model, example_inputs=(IDS,))


# -- 5. streams that are not updated by h + u --------------------------------------------


class RescaledBlock(nn.Module):
    """Doge: ``input_residual * residual + u``."""

    def __init__(self):
        super().__init__()
        self.n1, self.attn = nn.RMSNorm(D), TokenMixer(D)
        self.input_residual = nn.Parameter(torch.ones(D))

    def forward(self, h):
        return self.input_residual * h + self.attn(self.n1(h))


def test_rescaled_stream_is_refused_naming_the_op():
    with pytest.raises(NotAdditiveStreamError, match=r"rescaled: the residual add 'add' reads mul\(input_residual, h\)"):
        depthrewrite.inspect(LM(lambda i: RescaledBlock()), example_inputs=(IDS,))


class ScaledOutputBlock(IdentityFirstNormBlock):
    """Gemma 4: ``h *= layer_scalar`` after the last add."""

    def __init__(self, index):
        super().__init__(index, identity_at=-1)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, h):
        h = super().forward(h)
        h *= self.layer_scalar
        return h


def test_stream_rescaled_after_the_last_add_is_refused():
    with pytest.raises(NotAdditiveStreamError, match=r"after the last residual add: the block returns mul\(add_1, layer_scalar\)"):
        depthrewrite.inspect(LM(lambda i: ScaledOutputBlock(i)), example_inputs=(IDS,))


N_STREAMS = 3


class HyperBlock(nn.Module):
    """DeepSeek-V4 / HY-V4 hyper-connections: the stream is (B, T, n, d); a learned mix of
    the n streams feeds the branch and its output is spread back over them."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Parameter(torch.full((N_STREAMS,), 1.0 / N_STREAMS))
        self.post = nn.Parameter(torch.ones(N_STREAMS))
        self.norm, self.attn = nn.RMSNorm(D), TokenMixer(D)

    def forward(self, h):
        collapsed = (self.pre[:, None] * h).sum(-2)
        u = self.attn(self.norm(collapsed))
        return h + self.post[:, None] * u.unsqueeze(-2)


class HyperHead(nn.Module):
    def forward(self, h):
        return h.mean(-2)


class HyperLM(LM):
    def __init__(self):
        super().__init__(lambda i: HyperBlock())
        self.collapse = HyperHead()

    def forward(self, ids):
        h = self.embed(ids).unsqueeze(-2).expand(-1, -1, N_STREAMS, -1).contiguous()
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(self.collapse(h)))


def test_hyper_connection_streams_are_refused():
    with pytest.raises(NotAdditiveStreamError, match=rf"shape \(2, 6, {N_STREAMS}, {D}\).*hyper-connections"):
        depthrewrite.inspect(HyperLM(), example_inputs=(IDS,))


class DelayedShortcutBlock(IdentityFirstNormBlock):
    """LongCat-Flash: a shortcut MLP reads the second site's norm and is added at the end of
    the block, after a later site: its output enters the stream (and is routed) there."""

    def __init__(self, index):
        super().__init__(index, identity_at=-1)
        self.n3, self.shortcut, self.mlp2 = nn.LayerNorm(D), Mlp(D), Mlp(D)

    def forward(self, h):
        h = h + self.attn(self.n1(h))
        n = self.n2(h)
        short = self.shortcut(n)
        h = h + self.mlp(n)
        return h + self.mlp2(self.n3(h)) + short


def test_delayed_shortcut_branch_joins_the_site_where_it_is_added():
    model = LM(lambda i: DelayedShortcutBlock(i))
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert stream.sites_per_block() == [3, 3]
    third = stream.sites[2]
    assert third.kind == "parallel" and third.parts == ("mlp", "mlp") and third.norm_paths == ("blocks.0.n3",)
    assert_identity_rewrites_exact(model)
    grads = routed_gradients(model)
    assert grads["blocks.1.shortcut.up.weight"].abs().sum() > 0


class GatedResidual(nn.Module):
    """Qwen4-exp: the n streams are flattened into one (B, T, n * d) tensor; this child
    returns (a learned mix of them, the stream itself, the injection weights). As in
    Qwen4-exp, the untraceable variant checks the width in Python and norms the mix itself."""

    def __init__(self, traceable):
        super().__init__()
        self.traceable = traceable
        self.mix, self.inject = nn.Linear(N_STREAMS * D, N_STREAMS * D), nn.Linear(N_STREAMS * D, N_STREAMS)
        self.norm = nn.Identity() if traceable else nn.RMSNorm(D)

    def forward(self, h):
        if not self.traceable and h.shape[-1] != N_STREAMS * D:  # shape control flow: fx cannot trace it
            raise ValueError("width")
        mixed = (torch.sigmoid(self.mix(h)).unflatten(-1, (N_STREAMS, D)) * h.unflatten(-1, (N_STREAMS, D))).mean(-2)
        return self.norm(mixed), h, torch.sigmoid(self.inject(h))


class FlatHyperBlock(nn.Module):
    def __init__(self, traceable):
        super().__init__()
        self.hc, self.attn = GatedResidual(traceable), TokenMixer(D)
        self.norm = nn.RMSNorm(D) if traceable else nn.Identity()

    def forward(self, h):
        mixed, h, weights = self.hc(h)
        u = self.attn(self.norm(mixed))
        return h + (u.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class FlatHyperLM(nn.Module):
    def __init__(self, traceable):
        super().__init__()
        self.embed = nn.Embedding(50, N_STREAMS * D)
        self.blocks = nn.ModuleList(FlatHyperBlock(traceable) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(N_STREAMS * D), nn.Linear(N_STREAMS * D, 50)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@pytest.mark.parametrize("traceable", [True, False])
def test_flattened_hyper_connection_streams_are_refused(traceable):
    with pytest.raises(NotAdditiveStreamError, match=rf"\(2, 6, {N_STREAMS * D}\).*\(2, 6, {D}\).*hyper-connections"):
        depthrewrite.inspect(FlatHyperLM(traceable), example_inputs=(IDS,))


# -- the norm probe ----------------------------------------------------------------------


class HugeBranchBlock(nn.Module):
    """``x + f(norm(x))`` with a branch output thousands of times larger than ``x`` (CPM-Ant
    with random weights): nearly scale-invariant, but not a norm."""

    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.RMSNorm(D), nn.Linear(D, D)
        nn.init.constant_(self.up.weight, 300.0)

    def forward(self, x):
        return x + self.up(self.norm(x))


def test_norm_probe_rejects_a_residual_block_with_a_huge_branch():
    assert norm_type(HugeBranchBlock(), D) is None
    assert norm_type(nn.RMSNorm(D), D) == "rmsnorm" and norm_type(nn.LayerNorm(D), D) == "layernorm"
