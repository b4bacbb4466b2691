"""Train the bundled MoE transformer rewritten with Dual Attention Residuals (block form).

    python examples/train_moe_with_dar.py                        # moe:tiny, dar with 2 layers per block
    python examples/train_moe_with_dar.py --preset small --layers-per-block 4 --steps 300 --data notes.txt

A plain training loop, so that each step can show the cross-entropy and the MoE
load-balancing loss apart: ``MoEGPT.forward(ids, targets)`` returns their weighted sum
(``aux_loss_coef``), and ``model.aux_loss()`` the sum of the layers' load-balancing losses of
the last forward (1 per layer for perfectly uniform routing, ``n_experts`` per layer for a
collapse onto one expert). The same run through the library's trainer:
``depthrewrite train --model moe:tiny --scheme dar --option layers_per_block=2``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import depthrewrite
from depthrewrite.models import moe_from_preset
from depthrewrite.train.data import DataConfig, batch_at, load_splits


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the model's own matrices only: DAR's routing queries and key-norm
    weights are ``(2, d)`` matrices too, so a rule by shape alone would decay them."""
    routing = {id(p) for p in depthrewrite.routing_parameters(model)}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in routing]
    rest = [p for p in model.parameters() if p.dim() < 2 or id(p) in routing]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="a bundled MoE preset (tiny, small, medium)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--layers-per-block", type=int, default=2, help="DAR's K (1: full DAR)")
    parser.add_argument("--variant", default="dar", help="DAR variant: dar, selfkv, crossv, fixedkv")
    parser.add_argument("--data", default="stdlib", help="'stdlib' (the Python stdlib sources) or a text file/folder")
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1, help="on the model's own matrices only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a few-second run: 2 layers, 4 steps, batch 2 x 32")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.steps, args.batch_size, args.seq_len, args.max_bytes, args.log_every = 2, 4, 2, 32, 200_000, 1

    torch.manual_seed(args.seed)
    overrides = {} if args.layers is None else {"n_layer": args.layers}
    model = moe_from_preset(args.preset, **overrides)
    depthrewrite.rewrite(model, "dar", layers_per_block=args.layers_per_block, variant=args.variant)
    cfg = model.config
    print(f"moe:{args.preset} with {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_experts} experts (top {cfg.top_k}); "
          f"rewritten with dar (variant {args.variant}, layers_per_block {args.layers_per_block})")
    print(f"routing parameters: {sum(p.numel() for p in depthrewrite.routing_parameters(model))}")

    splits = load_splits(DataConfig(source=args.data, max_bytes=args.max_bytes), seed=args.seed)
    tokens = splits.train
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.lr)
    model.train()
    for step in range(args.steps):
        x, y = batch_at(tokens, seed=args.seed, step=step, batch_size=args.batch_size, seq_len=args.seq_len)
        logits, loss = model(x, y)
        balance = model.aux_loss().detach()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step == 0:
            ce = F.cross_entropy(logits.detach().flatten(0, 1), y.flatten())
            print(f"step {step + 1:4d}  loss {loss.item():.6f}  cross-entropy {ce.item():.6f}  "
                  f"load-balancing {balance.item():.6f} ({balance.item() / cfg.n_layer:.4f} per layer)")
    # what each site learned to read: DAR's value entries weighed by the gate times each
    # stream's softmax, averaged over the tokens of a held-out batch
    x, _ = batch_at(splits.val, seed=args.seed, step=0, batch_size=args.batch_size, seq_len=args.seq_len)
    print("depth-routing weights (rows: sites, F: the final readout):")
    print(depthrewrite.record_routing_weights(model, x).table())


if __name__ == "__main__":
    main()
