"""The analysis finds every residual shape of SPEC section 1 by reading the graph, and
refuses the shapes that are not PreNorm with an error naming the module and the shape."""

import pytest
import torch

import depthrewrite
from depthrewrite import NoResidualStreamError, NotPreNormError
from tests.conftest import hf_model
from tests.toy_models import NoStack, ToyLM, TupleBlock

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
    ("post_ln", "h + f(h) with no norm"),
    ("no_norm", "h + f(h) with no norm"),
])
def test_non_prenorm_shapes_are_refused_with_module_and_shape(shape, found):
    with pytest.raises(NotPreNormError) as err:
        analyse(ToyLM(shape=shape))
    assert "blocks.0" in str(err.value) and "blocks.0.mix" in str(err.value)
    assert found in str(err.value)


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
