"""Training harness: data split by document, stdlib corpus, deterministic batches, exact
resume, loss going down on real text, routing-weight recording, and ``depthrewrite compare``
writing its table and figures."""

from __future__ import annotations

import collections
import math
import pathlib
import signal

import pytest
import torch

from depthrewrite.cli import main, parse_value
from depthrewrite.models import gpt_from_preset
from depthrewrite.train import DataConfig, TrainConfig, batch_at, load_documents, read_metrics, split_documents, train
from depthrewrite.train import checkpoint, loop
from depthrewrite.train.data import EOT_MARKER, split_text, stdlib_documents, stdlib_files, to_tokens
from depthrewrite.routing_weights import record_routing_weights, token_weights
from tests.conftest import png_size


def _tiny(**kw) -> TrainConfig:
    base = dict(model="gpt:tiny", layers=2, steps=8, batch_size=4, seq_len=32, warmup_steps=2, eval_every=0,
                eval_batches=2, progress=False)
    base.update(kw)
    return TrainConfig(**base)


# ----------------------------------------------------------------------------- data
def test_split_is_by_document_and_deterministic(tmp_path):
    docs = [f"story {i:03d}: ".encode() + bytes([65 + i % 26]) * (50 + i) for i in range(40)]
    path = tmp_path / "stories.txt"
    path.write_bytes(EOT_MARKER.join(docs))
    loaded = load_documents(DataConfig(source=str(path)))
    assert loaded == docs  # the marker separates documents and is dropped

    train_idx, val_idx = split_documents(loaded, 0.25, seed=3)
    assert sorted(train_idx + val_idx) == list(range(40)) and not set(train_idx) & set(val_idx)
    assert len(val_idx) == 10
    val_text = bytes(to_tokens(loaded, val_idx).tolist())
    train_text = bytes(to_tokens(loaded, train_idx).tolist())
    for i in range(40):  # every document lies whole in exactly one split
        tag = f"story {i:03d}:".encode()
        assert (tag in val_text) == (i in val_idx) and (tag in train_text) == (i in train_idx)
        assert (docs[i] in val_text) == (i in val_idx)
    assert split_documents(loaded, 0.25, seed=3) == (train_idx, val_idx)
    assert split_documents(loaded, 0.25, seed=4) != (train_idx, val_idx)


def test_plain_text_documents_end_at_blank_lines():
    text = b"".join(f"para {i}\nline two of {i}\n\n".encode() for i in range(200))
    docs = split_text(text, doc_bytes=100)
    assert b"".join(docs) == text  # nothing lost or reordered
    for d in docs[:-1]:
        assert d.endswith(b"\n\n") and len(d) >= 100
    # no blank line and no newline at all (text8): fixed-size cuts
    flat = bytes(range(97, 123)) * 40
    cuts = split_text(flat, doc_bytes=64)
    assert b"".join(cuts) == flat and {len(c) for c in cuts[:-1]} == {64}


def test_stdlib_corpus_loads_sorted_and_capped():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    docs = stdlib_documents(300_000)
    assert sum(map(len, docs)) == 300_000
    assert docs[0] == files[0].read_bytes()[:300_000]
    assert docs == stdlib_documents(300_000)
    assert b"def " in b"".join(docs) and b"import " in b"".join(docs)


def test_batches_are_a_function_of_seed_and_step_and_ranks_partition_them():
    tokens = torch.arange(1000, dtype=torch.int64) % 256
    tokens = tokens.to(torch.uint8)
    x, y = batch_at(tokens, seed=1, step=7, batch_size=8, seq_len=16)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    x2, _ = batch_at(tokens, seed=1, step=7, batch_size=8, seq_len=16)
    assert torch.equal(x, x2)
    assert not torch.equal(x, batch_at(tokens, seed=1, step=8, batch_size=8, seq_len=16)[0])
    parts = [batch_at(tokens, seed=1, step=7, batch_size=8, seq_len=16, rank=r, world_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ValueError, match="divisible"):
        batch_at(tokens, seed=1, step=0, batch_size=6, seq_len=16, world_size=4)


def test_hf_dataset_from_a_local_text_file(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "rows.txt"
    path.write_text("".join(f"row number {i} of the file\n" for i in range(30)))
    docs = load_documents(DataConfig(hf_dataset=str(path), hf_split="train", hf_text_field="text"))
    assert docs == [f"row number {i} of the file".encode() for i in range(30)]


def test_a_dataset_that_cannot_be_loaded_names_the_flag(tmp_path):
    """It was the `datasets` package's own exception, with a traceback, from the CLI."""
    pytest.importorskip("datasets")
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "abc"}\n{broken')
    with pytest.raises(ValueError, match=rf"^hf_dataset '{path}' \(split 'train'\) could not be loaded: "):
        load_documents(DataConfig(hf_dataset=str(path), hf_split="train", hf_text_field="text"))


# ---------------------------------------------------------------------------- train
def test_resume_continues_bit_exactly(tmp_path, shakespeare):
    # dropout makes the losses depend on the RNG state too, so it must be restored
    common = dict(scheme="attnres", model_options={"dropout": 0.1}, data=DataConfig(source=str(shakespeare)),
                  steps=8, eval_every=3)
    straight = train(_tiny(**common, out=str(tmp_path / "a")))
    first = train(_tiny(**common, out=str(tmp_path / "b"), stop_after=4))
    second = train(_tiny(**common, out=str(tmp_path / "b"), resume=True))
    assert first.steps == [1, 2, 3, 4] and second.steps == [5, 6, 7, 8]
    assert torch.equal(torch.tensor(straight.losses), torch.tensor(first.losses + second.losses))
    for (name, p), q in zip(straight.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(p, q), name
    logged = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert torch.equal(torch.tensor(logged), torch.tensor(straight.losses))  # each step logged once
    with pytest.raises(ValueError, match="seed differs"):
        train(_tiny(**common, out=str(tmp_path / "b"), resume=True, seed=1))


def _rewrite_checkpoint(out, edit) -> None:
    path = checkpoint.latest_checkpoint(out)
    payload = torch.load(path, map_location="cpu", weights_only=False)
    edit(payload)
    torch.save(payload, path)


def test_resume_compares_scheme_options_with_their_defaults(tmp_path, shakespeare, caplog):
    """A checkpoint records the scheme's options with every default filled in: a default
    that changed since (simulated by editing the record to the old ``group_size``) stops
    the resume with the option named; giving the checkpoint's value explicitly continues.
    A checkpoint written before the record existed resumes on its given options, with a
    warning."""
    common = dict(scheme="attnres", data=DataConfig(source=str(shakespeare)), steps=4, out=str(tmp_path))
    train(_tiny(**common, stop_after=2))
    recorded = torch.load(checkpoint.latest_checkpoint(tmp_path), map_location="cpu", weights_only=False)
    assert recorded["scheme_options"]["group_size"] == 4 and recorded["scheme_options"]["eps"] == 1e-6

    _rewrite_checkpoint(tmp_path, lambda p: p["scheme_options"].update(group_size=None))
    with pytest.raises(ValueError, match="group_size: checkpoint None, now 4"):
        train(_tiny(**common, resume=True))
    resumed = train(_tiny(**common, resume=True, options={"group_size": None}))
    assert resumed.steps == [3, 4]

    old = {**common, "out": str(tmp_path / "old")}
    train(_tiny(**old, stop_after=2))
    _rewrite_checkpoint(tmp_path / "old", lambda p: p.pop("scheme_options"))
    with caplog.at_level("WARNING", logger="depthrewrite.train.loop"):
        resumed = train(_tiny(**old, resume=True))
    assert resumed.steps == [3, 4] and "does not record its scheme options" in caplog.text


def test_loss_goes_down_on_real_text(shakespeare):
    data = shakespeare.read_bytes()
    counts, n = collections.Counter(data), len(data)
    unigram = -sum(c / n * math.log(c / n) for c in counts.values())  # ~3.31 nats: byte frequencies alone
    result = train(_tiny(scheme="attnres", data=DataConfig(source=str(shakespeare)), steps=80, batch_size=16,
                         seq_len=64, lr=3e-3, warmup_steps=10, eval_every=40, eval_batches=4))
    first, last = result.losses[0], result.final_train_loss
    assert abs(first - math.log(256)) < 0.1  # starts at chance
    assert last < first - 2.0
    assert result.val[-1][1] < unigram - 0.3  # held-out text: more than byte frequencies were learned
    assert result.val[-1][1] < result.val[0][1]


# --------------------------------------------------------------------- routing weights
def test_recorded_weights_are_the_ones_the_router_mixes_with():
    import depthrewrite

    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "attnres")
    weights = record_routing_weights(model, torch.randint(0, 256, (2, 16)))
    # at init the queries are zero: uniform over the l sources of site l, and L+1 at the readout
    assert weights.labels == ["1", "2", "3", "4", "F"]
    for k, w in enumerate(weights.weights):
        assert torch.allclose(w, torch.full((k + 1,), 1.0 / (k + 1)))
    router = model.blocks[1].depth_route["site2"]
    with torch.no_grad():
        router.query.normal_()
        router.key_norm_weight.uniform_(0.5, 1.5)
        sources = [torch.randn(1, 64) * (i + 1) for i in range(4)]
        a = token_weights(router, sources).flatten()  # one token, one head: (4, 1, 1)
        mixed = sum(a[i] * sources[i] for i in range(4))
        assert torch.allclose(mixed, router.route(sources), atol=1e-5)
        assert not torch.allclose(a, torch.full((4,), 0.25), atol=1e-3)


def test_mhar_weights_are_per_head_softmaxes_of_the_router():
    import depthrewrite

    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "mhar", heads=4)
    router = model.blocks[1].depth_route["site2"]
    assert router.heads == 4
    with torch.no_grad():
        router.query.normal_()
        sources = [torch.randn(3, 64) for _ in range(4)]
        a = token_weights(router, sources)  # (sources, tokens, heads)
        assert a.shape == (4, 3, 4)
        mixed = (a.unsqueeze(-1) * torch.stack(sources).unflatten(-1, (4, 16))).sum(0).flatten(-2)
        assert torch.allclose(mixed, router.route(sources), atol=1e-5)
    weights = record_routing_weights(model, torch.randint(0, 256, (1, 8)))
    assert weights is not None and len(weights.labels) == 5


def test_block_attnres_weights_name_blocks_and_partial_and_unknown_schemes_are_skipped():
    import depthrewrite

    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "block_attnres", block_size=2)
    weights = record_routing_weights(model, torch.randint(0, 256, (1, 8)))
    assert weights.source_labels == [["b0"], ["b0", "partial"], ["b0", "b1"], ["b0", "b1", "partial"],
                                     ["b0", "b1", "b2"]]
    assert weights.columns() == ["b0", "b1", "b2", "partial"]
    assert torch.isnan(weights.matrix()[0, 1:]).all()
    plain = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), "residual")
    with pytest.raises(ValueError, match=r"GPT's scheme has no depth-routing weights \(found only routers that keep "
                                         r"the plain residual stream \(PassThrough\)\)"):
        record_routing_weights(plain, torch.randint(0, 256, (1, 8)))


# --------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("scheme", ["dar", "wav", "denseformer"])
def test_heatmaps_of_the_newer_schemes(tmp_path, scheme):
    """DAR's and WAV's sources, and DenseFormer's signed static weights, drawn as for AttnRes."""
    import depthrewrite
    from depthrewrite.train.plots import routing_heatmap

    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=2), scheme)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.add_(torch.randn_like(p))  # DenseFormer's weights then leave [0, 1]
    weights = record_routing_weights(model, torch.randint(0, 256, (1, 8)))
    width, height = png_size(routing_heatmap(weights, tmp_path / "w.png"))
    assert width >= 300 and height >= 200 and (tmp_path / "w.png").stat().st_size > 5_000


def test_compare_writes_table_and_figures(tmp_path, shakespeare, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--schemes", "residual,attnres,block_attnres", "--data", str(shakespeare),
                 "--layers", "2", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
                 "--eval-batches", "1", "--option", "block_attnres:block_size=2", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    table = (out / "results.md").read_text()
    for scheme, new in (("residual", "0"), ("attnres", "640"), ("block_attnres", "640")):  # 2 d (L+1) = 2*64*5
        row = next(line for line in table.splitlines() if line.startswith(f"| {scheme} |"))
        assert row.split("|")[3].strip() == new
        assert row in printed
    for name in ("loss_curves.png", "routing_attnres.png", "routing_block_attnres.png"):
        width, height = png_size(out / name)
        assert width >= 300 and height >= 200 and (out / name).stat().st_size > 5_000
    assert not (out / "routing_residual.png").exists()
    assert str(out / "loss_curves.png") in printed
    assert len([r for r in read_metrics(out / "attnres" / "metrics.jsonl") if "loss" in r]) == 4
    assert f"depthrewrite sample {out / '<scheme>'}" in printed  # and each scheme's folder samples
    assert main(["sample", str(out / "block_attnres"), "--tokens", "5", "--prompt", "to be"]) == 0
    assert "block_attnres at step 4" in capsys.readouterr().err


def test_cli_train_stop_and_resume(tmp_path, shakespeare, capsys):
    args = ["train", "--scheme", "block_attnres", "--option", "block_size=2", "--layers", "2", "--data",
            str(shakespeare), "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
            "--eval-batches", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(args + ["--stop-after", "2"]) == 0
    assert "2 steps" in capsys.readouterr().out
    assert main(args + ["--resume"]) == 0
    assert "2 steps" in capsys.readouterr().out  # steps 3 and 4
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    # the same command once more: said so, where it printed "0 steps, final train loss nan"
    assert main(args + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert f"the run in {tmp_path} is at step 4 already" in out and "nothing to train" in out, out
    assert "nan" not in out, out
    assert main(args + ["--resume", "--option", "block_size=4"]) == 2  # a different model than the checkpoint's
    assert "block_size: checkpoint 2, now 4" in capsys.readouterr().err


def test_cli_values_and_errors(capsys):
    assert [parse_value(v) for v in ("3", "0.5", "true", "False", "none", "x")] == [3, 0.5, True, False, None, "x"]
    assert main(["train", "--model", "gpt:nope", "--no-progress"]) == 2
    assert "gpt:tiny" in capsys.readouterr().err
    assert main(["train", "--option", "block_size", "--no-progress"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_resume_accepts_a_checkpoint_recording_fused_merge_unresolved(tmp_path, shakespeare):
    """Checkpoints written before ``fused_merge`` was resolved record None (the module
    default): they resume; this version records the False it resolves to."""
    common = dict(scheme="block_attnres", options={"block_size": 2}, data=DataConfig(source=str(shakespeare)),
                  steps=4, out=str(tmp_path))
    train(_tiny(**common, stop_after=2))
    recorded = torch.load(checkpoint.latest_checkpoint(tmp_path), map_location="cpu", weights_only=False)
    assert recorded["scheme_options"]["fused_merge"] is False
    _rewrite_checkpoint(tmp_path, lambda p: p["scheme_options"].update(fused_merge=None))
    assert train(_tiny(**common, resume=True)).steps == [3, 4]


# ------------------------------------------------------------------- schedule
def test_warmup_defaults_to_a_tenth_of_the_run_and_the_defaults_are_unchanged():
    """Unset, warmup is steps // 10: the README's runs keep their schedules (20 of the
    default 200 steps, 25 of compare's 250, as when these were fixed counts), and a short
    run warms up briefly and then decays."""
    from depthrewrite.train.compare import default_compare_train_config
    from depthrewrite.train.loop import lr_factor

    assert TrainConfig().warmup() == 20 and default_compare_train_config().warmup() == 25
    short = TrainConfig(steps=10)
    factors = [lr_factor(step, short) for step in range(short.steps)]
    assert short.warmup() == 1 and factors[0] == 1.0
    assert factors == sorted(factors, reverse=True) and factors[-1] < 0.2  # decays to near min_lr_ratio
    longer = TrainConfig(steps=20)  # resuming the short run with more steps: warmup 2, then decay
    assert [lr_factor(s, longer) for s in (0, 1)] == [0.5, 1.0] and lr_factor(19, longer) < 0.2


@pytest.mark.parametrize("warmup", [10, 25])
def test_warmup_of_the_whole_run_is_refused(warmup):
    with pytest.raises(ValueError, match=rf"^warmup_steps must be less than steps=10 .*found {warmup}"):
        TrainConfig(steps=10, warmup_steps=warmup).validate()
    TrainConfig(steps=10, warmup_steps=9).validate()


# ------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("text, value", [
    ("1.0,0.5", (1.0, 0.5)), ("(1.0,0.5)", (1.0, 0.5)), ("[1.0, 0.5]", (1.0, 0.5)), ("(2,)", (2,)), ("()", ()),
    ("1,true,none,x", (1, True, None, "x")), ("[3]", (3,)),
])
def test_cli_values_may_be_tuples(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is tuple


@pytest.mark.parametrize("text", ["1,,2", "(1,(2,3))", "[1,2", ","])
def test_cli_malformed_tuples_are_refused(text, capsys):
    assert main(["train", "--option", f"beta_init={text}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--option 'beta_init={text}'" in err and "tuple value" in err


def test_cli_sets_dar_beta_init(tmp_path, shakespeare, capsys):
    """The walkthrough's case: ``--option beta_init=...`` reached DAR as the string."""
    args = ["train", "--scheme", "dar", "--option", "beta_init=(1.0,0.25)", "--layers", "1", "--data",
            str(shakespeare), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
            "--eval-batches", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0, capsys.readouterr().err
    recorded = torch.load(checkpoint.latest_checkpoint(tmp_path), map_location="cpu", weights_only=False)
    assert tuple(recorded["scheme_options"]["beta_init"]) == (1.0, 0.25)


@pytest.mark.parametrize("command", ["train", "compare"])
def test_cli_help_shows_every_default(command):
    """Each value flag of train and compare says its default, as the subcommand applies it
    (train: 200 steps, compare: 250)."""
    from depthrewrite.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    unsaid = [a.option_strings[0] for a in sub._actions if a.option_strings and a.nargs != 0
              and a.dest not in ("model_option", "option", "hf_dataset") and "default" not in (a.help or "")]
    assert unsaid == []
    steps = next(a for a in sub._actions if a.dest == "steps")
    assert f"default {200 if command == 'train' else 250}" in steps.help


def test_resume_says_when_the_warmup_differs_from_the_checkpoints(tmp_path, shakespeare, caplog):
    """A run started with a fixed warmup (an explicit one, or the old default of 20 steps)
    and resumed without it follows a tenth of its steps: said, with the flag that keeps the
    old. Resumed with it, or started without one, nothing is said."""
    common = dict(scheme="residual", data=DataConfig(source=str(shakespeare)), steps=8, out=str(tmp_path))
    train(_tiny(**common, warmup_steps=3, stop_after=2))
    with caplog.at_level("WARNING", logger="depthrewrite.train.loop"):
        assert train(_tiny(**common, warmup_steps=None, stop_after=4, resume=True)).steps == [3, 4]
    assert "warmup is 0 steps now, 3 in the checkpoint's run" in caplog.text and "--warmup 3" in caplog.text
    caplog.clear()
    same = {**common, "out": str(tmp_path / "same")}
    train(_tiny(**same, warmup_steps=3, stop_after=2))
    unset = {**common, "out": str(tmp_path / "unset"), "warmup_steps": None}
    train(_tiny(**unset, stop_after=2))
    with caplog.at_level("WARNING", logger="depthrewrite.train.loop"):
        train(_tiny(**same, warmup_steps=3, resume=True))
        train(_tiny(**{**unset, "steps": 20}, resume=True))  # more steps: a longer warmup, as asked
    assert "warmup" not in caplog.text


# ------------------------------------------------------------- long runs: resume, divergence
def test_the_logged_lr_is_the_one_each_step_used(tmp_path, shakespeare):
    """Record ``step`` s (1-based) says the learning rate step s trained with, ``lr *
    lr_factor(s - 1)``: the first warmup value included, not the next step's."""
    from depthrewrite.train.loop import lr_factor

    config = _tiny(data=DataConfig(source=str(shakespeare)), steps=6, warmup_steps=2, out=str(tmp_path))
    train(config)
    logged = [(r["step"], r["lr"]) for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert logged == [(s, config.lr * lr_factor(s - 1, config)) for s in range(1, 7)]


def test_the_logged_gradient_norm_is_the_first_steps_before_clipping(tmp_path, shakespeare):
    """Step 1's record: the norm of the whole gradient of the initial model on step 1's batch,
    computed here from a model built the same way; none logged where nothing is clipped."""
    from depthrewrite.train.model import build_model

    config = _tiny(scheme="dar", data=DataConfig(source=str(shakespeare)), steps=2, warmup_steps=1, grad_clip=0.5,
                   out=str(tmp_path))
    result = train(config)
    logged = [r["grad_norm"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    model = build_model(config.model, {"n_layer": config.layers}, config.scheme, config.options, config.seq_len,
                        config.seed, torch.device("cpu")).model.train()
    x, y = batch_at(result.splits.train, seed=config.seed, step=0, batch_size=config.batch_size,
                    seq_len=config.seq_len)
    model(x, y)[1].backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert len(logged) == 2 and logged[0] > config.grad_clip  # clipped: the norm before, not after
    assert logged[0] == pytest.approx(want.item(), rel=1e-6)
    train(_tiny(data=DataConfig(source=str(shakespeare)), steps=2, warmup_steps=1, grad_clip=0.0,
                out=str(tmp_path / "none")))
    assert not any("grad_norm" in r for r in read_metrics(tmp_path / "none" / "metrics.jsonl"))


def test_resume_applies_the_given_optimizer_settings_and_says_which_changed(tmp_path, shakespeare, caplog):
    """``lr`` and ``weight_decay`` given on resume used to be overwritten by the
    checkpoint's (its optimizer and scheduler state), while ``min_lr_ratio``, ``grad_clip``
    and ``steps`` took effect: a silent mix. The given values apply from the resumed step on,
    the first resumed step included, and each change is named with the checkpoint's value."""
    from depthrewrite.train.loop import lr_factor

    common = dict(scheme="block_attnres", options={"block_size": 2}, data=DataConfig(source=str(shakespeare)),
                  steps=8, out=str(tmp_path))
    train(_tiny(**common, stop_after=4))
    changed = _tiny(**{**common, "steps": 16}, lr=1e-3, weight_decay=0.0, resume=True, stop_after=6)
    with caplog.at_level("WARNING", logger="depthrewrite.train.loop"):
        assert train(changed).steps == [5, 6]
    assert "lr is 0.001 now, 0.003 in the checkpoint's run" in caplog.text
    assert "weight_decay is 0.0 now, 0.1 in the checkpoint's run" in caplog.text
    logged = [(r["step"], r["lr"]) for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r][4:]
    assert logged == [(5, 1e-3 * lr_factor(4, changed)), (6, 1e-3 * lr_factor(5, changed))]
    saved = torch.load(checkpoint.latest_checkpoint(tmp_path), map_location="cpu", weights_only=False)
    assert [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.0, 0.0]
    assert saved["scheduler"]["base_lrs"] == [1e-3, 1e-3]


@pytest.mark.parametrize("save_every, stopped, saved", [
    (3, r"^training loss is nan at step 3; no checkpoint was written$", []),  # not a save step: the next loss
    # step 2's update overflows (its loss is finite, unclipped no gradient norm is looked at)
    (1, r"^parameters are not finite after step 2 \(.*\), not saved; .*step_00000001\.pt", ["step_00000001.pt"]),
], ids=["at_the_next_loss", "at_a_save"])
def test_a_nonfinite_loss_stops_the_run_before_a_checkpoint_holds_it(tmp_path, shakespeare, save_every, stopped,
                                                                     saved):
    """A diverged run used to train on in NaN and save NaN checkpoints over the good ones."""
    config = _tiny(data=DataConfig(source=str(shakespeare)), lr=1e9, grad_clip=0.0, steps=8, save_every=save_every,
                   keep_checkpoints=0, out=str(tmp_path))
    with pytest.raises(FloatingPointError, match=stopped):
        train(config)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == saved
    for path in checkpoint.list_checkpoints(tmp_path):
        state = torch.load(path, map_location="cpu", weights_only=False)["model"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path.name
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r)


def test_a_nonfinite_gradient_norm_stops_the_run(tmp_path, shakespeare, monkeypatch):
    """Clipping an infinite gradient norm makes the parameters NaN while the step's loss is
    still finite: the run stops there, not one step (and maybe one checkpoint) later."""
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def infinite_on_third(parameters, max_norm, *args, **kwargs):
        calls.append(real(parameters, max_norm, *args, **kwargs))
        return torch.tensor(float("inf")) if len(calls) == 3 else calls[-1]

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", infinite_on_third)
    config = _tiny(data=DataConfig(source=str(shakespeare)), steps=6, save_every=1, out=str(tmp_path))
    with pytest.raises(FloatingPointError, match=r"^the gradient norm is inf at step 3; .*step_00000002\.pt"):
        train(config)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001.pt", "step_00000002.pt"]


def test_a_fresh_run_refuses_an_out_holding_another_runs_checkpoints(tmp_path, shakespeare, capsys):
    """Without ``resume``, an out whose checkpoints were another run's used to be mixed in:
    metrics.jsonl restarted, the new run's first checkpoint (a lower step) deleted at once by
    ``keep_checkpoints``, and a later ``--resume`` continuing the other run. ``overwrite``
    (``--overwrite``) starts over, removing them; compare starts its runs over."""
    data = DataConfig(source=str(shakespeare))
    train(_tiny(scheme="block_attnres", data=data, steps=6, save_every=3, out=str(tmp_path)))
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(newest step_00000006\.pt\)"):
        train(_tiny(scheme="dar", data=data, steps=4, out=str(tmp_path)))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000006.pt"]
    train(_tiny(scheme="dar", data=data, steps=4, out=str(tmp_path), overwrite=True))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000004.pt"]
    assert train(_tiny(scheme="dar", data=data, steps=6, out=str(tmp_path), resume=True)).steps == [5, 6]
    args = ["train", "--layers", "2", "--data", str(shakespeare), "--steps", "2", "--batch-size", "4", "--seq-len",
            "32", "--eval-batches", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 2 and "--resume to continue it or --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0


def test_compare_reruns_into_the_same_out(tmp_path, shakespeare):
    from depthrewrite.train import CompareConfig, compare

    config = CompareConfig(schemes=("residual",), train=_tiny(data=DataConfig(source=str(shakespeare)), steps=2,
                                                                    warmup_steps=1),
                           out=str(tmp_path))
    compare(config)
    assert compare(config).rows[0].scheme == "residual"


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"", lambda b: b"\0" * 1000],
                         ids=["truncated", "empty", "zeros"])
def test_resume_passes_over_an_unreadable_newest_checkpoint(tmp_path, shakespeare, caplog, damage):
    """A checkpoint cut short (a node lost before the file reached the disk) used to stop the
    resume with torch.load's error (RuntimeError, EOFError or KeyError, naming no file): the
    next older one is taken, said with the file named, and the run still ends bit-exactly.
    The unreadable file is renamed, not left among the checkpoints: there it counted among the
    newest two kept, and the run's next save deleted the readable one it resumed from."""
    common = dict(scheme="wav", data=DataConfig(source=str(shakespeare)), steps=6, save_every=2, out=str(tmp_path))
    straight = train(_tiny(**{**common, "out": str(tmp_path / "straight")}))
    train(_tiny(**common, stop_after=5))  # saves 2, 4 and 5; keeps 4 and 5
    newest = checkpoint.latest_checkpoint(tmp_path)
    damaged = damage(newest.read_bytes())
    newest.write_bytes(damaged)
    with caplog.at_level("WARNING", logger="depthrewrite.train.checkpoint"):
        resumed = train(_tiny(**common, resume=True))
    assert f"cannot read {newest}" in caplog.text and "step_00000004.pt" in caplog.text
    assert resumed.steps == [5, 6] and resumed.losses == straight.losses[4:]
    # the resumed run saved only step 6: the one it resumed from is kept beside it
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000004.pt", "step_00000006.pt"]
    assert newest.with_name("step_00000005.pt.unreadable").read_bytes() == damaged
    for path in checkpoint.list_checkpoints(tmp_path):
        path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"resume: no readable checkpoint under .*step_00000006\.pt"):
        train(_tiny(**common, resume=True))


def test_resume_drops_a_metrics_line_cut_short(tmp_path, shakespeare, caplog):
    """A run killed while writing metrics.jsonl leaves half a line: the resume used to stop
    on a JSONDecodeError naming no file."""
    common = dict(data=DataConfig(source=str(shakespeare)), steps=4, out=str(tmp_path))
    train(_tiny(**common, stop_after=2))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 4.1')
    with caplog.at_level("WARNING", logger="depthrewrite.train.loop"):
        assert train(_tiny(**common, resume=True)).steps == [3, 4]
    assert "metrics.jsonl" in caplog.text and "cut short" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.1\n{"step": 2, "loss": 4.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 1 is not JSON"):
        train(_tiny(**common, resume=True))


def test_read_metrics_reads_a_file_still_being_written(tmp_path):
    """A live run's last line may be half written when a monitor reads the file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 4.1}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 4.1}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 4.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 1 is not JSON"):
        read_metrics(path)


def test_resume_past_the_end_is_refused_and_a_finished_run_is_left_as_it_is(tmp_path, shakespeare):
    """A checkpoint beyond ``steps`` (or ``stop_after``) used to resume into zero steps and a
    NaN train loss, and resuming a finished run logged its final validation loss twice."""
    common = dict(data=DataConfig(source=str(shakespeare)), steps=4, out=str(tmp_path))
    train(_tiny(**common))
    before = (tmp_path / "metrics.jsonl").read_text()
    again = train(_tiny(**common, resume=True))
    assert again.steps == [] and (tmp_path / "metrics.jsonl").read_text() == before
    with pytest.raises(ValueError, match=r"resume: the checkpoint is at step 4, past steps=3"):
        train(_tiny(**{**common, "steps": 3}, resume=True))
    with pytest.raises(ValueError, match=r"resume: the checkpoint is at step 4, past stop_after=3"):
        train(_tiny(**{**common, "steps": 8}, stop_after=3, resume=True))


def test_resume_refuses_training_text_that_changed(tmp_path, shakespeare):
    """The config names the data (a path), not what is in it: a corpus file edited or a
    folder given more files between stop and resume used to continue silently on other
    windows and another train/validation split."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(shakespeare.read_bytes()[:200_000])
    common = dict(data=DataConfig(source=str(text)), steps=4, out=str(tmp_path / "run"))
    train(_tiny(**common, stop_after=2))
    with text.open("ab") as f:
        f.write(b"\n\nA new scene, appended while the run was stopped.\n")
    with pytest.raises(ValueError, match=r"resume: the training and validation text differs from the checkpoint's"):
        train(_tiny(**common, resume=True))
    text.write_bytes(shakespeare.read_bytes()[:200_000])
    assert train(_tiny(**common, resume=True)).steps == [3, 4]


def test_an_interrupted_resume_leaves_metrics_jsonl_whole(tmp_path, shakespeare, monkeypatch):
    """The resume rewrites metrics.jsonl without the steps it will run again; a kill during
    that rewrite used to leave the file cut short: weeks of history lost."""
    common = dict(data=DataConfig(source=str(shakespeare)), steps=4, out=str(tmp_path))
    train(_tiny(**common, stop_after=2))
    before = (tmp_path / "metrics.jsonl").read_text()

    def killed_halfway(path, text, *args, **kwargs):
        with open(path, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        train(_tiny(**common, resume=True))
    assert (tmp_path / "metrics.jsonl").read_text() == before


# ----------------------------------------------------------------------- stop signals
_TRAIN_STEP = loop._train_step


@pytest.fixture
def python_default_handlers():
    """SIGINT and SIGTERM with Python's own handlers while the test runs (put back after):
    what the signal tests compare against. A process started in the background by a shell
    without job control (``cmd &`` in a script, as CI runners may start it) inherits SIGINT
    ignored, and Python then leaves it ignored: SIGINT raises no KeyboardInterrupt there
    (session 59: these tests failed so when the suite ran in the background)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def _signal_during_step(monkeypatch, at_step: int, signum: int, times: int = 1) -> None:
    """Deliver ``signum`` (``times`` times) to this process in the middle of 0-based step
    ``at_step``, between the backward and the optimizer's update, as a cluster's SIGTERM
    arrives at any moment. Replaces an earlier call's patch."""
    real = _TRAIN_STEP

    def step(runner, optimizer, *args, **kwargs):
        if args[2] != at_step:  # (scheduler, tokens, step, ...)
            return real(runner, optimizer, *args, **kwargs)
        update = optimizer.step

        def signalled_update(*a, **k):
            for _ in range(times):
                signal.raise_signal(signum)
            return update(*a, **k)

        optimizer.step = signalled_update
        try:
            return real(runner, optimizer, *args, **kwargs)
        finally:
            optimizer.step = update

    monkeypatch.setattr(loop, "_train_step", step)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_step_saves_and_resumes_bit_exactly(tmp_path, shakespeare, monkeypatch, python_default_handlers, signum):
    common = dict(scheme="block_attnres", model_options={"dropout": 0.1}, data=DataConfig(source=str(shakespeare)),
                  steps=6, eval_every=2)
    straight = train(_tiny(**common, out=str(tmp_path / "a")))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    _signal_during_step(monkeypatch, at_step=2, signum=signum)
    with pytest.raises(loop.TrainingInterrupted) as stopped:
        train(_tiny(**common, out=str(tmp_path / "b")))
    monkeypatch.undo()
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    name = signal.Signals(signum).name
    assert (stopped.value.signal_name, stopped.value.step) == (name, 3)  # the step it arrived in was finished
    assert stopped.value.checkpoint == checkpoint.checkpoint_path(tmp_path / "b", 3)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "b")] == ["step_00000003.pt"]
    resumed = train(_tiny(**common, out=str(tmp_path / "b"), resume=True))
    assert resumed.steps == [4, 5, 6]
    logged = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert torch.equal(torch.tensor(logged), torch.tensor(straight.losses))
    for (key, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), key


def test_a_second_sigint_stops_at_once_and_the_cli_exits_with_the_signals_status(tmp_path, shakespeare,
                                                                                 monkeypatch, capsys,
                                                                                 python_default_handlers):
    config = _tiny(scheme="attnres", data=DataConfig(source=str(shakespeare)), steps=4, out=str(tmp_path / "a"))
    _signal_during_step(monkeypatch, at_step=1, signum=signal.SIGINT, times=2)
    with pytest.raises(KeyboardInterrupt) as stopped:
        train(config)
    assert not isinstance(stopped.value, loop.TrainingInterrupted)
    assert checkpoint.list_checkpoints(tmp_path / "a") == []  # stopped at once: nothing saved
    _signal_during_step(monkeypatch, at_step=1, signum=signal.SIGTERM)
    args = ["train", "--scheme", "attnres", "--layers", "2", "--data", str(shakespeare), "--steps", "4",
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1",
            "--out", str(tmp_path / "b"), "--no-progress"]
    assert main(args) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step 2; its state is saved in" in (err := capsys.readouterr().err)
    assert "(--resume continues the run)" in err


def test_without_out_or_with_stop_on_signal_off_the_signals_are_left_alone(shakespeare, monkeypatch, python_default_handlers):
    common = dict(scheme="attnres", data=DataConfig(source=str(shakespeare)), steps=3)
    for config in (_tiny(**common), _tiny(**common, out=None, stop_on_signal=False)):
        _signal_during_step(monkeypatch, at_step=1, signum=signal.SIGINT)
        with pytest.raises(KeyboardInterrupt) as stopped:
            train(config)
        assert not isinstance(stopped.value, loop.TrainingInterrupted)
    with pytest.raises(ValueError, match="stop_on_signal must be True or False, found 'no'"):
        train(_tiny(**common, stop_on_signal="no"))


# -------------------------------------------------------------------- gradient accumulation
def test_gradient_accumulation_trains_the_same_steps(tmp_path, shakespeare):
    """--grad-accum 4 runs each step's batch as 4 micro-batches: the same data, the same
    mean loss and the same update, up to float32 summation order. Measured against one
    batch: losses within 1.8e-7 relative, parameters within 1.6e-6 absolute (AdamW turns
    ulp-level differences of near-zero gradients into steps of up to its lr, 3e-3). A wrong
    scale, or a micro-batch dropped or run twice, changes every update by about the lr, and
    the losses by 1e-3 or more after a few steps. Resuming with another count is allowed (it
    changes rounding only)."""
    common = dict(scheme="block_attnres", data=DataConfig(source=str(shakespeare)), steps=6, batch_size=8)
    whole = train(_tiny(**common))
    accumulated = train(_tiny(**common, grad_accum=4, out=str(tmp_path), stop_after=3))
    resumed = train(_tiny(**common, grad_accum=2, out=str(tmp_path), resume=True))
    torch.testing.assert_close(torch.tensor(accumulated.losses + resumed.losses), torch.tensor(whole.losses),
                               rtol=1e-5, atol=0)
    for (name, p), q in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match=r"grad_accum=3 must divide each rank's rows \(batch_size 8 over 1 ranks: 8\)"):
        train(_tiny(**common, grad_accum=3))


@pytest.mark.parametrize("settings, message", [
    (dict(lr=math.inf), r"^lr must be a finite number > 0, found inf"),
    (dict(weight_decay=math.inf), r"^weight_decay must be a finite number >= 0, found inf"),
    (dict(grad_clip=math.nan), r"^grad_clip must be a finite number >= 0, found nan"),
    (dict(device="gpu"), r"^device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', found 'gpu'"),
    (dict(save_every=10), r"^save_every needs out, the folder checkpoints go to \(--out\); found none"),
    (dict(save_every=10, overwrite=True), r"^save_every and overwrite need out"),
    (dict(scheme="blockattnres"), r"^unknown scheme 'blockattnres'; valid schemes: "),
    (dict(scheme="attnres", options={"group_size": 0}), r"^attnres: group_size must be None"),
    (dict(scheme="none", options={"eps": 1e-6}), r"^scheme 'none' \(no rewrite\) takes no options, found \['eps'\]"),
])
def test_settings_are_checked_before_anything_is_built(settings, message):
    """Each of these trained (inf: to a loss of nan naming no flag; save_every without out:
    to no checkpoint at all) or failed once the data and model were built."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^device 'cuda': CUDA is not available here \(torch "):
        TrainConfig(device="cuda").validate()


def test_out_must_be_a_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"^out must be a folder .*found the file"):
        TrainConfig(out=str(tmp_path / "notes.txt")).validate()


def test_compare_checks_every_scheme_before_it_trains_the_first(tmp_path, capsys):
    """A typo in the last scheme, or an option it does not take, failed only after the
    schemes before it had trained (72 s at the defaults), and no results were written."""
    for args, message in [(["--schemes", "residual,attnres,blockattnres"], "unknown scheme 'blockattnres'"),
                          (["--schemes", "block_attnres,attnres", "--option", "two_phase=false"],
                           "scheme 'attnres' has no option 'two_phase'"),
                          (["--schemes", "residual,attnres", "--option", "attnres:group_size=0"],
                           "attnres: group_size must be None")]:
        assert main(["compare", *args, "--out", str(tmp_path), "--no-progress"]) == 2
        assert message in capsys.readouterr().err
        assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_cli_checkpoint_flags_need_out(capsys):
    assert main(["train", "--keep-checkpoints", "3", "--no-progress"]) == 2
    assert "--keep-checkpoints needs --out" in capsys.readouterr().err
