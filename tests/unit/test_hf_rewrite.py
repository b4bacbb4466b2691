"""Rewritten Hugging Face models keep their interface: identity at init, generate() with
the KV cache, save/load, gradient checkpointing, train/eval, hidden states."""

import dataclasses
import importlib
import json
from contextlib import nullcontext

import pytest
import torch

import depthrewrite
from depthrewrite.rewrite import find_runtime
from tests.conftest import HF_FAMILIES, hf_model, perturb_routing

transformers = pytest.importorskip("transformers")
FAMILIES = list(HF_FAMILIES)
IDS = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def logits(model, ids=IDS, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_rewrite_is_bit_identical(family):
    model = hf_model(family)
    ref = logits(model)
    depthrewrite.rewrite(model, "residual")
    assert torch.equal(logits(model), ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["attnres", "block_attnres"])
def test_preserve_identity_is_bit_identical_at_init(family, scheme):
    model = hf_model(family)
    ref = logits(model)
    depthrewrite.rewrite(model, scheme, preserve_identity=True)
    assert torch.equal(logits(model), ref)
    perturb_routing(model)  # and the gate really routes once it moves
    assert not torch.allclose(logits(model), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_cache_equals_generate_without(family):
    model = depthrewrite.rewrite(hf_model(family), "block_attnres", block_size=2)
    perturb_routing(model)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with_cache = model.generate(IDS, use_cache=True, **kw)
    without = model.generate(IDS, use_cache=False, **kw)
    assert with_cache.shape == (2, 13)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_save_pretrained_and_load_back_is_bit_identical(family, tmp_path):
    model = depthrewrite.rewrite(hf_model(family, seed=3), "block_attnres", block_size=2, preserve_identity=True)
    perturb_routing(model)
    ref = logits(model)
    model.save_pretrained(tmp_path)
    loaded = depthrewrite.from_pretrained(tmp_path).eval()
    assert depthrewrite.inspect(loaded).num_sites == depthrewrite.inspect(model).num_sites
    assert torch.equal(logits(loaded), ref)


def test_saved_recipe_holds_every_option_so_other_defaults_do_not_change_the_model(tmp_path, monkeypatch):
    """The recipe in config.json lists the scheme's options with defaults filled in, and
    ``from_pretrained`` applies them all: a model saved under today's default (``attnres``
    groups 4 sites) loads with that computation under a version whose default differs
    (simulated: ``group_size`` None when not given), with bit-identical logits."""
    model = depthrewrite.rewrite(hf_model("llama", seed=3), "attnres")
    perturb_routing(model)
    ref = logits(model)
    model.save_pretrained(tmp_path)
    recipe = json.loads((tmp_path / "config.json").read_text())["depthrewrite"]
    assert recipe["scheme"] == "attnres"
    assert recipe["options"]["group_size"] == 4 and recipe["options"]["eps"] == 1e-6  # defaults recorded

    rewrite_module = importlib.import_module("depthrewrite.rewrite")  # the package's `rewrite` is the function
    real = rewrite_module.scheme_options
    monkeypatch.setattr(rewrite_module, "scheme_options", lambda cls, options: (
        real(cls, options) if "group_size" in options else dataclasses.replace(real(cls, options), group_size=None)))
    assert find_runtime(depthrewrite.rewrite(hf_model("llama", seed=3), "attnres")).scheme.plan is None
    loaded = depthrewrite.from_pretrained(tmp_path).eval()
    assert find_runtime(loaded).scheme.options.group_size == 4
    assert torch.equal(logits(loaded), ref)


def _saved_recipe(path) -> dict:
    return json.loads((path / "config.json").read_text())["depthrewrite"]


def test_fused_merge_is_recorded_as_used_and_loads_back_bit_identical(tmp_path, monkeypatch):
    """``fused_merge=None`` takes ``two_phase.FUSED_MERGE`` when the model is rewritten; the
    recipe records the True or False it gave, so the model loads back with the same second
    phase (bit-identical logits) whatever the flag is at load time."""
    from depthrewrite.passes import two_phase

    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    model = depthrewrite.rewrite(hf_model("llama", seed=3), "block_attnres", block_size=2)
    perturb_routing(model)
    ref = logits(model)
    model.save_pretrained(tmp_path)
    assert _saved_recipe(tmp_path)["options"]["fused_merge"] is True
    monkeypatch.setattr(two_phase, "FUSED_MERGE", False)
    assert torch.equal(logits(model), ref)  # the flag is read at rewrite time only
    loaded = depthrewrite.from_pretrained(tmp_path).eval()
    assert find_runtime(loaded).scheme.options.fused_merge is True
    assert torch.equal(logits(loaded), ref)


def test_a_checkpoint_recording_fused_merge_null_still_loads(tmp_path):
    """Checkpoints saved before the value was resolved record ``"fused_merge": null``: the
    module default, which they load with again."""
    model = depthrewrite.rewrite(hf_model("llama", seed=3), "dar", layers_per_block=2)
    perturb_routing(model)
    ref = logits(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["depthrewrite"]["options"]["fused_merge"] is False
    config["depthrewrite"]["options"]["fused_merge"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = depthrewrite.from_pretrained(tmp_path).eval()
    assert find_runtime(loaded).scheme.options.fused_merge is False
    assert torch.equal(logits(loaded), ref)


def test_state_dict_round_trip_is_bit_identical():
    model = depthrewrite.rewrite(hf_model("qwen3", seed=3), "attnres")
    perturb_routing(model)
    fresh = depthrewrite.rewrite(hf_model("qwen3", seed=4), "attnres")
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(logits(fresh), logits(model))


def test_inspect_says_when_a_rewritten_checkpoint_was_loaded_without_its_rewrite(tmp_path, caplog):
    """transformers' own from_pretrained of a rewritten model's checkpoint builds the plain
    model, its routing parameters left out: inspect says so, naming the scheme and the loader
    to use; depthrewrite.from_pretrained's model, and a plain model, get no warning."""
    depthrewrite.rewrite(hf_model("llama"), "dar", layers_per_block=1).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="depthrewrite"):
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        assert depthrewrite.inspect(plain).rewritten_with is None
        assert "LlamaForCausalLM is not rewritten, but its config records a rewrite with 'dar'" in caplog.text
        assert "depthrewrite.from_pretrained(path)" in caplog.text
        caplog.clear()
        assert depthrewrite.inspect(depthrewrite.from_pretrained(tmp_path)).rewritten_with[0] == "dar"
        depthrewrite.inspect(hf_model("llama"))
    assert "not rewritten" not in caplog.text


def test_models_built_from_one_config_object_keep_their_own_recipes(tmp_path):
    """transformers keeps the config object a model is built from, so models built from one
    object share it: a recipe recorded there was claimed by all of them, and rewriting a
    sibling with another scheme changed what this model saved (its routing lost on load)."""
    cfg = hf_model("llama").config
    plain, a, b = (transformers.AutoModelForCausalLM.from_config(cfg).eval() for _ in range(3))
    depthrewrite.rewrite(a, "attnres")
    depthrewrite.rewrite(b, "residual")
    perturb_routing(a)
    assert depthrewrite.hf.recorded_recipe(plain) is None
    assert depthrewrite.hf.recorded_recipe(a)["scheme"] == "attnres"
    assert a.model.config is a.config  # the submodules see the model's own copy
    a.save_pretrained(tmp_path)
    assert torch.equal(logits(depthrewrite.from_pretrained(tmp_path).eval()), logits(a))


@pytest.mark.parametrize("where", ["hub id", "config.json", "empty folder"])
def test_from_pretrained_says_it_takes_a_local_folder(tmp_path, where):
    depthrewrite.rewrite(hf_model("llama"), "attnres").save_pretrained(tmp_path / "saved")
    path = {"hub id": "meta-llama/Llama-3.2-1B", "config.json": tmp_path / "saved" / "config.json",
            "empty folder": tmp_path}[where]
    found = {"hub id": "nothing there", "config.json": "a file", "empty folder": "a folder without config.json"}[where]
    with pytest.raises(depthrewrite.DepthRewriteError, match=rf"^from_pretrained: path must be a local folder "
                                                             rf"written by save_pretrained .*; found {found} at"):
        depthrewrite.from_pretrained(path)


def test_from_pretrained_refuses_a_recipe_of_another_form(tmp_path):
    depthrewrite.rewrite(hf_model("llama"), "attnres").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["depthrewrite"]["options"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(depthrewrite.DepthRewriteError, match=r"'depthrewrite' entry must be \{'scheme': name, "
                                                             r"'options': \{...\}\}, as rewrite records it"):
        depthrewrite.from_pretrained(tmp_path)


def test_from_pretrained_refuses_a_plain_checkpoint(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    with pytest.raises(depthrewrite.DepthRewriteError, match="no 'depthrewrite' entry"):
        depthrewrite.from_pretrained(tmp_path)


def _enable_checkpointing(model, api: str, reentrant: bool) -> None:
    """transformers' activation checkpointing: ``gradient_checkpointing_enable`` (deprecated in
    transformers 5.25, which warns) or its successor ``activation_checkpointing_enable``, also
    every second layer only."""
    if api == "gradient":
        with pytest.warns(FutureWarning) if hasattr(model, "activation_checkpointing_enable") else nullcontext():
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return
    if not hasattr(model, "activation_checkpointing_enable"):
        pytest.skip(f"transformers {transformers.__version__} has no activation_checkpointing_enable")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant},
                                          every_n_layers=2 if api == "activation_every_2" else 1)


@pytest.mark.parametrize("api", ["gradient", "activation", "activation_every_2"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant, api):
    model = depthrewrite.rewrite(hf_model("llama", layers=3), "block_attnres", block_size=2)
    perturb_routing(model)
    model.train()

    def grads():
        model.zero_grad()
        # no KV cache in either run: transformers 4.x makes one by default, and turns it off
        # under checkpointing, whose attention then takes another path (other roundings)
        model(IDS, labels=IDS, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    _enable_checkpointing(model, api, reentrant)
    calls = []  # the layers' MLPs run again in the backward: the checkpointing is real
    hooks = [layer.mlp.register_forward_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    checkpointed = grads()
    for hook in hooks:
        hook.remove()
    assert len(calls) == 3 + (2 if api == "activation_every_2" else 3)
    assert plain.keys() == checkpointed.keys()
    assert any("depth_route" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("scheme", ["block_attnres", "dar", "wav"])
def test_activations_offloaded_to_host_memory_give_the_same_gradients(scheme):
    """Saved tensors moved to host memory by saved-tensor hooks (``save_on_cpu``), alone and
    with checkpointing: what ``activation_checkpointing_enable(offload=True)`` does with
    pinned memory, which a machine without a GPU lacks."""
    model = depthrewrite.rewrite(hf_model("llama", layers=4), scheme)
    perturb_routing(model)
    model.train()

    def grads(offload: bool):
        model.zero_grad()
        with torch.autograd.graph.save_on_cpu(pin_memory=False) if offload else nullcontext():
            model(IDS, labels=IDS).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(offload=False)
    offloaded = grads(offload=True)
    _enable_checkpointing(model, "activation", reentrant=False)
    both = grads(offload=True)
    assert plain.keys() == offloaded.keys() == both.keys()
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(both[name], plain[name], rtol=0, atol=0, msg=name)


def test_train_and_eval_switch_dropout_in_rewritten_blocks():
    model = depthrewrite.rewrite(hf_model("gpt2", resid_pdrop=0.5, embd_pdrop=0.0, attn_pdrop=0.0), "attnres")
    model.train()
    torch.manual_seed(0)
    a = model(IDS).logits
    b = model(IDS).logits
    assert not torch.equal(a, b)  # dropout on the branch outputs is active in train mode
    model.eval()
    assert torch.equal(logits(model), logits(model))


def test_hidden_states_are_reported_per_layer():
    model = depthrewrite.rewrite(hf_model("llama", layers=3), "attnres")
    out = model(IDS, output_hidden_states=True)
    assert len(out.hidden_states) == 4
    assert all(h.shape == (2, 7, 32) for h in out.hidden_states)


def test_preserve_identity_hidden_states_equal_the_original():
    model = hf_model("qwen3", layers=3)
    ref = model(IDS, output_hidden_states=True).hidden_states
    depthrewrite.rewrite(model, "attnres", preserve_identity=True)
    out = model(IDS, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
