"""A fixed sample of the model-zoo survey (benchmarks/zoo_coverage.py, docs/coverage.md):
families the survey shows as rewritten must stay rewritten with bit-identical identity
rewrites, and reviewed non-PreNorm / non-additive families must stay refused with the
reviewed reason and a message naming the module.

The per-family check is the survey's own ``check_family`` (one implementation), run in this
process: build from a shrunken default config, inspect, rewrite with attnres and dar, each
with and without ``preserve_identity`` (the identity rewrites compared with ``torch.equal``).

The whole survey, every family in a subprocess of its own, printing the coverage line
(8 min on an idle 2-core machine, about 20 min when it is shared; opt-in):

    DEPTHREWRITE_ZOO_FULL=1 /work/venv/bin/python -m pytest -q -s tests/zoo -k full_survey
"""

import math
import os

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.conftest import skip_before_transformers_5

pytest.importorskip("transformers")
pytestmark = skip_before_transformers_5("the sample's families and verdicts are transformers 5.25's survey "
                                        "(docs/coverage.md); some families are not in 4.x")


def _load_survey():
    return load_benchmark("zoo_coverage")


zoo = _load_survey()

#: families docs/coverage.md lists as rewritten: dense, GQA, sandwich norms, parallel
#: blocks, learned positions and mixture-of-experts
REWRITTEN = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
             "gpt_neox", "mixtral", "qwen2_moe", "granite", "olmo", "cohere",
             # built only with their OVERRIDES entry (shared-expert MoE, head_dim, conv+MoE hybrid)
             "dots1", "hunyuan_v1_dense", "lfm2_moe"]
#: reviewed refusals: (family, status, error class, the module the message must name)
REFUSED = [
    ("olmo2", "refused: not PreNorm", "NotPreNormError", "model.layers.0"),
    ("doge", "refused: not an additive stream", "NotAdditiveStreamError", "model.layers.0"),
    ("bert", "refused: not PreNorm", "NotPreNormError", "bert.encoder.layer.1"),  # post-LN
    ("dory", "refused: not an additive stream", "NotAdditiveStreamError", "model.layers.0"),  # looped depth
]


@pytest.mark.parametrize("family", REWRITTEN)
def test_family_is_rewritten_with_identity(family):
    result = zoo.check_family(family)
    assert result.status == "rewritten", result.detail
    assert result.runs == {"attnres": "ok", "attnres preserve_identity": "ok", "dar": "ok",
                           "dar preserve_identity": "ok"}
    # two layers, at least one residual site each (two for sequential blocks)
    assert result.sites is not None and 2 <= result.sites <= 4


@pytest.mark.parametrize("family,status,error,module", REFUSED)
def test_family_is_refused_with_a_reason(family, status, error, module):
    result = zoo.check_family(family)
    assert result.status == status, result.detail
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


def test_refusals_count_against_coverage_unless_reviewed():
    """The coverage number does not take the library's word: a not-PreNorm or not-additive
    refusal is excluded only for a reviewed family; every other refusal, and a reviewed
    family that is rewritten or refused for the other reason, counts against."""
    assert zoo.classify_refusal("olmo2", "NotPreNormError") == ("refused: not PreNorm", "")
    assert zoo.classify_refusal("doge", "NotAdditiveStreamError") == ("refused: not an additive stream", "")
    assert zoo.classify_refusal("llama", "NotPreNormError")[0] == "disputed"
    assert zoo.classify_refusal("llama", "NotAdditiveStreamError")[0] == "disputed"
    assert zoo.classify_refusal("olmo2", "NotAdditiveStreamError")[0] == "disputed"
    assert zoo.classify_refusal("bloom", "NoResidualStreamError")[0] == "refused: unsupported"
    assert zoo.classify_refusal("olmo2", "CaptureError")[0] == "refused: unsupported"
    assert zoo.classify_rewritten("llama") == ("rewritten", "")
    assert zoo.classify_rewritten("olmo2")[0] == "disputed"

    results = [zoo.Result(f"f{i}", status) for i, status in enumerate(
        ["rewritten"] * 6 + ["refused: not PreNorm", "refused: not an additive stream", "refused: unsupported",
                             "disputed", "failed", "timed out", "not buildable", "skipped"])]
    c = zoo.coverage(results)
    assert c["coverage"] == 6 / 10
    assert "coverage: 6/10 = 60.0%" in zoo.coverage_line(c)
    assert math.isnan(zoo.coverage([zoo.Result("x", "skipped")])["coverage"])


def test_reviewed_tables_name_real_families_once():
    """Each reviewed family is a causal-LM family of the installed transformers (a misspelt
    name would silently never match), and none is reviewed both as PreNorm and as not."""
    families = set(zoo.causal_lm_families())
    reviewed_not = set(zoo.REVIEWED_NOT_PRENORM) | set(zoo.REVIEWED_NOT_ADDITIVE)
    for table in (zoo.REVIEWED_NOT_PRENORM, zoo.REVIEWED_NOT_ADDITIVE, zoo.REVIEWED_PRENORM):
        assert set(table) <= families, set(table) - families
        assert all(evidence.strip() for evidence in table.values())
    assert not reviewed_not & set(zoo.REVIEWED_PRENORM)
    for family in list(zoo.OVERRIDES) + list(zoo.NEEDS_PACKAGE) + list(zoo.NOT_STANDALONE):
        assert family in families, family


def test_overridden_families_build_small():
    """Every family with an OVERRIDES entry gets a valid small config and a model under the
    size limit (on the meta device: no weights), with grouped or, failing that, plain
    multi-head attention, as the survey tries them."""
    for family in zoo.OVERRIDES:
        errors = []
        for mha in (False, True):
            try:
                params = zoo._count_params_meta(zoo.small_config(family, mha))
                break
            except Exception as e:  # noqa: BLE001 - reported below if neither variant builds
                errors.append(f"{type(e).__name__}: {e}")
        else:
            pytest.fail(f"{family}: {errors}")
        assert 0 < params <= zoo.MAX_PARAMS, (family, params)


@pytest.mark.skipif(os.environ.get("DEPTHREWRITE_ZOO_FULL") != "1",
                    reason="the full zoo survey takes 8-20 min; set DEPTHREWRITE_ZOO_FULL=1")
def test_full_survey_coverage():
    """Every causal-LM family, each in its own subprocess (the survey's machinery): prints
    the coverage line; coverage of the buildable families >= 95% and nothing failed."""
    results = zoo.survey(zoo.causal_lm_families(), workers=2, timeout=zoo.TIMEOUT_S)
    c = zoo.coverage(results)
    print("\n" + zoo.coverage_line(c))
    for status in zoo.AGAINST:
        for r in results:
            if r.status == status:
                print(f"  {status}: {r.family}: {r.detail[:200]}")
    failed = [r.family for r in results if r.status == "failed"]
    assert not failed, failed
    assert c["coverage"] >= 0.95, zoo.coverage_line(c)
