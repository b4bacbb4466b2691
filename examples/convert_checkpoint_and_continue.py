"""Convert a trained Hugging Face checkpoint to a depth-routing scheme without changing what it computes,
keep training it, save it, and load it back.

    python examples/convert_checkpoint_and_continue.py                       # makes its own small checkpoint
    python examples/convert_checkpoint_and_continue.py --checkpoint path/to/model --scheme attnres --steps 50

``preserve_identity=True`` (docs/spec.md section 7) keeps the residual stream and adds the routed read
through a gate that starts at 0, so the converted model's first loss is exactly the original's
and training moves it away from there. Without ``--checkpoint`` the script first trains a tiny
random Llama for a few steps and saves it with ``save_pretrained`` under ``--out``: the stand-in
for "your trained model". Text is fed as bytes, so the model's vocabulary must have at least 256 ids.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import depthrewrite
from depthrewrite.train.data import batch_at

TEXT = (
    "Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in "
    "confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an "
    "intrigue with a French girl, who had been a governess in their family.\n\n"
) * 30


def tokens() -> torch.Tensor:
    return torch.tensor(list(TEXT.encode()), dtype=torch.uint8)


def batch(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch_at(tokens(), seed=args.seed, step=step, batch_size=args.batch_size, seq_len=args.seq_len)


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def train_steps(model, args, first_step: int, steps: int, label: str) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    for step in range(first_step, first_step + steps):
        loss = lm_loss(model, *batch(args, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"{label} step {step - first_step + 1:3d}  loss {loss.item():.6f}")
    return losses


def make_checkpoint(args, path: pathlib.Path) -> pathlib.Path:
    """A small 'trained' model: a random Llama trained for --pretrain-steps and saved."""
    config = LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    train_steps(model, args, first_step=10_000, steps=args.pretrain_steps, label="pretrain")
    model.save_pretrained(path)
    print(f"saved the stand-in trained checkpoint to {path}")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a local HF checkpoint (default: make one under --out)")
    parser.add_argument("--scheme", default="block_attnres",
                        choices=sorted(s for s, cls in depthrewrite.SCHEMES.items() if cls.delta_applies))
    parser.add_argument("--out", default="runs/convert_example", help="where the checkpoints are written")
    parser.add_argument("--steps", type=int, default=30, help="training steps after the conversion")
    parser.add_argument("--pretrain-steps", type=int, default=30, help="steps of the stand-in checkpoint")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a few-second run: 2 layers, 3 + 3 steps, batch 2 x 16")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.steps, args.pretrain_steps, args.batch_size, args.seq_len = 2, 32, 3, 3, 2, 16

    out = pathlib.Path(args.out)
    checkpoint = args.checkpoint or make_checkpoint(args, out / "original")

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).train()
    x, y = batch(args, 0)  # the fixed batch: also the first training batch after the conversion
    with torch.no_grad():
        original = lm_loss(model, x, y).item()

    depthrewrite.rewrite(model, args.scheme, preserve_identity=True)
    losses = train_steps(model, args, first_step=0, steps=args.steps, label=args.scheme)
    print(f"original loss on the fixed batch: {original!r}")
    print(f"first loss after conversion:      {losses[0]!r}")
    print(f"first loss equals the original exactly: {losses[0] == original}")

    converted = out / "converted"
    model.save_pretrained(converted)
    reloaded = depthrewrite.from_pretrained(converted)
    model.eval(), reloaded.eval()
    with torch.no_grad():
        same = torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)
    print(f"saved to {converted}; reloaded with depthrewrite.from_pretrained, logits bit-identical: {same}")
    if losses[0] != original or not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
