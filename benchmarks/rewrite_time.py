"""How long capture + analysis + rewrite take for a 32-layer Llama (d=256) on the CPU.

    python benchmarks/rewrite_time.py [--layers 32] [--d-model 256] [--repeats 5]

Prints the median wall time of each stage over fresh models (goal: the whole under 5 s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(layers: int, d: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                         num_attention_heads=max(1, d // 64), num_key_value_heads=max(1, d // 128))
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scheme", default="block_attnres")
    args = parser.parse_args()
    import depthrewrite
    from depthrewrite.analysis import analyze

    analysis_times, rewrite_times = [], []
    for _ in range(args.repeats):
        model = build(args.layers, args.d_model)
        start = time.perf_counter()
        analyze(model)
        analysis_times.append(time.perf_counter() - start)
        model = build(args.layers, args.d_model)
        start = time.perf_counter()
        depthrewrite.rewrite(model, args.scheme)  # capture + analysis + rewrite + verify
        rewrite_times.append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Llama {args.layers} layers d={args.d_model}")
    print(f"capture + analysis           median {statistics.median(analysis_times):.3f} s")
    print(f"rewrite ({args.scheme}, total) median {statistics.median(rewrite_times):.3f} s   (goal < 5 s)")


if __name__ == "__main__":
    main()
