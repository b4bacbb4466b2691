"""Capture-level shapes of the model zoo, each on a toy model that has it: a final norm
also applied to the embedding (nanochat), blocks run several times (recurrent depth),
post-LN stacks, built-in depth routing and stacked streams (Inkling 2, Gemma 3n's AltUp),
a norm of the stream in block 0 only (RWKV), the load report of a rewritten checkpoint
and the single-block warning; the default example call turns a KV cache off."""

import contextlib
import logging
import pathlib
import types

import pytest
import torch
from torch import nn

import depthrewrite
from depthrewrite import NotAdditiveStreamError, NotPreNormError, UnsupportedStructureError
from depthrewrite.capture import _warn_single_block, default_example_inputs
from tests.conftest import hf_model, skip_before_transformers_5, transformers_major
from tests.toy_models import ToyBlock, ToyLM

IDS = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(IDS)


class EmbedNormLM(ToyLM):
    """nanochat: the final norm module also normalises the embedding before the blocks."""

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def depth_mix(sources, query, key_norm_weight, eps=1e-6):
    """docs/spec.md section 2 in the sources' own dtype: softmax over depth of w . RMSNorm_g(v_i)."""
    v = torch.stack(sources)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * key_norm_weight
    return ((keys * query).sum(-1).softmax(0).unsqueeze(-1) * v).sum(0)


def attnres_logits(model, ids):
    """Full AttnRes written out by hand for a rewritten
    EmbedNormLM, with its router parameters: source 0 is the *normed* embedding."""
    final_norm = nn.RMSNorm.forward.__get__(model.norm)  # the norm itself, not the routed call
    sources = [final_norm(model.embed(ids))]
    for block in model.blocks:
        for i, (norm, branch) in enumerate(((block.n1, block.mix), (block.n2, block.mlp)), start=1):
            router = block.depth_route[f"site{i}"]
            sources.append(branch(norm(depth_mix(sources, router.query, router.key_norm_weight))))
    router = model.norm.depth_route["readout"]
    return model.head(final_norm(depth_mix(sources, router.query, router.key_norm_weight)))


def test_final_norm_also_applied_to_the_embedding_routes_only_the_readout():
    torch.manual_seed(0)
    original = EmbedNormLM(n_layer=2).double()
    identity = depthrewrite.rewrite(original, "attnres", example_inputs=(IDS,), preserve_identity=True,
                                    inplace=False)
    assert torch.equal(logits(identity), logits(original))
    routed = depthrewrite.rewrite(original, "attnres", example_inputs=(IDS,), inplace=False)
    with torch.no_grad():  # off init: zero queries average the sources, which RMSNorm hides
        for name, p in routed.named_parameters():
            if "depth_route" in name:
                p.add_(torch.randn_like(p))
        expected = attnres_logits(routed, IDS)
    torch.testing.assert_close(logits(routed), expected, rtol=1e-12, atol=1e-12)


class LoopedLM(ToyLM):
    """Recurrent depth: the whole stack runs twice per forward."""

    def forward(self, ids):
        h = self.embed(ids)
        for _ in range(2):
            for block in self.blocks:
                h = block(h)
        return self.head(self.norm(h))


def test_blocks_run_several_times_are_not_an_additive_stream():
    with pytest.raises(NotAdditiveStreamError, match=r"block 'blocks.0' runs 2 times per forward \(recurrent"):
        depthrewrite.inspect(LoopedLM(), example_inputs=(IDS,))


class TiedHeadLM(ToyLM):
    """No module after the stack: the head is a matmul with the embedding (GPT-1 style)."""

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return h @ self.embed.weight.T


def test_post_ln_stack_without_final_norm_is_refused_as_post_ln():
    with pytest.raises(NotPreNormError) as err:
        depthrewrite.inspect(TiedHeadLM(shape="post_ln", norm="layer"), example_inputs=(IDS,))
    msg = str(err.value)
    assert "'blocks.2'" in msg and "'blocks.2.n2' (LayerNorm)" in msg and "post-LN, norm(h + f(h))" in msg


class FinalNormInLastBlock(ToyBlock):
    def forward(self, h):
        h = super().forward(h)
        return self.post2(h) if self.last else h


def test_final_norm_inside_the_last_block_is_an_unsupported_structure():
    model = TiedHeadLM(block_cls=FinalNormInLastBlock)
    for i, block in enumerate(model.blocks):
        block.last = i == len(model.blocks) - 1
    with pytest.raises(UnsupportedStructureError, match=r"'blocks.2.post2' \(RMSNorm\), and the other blocks do not"):
        depthrewrite.inspect(model, example_inputs=(IDS,))


class DepthMixer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query = nn.Parameter(torch.randn(d))

    def forward(self, history, h):
        states = torch.cat([history, h.unsqueeze(-2)], dim=-2)
        return ((states @ self.query).softmax(-1).unsqueeze(-1) * states).sum(-2)


class BuiltInRoutingLM(ToyLM):
    """Inkling 2: the model keeps the block outputs and routes over them before its norm."""

    def __init__(self):
        super().__init__()
        self.final_input = DepthMixer(16)

    def forward(self, ids):
        h = self.embed(ids)
        history = h.unsqueeze(-2)
        for block in self.blocks:
            new = block(h)
            history = torch.cat([history, h.unsqueeze(-2)], dim=-2)
            h = new
        return self.head(self.norm(self.final_input(history, h)))


def test_builtin_depth_routing_before_the_final_norm_is_not_an_additive_stream():
    with pytest.raises(NotAdditiveStreamError) as err:
        depthrewrite.inspect(BuiltInRoutingLM(), example_inputs=(IDS,))
    msg = str(err.value)
    assert "'final_input' (DepthMixer) as its argument 1" in msg and "argument 0 of shape [2, 6, 4, 16]" in msg


class StackedStreamsLM(ToyLM):
    """Gemma 3n's AltUp: the blocks carry two streams stacked on a first dimension."""

    def forward(self, ids):
        e = self.embed(ids)
        h = torch.stack([e, 2 * e])
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h[0]) + self.norm(h[1]))


def test_stacked_streams_are_not_an_additive_stream():
    expected = (r"shape \[2, 2, 6, 16\], is read in slices of shape \[2, 6, 16\] \(first by 'norm' "
                r"\(RMSNorm\)\): the blocks carry 2 streams")
    with pytest.raises(NotAdditiveStreamError, match=expected):
        depthrewrite.inspect(StackedStreamsLM(), example_inputs=(IDS,))


class FirstBlockNorm(ToyBlock):
    """RWKV: block 0 alone normalises the stream before its first site."""

    def __init__(self, d, shape, norm):
        super().__init__(d, shape, norm)
        self.pre = nn.LayerNorm(d)

    def forward(self, h):
        if self.first:
            h = self.pre(h)
        return super().forward(h)


def test_stream_norm_in_block_zero_only_is_named():
    model = ToyLM(block_cls=FirstBlockNorm)
    for i, block in enumerate(model.blocks):
        block.first = i == 0
    with pytest.raises(UnsupportedStructureError) as err:
        depthrewrite.inspect(model, example_inputs=(IDS,))
    assert "block 'blocks.0' normalises its stream (argument 0) with 'blocks.0.pre' (LayerNorm)" in str(err.value)
    for block in model.blocks:  # the same norm in every block is no block-0 embedding norm
        block.first = True
    with pytest.raises(depthrewrite.DepthRewriteError) as err:
        depthrewrite.inspect(model, example_inputs=(IDS,))
    assert not isinstance(err.value, UnsupportedStructureError)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_child_whose_tuple_output_the_block_branches_on_is_traced_as_a_tuple():
    """Qwen2-MoE in transformers 4.57: ``out = self.mlp(x); if isinstance(out, tuple): out, _
    = out``. A leaf's output is one proxy to the tracer, so the graph took the other branch
    and added the tuple to the stream; the block is traced again with the MLP returning a
    tuple, as it did in the recorded call."""
    model = ToyLM(shape="moe_tuple_checked")
    ref = logits(model)
    stream = depthrewrite.inspect(model, example_inputs=(IDS,))
    assert [s.kind for s in stream.sites] == ["attention", "mlp"] * 3
    depthrewrite.rewrite(model, "attnres", preserve_identity=True, example_inputs=(IDS,))
    assert torch.equal(logits(model), ref)


@contextlib.contextmanager
def _load_report_records():
    """transformers' load-report logger's messages, at WARNING whatever verbosity other tests
    left behind."""
    records = _Records()
    report_logger = logging.getLogger("transformers.modeling_utils")
    level = report_logger.level
    report_logger.setLevel(logging.WARNING)
    report_logger.addHandler(records)
    try:
        yield records
    finally:
        report_logger.removeHandler(records)
        report_logger.setLevel(level)


def _unused_weights_message(keys: list[str]) -> str:
    """transformers 4.x's warning of checkpoint weights the architecture does not have."""
    return (f"Some weights of the model checkpoint at /ckpt were not used when initializing LlamaForCausalLM: "
            f"{keys}\n- This IS expected if you are initializing LlamaForCausalLM from the checkpoint of a model "
            f"trained on another task or with another architecture.")


def test_the_4x_unused_weights_warning_loses_the_routing_keys_only():
    from depthrewrite.hf import _RoutingKeyReportFilter

    def filtered(keys):
        record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1,
                                   _unused_weights_message(keys), (), None)
        return record.getMessage() if _RoutingKeyReportFilter().filter(record) else None

    routing = ["model.layers.0.depth_route.site1.query", "model.norm.depth_route.readout.key_norm_weight"]
    assert filtered(routing) is None
    assert filtered(routing + ["model.extra.weight"]) == _unused_weights_message(["model.extra.weight"])
    assert filtered(["model.extra.weight"]) == _unused_weights_message(["model.extra.weight"])


@pytest.mark.skipif(transformers_major() is None or transformers_major() >= 5,
                    reason="transformers 4.x's warning (5.x: the LOAD REPORT test below)")
def test_from_pretrained_on_transformers_4_warns_of_no_routing_key(tmp_path):
    import transformers

    model = depthrewrite.rewrite(hf_model("llama"), "attnres", preserve_identity=True)
    model.save_pretrained(tmp_path)
    with _load_report_records() as records:
        depthrewrite.from_pretrained(tmp_path)
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # the plain load still warns
    unused = [m for m in records.messages if "were not used" in m]
    assert len(unused) == 1 and "depth_route" in unused[0]


@skip_before_transformers_5("no LOAD REPORT: it names unexpected keys in another warning")
def test_load_report_drops_the_routing_keys_and_keeps_the_others(tmp_path):
    from safetensors.torch import load_file, save_file

    model = depthrewrite.rewrite(hf_model("llama"), "attnres", preserve_identity=True)
    model.save_pretrained(tmp_path)
    with _load_report_records() as records:
        depthrewrite.from_pretrained(tmp_path)
        assert not any("LOAD REPORT" in m for m in records.messages)
        weights = next(pathlib.Path(tmp_path).glob("*.safetensors"))
        tensors = load_file(str(weights))
        tensors["model.not_a_parameter.weight"] = torch.zeros(3)
        save_file(tensors, str(weights), metadata={"format": "pt"})
        depthrewrite.from_pretrained(tmp_path)
    reports = [m for m in records.messages if "LOAD REPORT" in m]
    assert len(reports) == 1
    assert "model.not_a_parameter.weight" in reports[0] and "UNEXPECTED" in reports[0]
    assert "depth_route" not in reports[0]


def test_single_block_warning_is_logged_once(caplog):
    _warn_single_block.cache_clear()
    model = ToyLM(n_layer=1)
    with caplog.at_level(logging.WARNING, logger="depthrewrite"):
        depthrewrite.inspect(model, example_inputs=(IDS,))
        depthrewrite.rewrite(model, "attnres", example_inputs=(IDS,), inplace=False)
        depthrewrite.rewrite(model, "dar", example_inputs=(IDS,), inplace=False)
    warnings = [r for r in caplog.records if "holds a single block" in r.getMessage()]
    assert len(warnings) == 1 and "'blocks' of ToyLM" in warnings[0].getMessage()


class HalvingLM(ToyLM):
    """RWKV in eval mode: the stream is halved between two blocks."""

    def forward(self, ids):
        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                h = h / 2
        return self.head(self.norm(h))


def test_stream_rescaled_between_blocks_is_not_an_additive_stream():
    with pytest.raises(NotAdditiveStreamError, match=r"rescaled between blocks 'blocks.1' and 'blocks.2': the "
                                                     r"next block receives 0.5 times"):
        depthrewrite.inspect(HalvingLM(n_layer=4), example_inputs=(IDS,))


class _KwargsOnlyModel(nn.Module):
    """A causal LM whose forward takes ``use_cache`` only through ``**kwargs``."""

    def __init__(self, **config):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=11, **config)
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids, **kwargs):
        return input_ids


def test_default_example_turns_the_cache_off_through_var_keywords():
    # a cache filled during the capture makes the analysis replay blocks against a longer
    # cache than the recorded mask (granitemoe_swa)
    _, kwargs = default_example_inputs(_KwargsOnlyModel(use_cache=True))
    assert kwargs == {"use_cache": False}
    _, kwargs = default_example_inputs(_KwargsOnlyModel())  # no cache in the config: nothing passed
    assert kwargs == {}
