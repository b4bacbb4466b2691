"""A model built on the meta device (torchtitan's and FSDP2's way) is rewritten in place:
materialized on the CPU for the analysis, put back on the meta device, and after the
user's ``to_empty`` and init, ``reset_routing_parameters`` gives the routing its initial
values. The result equals a model rewritten with its values, and the rewrite leaves the
RNG, the device and the ties as they were. (torchtitan's whole flow, sharded on 2 ranks:
tests/e2e/test_distributed.py.)"""

import gc
import weakref

import pytest
import torch

import depthrewrite
from depthrewrite.errors import CaptureError
from depthrewrite.models.gpt import GPT, GPTConfig
from tests.conftest import skip_before_transformers_5
from tests.handwritten_models import TitanLlama, titan_init

CONFIG = GPTConfig(n_layer=4, tie_embeddings=True)
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def _on_meta(build=lambda: GPT(CONFIG)):
    with torch.device("meta"):
        return build()


def _finish(model, seed: int = 1):
    """The user's side after the rewrite: to_empty, the model's own init, then the routing's."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return depthrewrite.reset_routing_parameters(model)


@pytest.mark.parametrize("scheme", ["dar", "wav", "mhar"])
def test_a_meta_model_is_rewritten_in_place_and_equals_one_rewritten_with_values(scheme):
    model = _on_meta()
    rng = torch.get_rng_state()
    assert depthrewrite.rewrite(model, scheme) is model
    assert torch.equal(torch.get_rng_state(), rng)  # the user's init draws what it would have drawn
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert model.lm_head.weight is model.embed.weight
    routing = [n for n, _ in model.named_parameters() if ".depth_route." in n]
    assert routing and _finish(model) == len(routing)

    reference = _on_meta()
    reference.to_empty(device="cpu")
    reference.init_weights()
    depthrewrite.rewrite(reference, scheme)
    _finish(reference)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(model(IDS), reference(IDS))


def test_the_rewrite_keeps_no_materialized_weight_alive():
    """The CPU copy of the weights exists only for the analysis: every parameter it made is
    freed once the model is back on the meta device."""
    weights = []

    def init(model):
        model.init_weights()
        weights.extend(weakref.ref(p) for p in model.parameters())

    model = _on_meta()
    depthrewrite.rewrite(model, "dar", meta_init=init)
    gc.collect()
    assert weights and all(ref() is None for ref in weights)


def test_meta_init_materializes_a_model_without_init_weights_and_inspect_takes_it_too():
    example = (torch.randint(0, 128, (2, 8)),)
    model = _on_meta(TitanLlama)
    stream = depthrewrite.inspect(model, example_inputs=example, meta_init=titan_init)
    assert stream.stack_path == "layers" and all(p.is_meta for p in model.parameters())
    depthrewrite.rewrite(model, "block_attnres", example_inputs=example, meta_init=titan_init)
    model.to_empty(device="cpu")
    titan_init(model)
    depthrewrite.reset_routing_parameters(model)

    reference = TitanLlama()
    titan_init(reference)
    depthrewrite.rewrite(reference, "block_attnres", example_inputs=example)
    torch.testing.assert_close(model(*example), reference(*example), rtol=0, atol=0)


def test_reset_before_to_empty_and_a_bad_meta_init_are_refused():
    model = _on_meta()
    with pytest.raises(ValueError, match=r"rewrite: meta_init must be a function taking the model, found int"):
        depthrewrite.rewrite(model, "dar", meta_init=3)
    depthrewrite.rewrite(model, "dar")
    with pytest.raises(CaptureError, match=r"reset_routing_parameters: blocks\.0\.depth_route\.\w+\.\w+ is still on "
                                           r"the meta device; call model\.to_empty"):
        depthrewrite.reset_routing_parameters(model)


def test_an_init_that_leaves_a_tensor_on_meta_is_named():
    with pytest.raises(CaptureError, match=r"rewrite: GPT's parameter 'embed.weight' is still on the meta device"):
        depthrewrite.rewrite(_on_meta(), "dar", meta_init=lambda m: m.embed.to_empty(device="meta"))


def test_an_init_that_writes_nothing_is_named_not_blamed_on_the_model():
    """``to_empty`` leaves memory unset, so without the NaN marks an init that does nothing
    let the analysis run on stale values and fail as a structure error (NotPreNormError)."""
    numel = CONFIG.vocab_size * CONFIG.d_model
    with pytest.raises(CaptureError, match=rf"rewrite: the init did not write any of the {numel} values of "
                                           r"GPT's parameter 'embed.weight'"):
        depthrewrite.rewrite(_on_meta(), "dar", meta_init=lambda m: None)
    with pytest.raises(CaptureError, match=r"inspect: the init did not write any of the"):
        depthrewrite.inspect(_on_meta(), meta_init=lambda m: None)


def test_an_init_that_misses_part_of_a_tensor_is_named_with_the_count():
    def init_but_the_first_rows(model):
        model.init_weights()
        model.blocks[1].attn.qkv.weight.fill_(float("nan"))  # back to what it was before the init
        torch.nn.init.normal_(model.blocks[1].attn.qkv.weight[2:])

    model = _on_meta()
    numel = model.blocks[1].attn.qkv.weight.numel()
    with pytest.raises(CaptureError, match=rf"rewrite: the init did not write {2 * CONFIG.d_model} of the {numel} "
                                           r"values of GPT's parameter 'blocks.1.attn.qkv.weight'"):
        depthrewrite.rewrite(model, "dar", meta_init=init_but_the_first_rows)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="no packed 4-bit float in this torch")
def test_a_tensor_of_a_dtype_without_nan_is_not_marked():
    """Packed 4-bit floats have no NaN (and no fill_): such a tensor is left as to_empty left
    it, not a crash of the rewrite."""
    model = _on_meta()
    model.register_buffer("packed", torch.empty(4, dtype=torch.float4_e2m1fn_x2, device="meta"))
    depthrewrite.rewrite(model, "dar")
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def test_a_direct_capture_of_a_meta_model_says_what_materializes_it():
    from depthrewrite.capture import capture

    with pytest.raises(CaptureError, match=r"GPT's parameter 'embed.weight' is on the meta device: .*"
                                           r"depthrewrite.rewrite and depthrewrite.inspect materialize such a model"):
        capture(_on_meta())


def test_a_model_partly_on_the_meta_device_is_refused_and_keeps_its_values():
    """Materializing would run the init over the weights that have values, and the move back
    would drop them: nothing is lost by refusing."""
    model = _on_meta()
    model.lm_head = torch.nn.Linear(CONFIG.d_model, CONFIG.vocab_size, bias=False)
    kept = model.lm_head.weight.detach().clone()
    with pytest.raises(CaptureError, match=r"rewrite: GPT is partly on the meta device \('embed.weight'\) and "
                                           r"partly not \('lm_head.weight', on cpu\)"):
        depthrewrite.rewrite(model, "dar")
    assert torch.equal(model.lm_head.weight, kept)


@skip_before_transformers_5("from_config marks its modules initialized, so init_weights() after to_empty "
                            "initializes nothing, in the plain model as well")
def test_a_hugging_face_model_built_on_the_meta_device_inits_after_the_rewrite():
    """transformers marks the modules its init has run on (``_is_hf_initialized``) and skips
    them in a later init: marks left by the init the analysis ran would leave the user's
    init after ``to_empty`` doing nothing. The rewrite takes its init's marks away again."""
    pytest.importorskip("transformers")
    from tests.conftest import hf_model

    model = _on_meta(lambda: hf_model("llama"))
    depthrewrite.rewrite(model, "dar")
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.init_weights()
    depthrewrite.reset_routing_parameters(model)

    reference = _on_meta(lambda: hf_model("llama"))
    reference.to_empty(device="cpu")
    torch.manual_seed(1)
    reference.init_weights()
    depthrewrite.rewrite(reference, "dar")
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_an_init_that_fails_leaves_the_model_on_meta_without_its_marks():
    def failing_init(model):
        model.embed.marked_by_init = True
        raise RuntimeError("init failed")

    model = _on_meta()
    with pytest.raises(RuntimeError, match="init failed"):
        depthrewrite.rewrite(model, "dar", meta_init=failing_init)
    assert not hasattr(model.embed, "marked_by_init")
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
