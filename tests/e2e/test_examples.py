"""The scripts of ``examples/`` run at a tiny size (``--tiny``) and print what they promise.

Each runs in a subprocess from the repository root, as a user would run it. The compile
example's ``--tiny`` uses the backend's ``inner="aot_eager"`` (the same graphs and routing-op
count, no C++ build); its default compiles with Inductor behind the depthrewrite backend.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    # one thread: the tiny models are faster without OpenMP hand-offs on a shared 2-core machine
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--tiny", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def losses(stdout: str, label: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{label} step\s+\d+\s+loss (\S+)", stdout, re.M)]


def test_rewrite_hf_and_compile():
    out = run_example("rewrite_hf_and_compile.py")
    assert re.search(r"^4\s+model\.layers\.1\s+2\s+mlp\s+rmsnorm", out, re.M)  # inspect's table: 2 layers, 4 sites
    steps = [float(v) for v in re.findall(r"^step\s+\d+\s+loss (\S+)", out, re.M)]
    assert len(steps) == 3 and steps[-1] < steps[0]  # three compiled training steps, and they learn
    # two-phase block_attnres, blocks of 2 sites: one route_many for each of the 2 blocks and
    # the readout's, in one graph; the backward recomputes the first block's (recompute=True,
    # the default; the last site's group and the readout's keep theirs: KEEP_LAST_PHASE_ONE)
    assert re.search(r"^routing ops in the compiled graph: 3$", out, re.M), out
    assert "inner='aot_eager'" in out
    assert "'backward': {'depthrewrite::route_many_backward': 3, 'depthrewrite::route_many': 1}" in out


def test_convert_checkpoint_and_continue(tmp_path):
    out = run_example("convert_checkpoint_and_continue.py", "--out", str(tmp_path))
    original = float(re.search(r"^original loss on the fixed batch: (\S+)$", out, re.M).group(1))
    first = float(re.search(r"^first loss after conversion:\s+(\S+)$", out, re.M).group(1))
    assert first == original  # printed with repr: equal floats print equal, unequal ones differ
    converted = losses(out, "block_attnres")
    assert len(converted) == 3 and converted[0] == pytest.approx(first, abs=1e-6)
    assert len(set(converted)) == 3  # training moved the converted model
    assert "logits bit-identical: True" in out
    assert (tmp_path / "original" / "config.json").exists()
    assert '"depthrewrite"' in (tmp_path / "converted" / "config.json").read_text()  # the recipe was saved


def test_train_moe_with_dar():
    out = run_example("train_moe_with_dar.py")
    d, layers, n_experts, coef = 64, 2, 4, 0.01  # moe:tiny's width and experts, --tiny's layers, aux_loss_coef
    sites = 2 * layers
    assert f"routing parameters: {(4 * d + 4) * sites + 4 * d + 1}" in out  # README's DAR count
    rows = re.findall(r"^step\s+\d+\s+loss (\S+)\s+cross-entropy (\S+)\s+load-balancing (\S+)", out, re.M)
    assert len(rows) == 4
    for total, ce, balance in ((float(a), float(b), float(c)) for a, b, c in rows):
        assert total == pytest.approx(ce + coef * balance, abs=2e-6)  # the loss is CE + coef * LB
        assert 0 < balance <= layers * n_experts  # E * sum f P lies in (0, E] per layer
    assert float(rows[-1][1]) < float(rows[0][1])
    table = out.split("depth-routing weights (rows: sites, F: the final readout):\n")[1].splitlines()
    assert table[0].split() == ["e", "H0_1", "H1_1", "P0", "P1"]
    assert [row.split()[0] for row in table[1:]] == ["1", "2", "3", "4", "F"]
    for row in table[1:]:  # each site's weights sum to 1, each printed to 2 decimals
        values = [float(v) for v in row.split()[1:]]
        assert sum(values) == pytest.approx(1, abs=0.005 * len(values) + 1e-9), row


def test_property_test_your_model():
    out = run_example("property_test_your_model.py")
    assert out.strip().endswith("bit-identical to MiniGPT") and "property holds on 2 random models" in out
