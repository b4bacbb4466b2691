"""Host time of a training step with each block compiled alone against the whole model
compiled, on the CPU: where the per-block compile's extra host time goes.

The bundled GPT at a tiny width (so that the step is mostly host time), rewritten with a
scheme, compiled with the backend (Inductor) whole or block by block; the median step of
``--steps`` after warm-up, then ``--profile`` steps under cProfile, printing the self time
of Dynamo's frame entry (``compile_wrapper``: guard checks, the compiled code's call and
its side effects' replay) per step and per compiled call. Last, the forward alone with
Dynamo's guard checks on and skipped (``torch.compiler.set_stance(...,
skip_guard_eval_unsafe=True)``, taken in turns): what the guards cost a step; and, compiled
block by block, the size of the bytecode Dynamo runs for a block's call, and each routed
block's guard check timed on its call's own inputs (first, and again at once).

    python benchmarks/per_block_host.py --scheme dar_block --layers 24
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dis
import functools
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmark scripts
from e2e_throughput import CONFIGS  # noqa: E402  (the end-to-end configurations by name)

#: the configurations compared: the plain model and the routed ones
SCHEMES = ("baseline", "block_attnres", "mhar_block", "wav", "dar_block", "attnres", "mhar")


def name_of(scheme: str) -> str | None:
    """The scheme a configuration rewrites with (None: the plain model)."""
    return CONFIGS[scheme][0]


def build(scheme: str, layers: int, per_block: bool, settings: dict | None = None, **config):
    """The tiny bundled GPT (``config`` overrides its fields) rewritten with ``scheme`` and
    compiled whole or block by block: (what to call, the model). ``settings``: Inductor's
    (or the backend's) options for the compilation, the plain model's included."""
    import depthrewrite
    from depthrewrite.backend import depthrewrite_backend
    from depthrewrite.models.gpt import gpt_from_preset

    torch.manual_seed(0)
    model = gpt_from_preset("tiny", n_layer=layers, **config)
    name, options, _ = CONFIGS[scheme]
    if name is not None:
        model = depthrewrite.rewrite(model, name, **options)
    settings = settings or {}
    # the backend takes its options bound; torch.compile passes options only to Inductor
    backend = "inductor" if name is None else functools.partial(depthrewrite_backend, options=settings)
    options = (settings or None) if name is None else None
    if not per_block:
        return torch.compile(model, backend=backend, options=options), model
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend, options=options)
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
    forward = forward_with_and_without_guards(lambda: run(ids, ids), steps)
    if per_block and name_of(scheme) is not None:
        first, again = guard_check_times(model, step, steps)
        forward["guard_checks"] = (f"{min(first):.0f}-{max(first):.0f} us on the call's first check, "
                                   f"{min(again):.0f}-{max(again):.0f} us checked again at once")
    return {"ms_per_step": 1e3 * statistics.median(times), "entry_ms_per_step": 1e3 * self_s / profiled,
            "entry_us_per_call": 1e6 * self_s / calls if calls else 0.0, "calls_per_step": calls / profiled,
            "bytecode": bytecode_sizes(model) if per_block else "", **forward}


def compiled_frame(wrapper) -> tuple:
    """Where ``torch.compile(block)`` enters a block (the block class's ``__call__``), and
    Dynamo's cache entries for it."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    frame = type(wrapper._orig_mod).__call__
    return frame, _debug_get_cache_entry_list(frame.__code__)


def bytecode_sizes(model) -> str:
    """The size of the bytecode Dynamo runs for the first two blocks' calls and the last's
    (the compiled frame: inputs gathered, the graph called, its side effects replayed)."""
    sizes = []
    for i in sorted({0, 1, len(model.blocks) - 1}):
        sizes += [f"block {i}: {len(list(dis.get_instructions(entry.code)))}"
                  for entry in compiled_frame(model.blocks[i])[1]]
    return ", ".join(sizes)


def guard_check_times(model, step, steps: int) -> tuple[list[float], list[float]]:
    """Each block's guard check timed on the call's own inputs just before the call (us):
    the median over ``steps`` training steps of the first check, then of the same check
    again at once, one of each per block."""
    first, again = collections.defaultdict(list), collections.defaultdict(list)

    def check(wrapper, args, kwargs):
        frame, (entry,) = compiled_frame(wrapper)
        f_locals = {"self": wrapper._orig_mod, "args": args, "kwargs": kwargs}
        f_locals.update((name, cell.cell_contents)  # the frame's free variables (super()'s __class__)
                        for name, cell in zip(frame.__code__.co_freevars, frame.__closure__ or ()))
        for times in (first, again):
            start = time.perf_counter()
            if not entry.guard_manager.check(f_locals):
                raise RuntimeError(f"block {wrapper}'s guards fail on its own call")
            times[id(wrapper)].append(time.perf_counter() - start)

    hooks = [block.register_forward_pre_hook(check, with_kwargs=True) for block in model.blocks]
    try:
        for _ in range(steps):
            step()
    finally:
        for hook in hooks:
            hook.remove()
    return ([1e6 * statistics.median(t) for t in first.values()],
            [1e6 * statistics.median(t) for t in again.values()])


def forward_with_and_without_guards(forward, steps: int, rounds: int = 3) -> dict:
    """Median forward time (ms) with Dynamo's guards checked and skipped, in turns."""
    times = {False: [], True: []}
    try:
        for _ in range(rounds):
            for skip in (False, True):
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip)
                for _ in range(steps):
                    start = time.perf_counter()
                    forward()
                    times[skip].append(time.perf_counter() - start)
    finally:
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)
    return {"forward_ms": 1e3 * statistics.median(times[False]),
            "forward_ms_no_guards": 1e3 * statistics.median(times[True])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="dar_block", choices=SCHEMES[1:])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=5, help="steps under cProfile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | compiled | ms/step | Dynamo entry self ms/step | us a compiled call | compiled calls/step "
          "| forward ms | forward ms, guards skipped |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    notes = []
    for scheme in ("baseline", args.scheme):
        for per_block in (False, True):
            torch._dynamo.reset()
            row = measure(scheme, args.layers, per_block, args.steps, args.profile)
            if row["bytecode"]:
                notes.append(f"{scheme}, each block: bytecode instructions of the compiled call, {row['bytecode']}")
            if "guard_checks" in row:
                notes.append(f"{scheme}, each block: a block's guard check (median by block), {row['guard_checks']}")
            print(f"| {scheme} | {'each block' if per_block else 'whole'} | {row['ms_per_step']:.1f} | "
                  f"{row['entry_ms_per_step']:.2f} | {row['entry_us_per_call']:.0f} | {row['calls_per_step']:.0f} | "
                  f"{row['forward_ms']:.2f} | {row['forward_ms_no_guards']:.2f} |")
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
