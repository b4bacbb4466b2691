"""Peak memory of one compiled training step on the CPU, per backend setting:

    python3 benchmarks/step_memory_cpu.py dar '{"max_sum_terms": null}'
    python3 benchmarks/step_memory_cpu.py attnres '{"accumulate_grads": true}'

The bundled GPT at 8 layers, d=128, 8 x 256 tokens, float32, compiled with the backend
(Inductor's C++ code on the CPU); the step runs once to compile, then once under
``torch.profiler`` with memory profiling, and the peak is the largest sum of the tensors
allocated and not yet freed during that step (what existed before it, parameters
included, is not counted), printed in MiB (= activation units of tokens x d float32 here).
An indication only: Inductor fuses differently for the CPU, and at this size the
backward's long sums are short (docs/benchmarks.md, session 5).
"""

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

import depthrewrite
from depthrewrite import backend
from depthrewrite.models.gpt import gpt_from_preset

SCHEME_OPTIONS = {"dar": {"layers_per_block": 2}}


def step_peak_bytes(step) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    current = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak


def main() -> None:
    scheme, options = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    torch.manual_seed(0)
    model = gpt_from_preset("small", n_layer=8, d_model=128, n_head=4, max_seq_len=256)
    model = depthrewrite.rewrite(model, scheme, **SCHEME_OPTIONS.get(scheme, {})).train()
    compiled = torch.compile(model, backend="depthrewrite", options=options)
    x = torch.randint(0, model.config.vocab_size, (8, 256))

    def step():
        model.zero_grad(set_to_none=True)
        compiled(x, x)[1].backward()

    start = time.time()
    step()
    report = backend.last_report()
    print(f"{scheme} {options}: compiled in {time.time() - start:.0f} s; peak {step_peak_bytes(step) / 2**20:.1f} MiB; "
          f"fences {report.fences}, accumulated {report.accumulated}, saved for the backward "
          f"{report.saved_for_backward}, recompute marked {report.recompute_marked}")


if __name__ == "__main__":
    main()
