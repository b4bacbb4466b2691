"""One training run for the FSDP2 scaling study; rank 0 writes its losses and speed as JSON.

    python benchmarks/scaling_run.py --scheme block_attnres --json out.json            # one GPU
    torchrun --nproc-per-node 2 benchmarks/scaling_run.py --distributed fsdp2 ...      # two GPUs

Defaults are the scaling issue's setting: the bundled GPT 'medium' (d=1024, 24 layers),
sequence 2048, bf16 autocast, compiled with the ``depthrewrite`` backend (``--backend``),
global batch 8 sequences split across ranks, 50 steps. ``benchmarks/scaling_report.py``
compares the runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time


def parse_option(text: str):
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def _register_backend_from_source() -> None:
    """The backend is found through the package's entry point once installed; a source
    checkout that is not installed registers it here."""
    import torch._dynamo

    if "depthrewrite" not in torch._dynamo.list_backends(exclude_tags=()):
        from depthrewrite.backend import depthrewrite_backend

        torch._dynamo.register_backend(depthrewrite_backend, "depthrewrite")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:medium")
    parser.add_argument("--scheme", default="block_attnres")
    parser.add_argument("--option", action="append", default=[], help="scheme option KEY=VALUE")
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--backend", default="depthrewrite")
    parser.add_argument("--compile", choices=("on", "off"), default="on")
    parser.add_argument("--distributed", default="none")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    import torch

    _register_backend_from_source()
    from depthrewrite.train.data import DataConfig
    from depthrewrite.train.loop import TrainConfig, train

    config = TrainConfig(
        model=args.model, scheme=args.scheme, options=dict(parse_option(o) for o in args.option),
        data=DataConfig(source=args.data), steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=3e-4, warmup_steps=10, precision="bf16", compile=args.compile == "on",
        backend=args.backend if args.compile == "on" else "inductor", seed=0, device=args.device, eval_every=0, eval_batches=1,
        distributed=args.distributed, progress=False,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = train(config)
    if result.rank != 0:
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    record = dict(model=args.model, scheme=args.scheme, options=config.options, distributed=args.distributed,
                  world_size=world, backend=args.backend if config.compile else "eager", steps=args.steps,
                  global_batch=args.batch_size, seq_len=args.seq_len, losses=result.losses,
                  tokens_per_s=result.tokens_per_s, tokens_per_s_per_gpu=result.tokens_per_s / world,
                  peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                  params=result.params, new_params=result.new_params, seconds=time.perf_counter() - start,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    pathlib.Path(args.json).write_text(json.dumps(record))
    print(f"{args.scheme} world={world}: {result.tokens_per_s:,.0f} tokens/s, "
          f"final loss {result.losses[-1]:.4f}, {record['seconds']:.0f} s")


if __name__ == "__main__":
    main()
