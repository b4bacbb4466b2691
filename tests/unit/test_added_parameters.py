"""``depthrewrite.routing_parameters`` / ``named_routing_parameters``: exactly the parameters
a rewrite added, named as the model names them."""

from __future__ import annotations

import pytest
import torch

import depthrewrite
from depthrewrite.errors import DepthRewriteError
from depthrewrite.models import GPT, GPTConfig
from tests.conftest import hf_model


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(d_model=32, n_head=4, n_layer=4, max_seq_len=32))


def added_names(original, rewritten) -> set[str]:
    """The oracle: the parameter names the rewritten copy has and the original has not."""
    return {n for n, _ in rewritten.named_parameters()} - {n for n, _ in original.named_parameters()}


@pytest.mark.parametrize("scheme", list(depthrewrite.SCHEMES))
def test_they_are_the_parameters_the_rewrite_added(scheme):
    original = tiny_gpt()
    model = depthrewrite.rewrite(original, scheme, inplace=False)
    named = depthrewrite.named_routing_parameters(model)
    assert [n for n, _ in named] == [n for n, _ in model.named_parameters() if n in added_names(original, model)]
    by_name = dict(model.named_parameters())
    assert all(p is by_name[n] for n, p in named)
    assert [p for _, p in named] == depthrewrite.routing_parameters(model)
    assert sum(p.numel() for _, p in named) == (sum(p.numel() for p in model.parameters())
                                                - sum(p.numel() for p in original.parameters()))
    assert named or scheme == "residual"


@pytest.mark.parametrize("scheme", ["dar", "hyperconn", "mhc"])
def test_they_include_the_routing_matrices_a_rule_by_shape_would_catch(scheme):
    model = depthrewrite.rewrite(tiny_gpt(), scheme)
    matrices = [n for n, p in depthrewrite.named_routing_parameters(model) if p.dim() >= 2]
    assert matrices and all(".depth_route." in n for n in matrices)


def test_through_a_compile_wrapper_they_keep_its_names():
    model = depthrewrite.rewrite(tiny_gpt(), "block_attnres")
    wrapped = torch.compile(model, backend="eager")
    inner = depthrewrite.named_routing_parameters(model)
    outer = depthrewrite.named_routing_parameters(wrapped)
    assert [n for n, _ in outer] == [f"_orig_mod.{n}" for n, _ in inner]
    assert all(a is b for (_, a), (_, b) in zip(outer, inner))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_hugging_face_model(family):
    original = hf_model(family)
    model = depthrewrite.rewrite(original, "dar", inplace=False)
    assert {n for n, _ in depthrewrite.named_routing_parameters(model)} == added_names(original, model)


def test_a_model_not_rewritten_is_refused():
    model = tiny_gpt()
    with pytest.raises(DepthRewriteError, match="GPT is not rewritten"):
        depthrewrite.routing_parameters(model)
    with pytest.raises(ValueError, match="must be a torch.nn.Module, found str"):
        depthrewrite.named_routing_parameters("gpt")
