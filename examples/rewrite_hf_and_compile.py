"""Rewrite a Hugging Face causal LM, compile it with the ``depthrewrite`` backend, train a few steps.

    python examples/rewrite_hf_and_compile.py                         # small random Llama, block_attnres
    python examples/rewrite_hf_and_compile.py --model path/to/model --scheme mhar --data notes.txt

Without ``--model`` the script builds a small Llama from a config (random weights, byte-level
vocabulary of 256, nothing downloaded). ``--model`` takes a local directory or a hub id that
is already in your cache; its tokenizer is not used: the text is fed as bytes, so the ids
must fit the model's vocabulary (any vocabulary of at least 256 does).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import depthrewrite
import depthrewrite.backend
from depthrewrite.train.data import DataConfig, batch_at, load_splits

BUILTIN_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity.\n\n"
) * 40


def build_model(args) -> torch.nn.Module:
    if args.model is not None:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config)


def load_tokens(args) -> torch.Tensor:
    """Byte tokens of the training text: 'builtin' (a short string), 'stdlib' or a file/folder."""
    if args.data == "builtin":
        return torch.tensor(list(BUILTIN_TEXT.encode()), dtype=torch.uint8)
    return load_splits(DataConfig(source=args.data, max_bytes=args.max_bytes), seed=args.seed).train


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local path or cached hub id (default: a small random Llama)")
    parser.add_argument("--scheme", default="block_attnres", choices=sorted(depthrewrite.SCHEMES))
    parser.add_argument("--data", default="builtin", help="'builtin', 'stdlib' (the Python stdlib sources) or a text file")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="cap on the text read for 'stdlib' or a file")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="layers of the built-in Llama")
    parser.add_argument("--width", type=int, default=64, help="hidden size of the built-in Llama")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"],
                        help="compiler behind the depthrewrite backend (aot_eager: no code generation, fast to start)")
    parser.add_argument("--no-compile", action="store_true", help="train the rewritten model eagerly")
    parser.add_argument("--tiny", action="store_true",
                        help="a few-second run: 2 layers, 3 steps, batch 2 x 16, backend inner aot_eager")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.steps, args.batch_size, args.seq_len = 2, 32, 3, 2, 16
        args.inner = "aot_eager"

    model = build_model(args)
    print(depthrewrite.inspect(model))
    depthrewrite.rewrite(model, scheme=args.scheme)  # in place; routing parameters are ordinary parameters
    new = sum(p.numel() for n, p in model.named_parameters() if ".depth_route." in n)
    print(f"rewrote with {args.scheme}: {new} routing parameters")

    tokens = load_tokens(args)
    model.train()
    # fullgraph: the whole forward is one graph, so the backend's report covers every routing op
    runner = model if args.no_compile else torch.compile(model, backend="depthrewrite", fullgraph=True,
                                                         options={"inner": args.inner})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if not args.no_compile:
        print(f"compiling with the depthrewrite backend (inner={args.inner}): the first step includes it")
    for step in range(args.steps):
        x, y = batch_at(tokens, seed=args.seed, step=step, batch_size=args.batch_size, seq_len=args.seq_len)
        t0 = time.perf_counter()
        # no KV cache in training: a training step has no use for one
        logits = runner(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step + 1:4d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.2f} s)")

    if not args.no_compile:
        report = depthrewrite.backend.last_report()
        print(f"backend report: {report}")
        print(f"routing ops in the compiled graph: {report.num_routing_ops}")


if __name__ == "__main__":
    main()
