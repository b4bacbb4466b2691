"""Shared test fixtures: small Hugging Face models (random weights, no download) and the
real text corpora of ../shared/data."""

from __future__ import annotations

import os
import pathlib
import random
import socket

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter for the kernel tests: it must be on before triton.language is
    # first imported, which any test module may do (torch._inductor imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from tests.interpreter_patching import install

        install()  # two thirds of the kernel tests' time: see the module

# The test models are tiny: one thread is faster than two (and two stall badly when the
# 2-core CI machine is busy).
torch.set_num_threads(1)

# Inductor's C++ kernels as scalar loops, not vector code: the vectorized kernels take gcc
# about a fifth longer to build (a DAR block model compiled whole and block by block, 58-62 s
# against 75-76 s on the 2-core VM, session 73; gcc's builds were about two fifths of that
# test's time, profiled). What they check is the backend's graphs, which are the same either
# way; test_backend.py's test_inductor_matches_eager builds the vector code, Inductor's
# default. Processes that import this module (the C++ wrapper test's second process) get
# the same setting, so they find the first one's graphs in Inductor's caches. (Imported here,
# not above: it imports triton.language, which must come after TRITON_INTERPRET is set.)
import torch._inductor.config  # noqa: E402

torch._inductor.config.cpp.simdlen = 0


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`tests.slow_tests.SLOW_TESTS` ``slow`` (CI runs ``-m "not
    slow"``); stop the run if an entry names no test of a file collected whole."""
    from tests.slow_tests import is_slow, stale_entries

    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    root = pathlib.Path(config.rootpath)
    whole = [_relative(arg, root) for arg in config.args if "::" not in arg]
    stale = stale_entries([item.nodeid for item in items], [path for path in whole if path is not None])
    if stale:
        raise pytest.UsageError(f"tests/slow_tests.py names tests that were not collected (renamed?): {stale}")


def _relative(arg: str, root: pathlib.Path) -> str | None:
    """A command-line path as the node ids write it (relative to the root; "" for the root)."""
    try:
        relative = pathlib.Path(arg).resolve().relative_to(root)
    except ValueError:
        return None
    return "" if str(relative) == "." else relative.as_posix()


@pytest.fixture(autouse=True)
def _seeded_global_generator():
    """Every test starts from the same state of torch's global generator, whatever ran
    before it in its process (pytest-xdist hands tests to processes in a varying order), so
    a test that draws without its own generator sees the same numbers in every run: a
    test's verdict never depends on its neighbours (session 48: one GPU test failed on draws
    that its neighbours had left)."""
    torch.manual_seed(0)


def transformers_major() -> int | None:
    """The installed transformers' major version (None: not installed). The suite runs on
    5.x in CI; on 4.57 every test passes but those that check 5.x's own behaviour, which
    skip there with the reason (README, "Which models")."""
    try:
        import transformers
    except ImportError:
        return None
    return int(transformers.__version__.split(".")[0])


def skip_before_transformers_5(reason: str):
    """A skip mark for a test of something transformers 4.x does differently."""
    major = transformers_major()
    return pytest.mark.skipif(major is not None and major < 5, reason=f"transformers 4.x: {reason}")


DATA_DIR = pathlib.Path(os.environ.get("DEPTHREWRITE_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))

#: the seven families of the core issue, each with the config fields that make it small
HF_FAMILIES = {
    "llama": {},
    "qwen3": {"head_dim": 8},
    "mistral": {},
    "gpt2": None,  # built separately: different field names
    "gemma3_text": {"head_dim": 8},
    "gpt_neox": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def hf_model(family: str, layers: int = 2, seed: int = 0, **overrides):
    """A small causal LM of the given transformers family, with random weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=layers, n_head=4,
                                      bos_token_id=0, eos_token_id=0, **overrides)
    else:
        fields = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
        fields.update(HF_FAMILIES.get(family) or {})
        fields.update(overrides)
        cfg = transformers.CONFIG_MAPPING[family](**fields)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.float().eval()


def perturb_routing(model, scale=0.5, seed=0):
    """Move the routing parameters off their init so that tests see real routing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def corpus_bytes(name: str = "tinyshakespeare.txt", limit: int | None = None) -> bytes:
    path = DATA_DIR / name
    if not path.exists():
        if os.environ.get("CI"):  # CI always has ../shared/data: a missing corpus is a failure there
            raise FileNotFoundError(f"corpus {path} not found")
        pytest.skip(f"corpus {path} not found (set DEPTHREWRITE_DATA)")
    data = path.read_bytes()
    return data[:limit] if limit else data


def _corpus_file(tmp_path_factory, limit: int | None) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "tinyshakespeare.txt"
    path.write_bytes(corpus_bytes("tinyshakespeare.txt", limit))
    return path


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> pathlib.Path:
    """tinyshakespeare in a file of the test module's own (a source for ``DataConfig``)."""
    return _corpus_file(tmp_path_factory, None)


@pytest.fixture(scope="module")
def shakespeare_200k(tmp_path_factory) -> pathlib.Path:
    """Its first 200,000 bytes, enough for the tiny runs' windows and quicker to load."""
    return _corpus_file(tmp_path_factory, 200_000)


def png_size(path: pathlib.Path) -> tuple[int, int]:
    """(width, height) of a whole PNG file (its header and its end checked)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's store, taken below the
    kernel's ephemeral range. The ranks bind it seconds later, once spawned, and a port of
    that range may meanwhile become the local end of any process's outgoing connection: in
    session 76 a CI run's rank 0 found the port that the kernel had given it (bind to port
    0) in use ("EADDRINUSE"), while the other pytest worker's ranks were connecting."""
    pick = random.Random()  # not the global RNG, which tests seed
    low = _ephemeral_ports_start()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still closing (TIME_WAIT)
                continue
            return port
    raise RuntimeError(f"free_port: no free TCP port among 200 tries below {low}")


def _ephemeral_ports_start() -> int:
    """The first port the kernel hands out for outgoing connections (Linux's default
    where the file is missing)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def rank_environment(rank: int, port: int, ranks: int) -> None:
    """What torchrun gives a spawned rank of ``ranks`` on this machine (the environment a
    process group, or ``train``, reads), and one CPU thread."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def join_group(rank: int, port: int, ranks: int, on_gpus: bool = False) -> str:
    """A spawned rank in a process group of ``ranks`` on this machine (nccl on GPU ``rank``,
    else gloo), one CPU thread each; its device."""
    rank_environment(rank, port, ranks)
    if on_gpus:
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl" if on_gpus else "gloo")
    return f"cuda:{rank}" if on_gpus else "cpu"


def leave_together() -> None:
    """A barrier before a spawned rank destroys its process group and exits. Without it a
    rank whose own collective had returned could leave while gloo still sent another rank
    that collective's last message: in session 59 one CI run in three hung in a futex (the
    compiled-DDP test), and in session 61 a rank of the 3-rank gather test died with
    SIGABRT ("terminate called without an active exception") after ``full_tensor()``."""
    torch.distributed.barrier()


def skip_widest_row_in_half_precision(d: int, dtype: torch.dtype, widest: int) -> None:
    """Skip a kernel test of the widest row (``widest``, the kernels' MAX_ROW) in a half
    dtype where the kernels run through Triton's interpreter: ~8 s a case on the 2-core CI
    machine, and the half dtypes differ there only in their loads' and stores' casts, which
    the narrower rows test. On the GPU every dtype runs at that width."""
    if d == widest and dtype != torch.float32 and not torch.cuda.is_available():
        pytest.skip("the widest row in half precision: on the GPU only")
