"""A rewritten model exports with ``torch.export`` (a deployment's first step), and the
exported program computes what the model does, at shapes other than the export's."""

import pytest
import torch
from torch.export import Dim

import depthrewrite
from depthrewrite.errors import DepthRewriteError
from depthrewrite.models import GPT, GPTConfig
from tests.conftest import HF_FAMILIES, hf_model, perturb_routing, skip_before_transformers_5

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
OTHER = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("scheme", list(depthrewrite.SCHEMES))
def test_an_exported_model_with_dynamic_batch_and_length_computes_what_the_model_does(scheme):
    torch.manual_seed(0)
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=32, n_head=4, n_layer=4, max_seq_len=32)), scheme).eval()
    perturb_routing(model)
    dims = ({0: Dim("batch", max=64), 1: Dim("length", min=2, max=32)},)
    exported = torch.export.export(model, (IDS,), dynamic_shapes=dims)
    with torch.no_grad():
        assert torch.equal(exported.module()(OTHER), model(OTHER))


@pytest.mark.parametrize("family", [
    pytest.param(f, marks=skip_before_transformers_5("its plain Mixtral does not export (data-dependent expert "
                                                     "routing)") if f == "mixtral" else ())
    for f in HF_FAMILIES if f != "gpt2"])
def test_an_exported_hugging_face_model_computes_what_the_model_does(family):
    model = depthrewrite.rewrite(hf_model(family), "dar")
    perturb_routing(model)
    ids = IDS % 97
    exported = torch.export.export(model, (ids,), {"use_cache": False})  # a cache is no tensor output
    with torch.no_grad():
        assert torch.equal(exported.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


@skip_before_transformers_5("its GPT-2 builds no attention mask when exported: no call to refuse")
def test_a_call_made_only_when_exported_names_what_differs_and_exports_once_run_eagerly():
    """GPT-2 builds an explicit attention mask when exported, where its eager call passed
    none: the rewrite prepared no program for that call, and tracing cannot run inside the
    export. The error names the argument; an eager call with a padding mask prepares it."""
    model = depthrewrite.rewrite(hf_model("gpt2"), "block_attnres", block_size=2)
    ids = IDS % 97
    with pytest.raises(DepthRewriteError, match="unlike the nearest prepared call, attention_mask is a tensor or "
                                                 "object here, None there; run the model once eagerly"):
        torch.export.export(model, (ids,), {"use_cache": False})
    padded = torch.ones_like(ids)
    padded[0, 0] = 0
    with torch.no_grad():
        model(ids, attention_mask=padded, use_cache=False)
    exported = torch.export.export(model, (ids,), {"use_cache": False})
    with torch.no_grad():
        assert torch.equal(exported.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
