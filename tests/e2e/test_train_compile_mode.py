"""The training harness's ``compile_mode`` (``--compile-mode``): checked, passed to
torch.compile, and a CUDA-graph mode marks each training step as a new iteration."""

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
    assert calls == [dict(backend="depthrewrite", mode=expected_mode)]
    assert len(stepped) == marks


def test_the_cli_takes_the_mode():
    args = build_parser().parse_args(["train", "--compile", "on", "--compile-mode", "reduce-overhead"])
    config = _train_config(args, TrainConfig(), {})
    assert config.compile and config.compile_mode == "reduce-overhead"
    assert _train_config(build_parser().parse_args(["train"]), TrainConfig(), {}).compile_mode == "default"
