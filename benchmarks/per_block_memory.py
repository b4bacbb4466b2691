"""Memory of a training step with each block compiled alone against the whole model
compiled, on the CPU: what the per-block compile keeps for the backward.

The bundled GPT at a small width, rewritten with a scheme, compiled with the backend
(Inductor) whole or block by block. For one step after warm-up: the peak of the CPU
allocator's bytes above the step's start and the bytes held when the backward starts (from
the profiler's memory events), and the tensors autograd saves for the backward (through
saved-tensor hooks, each storage once): all of them, and those of the stream's shape
``(batch, tokens, d)``, and of those, compiled block by block, how many the block saving
them received (its arguments and the depth state it reads).

    python benchmarks/per_block_memory.py --scheme dar_block --layers 12
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmark scripts
from per_block_host import SCHEMES, build  # noqa: E402

BACKWARD_MARK = "per_block_memory: backward"


def measure(scheme: str, layers: int, per_block: bool, d_model: int, batch: int, tokens: int) -> dict:
    run, model = build(scheme, layers, per_block, d_model=d_model)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # compile, then warm
        _, loss = run(ids, ids)
        loss.backward()
    saved = {}  # storage -> (bytes, whether it has the stream's shape, whether the block received it)
    block_inputs: set[int] = set()  # the storages the block running now received (per-block only)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        saved.setdefault(key, (storage.nbytes(), tuple(t.shape) == (batch, tokens, d_model), key in block_inputs))
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), watching_inputs(model, block_inputs):
            _, loss = run(ids, ids)
        with record_function(BACKWARD_MARK):
            pass
        loss.backward()
    events = prof.profiler.kineto_results.events()
    backward_start = next(e.start_ns() for e in events if e.name() == BACKWARD_MARK)
    held = peak = 0
    at_backward = None
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if at_backward is None and event.start_ns() >= backward_start:
            at_backward = held
        held += event.nbytes()
        peak = max(peak, held)
    mib = 2.0 ** -20
    return {"peak_mib": peak * mib, "at_backward_mib": (at_backward or 0) * mib,
            "saved_mib": sum(n for n, _, _ in saved.values()) * mib,
            "saved_stream_shaped": sum(1 for _, shaped, _ in saved.values() if shaped),
            "saved_stream_shaped_inputs": sum(1 for _, shaped, received in saved.values() if shaped and received)}


@contextlib.contextmanager
def watching_inputs(model, storages: set[int]):
    """While a compiled block runs, ``storages`` holds those of its arguments and of the
    depth state it reads (a routed block reads it from the runtime, not its arguments)."""

    def enter(block, args):
        routed = getattr(block, "_orig_mod", block)
        state = getattr(getattr(routed, "_depth_runtime", None), "state", None)
        storages.clear()
        storages.update(t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, state))
                        if isinstance(t, torch.Tensor))

    hooks = [h for block in model.blocks if hasattr(block, "_orig_mod")
             for h in (block.register_forward_pre_hook(enter), block.register_forward_hook(lambda *_: storages.clear()))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="dar_block", choices=SCHEMES[1:])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | compiled | peak MiB above the step's start | held MiB when the backward starts "
          "| saved for the backward, MiB | of them (batch, tokens, d) tensors | of those, a block graph's inputs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for scheme in ("baseline", args.scheme):
        for per_block in (False, True):
            torch._dynamo.reset()
            row = measure(scheme, args.layers, per_block, args.d_model, args.batch, args.tokens)
            print(f"| {scheme} | {'each block' if per_block else 'whole'} | {row['peak_mib']:.1f} | "
                  f"{row['at_backward_mib']:.1f} | {row['saved_mib']:.1f} | {row['saved_stream_shaped']} | "
                  f"{row['saved_stream_shaped_inputs'] if per_block else '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
