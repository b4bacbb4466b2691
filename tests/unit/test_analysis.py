"""The analysis finds every residual shape of docs/spec.md section 1 by reading the graph, and
refuses the shapes that are not PreNorm with an error naming the module and the shape."""

import pytest
import torch

import depthrewrite
from depthrewrite import CaptureError, NoResidualStreamError, NotPreNormError
from tests.conftest import hf_model
from tests.handwritten_models import GPTConfig, NanoGPT, TitanLlama
from tests.toy_models import NoStack, TokenMixer, ToyBlock, ToyLM, TupleBlock

IDS = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))


def analyse(model):
    return depthrewrite.inspect(model, example_inputs=(IDS,))


@pytest.mark.parametrize("shape", ["plain", "reversed", "inplace", "torch_add", "sandwich", "moe_tuple", "scaled"])
def test_sequential_shapes_give_two_sites_per_block(shape):
    stream = analyse(ToyLM(shape=shape, n_layer=3))
    assert stream.sites_per_block() == [2, 2, 2]
    assert [s.kind for s in stream.sites[:2]] == ["attention", "mlp"]
    assert stream.final_norm_path == "norm"
    assert stream.stack_path == "blocks"


def test_sandwich_post_norm_belongs_to_the_branch():
    site = analyse(ToyLM(shape="sandwich")).sites[0]
    assert site.norm_paths == ("blocks.0.n1",)
    assert "blocks.0.post1" in site.branch_paths


@pytest.mark.parametrize("shape", ["parallel_two_adds", "parallel_sum"])
def test_parallel_blocks_give_one_site(shape):
    stream = analyse(ToyLM(shape=shape, n_layer=4))
    assert stream.sites_per_block() == [1, 1, 1, 1]
    assert all(s.kind == "parallel" for s in stream.sites)


def test_parallel_two_adds_exposes_its_parts():
    site = analyse(ToyLM(shape="parallel_two_adds")).sites[0]
    assert site.parts == ("attention", "mlp")


def test_layernorm_and_embedding_scaling():
    stream = analyse(ToyLM(norm="layer", emb_scale=True))
    assert {s.norm_type for s in stream.sites} == {"layernorm"}
    assert stream.final_norm_type == "rmsnorm"


def test_blocks_returning_tuples():
    stream = analyse(ToyLM(block_cls=TupleBlock))
    assert stream.num_sites == 6


@pytest.mark.parametrize("shape, found", [
    ("post_norm", "post-norm h + norm(f(h))"),
    ("post_ln", "post-LN norm(h + f(h))"),
    ("no_norm", "h + f(h) with no norm"),
])
def test_non_prenorm_shapes_are_refused_with_module_and_shape(shape, found):
    with pytest.raises(NotPreNormError) as err:
        analyse(ToyLM(shape=shape))
    assert "blocks.0" in str(err.value) and "blocks.0.mix" in str(err.value)
    assert found in str(err.value)


def test_post_ln_block_before_a_final_norm_names_its_norm():
    # a hand-written post-LN GPT keeps a final norm: the capture finds it, the block's
    # own add is refused, and the message says where the sum goes
    with pytest.raises(NotPreNormError) as err:
        analyse(ToyLM(shape="post_ln", norm="layer"))
    msg = str(err.value)
    assert "post-LN norm(h + f(h))" in msg and "'blocks.0.n1' (LayerNorm)" in msg
    assert "with no norm" not in msg


class RawThenPreNorm(ToyBlock):
    """A raw first branch, then a PreNorm site whose norm reads the first sum: that norm
    belongs to the next site, so the first shape is no norm at all, not post-LN."""

    def forward(self, h):
        h = h + self.mix(h)
        return h + self.mlp(self.n2(h))


def test_raw_branch_before_a_prenorm_site_is_not_called_post_ln():
    with pytest.raises(NotPreNormError) as err:
        analyse(ToyLM(block_cls=RawThenPreNorm))
    assert "h + f(h) with no norm" in str(err.value) and "post-LN" not in str(err.value)


def test_missing_final_norm_is_refused():
    with pytest.raises(NotPreNormError, match="not a normalisation"):
        analyse(ToyLM(final_norm=False))


def test_model_without_residual_stream_is_refused():
    with pytest.raises(NoResidualStreamError, match="no stack of blocks"):
        depthrewrite.inspect(NoStack(), example_inputs=(IDS % 10,))


def test_olmo2_is_refused_naming_module_and_shape():
    with pytest.raises(NotPreNormError) as err:
        depthrewrite.inspect(hf_model("olmo2"))
    msg = str(err.value)
    assert "model.layers.0" in msg and "model.layers.0.self_attn" in msg
    assert "post-norm h + norm(f(h))" in msg


@pytest.mark.parametrize("family, per_block, kinds", [
    ("llama", 2, ["attention", "mlp"]),
    ("qwen3", 2, ["attention", "mlp"]),
    ("mistral", 2, ["attention", "mlp"]),
    ("gpt2", 2, ["attention", "mlp"]),
    ("gemma3_text", 2, ["attention", "mlp"]),
    ("gpt_neox", 1, ["parallel"]),
    ("mixtral", 2, ["attention", "mlp"]),
])
def test_hf_families(family, per_block, kinds):
    stream = depthrewrite.inspect(hf_model(family, layers=3))
    assert stream.sites_per_block() == [per_block] * 3
    assert [s.kind for s in stream.sites[:per_block]] == kinds
    assert stream.d_model == 32


def test_inspect_prints_a_table():
    text = str(depthrewrite.inspect(hf_model("llama")))
    lines = text.splitlines()
    assert "4 sites" in lines[0] and "final norm 'model.norm' (rmsnorm)" in lines[0]
    assert lines[1].split()[:4] == ["site", "block", "pos", "kind"]
    assert "model.layers.1.post_attention_layernorm" in text


def test_analysis_leaves_train_mode_alone():
    model = ToyLM().train()
    analyse(model)
    assert all(m.training for m in model.modules())


# A branch mixes tokens if its output at one position depends on the input at another:
# a one-token example cannot show that, and must not be read as "no branch mixes".
@pytest.mark.parametrize("shape", [(1, 1), (2, 1)])
def test_one_token_example_labels_kinds_as_a_longer_one(shape):
    model = NanoGPT(GPTConfig()).eval()
    short = depthrewrite.inspect(model, example_inputs=(IDS[:shape[0], :shape[1]],))
    assert [s.kind for s in short.sites] == ["attention", "mlp"] * 3
    assert [s.kind for s in short.sites] == [s.kind for s in depthrewrite.inspect(model, example_inputs=(IDS,)).sites]


def test_one_token_example_rewrites_wav_as_a_longer_one():
    torch.manual_seed(0)
    base = NanoGPT(GPTConfig()).eval()
    short = depthrewrite.rewrite(base, "wav", example_inputs=(IDS[:1, :1],), inplace=False)
    long = depthrewrite.rewrite(base, "wav", example_inputs=(IDS,), inplace=False)
    with torch.no_grad():  # WAV's phase detail signs each site by its kind
        assert torch.equal(short(IDS)[0], long(IDS)[0])


def test_one_token_example_is_refused_when_the_block_takes_more_than_the_stream():
    # torchtitan passes its RoPE table to every block: a probe on a longer stream made up
    # by depthrewrite would not know how to size it, so the short example is refused
    with pytest.raises(CaptureError) as err:
        depthrewrite.inspect(TitanLlama(), example_inputs=(IDS[:, :1],))
    msg = str(err.value)
    assert "example_inputs" in msg and "sequence of 1 token" in msg and "at least 2 tokens" in msg
    assert "'layers.0'" in msg and "'freqs_cis'" in msg


class DecodeOnlyMixer(TokenMixer):
    """A mixer written for one token at a time (a decode kernel): it cannot say whether it
    mixes tokens, and refuses a longer sequence."""

    def forward(self, x):
        if x.shape[-2] != 1:
            raise ValueError(f"DecodeOnlyMixer takes one token, got {x.shape[-2]}")
        return super().forward(x)


def test_one_token_example_is_refused_when_the_block_fails_on_two_tokens():
    model = ToyLM()
    for block in model.blocks:
        block.mix = DecodeOnlyMixer(16)
    with pytest.raises(CaptureError) as err:
        depthrewrite.inspect(model, example_inputs=(IDS[:1, :1],))
    msg = str(err.value)
    assert "sequence of 1 token" in msg and "two-token copy of its stream failed" in msg
    assert "DecodeOnlyMixer takes one token, got 2" in msg and "example_inputs" in msg
