"""The backend's ``fuse_output_norms`` pass (:mod:`depthrewrite.norm_fusion`) on the graphs
Dynamo records: the RMSNorms it recognises after a ``route_merge`` are fused (counted, the
same loss and gradients), the ones it must not touch are left alone."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
import torch.nn.functional as F
from torch import nn

import depthrewrite
from depthrewrite import backend
from depthrewrite.models.gpt import GPT, GPTConfig
from depthrewrite.ops import route_merge


class GptNorm(nn.Module):  # the bundled GPT's RMSNorm, written out
    def __init__(self, d):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(d) + 0.5), 1e-6

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class LlamaNorm(nn.Module):  # Hugging Face's LlamaRMSNorm
    def __init__(self, d):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.rand(d) + 0.5), 1e-5

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class TorchNorm(nn.RMSNorm):  # F.rms_norm
    def __init__(self, d):
        super().__init__(d, eps=1e-5)
        with torch.no_grad():
            self.weight.uniform_(0.5, 1.5)


class GemmaNorm(LlamaNorm):  # scales by 1 + weight: not the op's norm
    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).type_as(hidden_states)


class Merge(nn.Module):
    """A route_merge (J = 2, shared keys: DAR's) read by ``norm``; ``also_x`` returns x too."""

    def __init__(self, norm: nn.Module, d: int, also_x: bool = False):
        super().__init__()
        self.norm, self.also_x = norm, also_x
        self.queries = nn.Parameter(torch.randn(2, d) / d**0.5)
        self.key_norm_weights = nn.Parameter(torch.rand(2, d) + 0.5)
        self.mix = nn.Parameter(torch.tensor([0.7, 0.3]))

    def forward(self, outs, lses, values):
        x = route_merge(outs, lses, values, values[::-1], queries=self.queries,
                        key_norm_weights=self.key_norm_weights, mix=self.mix)
        normed = self.norm(x)
        return (normed, x) if self.also_x else normed


def _inputs(d, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, 5, d, generator=gen).to(dtype).requires_grad_() for _ in range(4)]
    lses = [torch.randn(3, 5, 1, generator=gen).requires_grad_() for _ in range(2)]
    return rows[:2], lses, rows[2:]


def _run(model, fn, inputs):
    model.zero_grad()
    for t in [*inputs[0], *inputs[1], *inputs[2]]:
        t.grad = None
    result = fn(*inputs)
    result = result if isinstance(result, tuple) else (result,)
    sum((r.float() * torch.linspace(-1, 1, r.shape[-1])).sum() for r in result).backward()
    leaves = [*model.parameters(), *inputs[0], *inputs[1], *inputs[2]]
    return [r.detach() for r in result], [t.grad.clone() for t in leaves]


def _compile_and_compare(model, inputs, fuse=True):
    expected, expected_grads = _run(model, model, inputs)
    torch._dynamo.reset()
    backend.clear_reports()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True,
                             options={"inner": "aot_eager", "fuse_output_norms": fuse})
    got, grads = _run(model, compiled, inputs)
    for a, b in zip(got + grads, expected + expected_grads, strict=True):
        # the absolute tolerance at 1e-6 of the tensor's largest entry: an entry that is a sum
        # with cancellation carries the rounding of its terms, whose scale is the tensor's
        # (session 22: with one draw of the parameters, after test_backend.py's tests, a
        # query gradient entry of 0.078 differed by 1.9e-6 in a tensor up to 8.6, while
        # both paths were 2.5e-7 / 2.2e-7 from float64 in relative L2)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())))
    return backend.last_report()


@pytest.mark.parametrize("norm", [GptNorm, LlamaNorm, TorchNorm], ids=lambda n: n.__name__)
def test_recognised_norms_are_fused_with_the_same_result(norm):
    report = _compile_and_compare(Merge(norm(24), 24), _inputs(24))
    assert report.fused_norms == 1
    # the normed row comes out of the merge: no norm left, no recomputation of x
    assert report.aot_graphs["forward"] == {"depthrewrite::route_merge": 1}
    assert report.aot_graphs["backward"] == {"depthrewrite::route_merge_backward": 1}


@pytest.mark.parametrize("model", [
    lambda: Merge(GemmaNorm(24), 24),  # 1 + weight
    lambda: Merge(GptNorm(24), 24, also_x=True),  # x read besides the norm
], ids=["one-plus-weight", "x-read-elsewhere"])
def test_other_norms_and_shared_results_are_left_alone(model):
    report = _compile_and_compare(model(), _inputs(24))
    assert report.fused_norms == 0


def test_a_norm_of_another_dtype_gets_the_fused_row_cast_to_it():
    """A float32 weight times a bfloat16 row (fp32 parameters, bf16 activations) gives a
    float32 result: fused, the row is cast to it; within bfloat16's rounding of eager."""
    model = Merge(GptNorm(24), 24)
    inputs = _inputs(24, torch.bfloat16)
    expected = model(*inputs)
    torch._dynamo.reset()
    backend.clear_reports()
    got = torch.compile(model, backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager"})(*inputs)
    assert backend.last_report().fused_norms == 1
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-2)


def test_option_off_leaves_the_graph_and_reports_none():
    report = _compile_and_compare(Merge(GptNorm(24), 24), _inputs(24), fuse=False)
    assert report.fused_norms is None
    assert report.aot_graphs["forward"] == {"depthrewrite::route_merge": 1}


@pytest.mark.parametrize("scheme,options,merges", [
    ("block_attnres", {"block_size": 2}, 2),  # 2 layers: the second site of each block merges
    ("dar", {"layers_per_block": 1}, 2),
    ("mhar", {"block_size": 2, "heads": 4}, 2),
])
def test_rewritten_gpt_fuses_every_merged_sites_norm(scheme, options, merges, monkeypatch):
    """With ``two_phase.FUSED_MERGE`` the bundled GPT's branch norms after each merge are
    fused (the dead residual adds Dynamo hands over do not stop it), loss and gradients as
    eager's in float32. Through AOTAutograd; through Inductor's lowering the same checks run
    in tests/compile/test_backend.py (test_dar_fused_merge_matches_eager_through_inductor:
    one Inductor compilation on the CPU serves both)."""
    from depthrewrite.passes import two_phase

    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    torch.manual_seed(0)
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=64, n_layer=2, n_head=4, max_seq_len=16, vocab_size=128)),
                                 scheme, **options)
    with torch.no_grad():  # queries away from zero: the merges' weights are not all equal
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 0.3)
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(fn):
        model.zero_grad()
        _, loss = fn(idx, idx)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = loss_and_grads(model)
    torch._dynamo.reset()
    backend.clear_reports()
    got = loss_and_grads(torch.compile(model, backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager"}))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    report = backend.last_report()
    assert report.fused_norms == merges
    assert report.aot_graphs["forward"]["depthrewrite::route_merge"] == merges
    assert "depthrewrite::route_merge" not in report.aot_graphs["backward"]  # nothing left to make again


def test_fused_rows_are_the_norm_of_the_merge_not_of_its_rounding():
    """The documented difference: in bfloat16 the fused norm reads x before rounding; the
    op's result equals F.rms_norm of the float32 merge, rounded once."""
    d = 24
    outs, lses, values = _inputs(d, torch.bfloat16)
    merge = Merge(TorchNorm(d), d)
    kwargs = dict(queries=merge.queries, key_norm_weights=merge.key_norm_weights, mix=merge.mix)
    fused = route_merge(outs, lses, values, values[::-1], out_norm_weight=merge.norm.weight, out_norm_eps=1e-5,
                        **kwargs)
    x32 = route_merge([o.float() for o in outs], lses, [v.float() for v in values],
                      [v.float() for v in values[::-1]], **kwargs)
    torch.testing.assert_close(fused, F.rms_norm(x32, (d,), merge.norm.weight, 1e-5).to(torch.bfloat16),
                               rtol=0, atol=0)


def _bf16_errors(model, batches: list, fuse: bool, truths: list[dict]) -> list[dict]:
    """For each token batch, the relative L2 error against its ``truth`` of every gradient
    of a bf16-autocast step of ``model`` compiled (once) with the norms fused or not."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True,
                             options={"inner": "aot_eager", "fuse_output_norms": fuse})
    errors = []
    for idx, truth in zip(batches, truths, strict=True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = compiled(idx, idx)
        loss.backward()
        grads = dict(model.named_parameters())
        errors.append({n: float((grads[n].grad.double() - t).norm() / t.norm()) for n, t in truth.items()})
    return errors


@pytest.mark.parametrize("scheme,options", [("block_attnres", {"block_size": 2}), ("dar", {"layers_per_block": 1})])
def test_fused_norms_are_no_less_accurate_in_bf16(scheme, options, monkeypatch):
    """Fused, the branch norm reads the merge before its rounding to bf16: a different
    rounding path from eager's. Against the float64 truth its gradients' errors are, over
    4 token batches and every parameter, no larger than the unfused compiled model's
    (geometric mean of the ratios; single cancellation-bound scalars move either way).
    Each form is compiled once and run on the 4 batches (same shape: no recompilation)."""
    import copy
    import math

    from depthrewrite.passes import two_phase

    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    torch.manual_seed(0)
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=64, n_layer=2, n_head=4, max_seq_len=64,
                                               vocab_size=128)), scheme, **options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 0.3)
    batches = [torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(seed)) for seed in range(1, 5)]
    exact = copy.deepcopy(model).double()
    truths = []
    for idx in batches:
        exact.zero_grad(set_to_none=True)
        exact(idx, idx)[1].backward()
        truths.append({n: p.grad.clone() for n, p in exact.named_parameters() if p.grad is not None})
    fused = _bf16_errors(model, batches, True, truths)
    assert backend.last_report().fused_norms > 0
    unfused = _bf16_errors(model, batches, False, truths)
    assert backend.last_report().fused_norms is None
    logs = [math.log(f[n] / u[n]) for f, u in zip(fused, unfused, strict=True) for n in u if u[n] > 0 and f[n] > 0]
    assert math.exp(sum(logs) / len(logs)) <= 1.0, math.exp(sum(logs) / len(logs))
