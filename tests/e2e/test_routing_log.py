"""The training harness records the routing weights at every evaluation (``routing_log``):
what it records, that recording changes nothing the run trains, resume, and
``depthrewrite routing``. The distributed runs' records: tests/e2e/test_distributed.py."""

from __future__ import annotations

import json

import pytest
import torch

import depthrewrite
from depthrewrite.cli import main
from depthrewrite.routing_weights import RoutingWeights, record_routing_weights
from depthrewrite.train import DataConfig, TrainConfig, batch_at, read_metrics, train
from depthrewrite.train import routing_log
from depthrewrite.train.data import VAL_STREAM
from depthrewrite.train.routing_log import read_routing


def _config(text, **kw) -> TrainConfig:
    base = dict(model="gpt:tiny", layers=2, scheme="attnres", data=DataConfig(source=str(text)), steps=6,
                batch_size=4, seq_len=32, warmup_steps=1, eval_every=3, eval_batches=1, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def _first_val_batch(result) -> torch.Tensor:
    c = result.config
    x, _ = batch_at(result.splits.val, seed=c.seed, step=0, batch_size=c.batch_size, seq_len=c.seq_len,
                    stream=VAL_STREAM)
    return x


def _assert_same_weights(got: RoutingWeights, want: RoutingWeights) -> None:
    assert (got.scheme, got.labels, got.source_labels, got.static) == (want.scheme, want.labels,
                                                                        want.source_labels, want.static)
    for g, w in zip(got.weights, want.weights, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)  # the record keeps 6 significant digits


def test_each_evaluation_records_the_weights_of_the_model_at_its_step_and_a_resume_keeps_them(tmp_path,
                                                                                          shakespeare_200k):
    straight = train(_config(shakespeare_200k, out=str(tmp_path / "a")))
    first = train(_config(shakespeare_200k, out=str(tmp_path / "b"), stop_after=3))
    logged = read_routing(tmp_path / "a")
    assert [step for step, _ in logged] == [3, 6]
    _assert_same_weights(logged[0][1], record_routing_weights(first.model, _first_val_batch(first)))
    _assert_same_weights(logged[1][1], record_routing_weights(straight.model, _first_val_batch(straight)))
    _assert_same_weights(straight.routing, logged[1][1])
    assert not torch.equal(logged[0][1].weights[-1], logged[1][1].weights[-1])  # the routing trained meanwhile
    train(_config(shakespeare_200k, out=str(tmp_path / "b"), resume=True))
    val = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "val_loss" in r]
    assert val == [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "val_loss" in r]


@pytest.mark.parametrize("scheme", ["attnres", "block_attnres", "mhar", "wav", "dar", "denseformer", "residual",
                                    "hyperconn"])
def test_a_record_for_every_scheme_with_weights_and_none_for_the_others(tmp_path, shakespeare_200k, scheme):
    result = train(_config(shakespeare_200k, scheme=scheme, out=str(tmp_path)))
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "val_loss" in r]
    assert len(records) == 2
    if not depthrewrite.has_routing_weights(result.model):
        assert scheme in ("residual", "hyperconn") and result.routing is None
        assert not any(routing_log.ROUTING_FIELD in r for r in records)
        return
    for record in records:
        weights = RoutingWeights.from_record(record[routing_log.ROUTING_FIELD])
        assert weights.scheme == scheme and weights.labels[-1] == "F"
        if not weights.static:  # softmaxes (DAR's gate-weighted pair of them): each site's weights sum to 1
            for w in weights.weights:
                assert abs(w.sum().item() - 1) < 1e-5


def test_the_moe_model_records_them_too(tmp_path, shakespeare_200k):
    result = train(_config(shakespeare_200k, model="moe:tiny", scheme="dar", out=str(tmp_path)))
    _assert_same_weights(read_routing(tmp_path)[-1][1], record_routing_weights(result.model, _first_val_batch(result)))


def _with_and_without_recording(shakespeare_200k, tmp_path, monkeypatch, **settings):
    """The same run twice, into ``tmp_path / "True"`` with the routing recorded and into
    ``"False"`` without; their results and the graphs Dynamo compiled for each."""
    from torch._dynamo.utils import counters

    results, graphs = [], []
    for record in (True, False):
        if not record:
            monkeypatch.setattr(routing_log, "routing_at_evaluation", lambda *args: None)
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        results.append(train(_config(shakespeare_200k, out=str(tmp_path / str(record)), **settings)))
        graphs.append(counters["stats"]["unique_graphs"] - before)
    return results, graphs


@pytest.mark.parametrize("compiled", [False, True])
def test_recording_changes_nothing_the_run_trains(tmp_path, shakespeare_200k, monkeypatch, compiled):
    """Dropout draws from the RNG and a compiled model's guards see the routers: a recording
    that consumed random numbers, or left anything Dynamo guards on changed, would show."""
    settings = dict(scheme="block_attnres", model_options={"dropout": 0.1}, steps=7, eval_every=2)
    if compiled:
        settings.update(compile=True, backend="eager")
    (recorded, plain), graphs = _with_and_without_recording(shakespeare_200k, tmp_path, monkeypatch, **settings)
    assert len(read_routing(tmp_path / "True")) == 4 and not read_routing(tmp_path / "False")
    assert torch.equal(torch.tensor(recorded.losses), torch.tensor(plain.losses))
    assert [v for _, v in recorded.val] == [v for _, v in plain.val]
    for (name, p), q in zip(recorded.model.state_dict().items(), plain.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert graphs[0] == graphs[1] and (graphs[0] > 0) == compiled  # no graph compiled again after a recording


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the device machine)")
def test_on_cuda_compiled_with_the_backend_a_recording_compiles_nothing_again(tmp_path, shakespeare_200k, monkeypatch):
    """On the GPU only the recompilation and the records are checked: two runs agreeing bit
    for bit would need every kernel of the step to be deterministic, which is not asked here."""
    (recorded, _), graphs = _with_and_without_recording(
        shakespeare_200k, tmp_path, monkeypatch, scheme="dar", steps=5, eval_every=2, device="cuda", precision="bf16",
        compile=True, backend="depthrewrite")
    logged = read_routing(tmp_path / "True")
    assert [step for step, _ in logged] == [2, 4, 5]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = record_routing_weights(recorded.model, _first_val_batch(recorded).cuda())
    _assert_same_weights(logged[-1][1], want)
    assert graphs[0] == graphs[1] > 0


def test_records_round_trip_and_a_bad_record_is_named():
    weights = RoutingWeights("wav", ["1", "F"], [torch.tensor([1.0]), torch.tensor([0.25, 0.75])],
                             [["e"], ["e", "C0"]])
    record = json.loads(json.dumps(weights.to_record()))
    _assert_same_weights(RoutingWeights.from_record(record), weights)
    with pytest.raises(ValueError, match=r"lacks \['static'\]"):
        RoutingWeights.from_record({k: v for k, v in record.items() if k != "static"})
    with pytest.raises(ValueError, match=r"entries per site: \[1, 2\] names, \[1, 1\] weights"):
        RoutingWeights.from_record({**record, "weights": [[1.0], [1.0]]})


def test_the_table_leaves_sources_a_site_does_not_read_blank():
    weights = RoutingWeights("block_attnres", ["1", "2", "F"],
                             [torch.tensor([1.0]), torch.tensor([0.375, 0.625]), torch.tensor([0.5, 0.5])],
                             [["b0"], ["b0", "partial"], ["b0", "b1"]])
    assert weights.table().splitlines() == ["     b0    b1  partial",
                                            "1  1.00",
                                            "2  0.38           0.62",
                                            "F  0.50  0.50"]


def test_cli_routing_prints_and_draws_an_evaluation(tmp_path, shakespeare_200k, capsys):
    train(_config(shakespeare_200k, scheme="dar", out=str(tmp_path)))
    capsys.readouterr()
    assert main(["routing", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dar: depth-routing weights at step 6")
    assert (tmp_path / "routing_step_6.png").stat().st_size > 5_000
    rows = out.splitlines()[1:-1]
    assert rows[0].split()[:2] == ["e", "H0_1"] and [r.split()[0] for r in rows[1:]] == ["1", "2", "3", "4", "F"]
    assert main(["routing", str(tmp_path / "metrics.jsonl"), "--step", "3", "--plot", str(tmp_path / "s3.png")]) == 0
    assert "at step 3" in capsys.readouterr().out and (tmp_path / "s3.png").exists()
    assert main(["routing", str(tmp_path), "--site", "2"]) == 0  # one site over the evaluations
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("dar: site 2's depth-routing weights at each evaluation")
    logged = {step: w.weights[1] for step, w in read_routing(tmp_path)}
    names = read_routing(tmp_path)[0][1].source_labels[1]
    assert lines[1].split() == names  # site 2 reads e and the two streams' partial entries
    for line in lines[2:]:
        step, *values = line.split()
        assert values == [f"{v:.2f}" for v in logged[int(step)].tolist()]
    assert [line.split()[0] for line in lines[2:]] == ["3", "6"]
    assert main(["routing", str(tmp_path), "--site", "9"]) == 2
    assert "--site '9': the run's sites are 1, 2, 3, 4, F" in capsys.readouterr().err
    assert main(["routing", str(tmp_path), "--site", "2", "--step", "3"]) == 2
    assert "give one or the other" in capsys.readouterr().err
    assert main(["routing", str(tmp_path), "--step", "4"]) == 2
    assert "--step 4: no evaluation at that step recorded routing weights; the 2 that did are at steps 3, 6" in \
        capsys.readouterr().err
    assert main(["routing", str(tmp_path / "nowhere")]) == 2
    assert "no metrics file at" in capsys.readouterr().err


def test_cli_routing_of_a_run_without_weights_says_why(tmp_path, shakespeare_200k, capsys):
    train(_config(shakespeare_200k, scheme="residual", out=str(tmp_path)))
    assert main(["routing", str(tmp_path)]) == 2
    assert "no evaluation in its metrics file recorded routing weights (its scheme has none" in capsys.readouterr().err
