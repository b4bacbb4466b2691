"""A training step's host time with Inductor's wrapper in Python and in C++ (``cpp_wrapper``),
on the CPU: what the C++ wrapper saves the plain model and the routed ones.

The bundled GPT at a tiny width and one sequence of 16 tokens, so that the step is mostly
host time, rewritten with a scheme (the end-to-end configurations' options) and compiled
with the backend (the plain model with Inductor), once with each wrapper. Each pair is timed
side by side: ``--repeats`` rounds of ``--steps`` training steps, the two taken in turns,
the median of each. The first step, which compiles, is timed on its own (each compilation
with a new, empty Inductor cache folder, so that neither finds the other's code), and its
losses are compared too (the same weights and tokens).

    python benchmarks/cpp_wrapper_host.py --layers 6 --schemes baseline block_attnres dar_block wav
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmark scripts
from per_block_host import SCHEMES, build  # noqa: E402  (the tiny GPT as an end-to-end configuration)


@contextlib.contextmanager
def _empty_inductor_cache():
    """Inductor's cache folder a new, empty one (Inductor reads the variable at each use)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cpp_wrapper_host_")
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def measure(scheme: str, layers: int, steps: int, repeats: int) -> dict:
    """ms per step with each wrapper (median of ``repeats`` rounds, taken in turns) and the
    two compilations' first-step losses."""
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    runs, first_loss, compile_s = {}, {}, {}
    # once, not before each compilation: a reset drops the compiled code of the first, whose
    # first timed round would then compile again (the first round of session 58's runs did)
    torch._dynamo.reset()
    for cpp in (False, True):
        run, model = build(scheme, layers, per_block=False, settings={"cpp_wrapper": cpp})

        def step(run=run, model=model):
            model.zero_grad(set_to_none=True)
            _, loss = run(ids, ids)
            loss.backward()
            return loss.detach()

        with _empty_inductor_cache():
            start = time.perf_counter()
            first_loss[cpp] = step().item()  # compiles
            compile_s[cpp] = time.perf_counter() - start
        for _ in range(2):
            step()
        runs[cpp] = step
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats):
        for cpp in ((False, True) if r % 2 == 0 else (True, False)):
            start = time.perf_counter()
            for _ in range(steps):
                runs[cpp]()
            times[cpp].append((time.perf_counter() - start) / steps * 1e3)
    return {"python_ms": statistics.median(times[False]), "cpp_ms": statistics.median(times[True]),
            "loss_difference": abs(first_loss[True] - first_loss[False]),
            "python_first_s": compile_s[False], "cpp_first_s": compile_s[True]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["baseline", "block_attnres", "dar_block", "wav"],
                    choices=SCHEMES)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"tiny GPT, {args.layers} layers, 1 x 16 tokens, CPU, torch {torch.__version__}; ms a training step, "
          f"median of {args.repeats} x {args.steps} steps, the two wrappers in turns")
    print("| model | Python wrapper ms | C++ wrapper ms | C++ / Python | first losses differ by "
          "| first step s, Python / C++ |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for scheme in args.schemes:
        row = measure(scheme, args.layers, args.steps, args.repeats)
        print(f"| {scheme} | {row['python_ms']:.2f} | {row['cpp_ms']:.2f} | {row['cpp_ms'] / row['python_ms']:.3f} | "
              f"{row['loss_difference']:.1e} | {row['python_first_s']:.1f} / {row['cpp_first_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
