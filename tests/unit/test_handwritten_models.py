"""Models nobody here wrote (nanoGPT- and torchtitan-style) are captured, rewritten with
every scheme, identical at initialisation with preserve_identity, and they train."""

import gc

import pytest
import torch

import depthrewrite
from depthrewrite.errors import CaptureError, DepthRewriteError, NoResidualStreamError, UnsupportedStructureError
from tests.handwritten_models import (
    CheckpointedLM, FirstLayerSkipLM, GPTConfig, NanoGPT, PythonListLM, StartPosLM, TitanLlama,
)

IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
IDENTITY = [s for s, cls in depthrewrite.SCHEMES.items() if cls.delta_applies]


def build(kind, seed=0):
    torch.manual_seed(seed)
    return (NanoGPT(GPTConfig()) if kind == "nanogpt" else TitanLlama()).eval()


def logits(model):
    with torch.no_grad():
        out = model(IDS)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind, stack, final", [("nanogpt", "transformer.h", "transformer.ln_f"),
                                                ("titan", "layers", "norm")])
def test_the_stream_is_found(kind, stack, final):
    stream = depthrewrite.inspect(build(kind), example_inputs=(IDS,))
    assert stream.stack_path == stack and stream.final_norm_path == final
    assert stream.sites_per_block() == [2, 2, 2]
    assert [s.kind for s in stream.sites[:2]] == ["attention", "mlp"]


@pytest.mark.parametrize("kind", ["nanogpt", "titan"])
@pytest.mark.parametrize("scheme", IDENTITY + ["residual"])
def test_identity_at_init(kind, scheme):
    model = build(kind)
    ref = logits(model)
    options = {} if scheme == "residual" else {"preserve_identity": True}
    if scheme == "mhar" and kind == "titan":
        options["heads"] = 4  # no config to read the head count from: MHAR asks for it
    depthrewrite.rewrite(model, scheme, example_inputs=(IDS,), **options)
    assert torch.equal(logits(model), ref)


def test_mhar_without_a_config_asks_for_heads():
    with pytest.raises(ValueError, match="heads"):
        depthrewrite.rewrite(build("titan"), "mhar", example_inputs=(IDS,))


@pytest.mark.parametrize("kind", ["nanogpt", "titan"])
@pytest.mark.parametrize("scheme", ["attnres", "block_attnres", "dar", "mhc"])
def test_rewritten_handwritten_models_train(kind, scheme):
    model = depthrewrite.rewrite(build(kind), scheme, example_inputs=(IDS,)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    targets = torch.roll(IDS, -1, dims=1)
    losses = []
    for _ in range(30):
        out = model(IDS)
        out = out[0] if isinstance(out, tuple) else out
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def _gradients(model, scheme):
    depthrewrite.rewrite(model, scheme, example_inputs=(IDS,), **({"heads": 4} if scheme == "mhar" else {}))
    model.train()
    targets = torch.roll(IDS, -1, dims=1)
    for _ in range(2):  # the second step must not see the first one's depth state
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(IDS).flatten(0, 1), targets.flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scheme", ["residual", "attnres", "block_attnres", "dar", "wav", "mhc"])
def test_checkpoint_around_the_block_call_gives_the_plain_gradients(scheme):
    """``checkpoint(block, x, ...)`` in the model's loop runs the block's call again in the
    backward, after the depth runtime has moved on: the replay must see the depth state the
    first run saw (it raised RuntimeOrderError 'ran as block 0')."""
    torch.manual_seed(0)
    plain = _gradients(CheckpointedLM(), scheme)
    torch.manual_seed(0)
    checkpointed = _gradients(CheckpointedLM(use_reentrant=False), scheme)
    assert plain.keys() == checkpointed.keys()
    assert scheme == "residual" or any("depth_route" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0, msg=name)


def test_checkpointed_forward_without_backward_keeps_no_state():
    torch.manual_seed(0)
    model = depthrewrite.rewrite(CheckpointedLM(use_reentrant=False), "attnres", example_inputs=(IDS,)).train()
    out = model(IDS)
    assert any(block.__dict__.get("_depth_pending") for block in model.blocks)
    del out
    gc.collect()
    assert not any(block.__dict__.get("_depth_pending") for block in model.blocks)


def test_reentrant_checkpoint_around_the_block_call_is_refused():
    """With use_reentrant=True the block's call runs with gradients off: the depth state it
    passes on would silently get no gradient."""
    torch.manual_seed(0)
    model = depthrewrite.rewrite(CheckpointedLM(use_reentrant=True), "attnres", example_inputs=(IDS,)).train()
    with pytest.raises(DepthRewriteError, match=r"block 'blocks.0' .*use_reentrant=False"):
        model(IDS)


def test_blocks_in_a_python_list_are_named():
    with pytest.raises(NoResidualStreamError, match=r"PythonListLM.blocks is a Python list of 3 ArgsBlock .*nn.ModuleList"):
        depthrewrite.inspect(PythonListLM(), example_inputs=(IDS,))


@pytest.mark.parametrize("kind", ["nanogpt", "titan"])
def test_a_model_on_the_meta_device_without_an_init_is_refused_with_what_to_do(kind):
    """torchtitan builds its model under torch.device("meta") before to_empty and its weight
    init. The analysis needs values: a model with no ``init_weights()`` needs ``meta_init``
    to materialize it for the analysis (tests/unit/test_meta_rewrite.py), and without one
    the error says so; the model stays on the meta device."""
    with torch.device("meta"):
        model = build(kind)
    with pytest.raises(CaptureError, match=r"rewrite: .* is on the meta device and has no init_weights\(\).*meta_init="):
        depthrewrite.rewrite(model, "block_attnres", example_inputs=(IDS,))
    assert all(p.is_meta for p in model.parameters())


def test_a_skip_into_every_block_is_named_between_the_first_two_blocks():
    """The chain breaks at its first link: the error names the stack's blocks, as it does
    where it breaks later (it said only "no stack of blocks")."""
    with pytest.raises(UnsupportedStructureError, match=r"the stream is changed between blocks 'blocks.0' and "
                       r"'blocks.1'"):
        depthrewrite.inspect(FirstLayerSkipLM(), example_inputs=(IDS,))


def _decode(branch_on_start=False, steps=10):
    """Greedy decoding of the original and of its rewrite (identical at initialisation)."""
    torch.manual_seed(0)
    original = StartPosLM(branch_on_start=branch_on_start).eval()
    prompt = IDS[:1, :5]
    routed = depthrewrite.rewrite(original, "block_attnres", example_inputs=(prompt,), inplace=False,
                                  preserve_identity=True).eval()
    return original, routed, prompt


@pytest.mark.parametrize("branch_on_start", [False, True])
def test_an_int_decoding_position_is_traced_once_as_an_input(branch_on_start):
    """Meta Llama's ``layer(h, start_pos, mask)`` with an int ``start_pos``: traced as an
    input from its second value on, one graph serves every position (it was one graph per
    position, traced at each new one). A block that branches on it keeps a graph per value."""
    original, routed, prompt = _decode(branch_on_start)
    want, got = original.generate(prompt, 10), routed.generate(prompt, 10)
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), step
    block = routed.layers[1]
    if branch_on_start:
        assert block._depth_int_inputs == frozenset() and block._depth_int_constants == {1}
        assert sum(p.spec.positional[1][0] == "const" for p in block._depth_programs.values()) >= 10
    else:
        assert block._depth_int_inputs == {1}
        # in eval mode, the prompt's position 0 and the first decoded one were traced as constants
        consts = [p.spec.positional[1] for p in block._depth_programs.values() if not p.spec.training]
        assert sorted(c for c in consts if c[0] == "const") == [("const", 0), ("const", 5)]
        programs = len(block._depth_programs)
        routed.generate(prompt, 20)  # 10 positions more
        assert len(block._depth_programs) == programs


def test_a_compiled_decoder_reads_each_position_through_the_traced_int():
    original, routed, prompt = _decode()
    routed.generate(prompt, 3)  # eager first: the graphs a compiled call may use are made outside it
    compiled = torch.compile(routed, backend="depthrewrite", options={"inner": "aot_eager"}, fullgraph=True)
    want = original.generate(prompt, 8)
    with torch.no_grad():
        tokens, pos = prompt, 0
        for step in range(8):
            out = compiled(tokens, pos)
            assert torch.equal(out, want[step]), step
            pos += tokens.shape[1]
            tokens = out[:, -1:].argmax(-1)
