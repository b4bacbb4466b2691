"""The training harness's ``compile_mode`` (``--compile-mode``) and ``compile_options``
(``--compile-option``): checked, passed to torch.compile, and a CUDA-graph mode marks each
training step as a new iteration."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.cli import _train_config, build_parser, main
from depthrewrite.train import TrainConfig, train


def _tiny(**kw) -> TrainConfig:
    base = dict(model="gpt:tiny", layers=2, steps=3, batch_size=2, seq_len=16, warmup_steps=1, eval_every=0,
                eval_batches=1, progress=False)
    return TrainConfig(**{**base, **kw})


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"compile_mode must be one of .*reduce-overhead.*found 'fast'"):
        _tiny(compile_mode="fast").validate()
    with pytest.raises(SystemExit):
        main(["train", "--compile", "on", "--compile-mode", "fast"])


@pytest.mark.parametrize("mode,expected_mode,marks", [("default", None, 0), ("reduce-overhead", "reduce-overhead", 3),
                                                      ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs", 0)])
def test_the_mode_reaches_torch_compile_and_cuda_graph_modes_mark_each_step(monkeypatch, mode, expected_mode, marks):
    calls, stepped = [], []

    def fake_compile(module, **kwargs):  # records the call, runs the module eagerly
        calls.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: stepped.append(1))
    train(_tiny(compile=True, backend="depthrewrite", compile_mode=mode, scheme="attnres"))
    assert calls == [dict(backend="depthrewrite", mode=expected_mode, options=None)]
    assert len(stepped) == marks


def test_the_cli_takes_the_mode():
    args = build_parser().parse_args(["train", "--compile", "on", "--compile-mode", "reduce-overhead"])
    config = _train_config(args, TrainConfig(), {})
    assert config.compile and config.compile_mode == "reduce-overhead"
    assert _train_config(build_parser().parse_args(["train"]), TrainConfig(), {}).compile_mode == "default"


def test_compile_options_reach_the_backend():
    """--compile-option: the backend's own options through the trainer (DAR block's
    lowest-memory form needs recompute_branch_outputs="narrow"), on the CPU through the
    backend's aot_eager inner compiler."""
    from depthrewrite import backend

    args = ["train", "--compile", "on", "--backend", "depthrewrite", "--compile-option", "inner=aot_eager",
            "--compile-option", "recompute_branch_outputs=narrow", "--compile-option", "max_sum_terms=none"]
    config = _train_config(build_parser().parse_args(args), TrainConfig(), {})
    assert config.compile_options == {"inner": "aot_eager", "recompute_branch_outputs": "narrow", "max_sum_terms": None}
    backend.clear_reports()
    train(_tiny(compile=True, backend="depthrewrite", scheme="dar", options={"layers_per_block": 1},
                compile_options=config.compile_options))
    report = backend.last_report()
    assert report.inner == "aot_eager" and report.max_sum_terms is None and report.num_routing_ops > 0


@pytest.mark.parametrize("options, message", [
    ({"max_sum_term": 4}, r"'max_sum_term' \(did you mean 'max_sum_terms'\?\)"),
    ({"recompute_branch_outputs": "wide"}, r"options\['recompute_branch_outputs'\] must be True, False or 'narrow'; "
                                           r"found 'wide'"),
])
def test_a_bad_compile_option_is_refused_before_training(options, message):
    with pytest.raises(ValueError, match=message):
        _tiny(compile=True, backend="depthrewrite", compile_options=options).validate()


def test_compile_options_and_a_mode_exclude_each_other(capsys):
    with pytest.raises(ValueError, match=r"compile_options and compile_mode='reduce-overhead' exclude each other"):
        _tiny(compile=True, compile_mode="reduce-overhead", compile_options={"max_autotune": True}).validate()
    assert main(["train", "--compile", "on", "--compile-mode", "reduce-overhead", "--compile-option",
                 "max_autotune=true"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_each_micro_batch_is_a_new_cuda_graph_iteration(monkeypatch):
    """With --grad-accum, each micro-batch's forward and backward replay the recorded graphs
    once more: each is marked as a new CUDA-graph iteration, as a step without accumulation is."""
    stepped = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: module)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: stepped.append(1))
    train(_tiny(compile=True, backend="depthrewrite", compile_mode="reduce-overhead", scheme="attnres",
                grad_accum=2))
    assert len(stepped) == 3 * 2


@pytest.mark.parametrize("settings, message", [
    (dict(backend="depthrewrite"), r"^backend='depthrewrite' applies to torch.compile, which this run does not use"),
    (dict(compile_options={"max_sum_terms": 4}, backend="depthrewrite"),
     r"^backend='depthrewrite', compile_options=\{'max_sum_terms': 4\} apply to torch.compile"),
    (dict(compile=True, backend="nosuchbackend"), r"^backend must be a torch.compile backend \(.*inductor.*\), "
                                                  r"found 'nosuchbackend'"),
    (dict(compile=True, compile_options={"recompute_branch_outputs": "narrow"}),
     r"^compile_options \['recompute_branch_outputs'\] belong to backend 'depthrewrite' \(--backend depthrewrite\); "
     r"found backend 'inductor'"),
    (dict(compile=True, compile_options={"max_fusion_size": "big"}),
     r"^compile_options\['max_fusion_size'\] must be int \(torch._inductor.config.max_fusion_size\); found 'big'"),
    (dict(compile=True, compile_options={"triton.cudagraphs": 1}),
     r"^compile_options\['triton.cudagraphs'\] must be bool"),
])
def test_compile_settings_are_checked_before_anything_is_built(settings, message):
    """Without compile they were ignored (the run trained eagerly, silently); an option of
    the other backend, a backend's wrong name or a setting's wrong type failed after the
    model was built, in torch's words."""
    with pytest.raises(ValueError, match=message):
        _tiny(**settings).validate()


def test_the_backends_options_must_be_a_dict_and_inductor_settings_are_typed(caplog):
    from depthrewrite.backend import check_options

    with pytest.raises(ValueError, match=r"^depthrewrite_backend: options must be a dict such as \{'inner': "
                                         r"'aot_eager'\}; found str 'inner=aot_eager'"):
        check_options("inner=aot_eager")
    with caplog.at_level("WARNING", logger="depthrewrite"):  # said, not refused: switching inner alone bisects
        check_options({"inner": "aot_eager", "max_fusion_size": 8})
    assert "options ['max_fusion_size'] are Inductor settings, which inner='aot_eager' does not use" in caplog.text
    with pytest.raises(ValueError, match=r"^depthrewrite_backend: options\['max_fusion_size'\] must be int"):
        check_options({"max_fusion_size": 8.5})
    assert check_options({"max_fusion_size": 8, "triton.cudagraphs": False}).inductor == {
        "max_fusion_size": 8, "triton.cudagraphs": False}
