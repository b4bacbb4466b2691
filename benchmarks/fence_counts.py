"""How many fences the backend's long-sum pass (depthrewrite/sum_fences.py) puts in the
compiled graphs of the bundled GPT ``medium`` (24 layers) per scheme, on the CPU:

    python3 benchmarks/fence_counts.py [dar_block attnres wav block_attnres mhar_block]

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

CONFIGS = {"dar_block": ("dar", {"layers_per_block": 3}), "attnres": ("attnres", {}), "wav": ("wav", {}),
           "mhar": ("mhar", {}), "block_attnres": ("block_attnres", {}), "mhar_block": ("mhar", {"block_size": 6})}


def fences(name: str) -> dict:
    scheme, options = CONFIGS[name]
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("medium", d_model=64, n_head=4, max_seq_len=64), scheme, **options)
    torch._dynamo.reset()
    backend.clear_reports()
    compiled = torch.compile(model, backend="depthrewrite", options={"inner": "aot_eager"})
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    compiled(x, x)[1].backward()
    return backend.last_report().fences


def main() -> None:
    sum_fences.MIN_NUMEL = 0
    for name in sys.argv[1:] or list(CONFIGS):
        print(name, fences(name), flush=True)


if __name__ == "__main__":
    main()
