"""``depthrewrite inspect MODEL`` prints the residual-stream table of a bundled preset or of
a local Hugging Face config, and fails with a clear message otherwise."""

import pathlib
import signal
import subprocess
import sys

import pytest

from depthrewrite.cli import main


def test_inspect_bundled_preset(capsys):
    assert main(["inspect", "gpt:tiny", "--layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "through 3 blocks of 'blocks'" in out and "6 sites" in out
    assert "blocks.2.norm_mlp" in out


def test_inspect_counts_one_block_in_the_singular(capsys):
    assert main(["inspect", "gpt:tiny", "--layers", "1"]) == 0
    assert "through 1 block of 'blocks'" in capsys.readouterr().out


def test_inspect_hf_config_path(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4).save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path / "config.json"), "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPTNeoXForCausalLM" in out and "2 sites" in out and "parallel" in out


def test_inspect_of_a_rewritten_checkpoint_names_its_scheme(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import depthrewrite

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = depthrewrite.rewrite(transformers.LlamaForCausalLM(config), "dar", layers_per_block=1)
    model.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rewritten with 'dar' (" in out and "layers_per_block=1" in out and "4 sites" in out


def test_inspect_of_a_model_saved_whole_names_its_scheme(tmp_path, capsys):
    import torch

    import depthrewrite
    from depthrewrite.models import GPT, GPTConfig

    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=32, n_head=4, n_layer=3, max_seq_len=32)), "wav")
    torch.save(model, tmp_path / "model.pt")
    assert main(["inspect", str(tmp_path / "model.pt")]) == 0
    out = capsys.readouterr().out
    assert "rewritten with 'wav' (" in out and "through 3 blocks of 'blocks'" in out
    assert main(["inspect", str(tmp_path / "model.pt"), "--layers", "2"]) == 2
    assert "--layers cannot change a model saved whole" in capsys.readouterr().err


def test_inspect_of_a_state_dict_says_it_has_no_architecture(tmp_path, capsys):
    import torch

    from depthrewrite.models import GPT, GPTConfig

    torch.save(GPT(GPTConfig(d_model=32, n_head=4, n_layer=2, max_seq_len=32)).state_dict(), tmp_path / "sd.pt")
    assert main(["inspect", str(tmp_path / "sd.pt")]) == 2
    assert "holds an object of type OrderedDict, not a model saved whole (torch.save(model)): a state_dict " \
           "has no architecture" in capsys.readouterr().err


@pytest.mark.parametrize("model, message", [("gpt:huge", "unknown gpt preset 'huge'"),
                                            ("/no/such/folder", "no such file or folder: '/no/such/folder'"),
                                            ("./config.json", "no such file or folder: './config.json'")])
def test_inspect_errors_are_clear(model, message, capsys):
    assert main(["inspect", model]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["/nonexistent", "no-such-owner/no-such-model"])
def test_inspect_of_nothing_says_what_it_looked_for(name, capsys):
    """Not a path, not a preset, not a cached model id: said in those words, not in those of
    the Hugging Face lookup (a path is no valid repo id; an id is looked up offline)."""
    pytest.importorskip("transformers")
    assert main(["inspect", name]) == 2
    err = capsys.readouterr().err
    assert f"no such file or folder: {name!r}" in err and "gpt:tiny" in err and "model id" in err
    assert "Repo id" not in err and "internet" not in err


@pytest.mark.parametrize("layers", ["0", "-1"])
def test_inspect_refuses_a_layer_count_below_one(layers, capsys):
    """`--layers 0` built the preset's own depth silently (0 read as "not given")."""
    assert main(["inspect", "gpt:tiny", "--layers", layers]) == 2
    assert f"--layers must be a positive int, found {layers}" in capsys.readouterr().err


def test_inspect_of_a_folder_without_a_config(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err


def test_a_reader_that_stops_early_ends_inspect_without_a_traceback():
    """``depthrewrite inspect ... | head -1``: the write to the closed pipe used to end in a
    BrokenPipeError's traceback; now the exit status of a program stopped by SIGPIPE, and
    nothing on stderr. (700 blocks: a table of about 110 kB, larger than a pipe's 64 KiB
    buffer; 1,500 took 91 s of a busy CI run.)"""
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "depthrewrite.cli", "inspect", "gpt:tiny", "--layers", "700"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"GPT: residual stream of width 64 through 700 blocks")
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 128 + signal.SIGPIPE and err == "", err
