"""How many fences the backend's long-sum pass (depthrewrite/sum_fences.py) puts in the
compiled graphs of the bundled GPT ``medium`` (24 layers) per scheme, on the CPU:

    python3 benchmarks/fence_counts.py [--accumulate] [dar_block attnres wav block_attnres mhar_block]

``--accumulate``: with the backend option ``accumulate_grads`` (gradient terms moved into
``route_backward``; the fences then bound what is left), and how many terms it moved.

The graph structure does not depend on the width or the batch, so the model is built at
d=64 with 8 tokens and the pass's size threshold set to 0 (at the real size every
activation-sized sum is above it); AOTAutograd without code generation
(``inner="aot_eager"``) applies the same pass.
"""

import sys

import torch

import depthrewrite
from depthrewrite import backend, sum_fences
from depthrewrite.models.gpt import gpt_from_preset
from e2e_throughput import CONFIGS  # the schemes and options of the GPU runs

DEFAULT = ("dar_block", "attnres", "mhar", "wav", "block_attnres", "mhar_block")


def fences(name: str, accumulate: bool = False) -> tuple[dict, dict]:
    scheme, options, _ = CONFIGS[name]
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("medium", d_model=64, n_head=4, max_seq_len=64), scheme, **options)
    torch._dynamo.reset()
    backend.clear_reports()
    compiled = torch.compile(model, backend="depthrewrite", options={"inner": "aot_eager",
                                                                     "accumulate_grads": accumulate})
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    compiled(x, x)[1].backward()
    report = backend.last_report()
    return report.fences, report.accumulated


def main() -> None:
    sum_fences.MIN_NUMEL = 0
    accumulate = "--accumulate" in sys.argv[1:]
    for name in [a for a in sys.argv[1:] if a != "--accumulate"] or DEFAULT:
        fenced, accumulated = fences(name, accumulate)
        print(name, "fences", fenced, "accumulated", accumulated, flush=True)


if __name__ == "__main__":
    main()
