"""A run's losses read back from its metrics file (``metrics.read_history``) and
``depthrewrite curves``: several runs' curves in one figure, with a table."""

from __future__ import annotations

from depthrewrite.cli import main
from depthrewrite.train import DataConfig, TrainConfig, train
from depthrewrite.train.metrics import METRICS_FILE, read_history
from tests.conftest import png_size


def _config(text, out, **kw) -> TrainConfig:
    base = dict(model="gpt:tiny", layers=2, data=DataConfig(source=str(text)), steps=12, batch_size=4, seq_len=32,
                warmup_steps=1, eval_every=4, eval_batches=1, save_every=6, progress=False, out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def test_the_history_is_what_the_run_returned_a_resumed_run_included(tmp_path, shakespeare_200k):
    straight = train(_config(shakespeare_200k, tmp_path / "a", scheme="dar"))
    history = read_history(tmp_path / "a")
    assert history.steps == straight.steps == list(range(1, 13))
    assert history.losses == straight.losses and history.val == straight.val
    assert history.final_train_loss() == straight.final_train_loss
    assert history.best_val() == min(straight.val, key=lambda sv: sv[1])
    train(_config(shakespeare_200k, tmp_path / "b", scheme="dar", stop_after=6))
    train(_config(shakespeare_200k, tmp_path / "b", scheme="dar", resume=True))
    resumed = read_history(tmp_path / "b" / METRICS_FILE)
    assert (resumed.steps, resumed.losses) == (history.steps, history.losses)
    assert [sv for sv in resumed.val if sv[0] != 6] == history.val  # the first invocation evaluated as it ended
    # a live run's last line, still being written, is left out
    with (tmp_path / "b" / METRICS_FILE).open("a") as f:
        f.write('{"step": 13, "lo')
    assert read_history(tmp_path / "b").steps == history.steps


def test_curves_prints_a_row_per_run_and_draws_them(tmp_path, shakespeare_200k, capsys):
    runs = {scheme: train(_config(shakespeare_200k, tmp_path / scheme, scheme=scheme)) for scheme in ("attnres", "wav")}
    figure = tmp_path / "curves.png"
    assert main(["curves", str(tmp_path / "attnres"), str(tmp_path / "wav" / METRICS_FILE), "--out",
                 str(figure)]) == 0
    printed = capsys.readouterr().out
    for scheme, result in runs.items():
        (last_step, last), (best_step, best) = result.val[-1], min(result.val, key=lambda sv: sv[1])
        assert (f"| {scheme} | 12 | {result.final_train_loss:.4f} | {last:.4f} (step {last_step}) | "
                f"{best:.4f} (step {best_step}) |") in printed
    width, height = png_size(figure)
    assert width >= 300 and height >= 200 and figure.stat().st_size > 5_000 and str(figure) in printed
    # two runs of one name are told apart by their paths
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "attnres").mkdir()
    (tmp_path / "other" / "attnres" / METRICS_FILE).write_text((tmp_path / "attnres" / METRICS_FILE).read_text())
    assert main(["curves", str(tmp_path / "attnres"), str(tmp_path / "other" / "attnres"), "--out",
                 str(figure)]) == 0
    assert f"| {tmp_path / 'other' / 'attnres'} | 12 |" in capsys.readouterr().out
    assert main(["curves", str(tmp_path / "nowhere")]) == 2
    assert "read_history: no metrics file at" in capsys.readouterr().err
