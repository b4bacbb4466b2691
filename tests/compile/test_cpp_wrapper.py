"""Inductor's C++ wrapper (``cpp_wrapper=True``) with the backend: the routing calls whose
results hold lists get their flat companions (depthrewrite.cpp_wrapper), and the compiled
model matches eager. Without the pass Inductor stops on those calls ("fallback kernels with
runtime lookup currently only support tensor returns", torch 2.13)."""

from __future__ import annotations

import collections
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import depthrewrite
from depthrewrite import backend
from depthrewrite import cpp_wrapper
from depthrewrite.cpp_wrapper import cpp_wrapper_calls_list_arguments, flatten_nested_results
from depthrewrite.models.gpt import gpt_from_preset
from depthrewrite.ops.flat_returns import NESTED_RESULT_OPS
from tests.conftest import perturb_routing

#: the schemes whose graphs hold every op with nested results: DAR's fused merge
#: (route_many, route_many_backward, route_merge_backward) and WAV (route_backward)
SCHEMES = {"dar": {"fused_merge": True}, "wav": {}}


def _model(scheme: str, layers: int = 1):
    """One layer holds every op of the scheme's graphs (the C++ wrapper's build of a graph,
    20-60 s on a 2-core machine, grows with its calls); block by block takes two."""
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=layers), scheme, **SCHEMES[scheme])
    perturb_routing(model)
    return model.train()


def _loss_and_grads(model, fn, idx):
    model.zero_grad(set_to_none=True)
    _, loss = fn(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_matches_eager(model, compiled, idx, rtol, atol) -> float:
    """Loss and every gradient of ``compiled`` match eager's; the compiled loss."""
    want_loss, want = _loss_and_grads(model, model, idx)
    loss, got = _loss_and_grads(model, compiled, idx)
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=atol)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)
    return loss.item()


def _op_names(graph) -> collections.Counter:
    """The depthrewrite ops a graph calls, by name (the flat companions of every result count
    as ``<op>_flat``)."""
    names = [n.target._schema.name for n in graph.nodes if n.op == "call_function" and hasattr(n.target, "_schema")]
    return collections.Counter(re.sub(r"_flat\d+$", "_flat", name.split("::")[1]) for name in names
                               if name.startswith("depthrewrite::"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_flat_results_compute_what_the_nested_ones_did(scheme):
    """The pass alone on AOTAutograd's graphs, run as they are (no Inductor): every call
    with nested results is replaced, each read of a result part reads the same tensor from
    the flat result, and loss and every gradient are eager's to the bit."""
    replaced: collections.Counter = collections.Counter()

    def run_flattened(gm, _inputs):
        before = _op_names(gm.graph)
        count = flatten_nested_results(gm.graph)
        after = _op_names(gm.graph)
        gm.graph.lint()
        gm.recompile()
        for name in NESTED_RESULT_OPS:
            assert after[name] == 0 and after[f"{name}_flat"] == before[name], name
            replaced[name] += before[name]
        assert count == sum(before[name] for name in NESTED_RESULT_OPS)
        return make_boxed_func(gm.forward)

    model = _model(scheme)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=run_flattened, bw_compiler=run_flattened),
                             fullgraph=True)
    _assert_matches_eager(model, compiled, idx, rtol=0, atol=0)
    expected = {"dar": ("route_many", "route_many_backward", "route_merge_backward"), "wav": ("route_backward",)}
    assert {name for name, n in replaced.items() if n} == set(expected[scheme])


NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the device machine)")
#: the backend's options for a compilation that must run the pass, whose report the tests
#: read (a graph loaded from Inductor's caches skips the pass, and its report)
UNCACHED = {"cpp_wrapper": True, "force_disable_caches": True}


def _assert_reported(report, device: str, options: dict) -> None:
    """What the report of a graph compiled with the C++ wrapper says: the implementation of
    the routing calls, the options, the calls given flat results. DAR: route_many in the
    forward (phase 1's calls, one a stream), and in the backward the recomputed ones with
    every route_many_backward and route_merge_backward; WAV: the route_backward calls left
    without a running sum (the rest became route_backward_into_)."""
    assert set(report.implementation.values()) == {"reference" if device == "cpu" else "triton"}
    assert report.config_patches.items() >= options.items()  # DAR's graph hint besides
    assert report.flattened["backward"] > 0
    assert report.flattened.get("forward", 0) == report.aot_graphs["forward"].get("depthrewrite::route_many", 0)


def _compile_and_check(scheme: str, device: str, options: dict) -> float | None:
    """Compiled whole through Inductor with its wrapper in C++, float32: loss and gradients
    match eager's, the report counts the calls that got flat results, and the setting stays
    scoped to the compilation; the compiled loss. A torch whose C++ wrapper cannot call the
    routing ops (2.11, the device's) refuses, naming the setting: None."""
    model = _model(scheme).to(device)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    backend.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options=options)
    if not cpp_wrapper_calls_list_arguments():
        with pytest.raises(Exception, match=r"cpp_wrapper.*needs a torch whose C\+\+ wrapper calls ops"):
            compiled(idx, idx)
        return None
    # the CPU's reference ops in both; the GPU's kernels beside Inductor's own kernels
    rtol, atol = (1e-5, 1e-6) if device == "cpu" else (1e-4, 1e-5)
    loss = _assert_matches_eager(model, compiled, idx, rtol=rtol, atol=atol)
    _assert_reported(backend.last_report(), device, options)
    assert torch._inductor.config.cpp_wrapper is False
    return loss


@NEEDS_GPU
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpp_wrapper_compiles_and_matches_eager_on_the_gpu(scheme):
    """On the GPU the routing calls run the fused kernels, in eager too."""
    _compile_and_check(scheme, "cuda", UNCACHED)


def test_blocks_compiled_one_by_one_with_the_cpp_wrapper_match_eager():
    """torchtitan's per-block compile with the C++ wrapper, DAR with its fused merge: each
    block's graph gets its own companions, loss and gradients match eager's, and each
    block's report says what the whole model's would."""
    model = _model("dar", layers=2)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(model, model, idx)
    torch._dynamo.reset()
    backend.clear_reports()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="depthrewrite", fullgraph=True, options=UNCACHED)
    loss, got = _loss_and_grads(model, model, idx)
    got = {name.replace("._orig_mod", ""): grad for name, grad in got.items()}  # the compiled blocks' wrappers
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(backend.reports()) == len(model.blocks)
    for report in backend.reports():
        _assert_reported(report, "cpu", UNCACHED)
    assert torch._inductor.config.cpp_wrapper is False


def test_a_torch_whose_cpp_wrapper_cannot_call_the_routing_ops_is_refused(monkeypatch):
    """Where this torch's C++ wrapper cannot call ops that take lists of tensors (torch
    2.11: "arg type List[Tensor] is not yet supported by custom_op_wrapper", deep in
    Inductor), the backend refuses before Inductor runs, naming the setting and the torch."""
    monkeypatch.setattr(cpp_wrapper, "cpp_wrapper_calls_list_arguments", lambda: False)
    model = _model("wav")
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    backend.clear_reports()
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options={"cpp_wrapper": True})
    with pytest.raises(Exception, match=rf"cpp_wrapper.*found torch {re.escape(torch.__version__)}"):
        compiled(idx, idx)
    assert backend.reports() == []  # nothing was lowered


def test_a_result_read_other_than_by_index_is_refused():
    """A graph that passes a result's list on whole (not what AOTAutograd makes) is named,
    not miscompiled."""
    values = [torch.randn(4, 8) for _ in range(3)]
    queries, weights = torch.randn(2, 8), torch.rand(2, 8)

    def f(values, queries, weights):
        out, lse, stats = torch.ops.depthrewrite.route_many(values, queries, weights, 1, 1e-6, None)
        return out[0] + out[1], stats

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(values, queries, weights)
    call = next(n for n in gm.graph.nodes if n.op == "call_function" and "route_many" in str(n.target))
    outs = next(u for u in call.users if u.args[1] == 0)
    with gm.graph.inserting_after(outs):
        whole = gm.graph.call_function(len, (outs,))  # the list itself read
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((*output.args[0], whole),)
    with pytest.raises(RuntimeError, match=r"route_many call .* is read by .*len.*expected only indexing"):
        flatten_nested_results(gm.graph)


#: the second process: the model, tokens and options of the first compilation, loaded
_CACHED_RUN = """
import torch
from depthrewrite import backend
from tests.compile.test_cpp_wrapper import CACHED, _model
model = _model("wav")
ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
_, loss = torch.compile(model, backend="depthrewrite", fullgraph=True, options=CACHED)(ids, ids)
loss.backward()
print(repr(loss.item()), sum(backend.last_report().flattened.values()))
"""
#: the caches on: the test below gives Inductor an empty cache folder of its own
CACHED = {"cpp_wrapper": True}


def test_cpp_wrapper_compiles_matches_eager_and_loads_from_the_caches_in_a_new_process(monkeypatch, tmp_path):
    """WAV on the CPU compiled whole with the C++ wrapper into an empty cache folder (so the
    pass runs and is reported: _compile_and_check), then a second process loads the same
    graphs from Inductor's caches (no pass runs, so nothing is flattened there) and calls
    the flat companions by name: they are defined before the caches are read (without it
    the load fails, "Could not find schema for depthrewrite::route_many_flat5" with DAR in
    session 58, in ``findSchemaOrThrow`` with WAV here, checked in session 65). Until session
    65 two new processes compiled and loaded DAR, and another test compiled WAV on the CPU
    (about a minute of CI's time)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    first_loss = _compile_and_check("wav", "cpu", CACHED)
    if first_loss is None:  # this torch refused the setting
        return
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _CACHED_RUN], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    second_loss, second_flattened = run.stdout.split()[-2:]
    assert int(second_flattened) == 0  # loaded, not compiled
    assert float(second_loss) == first_loss
