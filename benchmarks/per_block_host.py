"""Host time of a training step with each block compiled alone against the whole model
compiled, on the CPU: where the per-block compile's extra host time goes.

The bundled GPT at a tiny width (so that the step is mostly host time), rewritten with a
scheme, compiled with the backend (Inductor) whole or block by block; the median step of
``--steps`` after warm-up, then ``--profile`` steps under cProfile, printing the self time
of Dynamo's frame entry (``compile_wrapper``: guard checks, the compiled code's call and
its side effects' replay) per step and per compiled call.

    python benchmarks/per_block_host.py --scheme dar_block --layers 24
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time

import torch
from e2e_throughput import CONFIGS  # the end-to-end configurations: scheme and options by name

#: the configurations compared: the plain model and the routed ones
SCHEMES = ("baseline", "block_attnres", "mhar_block", "wav", "dar_block", "attnres", "mhar")


def build(scheme: str, layers: int, per_block: bool):
    import depthrewrite
    from depthrewrite.backend import depthrewrite_backend
    from depthrewrite.models.gpt import gpt_from_preset

    torch.manual_seed(0)
    model = gpt_from_preset("tiny", n_layer=layers)
    name, options, _ = CONFIGS[scheme]
    if name is not None:
        model = depthrewrite.rewrite(model, name, **options)
    backend = "inductor" if name is None else functools.partial(depthrewrite_backend, options={})
    if not per_block:
        return torch.compile(model, backend=backend), model
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend)
    return model, model


def measure(scheme: str, layers: int, per_block: bool, steps: int, profiled: int) -> dict:
    run, model = build(scheme, layers, per_block)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))

    def step():
        _, loss = run(ids, ids)
        loss.backward()

    for _ in range(3):  # compile, then warm
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    profile = cProfile.Profile()
    profile.runcall(lambda: [step() for _ in range(profiled)])
    entry = [(calls, self_s) for (path, _, fn), (_, calls, self_s, _, _) in pstats.Stats(profile).stats.items()
             if fn == "compile_wrapper" and path.endswith("eval_frame.py")]
    calls, self_s = (sum(c for c, _ in entry), sum(s for _, s in entry)) if entry else (0, 0.0)
    return {"ms_per_step": 1e3 * statistics.median(times), "entry_ms_per_step": 1e3 * self_s / profiled,
            "entry_us_per_call": 1e6 * self_s / calls if calls else 0.0, "calls_per_step": calls / profiled}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="dar_block", choices=SCHEMES[1:])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=5, help="steps under cProfile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | compiled | ms/step | Dynamo entry self ms/step | us a compiled call | compiled calls/step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for scheme in ("baseline", args.scheme):
        for per_block in (False, True):
            torch._dynamo.reset()
            row = measure(scheme, args.layers, per_block, args.steps, args.profile)
            print(f"| {scheme} | {'each block' if per_block else 'whole'} | {row['ms_per_step']:.1f} | "
                  f"{row['entry_ms_per_step']:.2f} | {row['entry_us_per_call']:.0f} | {row['calls_per_step']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
