"""The public rewrite() API: options, errors, in-place semantics, parameter counts."""

import copy
import math
import types
import typing

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


def test_inspect_of_a_rewritten_model_names_its_scheme_and_options():
    plain = depthrewrite.inspect(ToyLM(n_layer=2), example_inputs=(IDS,))
    assert plain.rewritten_with is None and "rewritten with" not in str(plain)
    model = rewrite(ToyLM(n_layer=2), "block_attnres", block_size=2)
    stream = depthrewrite.inspect(model)
    scheme, options = stream.rewritten_with
    assert scheme == "block_attnres" and options["block_size"] == 2 and options["fused_merge"] is False
    assert "rewritten with 'block_attnres' (" in str(stream) and "block_size=2" in str(stream)
    assert stream.sites == plain.sites


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


# ------------------------------------------------------------------ option types
#: options a scheme needs to get as far as checking the others on ToyLM (no config: no head count)
_NEEDED = {"mhar": {"heads": 2}}


def _options_of_type(kind: type) -> list[tuple[str, str]]:
    """(scheme, option) for every option annotated ``kind`` (or ``kind | None``)."""
    found = []
    for name, cls in sorted(depthrewrite.SCHEMES.items()):
        for option, annotation in typing.get_type_hints(cls.Options).items():
            union = typing.get_origin(annotation) is types.UnionType
            given = {a for a in typing.get_args(annotation) if a is not type(None)} if union else {annotation}
            if given == {kind}:
                found.append((name, option))
    return found


def _rejected(scheme: str, option: str, value) -> str:
    with pytest.raises(ValueError) as err:
        rewrite(ToyLM(n_layer=2), scheme, **{**_NEEDED.get(scheme, {}), option: value})
    return str(err.value)


@pytest.mark.parametrize("scheme, option", _options_of_type(int))
def test_int_options_refuse_bools(scheme, option):
    """``True`` is an int to Python; as a block size or a head count it is a mistake."""
    assert _rejected(scheme, option, True).startswith(f"{scheme}: {option} must be ")


#: WAV's detail biases at -inf weigh the details 0: block_attnres exactly (test_schemes_routed)
_MEANINGFUL_NON_FINITE = {("wav", "detail_bias_init", -math.inf)}


@pytest.mark.parametrize("scheme, option, value", [
    (s, o, v) for s, o in _options_of_type(float) for v in (math.nan, math.inf, -math.inf)
    if (s, o, v) not in _MEANINGFUL_NON_FINITE])
def test_float_options_refuse_non_finite_values_by_name(scheme, option, value):
    """Checked where they are set: not as a non-finite output at verification, nor in the
    words of an internal op."""
    message = _rejected(scheme, option, value)
    assert message.startswith(f"{scheme}: {option} must be ")
    assert "finite" in message or "strictly between" in message  # mhc's pre_init: a bounded range


@pytest.mark.parametrize("scheme, option", _options_of_type(bool))
@pytest.mark.parametrize("value", [1, "no"])
def test_bool_options_refuse_other_truthy_values(scheme, option, value):
    assert _rejected(scheme, option, value).startswith(f"{scheme}: {option} must be True")  # ", False (or None)"


def test_option_types_cover_every_scheme():
    """The three tests above see every scheme's numeric and boolean options (a field
    annotated otherwise would escape them)."""
    seen = {(s, o) for kind in (int, float, bool) for s, o in _options_of_type(kind)}
    for name, cls in depthrewrite.SCHEMES.items():
        for option, annotation in typing.get_type_hints(cls.Options).items():
            if option not in ("gate", "variant", "readout", "beta_init"):
                assert (name, option) in seen, (name, option, annotation)


@pytest.mark.parametrize("beta", [(math.nan, 0.5), (1.0, math.inf)])
def test_dar_beta_init_must_be_finite(beta):
    message = _rejected("dar", "beta_init", beta)
    assert message.startswith("dar: beta_init must be a pair of finite numbers")


def test_block_size_true_is_not_recorded_as_a_block_size():
    """The walkthrough's case: accepted, it was saved as ``"block_size": true``."""
    assert "found True" in _rejected("block_attnres", "block_size", True)


@pytest.mark.parametrize("argument", ["inplace", "verify"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_inplace_and_verify_must_be_bools(argument, value):
    """``inplace="no"`` is truthy: it rewrote in place. Refused before anything is touched."""
    model = ToyLM()
    with pytest.raises(ValueError, match=rf"^rewrite: {argument} must be True or False, found {value!r}"):
        depthrewrite.rewrite(model, "attnres", example_inputs=(IDS,), **{argument: value})
    assert depthrewrite.rewrite(model, "attnres", example_inputs=(IDS,)) is model  # untouched, still rewritable


def test_residual_takes_the_common_options_and_stays_the_identity():
    """Every scheme takes ``preserve_identity`` and ``gate`` (``SchemeOptions``), so that one
    set of options can go to several schemes (``depthrewrite compare --option``); the identity
    rewrite satisfies ``preserve_identity`` as it is, makes no gate, and records what it was
    given. Other options are refused."""
    from depthrewrite.rewrite import find_runtime

    model = ToyLM()
    with torch.no_grad():
        reference = model(IDS)
    rewrite(model, "residual", preserve_identity=True, gate="channel")
    with torch.no_grad():
        assert torch.equal(model(IDS), reference)
    assert sum(p.numel() for n, p in model.named_parameters() if "depth_route" in n) == 0
    assert find_runtime(model).scheme.resolved_options() == {"preserve_identity": True, "gate": "channel"}
    with pytest.raises(ValueError, match="valid options: gate, preserve_identity"):
        rewrite(ToyLM(), "residual", eps=1e-6)


def test_deepcopy_of_a_rewritten_model_warns_nothing_and_computes_the_same():
    """Deep-copying a pytree spec made torch (2.13) warn that ``LeafSpec`` is deprecated;
    blocks used to keep their last call's specs. A copy after a forward warns nothing."""
    import warnings

    model = rewrite(ToyLM(), "dar")  # verification ran a forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(copied(IDS), model(IDS))


def test_readme_scheme_table_names_each_schemes_options():
    """The README's scheme table names each scheme's own options, and says that the common
    ones (``SchemeOptions``: ``preserve_identity``, ``gate``) go with every scheme, the
    identity rewrite included."""
    import dataclasses
    import pathlib

    from depthrewrite.passes import SchemeOptions

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text().split("\n## Schemes\n")[1]
    assert "Every scheme takes `preserve_identity=True`" in readme
    common = {f.name for f in dataclasses.fields(SchemeOptions)}
    for name, cls in depthrewrite.SCHEMES.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
        options_column = row.split(" | ")[2]
        own = {f.name for f in dataclasses.fields(cls.Options)} - common
        assert all(f"`{option}`" in options_column for option in own), (name, own)


# ------------------------------------------------------------------ checked before a model
@pytest.mark.parametrize("scheme, options", [
    ("attnres", {"group_size": 0}), ("block_attnres", {"block_size": 0}), ("block_attnres", {"keep_groups": -1}),
    ("mhar", {"heads": 0}), ("mhar", {"heads": 2, "block_size": 2, "group_size": 2}), ("wav", {"rho": 0.0}),
    ("wav", {"block_size": 0}), ("dar", {"layers_per_block": 0}), ("dar", {"variant": ["dar"]}),
    ("mhc", {"sinkhorn_iters": 0}), ("hyperconn", {"streams": 0}), ("mhc", {"pre_init": 1.0}),
    ("layerscale", {"preserve_identity": True, "init": 0.5}),
])
def test_options_are_checked_without_a_model_as_rewrite_checks_them(scheme, options):
    """``scheme_options`` runs every check that needs no model, with rewrite's own words, so
    that ``depthrewrite compare`` refuses a later scheme's bad value before it trains the
    first (it failed only when that scheme's turn came)."""
    from depthrewrite.passes import scheme_class, scheme_options

    with pytest.raises(ValueError) as without_model:
        scheme_options(scheme_class(scheme), options)
    with pytest.raises(ValueError) as rewritten:
        rewrite(ToyLM(n_layer=2), scheme, **options)
    assert str(rewritten.value) == str(without_model.value)


@pytest.mark.parametrize("scheme", ["attnres", "block_attnres", "dar", "residual", "rezero", "denseformer"])
def test_a_gate_without_preserve_identity_is_said_to_be_unused(caplog, scheme):
    """``gate='channel'`` shapes the gate that ``preserve_identity=True`` adds; without it the
    gate was ignored silently, yet recorded in the recipe. A warning, not an error: recipes
    saved with it must load back."""
    with caplog.at_level("WARNING", logger="depthrewrite"):
        rewrite(ToyLM(n_layer=2), scheme, gate="channel")
    assert f"{scheme}: gate='channel' is left unused: it shapes the gate that preserve_identity=True adds" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="depthrewrite"):
        model = rewrite(ToyLM(n_layer=2), scheme, gate="channel", preserve_identity=True)
    assert "left unused" not in caplog.text
    assert depthrewrite.inspect(model).rewritten_with[1]["gate"] == "channel"


@pytest.mark.parametrize("options", [{"rho": 7.0}, {"detail_bias_init": 3.0}])
def test_wav_detail_options_without_details_are_said_to_be_unused(caplog, options):
    name, value = next(iter(options.items()))
    with caplog.at_level("WARNING", logger="depthrewrite"):
        rewrite(ToyLM(n_layer=2), "wav", details=False, **options)
    assert f"wav: {name}={value!r} is left unused: it shapes the detail sources, which details=False" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="depthrewrite"):
        rewrite(ToyLM(n_layer=2), "wav", details=False)
    assert "left unused" not in caplog.text


@pytest.mark.parametrize("scheme, options, message", [
    ("block_attnres", {"block_size": 5}, "block_attnres: block_size=5 is more than the model's 4 routing sites"),
    ("mhar", {"heads": 2, "block_size": 5}, "mhar: block_size=5 is more than the model's 4 routing sites"),
    ("wav", {"block_size": 5}, "wav: block_size=5 is more than the model's 4 routing sites"),
    ("dar", {"layers_per_block": 3}, "dar: layers_per_block=3 is more than the model's 2 layers"),
])
def test_a_block_larger_than_the_model_is_reported_and_kept_as_given(caplog, scheme, options, message):
    """The model is then one block that never closes: well defined, and options made for a
    deeper model are reused on small ones on purpose, so it is a warning, not an error; the
    recipe keeps the value given (not clamped). At the model's size, nothing is said."""
    with caplog.at_level("WARNING", logger="depthrewrite"):
        model = rewrite(ToyLM(n_layer=2), scheme, **options)
    assert message + ": the whole model is one block that never closes" in caplog.text
    assert all(depthrewrite.inspect(model).rewritten_with[1][k] == v for k, v in options.items())
    caplog.clear()
    fits = {k: (2 if k == "layers_per_block" else 4 if k == "block_size" else v) for k, v in options.items()}
    with caplog.at_level("WARNING", logger="depthrewrite"):
        rewrite(ToyLM(n_layer=2), scheme, **fits)
    assert "never closes" not in caplog.text


def test_a_full_schemes_default_groups_fit_a_model_smaller_than_a_group():
    """group_size groups the computation of the same function (default 4): a model of fewer
    sites is one group, not an error."""
    model = rewrite(ToyLM(n_layer=1), "attnres")
    assert depthrewrite.inspect(model).rewritten_with[1]["group_size"] == 4


def test_inspect_and_reset_refuse_what_is_not_a_rewritten_module():
    with pytest.raises(ValueError, match=r"^inspect: model must be a torch.nn.Module, found str \(the CLI's"):
        depthrewrite.inspect("gpt:tiny")
    with pytest.raises(ValueError, match=r"^inspect: meta_init must be a function taking the model, found int"):
        depthrewrite.inspect(ToyLM(), meta_init=3)
    with pytest.raises(ValueError, match=r"^reset_routing_parameters: model must be a torch.nn.Module, found str"):
        depthrewrite.reset_routing_parameters("x")
    original = ToyLM()
    rewrite(original, "attnres", inplace=False)
    with pytest.raises(depthrewrite.DepthRewriteError, match=r"^reset_routing_parameters: ToyLM is not rewritten"):
        depthrewrite.reset_routing_parameters(original)
    assert depthrewrite.reset_routing_parameters(rewrite(ToyLM(), "residual")) == 0  # rewritten, nothing to reset


def test_a_model_whose_own_output_is_not_finite_is_not_blamed_on_the_rewrite():
    model = ToyLM()
    token = int(IDS[0, 0])  # a token of the capture input: its embedding row made NaN
    with torch.no_grad():
        model.embed.weight[token] = math.nan
    with pytest.raises(depthrewrite.DepthRewriteError, match=r"^verification: ToyLM's output was non-finite before "
                                                             r"the rewrite too"):
        rewrite(model, "attnres")


@pytest.mark.parametrize("example", [(IDS[:0],), {"ids": IDS[:, :0]}])
def test_an_empty_example_batch_is_refused_by_name(example):
    with pytest.raises(depthrewrite.CaptureError, match=r"^example_inputs: (argument 0|keyword 'ids') is an empty "
                                                        r"tensor \(shape \((0, 6|2, 0)\)\)"):
        depthrewrite.rewrite(ToyLM(), "attnres", example_inputs=example)


def test_a_forward_left_on_the_instance_by_transformers_4_is_dropped():
    """transformers 4.x, after a call with output_hidden_states, leaves each decoder layer
    an instance attribute ``forward`` bound to its class's own forward; kept, it would
    shadow the routed class's forward and run the original block with the depth state's
    extra arguments."""
    model, reference = ToyLM(), ToyLM()
    reference.load_state_dict(model.state_dict())
    for block in model.blocks:
        block.forward = block.forward  # what transformers 4.57's check_model_inputs puts back
    rewrite(model, "block_attnres", block_size=2)
    rewrite(reference, "block_attnres", block_size=2)
    assert not any("forward" in block.__dict__ for block in model.blocks)
    with torch.no_grad():
        for router_params in (model, reference):  # routing away from its init, the same in both
            torch.manual_seed(3)
            for name, p in router_params.named_parameters():
                if "depth_route" in name:
                    p.normal_()
        assert torch.equal(model(IDS), reference(IDS))


def test_a_foreign_forward_on_the_instance_is_refused_before_any_change():
    """A wrapper such as accelerate's hooks would bypass the rewrite: refused, the model untouched."""
    import functools

    model = ToyLM()
    model.blocks[0].forward = model.blocks[0].forward  # transformers 4.x's: would be dropped
    block = model.blocks[1]
    block.forward = functools.partial(type(block).forward, block)
    with pytest.raises(depthrewrite.UnsupportedStructureError,
                       match=r"module 'blocks.1' \(ToyBlock\) has an instance attribute 'forward' \(partial of "
                             r"tests.toy_models.ToyBlock.forward\) in place of its class's forward: the rewrite replaces the class's forward, "
                             r"which this attribute would bypass. Remove it before the rewrite \(for accelerate's "
                             r"hooks of a device_map load: accelerate.hooks.remove_hook_from_module\(model, "
                             r"recurse=True\)\)$"):
        rewrite(model, "attnres")
    assert not any(hasattr(m, "depth_route") for m in model.modules())
    assert "forward" in model.blocks[0].__dict__ and type(model.blocks[0]).__name__ == "ToyBlock"
