"""benchmarks/launcher_host.py, whose CPU figures docs/benchmarks.md (session 66) quotes: on a
machine without CUDA it times our CUDA kernel functions (the launchers) with the kernels
not launched, one JSON line a case, and ``--summarize`` puts two versions' lines side by
side. Run in a process of its own: the script replaces the kernels of the modules it imports."""

import json
import os
import subprocess
import sys

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

CASES = 10


def test_the_cpu_run_times_every_case_and_the_summary_sets_labels_side_by_side(tmp_path):
    script = str(BENCHMARKS / "launcher_host.py")
    lines = []
    for label, extra in (("a", []), ("b", ["--profile", "5"])):
        run = subprocess.run([sys.executable, script, "--calls", "2", "--repeats", "1", "--label", label, *extra],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert run.returncode == 0, run.stderr[-2000:]
        lines += [line for line in run.stdout.splitlines() if line.startswith("{")]
    # b's profiles: one a case, each of its calls counted, our launchers among the functions
    profiles = run.stderr.split("== ")[1:]
    assert [p.splitlines()[0] for p in profiles] == [json.loads(line)["case"] for line in lines[CASES:]]
    assert all("function calls" in p and "depthrewrite/kernels/" in p for p in profiles)
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 2 * CASES
    assert all(r["device"] == "cpu (kernels not launched)" and r["us"] > 0 and r["aten_ops"] >= 1 for r in rows)
    wav_backward = [r for r in rows if r["case"] == "WAV site: route_backward_into_, N=16"]
    assert [r["aten_ops"] for r in wav_backward] == [7, 7]  # docs/benchmarks.md, session 66
    path = tmp_path / "lines.jsonl"
    path.write_text("\n".join(lines))
    table = subprocess.run([sys.executable, script, "--summarize", str(path)], capture_output=True, text=True,
                           timeout=60, check=True).stdout.splitlines()
    assert table[0].startswith("| case | a us (processes) | a ATen ops | b us (processes) | b ATen ops |")
    assert len(table) == 2 + CASES


def test_the_parts_run_puts_every_stubbed_kernel_back():
    """``--parts`` times the launchers without their launches, then with them again in the
    same process: every kernel it replaced is the same object afterwards."""
    launcher_host = load_benchmark("launcher_host")
    from depthrewrite.kernels import param_grads, route_many_triton, route_triton

    kernels = (route_triton._route_bwd_kernel, route_many_triton._route_many_fwd_kernel, param_grads._finish_kernel)
    replaced = launcher_host._stub_kernel_launches()
    try:
        assert route_triton._route_bwd_kernel is not kernels[0]
        assert set(replaced.values()) >= set(kernels)
    finally:
        launcher_host._restore(replaced)
    assert (route_triton._route_bwd_kernel, route_many_triton._route_many_fwd_kernel,
            param_grads._finish_kernel) == kernels
