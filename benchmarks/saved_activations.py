"""What a compiled training step keeps for the backward, per scheme, on the CPU.

    python3 benchmarks/saved_activations.py [--schemes baseline,block_attnres,...] [--layers 12] [--top 6]

Builds the bundled GPT small (d=128, bf16, batch 2 x 64 tokens), rewrites it with each
configuration, compiles it with Inductor (``compile_fx`` with its default min-cut
partitioner, the same partition a GPU run gets, up to device-specific kernels) and lists
the backward graph's inputs that are not tangents: the tensors the forward saves for the
backward (parameters excluded). Sizes are given in units of one ``tokens x d`` bf16
activation, so that they scale to a larger model (at 350M, 24 layers: twice the units of
this 12-layer model; one unit = 32 MiB). This is the saved set, not the peak: the backward's
own temporaries come on top (docs/benchmarks.md compares with GPU peaks).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import torch
import torch._functorch.config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import depthrewrite  # noqa: E402
from depthrewrite.models.gpt import GPT, GPTConfig  # noqa: E402
from depthrewrite.recompute import mark_recomputable  # noqa: E402

#: name -> (scheme or None for the baseline, options[, True: the backend's
#: recompute_partial_sums, the tagged partial sums marked for recomputation]): the e2e
#: benchmark's block forms
CONFIGS = {
    "baseline": (None, {}),
    "block_attnres": ("block_attnres", {}),
    "block_attnres_keep": ("block_attnres", {"recompute": False}),
    "block_attnres_1p": ("block_attnres", {"two_phase": False}),
    "mhar_block": ("mhar", {"block_size": 6}),
    "wav": ("wav", {"block_size": 6}),
    "dar_block": ("dar", {"layers_per_block": 3}),
    "wav_recompute": ("wav", {"block_size": 6}, True),
    "dar_block_recompute": ("dar", {"layers_per_block": 3}, True),
}


def saved_tensors(cfg: tuple, d: int, layers: int, heads: int, batch: int, seq: int) -> list[dict]:
    """The saved tensors of one compiled training step: size and producing source line."""
    graphs = {}

    def inner(gm, example_inputs, *args, **kwargs):
        graphs["backward" if kwargs.get("is_backward") else "forward"] = gm
        return compile_fx_inner(gm, example_inputs, *args, **kwargs)

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def backend(gm, example_inputs):
        if recompute:
            mark_recomputable(gm.graph)
        return compile_fx(gm, example_inputs, inner_compile=inner)

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(GPTConfig(d_model=d, n_layer=layers, n_head=heads, max_seq_len=seq))
    scheme, options, recompute = (*cfg, False)[:3]
    if scheme is not None:
        model = depthrewrite.rewrite(model, scheme, **options)
    model = model.to(torch.bfloat16).train()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, 256, (batch, seq))
    # no cache: a cache hit would skip the partition this reads
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, loss = compiled(ids, ids)
        loss.backward()
    producers = {n.name: n for n in graphs["forward"].graph.nodes}
    rows = []
    for node in graphs["backward"].graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        value = node.meta.get("val")
        source = producers.get(node.name)
        if not isinstance(value, torch.Tensor) or source is None or source.op == "placeholder":
            continue  # parameters and inputs are kept anyway
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', source.meta.get("stack_trace") or "")
        where = (f"{os.path.basename(frames[-1][0])}:{frames[-1][1]} {frames[-1][2]}" if frames
                 else str(source.target))
        rows.append(dict(bytes=value.numel() * value.element_size(), where=where))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemes", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--top", type=int, default=6, help="source lines listed per scheme")
    ap.add_argument("--functorch", default="{}", metavar="JSON",
                    help='AOTAutograd partitioner settings for every configuration, e.g. '
                         '\'{"ban_recompute_materialized_backward": false}\' (torch._functorch.config)')
    args = ap.parse_args()
    patches = json.loads(args.functorch)
    d, heads, batch, seq = 128, 4, 2, 64
    unit = batch * seq * d * 2
    base = None
    print(f"saved for the backward, units of one {batch * seq} x {d} bf16 activation ({unit} bytes); "
          f"{args.layers} layers")
    for name in args.schemes.split(","):
        with torch._functorch.config.patch(**patches):
            rows = saved_tensors(CONFIGS[name], d, args.layers, heads, batch, seq)
        total = sum(r["bytes"] for r in rows) / unit
        base = total if name == "baseline" else base
        extra = "" if base is None or name == "baseline" else f" (extra {total - base:+.1f})"
        print(f"{name}: {total:.1f} units in {len(rows)} tensors{extra}")
        by_line = collections.Counter()
        for r in rows:
            by_line[r["where"]] += r["bytes"] / unit
        for where, units in by_line.most_common(args.top):
            print(f"    {units:6.1f}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
