"""The public rewrite() API: options, errors, in-place semantics, parameter counts."""

import copy

import pytest
import torch

import depthrewrite
from depthrewrite import AlreadyRewrittenError, NoResidualStreamError
from tests.toy_models import NoStack, ToyLM

IDS = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))


def rewrite(model, scheme, **options):
    return depthrewrite.rewrite(model, scheme, example_inputs=(IDS,), **options)


def test_unknown_scheme_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        rewrite(ToyLM(), "attn_res")
    for name in ("residual", "attnres", "block_attnres"):
        assert name in str(err.value)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        rewrite(ToyLM(), "block_attnres", blocksize=2)
    assert "'blocksize'" in str(err.value) and "block_size" in str(err.value)
    assert "preserve_identity" in str(err.value)


@pytest.mark.parametrize("options, word", [
    ({"block_size": 0}, "block_size"), ({"eps": -1.0}, "eps"), ({"gate": "vector"}, "gate"),
    ({"preserve_identity": 1}, "preserve_identity"),
])
def test_bad_option_values(options, word):
    with pytest.raises(ValueError, match=word):
        rewrite(ToyLM(), "block_attnres", **options)


def test_rewrite_is_in_place_and_returns_the_same_object():
    model = ToyLM()
    block = model.blocks[0]
    out = rewrite(model, "attnres")
    assert out is model and out.blocks[0] is block
    assert isinstance(block, type(ToyLM().blocks[0]))  # still an instance of its own class


def test_inplace_false_leaves_the_original_untouched():
    model = ToyLM()
    before = copy.deepcopy(model.state_dict())
    out = depthrewrite.rewrite(model, "attnres", example_inputs=(IDS,), inplace=False)
    assert out is not model
    assert set(model.state_dict()) == set(before)
    assert not any("depth_route" in n for n, _ in model.named_parameters())
    assert any("depth_route" in n for n, _ in out.named_parameters())
    depthrewrite.rewrite(model, "block_attnres", example_inputs=(IDS,))  # still rewritable


def test_rewriting_twice_is_an_error():
    model = rewrite(ToyLM(), "attnres")
    with pytest.raises(AlreadyRewrittenError, match="already rewritten with scheme 'attnres'"):
        rewrite(model, "block_attnres")


def test_no_residual_stream_is_an_error():
    with pytest.raises(NoResidualStreamError):
        depthrewrite.rewrite(NoStack(), "attnres", example_inputs=(IDS % 10,))


@pytest.mark.parametrize("scheme", ["attnres", "block_attnres"])
@pytest.mark.parametrize("shape, sites_per_layer", [("plain", 2), ("parallel_two_adds", 1)])
def test_new_parameter_count_is_2d_times_L_plus_1(scheme, shape, sites_per_layer):
    d, layers = 16, 3
    model = ToyLM(d=d, n_layer=layers, shape=shape)
    original = {n for n, _ in model.named_parameters()}
    rewrite(model, scheme)
    new = {n: p for n, p in model.named_parameters() if n not in original}
    L = layers * sites_per_layer
    assert sum(p.numel() for p in new.values()) == 2 * d * (L + 1)
    assert depthrewrite.inspect(model).num_sites == L


def test_preserve_identity_adds_one_gate_per_site():
    d = 16
    model = ToyLM(d=d, n_layer=2)
    original = {n for n, _ in model.named_parameters()}
    rewrite(model, "attnres", preserve_identity=True)
    new = {n: p for n, p in model.named_parameters() if n not in original}
    assert sum(p.numel() for p in new.values()) == 2 * d * 5 + 5
    gates = [p for n, p in new.items() if n.endswith("gate")]
    assert len(gates) == 5 and all(torch.all(g == 0) for g in gates)


def test_parameter_names_are_stable_and_readable():
    model = rewrite(ToyLM(n_layer=2), "attnres")
    names = [n for n, _ in model.named_parameters() if "depth_route" in n]
    assert names[:2] == ["blocks.0.depth_route.site1.query", "blocks.0.depth_route.site1.key_norm_weight"]
    assert "norm.depth_route.readout.query" in names


def test_block_attnres_default_block_size_gives_at_most_8_blocks():
    from depthrewrite.passes.attnres import default_block_size

    for sites in range(1, 130):
        size = default_block_size(sites)
        assert size % 2 == 0 and -(-sites // size) <= 8
        assert size == 2 or -(-sites // (size - 2)) > 8  # the smallest such even size


def test_blocks_out_of_order_is_a_clear_error():
    model = rewrite(ToyLM(n_layer=3), "attnres")
    model.blocks = torch.nn.ModuleList([model.blocks[0], model.blocks[2], model.blocks[1]])
    with pytest.raises(depthrewrite.RuntimeOrderError, match="in order"):
        model(IDS)


@pytest.mark.parametrize("scheme", sorted(depthrewrite.SCHEMES))
def test_every_scheme_trains_under_bf16_autocast(scheme):
    """Under autocast the embedding is float32 and the branches bf16 (an MoE may even give
    float32): routing must still see one dtype and the loss must backpropagate."""
    from depthrewrite.models import moe_from_preset

    torch.manual_seed(0)
    model = depthrewrite.rewrite(moe_from_preset("tiny", n_layer=2), scheme)
    ids = torch.randint(0, 256, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(ids, ids)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "depth_route" in n and p.grad is not None]
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert grads or scheme == "residual"


@pytest.mark.parametrize("scheme", sorted(depthrewrite.SCHEMES))
def test_resolved_options_rebuild_the_same_rewrite(scheme):
    """What checkpoints and ``save_pretrained`` record (every option as used, automatic
    choices such as ``block_size`` and ``heads`` resolved) is a valid set of options that
    rebuilds the same rewrite: the same record, parameter names and bit-identical logits."""
    from depthrewrite.models.gpt import gpt_from_preset
    from depthrewrite.rewrite import find_runtime

    torch.manual_seed(0)
    first = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=4), scheme)
    recorded = find_runtime(first).scheme.resolved_options()
    again = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=4), scheme, **recorded)
    assert find_runtime(again).scheme.resolved_options() == recorded
    again.load_state_dict(first.state_dict())  # strict: the same parameters
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(ids), first(ids))
