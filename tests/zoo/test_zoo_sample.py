"""A fixed sample of the model-zoo survey (benchmarks/zoo_coverage.py, docs/coverage.md):
families the survey shows as rewritten must stay rewritten with bit-identical identity
rewrites, and known non-PreNorm families must stay refused with a reason naming the module.

The per-family check is the survey's own ``check_family`` (one implementation), run in this
process: build from a shrunken default config, inspect, rewrite with attnres and dar, each
with and without ``preserve_identity`` (the identity rewrites compared with ``torch.equal``).
"""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("transformers")

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "zoo_coverage.py"


def _load_survey():
    spec = importlib.util.spec_from_file_location("zoo_coverage", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


zoo = _load_survey()

#: families docs/coverage.md lists as rewritten: dense, GQA, sandwich norms, parallel
#: blocks, learned positions and mixture-of-experts
REWRITTEN = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
             "gpt_neox", "mixtral", "qwen2_moe", "granite", "olmo", "cohere"]
#: families refused by design: (family, error class, the module the message must name)
REFUSED = [
    ("olmo2", "NotPreNormError", "model.layers.0"),
    ("bloom", "NoResidualStreamError", "transformer.h.0"),
]


@pytest.mark.parametrize("family", REWRITTEN)
def test_family_is_rewritten_with_identity(family):
    result = zoo.check_family(family)
    assert result.status == "rewritten", result.detail
    assert result.runs == {"attnres": "ok", "attnres preserve_identity": "ok", "dar": "ok",
                           "dar preserve_identity": "ok"}
    # two layers, at least one residual site each (two for sequential blocks)
    assert result.sites is not None and 2 <= result.sites <= 4


@pytest.mark.parametrize("family,error,module", REFUSED)
def test_family_is_refused_with_a_reason(family, error, module):
    result = zoo.check_family(family)
    assert result.status == "refused", result.detail
    assert result.cause == error
    assert f"'{module}'" in result.detail


def test_identity_break_is_reported_as_failure(monkeypatch):
    """The survey's classifier itself: a rewrite whose identity output differs must be
    'failed', not 'rewritten' (guards the check the sample relies on)."""
    import torch
    import depthrewrite

    real = depthrewrite.rewrite

    def perturbed(model, scheme, **kw):
        model = real(model, scheme, **kw)
        if kw.get("preserve_identity"):
            with torch.no_grad():
                model.get_output_embeddings().weight.add_(1e-3)
        return model

    monkeypatch.setattr(depthrewrite, "rewrite", perturbed)
    result = zoo.check_family("llama")
    assert result.status == "failed"
    assert result.cause == "identity broken"
