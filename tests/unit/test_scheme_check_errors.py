"""benchmarks/gpu_scheme_check.py's gradient errors: a gradient that is exactly zero in the
reference (a symmetry: DAR's first-site gate) is measured against its kind's scale, so
rounding passes and a wrong value still fails; every other gradient against its own norm."""

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
    errors, _, allowed = check.gradient_errors(
        {"gate": torch.tensor([1.0 - 9.3e-6]), "weight": torch.tensor([3.0, 4.0 + 2e-4])}, reference, exact, "fp32")
    assert abs(allowed["gate"] - 4.0e-4) < 1e-6  # 4x the reference's own error, above 1e-4
    assert allowed["weight"] == check.TOLERANCE["fp32"]
    assert errors["gate"] <= allowed["gate"] and errors["weight"] <= allowed["weight"]  # 9.3e-6; 2e-4 / 5
    errors, _, allowed = check.gradient_errors(
        {"gate": torch.tensor([1.1]), "weight": torch.tensor([3.0, 4.0 + 1e-3])}, reference, exact, "fp32")
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
    errors, _, allowed = check.gradient_errors(candidate, near, exact, "fp32")
    assert errors["transport"] > allowed["transport"]  # 3e-4 against max(1e-4, 4 x 2e-5)
    errors, _, allowed = check.gradient_errors(candidate, [near, far], exact, "fp32")
    assert abs(allowed["transport"] - 4e-4) < 1e-6 and errors["transport"] <= allowed["transport"]
    assert check.reference_errors([near, far], exact)["transport"] == check.errors_against(far, exact)["transport"]
    errors, _, allowed = check.gradient_errors({"transport": torch.tensor([1.1])}, [near, far], exact, "fp32")
    assert errors["transport"] > allowed["transport"]
