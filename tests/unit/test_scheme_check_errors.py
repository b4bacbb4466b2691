"""benchmarks/gpu_scheme_check.py's gradient errors: a gradient that is exactly zero in the
reference (a symmetry: DAR's first-site gate) is measured against its kind's scale, so
rounding passes and a wrong value still fails; every other gradient against its own norm."""

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


def _load():
    return load_benchmark("gpu_scheme_check")


def _reference():
    return {"blocks.0.site1.mix": torch.zeros(1), "blocks.0.site2.mix": torch.tensor([3e-4]),
            "blocks.1.site1.mix": torch.tensor([-4e-4]), "blocks.0.site1.beta": torch.tensor([3.0, 4.0])}


def test_a_zero_gradient_is_scaled_by_its_kind_and_others_by_their_own_norm():
    check = _load()
    scales = check._scales(_reference())
    assert scales["blocks.0.site1.mix"] == torch.tensor([3e-4, -4e-4]).norm().item()  # the other mix gradients
    assert scales["blocks.0.site2.mix"] == torch.tensor(3e-4).item()
    assert scales["blocks.0.site1.beta"] == 5.0


def test_rounding_of_a_zero_gradient_passes_and_a_wrong_value_fails():
    check = _load()
    ref = _reference()
    scale = check._scales(ref)["blocks.0.site1.mix"]
    # the H200's fused merge left 1.2e-10 where the reference's two equal sums cancel to 0.0
    assert check._rel(torch.tensor([1.2e-10]), ref["blocks.0.site1.mix"], scale) < check.TOLERANCE["fp32"]
    assert check._rel(torch.tensor([1e-5]), ref["blocks.0.site1.mix"], scale) > check.TOLERANCE["fp32"]
    # without the scale the same rounding reads as a relative error of about 1e20
    assert check._rel(torch.tensor([1.2e-10]), ref["blocks.0.site1.mix"]) > 1e19


def test_a_kind_that_is_all_zero_keeps_the_strict_comparison():
    check = _load()
    scales = check._scales({"a.gate": torch.zeros(2), "b.gate": torch.zeros(3)})
    assert scales == {"a.gate": 0.0, "b.gate": 0.0}
    assert check._rel(torch.tensor([1e-12, 0.0]), torch.zeros(2), scales["a.gate"]) > 1.0



def test_a_candidate_is_measured_against_float64_with_the_references_own_error_as_slack():
    """fp32 as bf16: against the float64 truth, at most 1e-4 or 4x the reference's own error.
    Session 22's case: on a cancellation-bound gate gradient whose fp32 reference is 1e-4
    from the truth, a candidate 9.3e-6 from it passes (against the reference it read
    9.4e-5) and one off by a tenth fails; on a well-conditioned gradient the limit is 1e-4."""
    check = _load()
    exact = {"gate": torch.tensor([1.0]), "weight": torch.tensor([3.0, 4.0])}
    reference = {"gate": torch.tensor([1.0 + 1.0e-4]), "weight": torch.tensor([3.0, 4.0 + 1e-7])}
    errors, _, verdict = check.gradient_errors(
        {"gate": torch.tensor([1.0 - 9.3e-6]), "weight": torch.tensor([3.0, 4.0 + 2e-4])}, reference, exact, "fp32")
    allowed = verdict.allowed
    assert abs(allowed["gate"] - 4.0e-4) < 1e-6  # 4x the reference's own error, above 1e-4
    assert allowed["weight"] == check.TOLERANCE["fp32"]
    assert errors["gate"] <= allowed["gate"] and errors["weight"] <= allowed["weight"]  # 9.3e-6; 2e-4 / 5
    errors, _, verdict = check.gradient_errors(
        {"gate": torch.tensor([1.1]), "weight": torch.tensor([3.0, 4.0 + 1e-3])}, reference, exact, "fp32")
    allowed = verdict.allowed
    assert errors["gate"] > allowed["gate"] and errors["weight"] > allowed["weight"]  # 0.1; 1e-3 / 5


def test_a_routing_scheme_on_cuda_must_run_every_call_on_the_kernels():
    check = _load()
    assert check.lowered_to_kernels("dar", "cuda", {"depthrewrite::route_many (triton)": 6})
    assert check.lowered_to_kernels("mhar_block_fm", "cuda:0", {"depthrewrite::route_many (triton)": 3,
                                                                "depthrewrite::route_merge (triton)": 2})
    assert not check.lowered_to_kernels("dar", "cuda", {})  # nothing lowered: the rewrite did not route
    assert not check.lowered_to_kernels("wav", "cuda", {"depthrewrite::route (triton+reference)": 5})
    assert not check.lowered_to_kernels("attnres_site", "cuda", {"depthrewrite::route (reference)": 5})
    assert check.lowered_to_kernels("residual", "cuda", {})  # a baseline adds no routing op
    assert check.lowered_to_kernels("dar", "cpu", {"depthrewrite::route_many (reference)": 6})


def test_with_several_references_the_allowance_is_four_times_the_farthest():
    """Session 23: two correct fp32 implementations (Inductor alone, eager) land on either
    side of one another on a cancellation-bound scalar; the candidate may be 4x as far from
    the truth as the farther of them, and a gradient off by a tenth still fails."""
    check = _load()
    exact = {"transport": torch.tensor([1.0])}
    near, far = {"transport": torch.tensor([1.0 + 2e-5])}, {"transport": torch.tensor([1.0 - 1e-4])}
    candidate = {"transport": torch.tensor([1.0 + 3e-4])}
    errors, _, verdict = check.gradient_errors(candidate, near, exact, "fp32")
    allowed = verdict.allowed
    assert errors["transport"] > allowed["transport"]  # 3e-4 against max(1e-4, 4 x 2e-5)
    errors, _, verdict = check.gradient_errors(candidate, [near, far], exact, "fp32")
    allowed = verdict.allowed
    assert abs(allowed["transport"] - 4e-4) < 1e-6 and errors["transport"] <= allowed["transport"]
    assert check.reference_errors([near, far], exact)["transport"] == check.errors_against(far, exact)["transport"]
    errors, _, verdict = check.gradient_errors({"transport": torch.tensor([1.1])}, [near, far], exact, "fp32")
    allowed = verdict.allowed
    assert errors["transport"] > allowed["transport"]


def _kind(prefix: str, errors: list[float]) -> dict[str, torch.Tensor]:
    """Gradients ``prefix.{i}.mix`` = 1 + errors[i]: against a truth of ones, each one's
    relative error is its entry of ``errors``."""
    return {f"{prefix}.{i}.mix": torch.tensor([1.0 + e]) for i, e in enumerate(errors)}


def test_a_gradient_may_reach_twice_the_largest_error_of_its_kind_in_the_references():
    """Session 25: on a kind of cancellation-bound scalars one correct rounding lands 30x
    nearer the truth than another on some gradient; its allowance is at least twice the worst
    the references make on the kind, so that chance passes, and a gradient beyond it fails."""
    check = _load()
    exact = _kind("b", [0.0] * 5)
    reference = _kind("b", [0.2, 0.01, 0.1, 0.15, 0.12])
    errors, _, verdict = check.gradient_errors(_kind("b", [0.1, 0.3, 0.1, 0.1, 0.1]), reference, exact, "bf16")
    allowed = verdict.allowed
    assert abs(allowed["b.1.mix"] - 0.4) < 1e-6  # 2 x 0.2, above 4 x 0.01
    assert errors["b.1.mix"] <= allowed["b.1.mix"]
    errors, _, verdict = check.gradient_errors(_kind("b", [0.1, 0.5, 0.1, 0.1, 0.1]), reference, exact, "bf16")
    allowed = verdict.allowed
    assert errors["b.1.mix"] > allowed["b.1.mix"]
    # a kind's ceiling is its own: a far-off kind lends nothing to another
    exact = {**exact, "b.0.weight": torch.tensor([1.0])}
    errors, _, verdict = check.gradient_errors({**reference, "b.0.weight": torch.tensor([1.2])},
                                               {**reference, "b.0.weight": torch.tensor([1.001])}, exact, "bf16")
    allowed = verdict.allowed
    assert allowed["b.0.weight"] == check.TOLERANCE["bf16"] and errors["b.0.weight"] > allowed["b.0.weight"]


def test_a_kind_whose_median_error_is_over_twice_the_references_fails():
    """Pooled by kind: every gradient under its own allowance, but the kind as a whole 3x
    less accurate than the references, as a kernel that rounds worse throughout is."""
    check = _load()
    exact = _kind("b", [0.0] * 5)
    reference = _kind("b", [0.02, 0.04, 0.05, 0.06, 0.2])
    errors, ref_errors, verdict = check.gradient_errors(_kind("b", [0.12, 0.15, 0.15, 0.18, 0.2]), reference, exact,
                                                        "bf16")
    allowed = verdict.allowed
    assert all(errors[n] <= allowed[n] for n in errors)
    ours, theirs, median_allowed = check.kind_medians(errors, ref_errors, "bf16")["mix"]
    assert abs(ours - 0.15) < 1e-6 and abs(theirs - 0.05) < 1e-6 and abs(median_allowed - 0.1) < 1e-6
    assert ours > median_allowed
    # the judgment: every gradient within its allowance, the kind's median not
    assert verdict.gradient_ratio <= 1.0 and abs(verdict.median_ratio - 1.5) < 1e-5 and not verdict.ok
    errors, ref_errors, verdict = check.gradient_errors(_kind("b", [0.03, 0.05, 0.09, 0.1, 0.2]), reference, exact,
                                                        "bf16")
    ours, _, median_allowed = check.kind_medians(errors, ref_errors, "bf16")["mix"]
    assert ours <= median_allowed  # 0.09 against 2 x 0.05
    assert verdict.ok


def test_a_kind_median_below_the_tolerance_passes():
    check = _load()
    medians = check.kind_medians({"a.mix": 1e-5, "b.mix": 2e-5}, {"a.mix": 1e-7, "b.mix": 1e-7}, "fp32")
    assert medians["mix"][2] == check.TOLERANCE["fp32"]


def test_patches_set_a_variants_constants_and_refuse_a_name_without_any(monkeypatch):
    """``--patches`` checks the schemes with an end-to-end variant's module constants set
    (session 69 checked DAR's per-token scalars so before they became the default)."""
    from depthrewrite.passes import dar

    check = _load()
    monkeypatch.setattr(dar, "PER_TOKEN_SCALARS", True)  # put back after the test
    assert check.apply_patches("dar_block_wholesums") == ["depthrewrite.passes.dar.PER_TOKEN_SCALARS = False"]
    assert dar.PER_TOKEN_SCALARS is False
    with pytest.raises(ValueError, match=r"'dar_block' is not one of e2e_throughput.py's variants with patches"):
        check.apply_patches("dar_block")
