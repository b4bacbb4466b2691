"""A trained run's model back from its folder (``train.trained_model.load_trained``) and
``depthrewrite sample``: the rebuilt model computes what the trained one did, from any of its
checkpoints, with the scheme options the run used."""

from __future__ import annotations

import pytest
import torch

import depthrewrite
from depthrewrite.cli import SAMPLE_SEPARATOR, main
from depthrewrite.passes import two_phase
from depthrewrite.train import DataConfig, TrainConfig, checkpoint, train
from depthrewrite.train import generate, load_trained
from depthrewrite.train.sampling import decode, encode


def _config(text, out, **kw) -> TrainConfig:
    base = dict(model="gpt:tiny", layers=2, data=DataConfig(source=str(text)), steps=6, batch_size=4, seq_len=32,
                warmup_steps=1, eval_every=0, eval_batches=1, save_every=3, progress=False, out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("scheme, options", [("dar", {"layers_per_block": 1}), ("block_attnres", {}),
                                             ("none", {}), ("wav", {"model_overrides": True})])
def test_the_loaded_model_is_the_trained_one_bit_for_bit(tmp_path, shakespeare_200k, scheme, options):
    model_options = {"parallel_block": True} if options.pop("model_overrides", False) else {}
    result = train(_config(shakespeare_200k, tmp_path, scheme=scheme, options=options, model_options=model_options))
    torch.manual_seed(123)  # not the run's seed: building the model seeds the generator with that one
    rng = torch.get_rng_state()
    loaded = load_trained(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng)  # building the model seeded nothing the caller sees
    assert loaded.step == 6 and loaded.checkpoint == checkpoint.checkpoint_path(tmp_path, 6)
    assert not loaded.model.training and loaded.seq_len == 32
    want, got = result.model.state_dict(), loaded.model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, 256, (2, 32))
    assert torch.equal(_logits(loaded.model, ids), _logits(result.model.eval(), ids))
    if scheme != "none":
        assert depthrewrite.inspect(loaded.model).rewritten_with == depthrewrite.inspect(result.model).rewritten_with


def test_an_earlier_step_and_the_options_the_run_used_whatever_the_default_now(tmp_path, shakespeare_200k, monkeypatch):
    result = train(_config(shakespeare_200k, tmp_path, scheme="block_attnres"))
    earlier = torch.load(checkpoint.checkpoint_path(tmp_path, 3), weights_only=False)["model"]
    loaded = load_trained(tmp_path, step=3)
    assert loaded.step == 3 and all(torch.equal(v, earlier[k]) for k, v in loaded.model.state_dict().items())
    assert not torch.equal(loaded.model.state_dict()["embed.weight"], result.model.state_dict()["embed.weight"])
    # the run used the module default fused_merge=False; a later default must not change the model
    monkeypatch.setattr(two_phase, "FUSED_MERGE", True)
    again = load_trained(tmp_path)
    assert depthrewrite.inspect(again.model).rewritten_with == depthrewrite.inspect(result.model).rewritten_with
    ids = torch.randint(0, 256, (1, 32))
    assert torch.equal(_logits(again.model, ids), _logits(result.model.eval(), ids))


def test_a_checkpoint_from_before_the_options_were_recorded_loads_on_the_options_given(tmp_path, shakespeare_200k,
                                                                                     caplog):
    result = train(_config(shakespeare_200k, tmp_path, scheme="attnres", options={"group_size": 2}))
    path = checkpoint.checkpoint_path(tmp_path, 6)
    payload = torch.load(path, weights_only=False)
    del payload["scheme_options"]  # as checkpoints written before it was recorded are
    torch.save(payload, path)
    with caplog.at_level("WARNING", logger="depthrewrite.train.trained_model"):
        loaded = load_trained(tmp_path)
    assert "does not record its scheme options" in caplog.text
    assert depthrewrite.inspect(loaded.model).rewritten_with == depthrewrite.inspect(result.model).rewritten_with
    ids = torch.randint(0, 256, (1, 32))
    assert torch.equal(_logits(loaded.model, ids), _logits(result.model.eval(), ids))


def test_missing_and_unreadable_checkpoints_are_named(tmp_path, shakespeare_200k, caplog):
    with pytest.raises(ValueError, match="no checkpoint under .*checkpoints'.*--save-every"):
        load_trained(tmp_path)
    train(_config(shakespeare_200k, tmp_path, scheme="attnres"))
    with pytest.raises(ValueError, match="step 4: no checkpoint of that step under .* it holds steps 3, 6"):
        load_trained(tmp_path, step=4)
    newest = checkpoint.checkpoint_path(tmp_path, 6)
    newest.write_bytes(newest.read_bytes()[:1000])
    with caplog.at_level("WARNING", logger="depthrewrite.train.checkpoint"):
        assert load_trained(tmp_path).step == 3
    assert f"checkpoint: cannot read {newest}" in caplog.text
    assert newest.exists()  # only read: a look at a run changes nothing in its folder
    with pytest.raises(ValueError, match=r"step 6: cannot read .*step_00000006\.pt' \(RuntimeError"):
        load_trained(tmp_path, step=6)
    if not torch.cuda.is_available():  # a device this machine lacks is named
        with pytest.raises(ValueError, match="device 'cuda': CUDA is not available here"):
            load_trained(tmp_path, device="cuda")


def test_sample_prints_what_generate_gives_the_loaded_model(tmp_path, shakespeare_200k, capsys):
    train(_config(shakespeare_200k, tmp_path, scheme="dar"))
    assert main(["sample", str(tmp_path), "--prompt", "ROMEO:", "--tokens", "40", "--seed", "7",
                 "--top-k", "20"]) == 0
    out, err = capsys.readouterr()
    loaded = load_trained(tmp_path)
    ids = generate(loaded.model, encode("ROMEO:"), 40, temperature=0.8, top_k=20, context=32,
                   generator=torch.Generator().manual_seed(7))
    assert out == decode(ids) + "\n" and out.startswith("ROMEO:")
    assert "gpt:tiny / dar at step 6" in err and "context 32, seed 7" in err
    assert main(["sample", str(tmp_path / "nowhere")]) == 2
    assert "sample: error: " in capsys.readouterr().err
    assert main(["sample", str(tmp_path), "--temperature", "-1"]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err
    assert main(["sample", str(tmp_path), "--prompt", "a", "--tokens", "8", "--samples", "3", "--seed", "2"]) == 0
    rows = generate(loaded.model, encode("a").expand(3, -1), 8, temperature=0.8, context=32,
                    generator=torch.Generator().manual_seed(2))
    texts = capsys.readouterr().out[:-1].split(SAMPLE_SEPARATOR)
    assert texts == [decode(row) for row in rows] and len(set(texts)) > 1
    assert main(["sample", str(tmp_path), "--samples", "0"]) == 2
    assert "--samples must be >= 1, found 0" in capsys.readouterr().err
    assert main(["sample", str(tmp_path), "--tokens", "-3"]) == 2
    assert "--tokens must be >= 0, found -3" in capsys.readouterr().err
    assert main(["sample", str(tmp_path), "--context", "257"]) == 2  # gpt:tiny's max_seq_len is 256
    assert "--context 257: the model reads at most 256 positions" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the run and the loaded model on the GPU")
def test_on_cuda_the_loaded_model_is_the_trained_one_and_samples(tmp_path, shakespeare_200k, capsys):
    """On the GPU the routing runs the fused Triton kernels; the loaded model runs the same
    ones on the same weights (a run trained in bf16 autocast keeps float32 weights)."""
    result = train(_config(shakespeare_200k, tmp_path, scheme="dar", device="cuda", precision="bf16"))
    loaded = load_trained(tmp_path, device="cuda")
    ids = torch.randint(0, 256, (2, 32), device="cuda")
    assert torch.equal(_logits(loaded.model, ids), _logits(result.model.eval(), ids))
    assert main(["sample", str(tmp_path), "--device", "cuda", "--tokens", "50", "--temperature", "0"]) == 0
    greedy = generate(loaded.model, encode("\n").cuda(), 50, temperature=0, context=32)
    assert capsys.readouterr().out == decode(greedy.cpu()) + "\n"
