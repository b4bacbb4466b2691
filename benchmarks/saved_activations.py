"""What a compiled training step keeps for the backward, per scheme, on the CPU.

    python3 benchmarks/saved_activations.py [--schemes baseline,block_attnres,...] [--layers 12] [--top 6]
                                            [--width 128] [--functorch JSON] [--liveness]

Builds the bundled GPT small (d=128, bf16, batch 2 x 64 tokens), rewrites it with each
configuration, compiles it with Inductor (``compile_fx`` with its default min-cut
partitioner, the same partition a GPU run gets, up to device-specific kernels) and lists
the backward graph's inputs that are not tangents: the tensors the forward saves for the
backward (parameters excluded). Sizes are given in units of one ``tokens x d`` bf16
activation, so that they scale to a larger model (at 350M, 24 layers: twice the units of
this 12-layer model; one unit = 32 MiB). This is the saved set, not the peak: the backward's
own temporaries come on top (docs/benchmarks.md compares with GPU peaks). ``--liveness``
adds an estimate of the backward's peak from its graph (each tensor freed after its last
use) and what is live there, by kind (saved, made by the backward, tangents) and line.
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
from depthrewrite.norm_fusion import fuse_output_norms  # noqa: E402
from depthrewrite.recompute import mark_recomputable  # noqa: E402

#: name -> (scheme or None for the baseline, options[, True: the backend's
#: recompute_partial_sums, the tagged partial sums marked for recomputation; "branch": that
#: and recompute_branch_outputs; "narrow": that option set to "narrow"]): the e2e
#: benchmark's block forms. With the scheme option fused_merge the second phase goes
#: through route_merge, the branch norms fused into it as the backend's fuse_output_norms does
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
    "wav_branch": ("wav", {"block_size": 6}, "branch"),
    "dar_block_branch": ("dar", {"layers_per_block": 3}, "branch"),
    "block_attnres_recompute": ("block_attnres", {}, True),
    "mhar_block_recompute": ("mhar", {"block_size": 6}, True),
    "block_attnres_recompute_fm": ("block_attnres", {"fused_merge": True}, True),
    "mhar_block_recompute_fm": ("mhar", {"block_size": 6, "fused_merge": True}, True),
    "dar_block_recompute_fm": ("dar", {"layers_per_block": 3, "fused_merge": True}, True),
    "dar_block_branch_fm": ("dar", {"layers_per_block": 3, "fused_merge": True}, "branch"),
    # "narrow": recompute_branch_outputs="narrow", only the attention projections' outputs
    "wav_narrow": ("wav", {"block_size": 6}, "narrow"),
    "dar_block_narrow": ("dar", {"layers_per_block": 3}, "narrow"),
    "dar_block_narrow_fm": ("dar", {"layers_per_block": 3, "fused_merge": True}, "narrow"),
}


def _tensor_bytes(node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _where(node) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")
    return f"{os.path.basename(frames[-1][0])}:{frames[-1][1]} {frames[-1][2]}" if frames else str(node.target)


def backward_peak(graph, producers: dict) -> tuple[int, list[dict]]:
    """The backward graph's peak if each tensor were freed after its last use, before
    Inductor (which fuses elementwise chains: fewer intermediates than counted here):
    (bytes, the tensors live at the peak with their kind and source line). Views share
    their base's storage, which lives until the last use of any of them; the gradients the
    graph returns (parameters', the same with and without a scheme but for the routing
    parameters) are left out."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    returned = set(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
    base = {}
    for node in nodes:  # a view's storage is its base's
        is_view = getattr(node.target, "is_view", False) and node.all_input_nodes
        base[node] = base.get(node.all_input_nodes[0], node.all_input_nodes[0]) if is_view else node
    last_use = {}
    for i, node in enumerate(nodes):
        for inp in node.all_input_nodes:
            last_use[base.get(inp, inp)] = i
    def kept_anyway(node) -> bool:  # a parameter or an input of the step
        source = producers.get(node.name)
        return node.op == "placeholder" and not node.name.startswith("tangents") and (
            source is None or source.op == "placeholder")

    live, peak, at_peak = {}, 0, {}
    for i, node in enumerate(nodes):
        if base[node] is node and node not in returned and node in last_use and not kept_anyway(node):
            live[node] = _tensor_bytes(node)
        current = sum(live.values())
        if current > peak:
            peak, at_peak = current, dict(live)
        for inp in node.all_input_nodes:
            if last_use.get(base.get(inp, inp)) == i:
                live.pop(base.get(inp, inp), None)
    rows = []
    for node, size in at_peak.items():
        saved = node.op == "placeholder"
        kind = ("tangent" if node.name.startswith("tangents") else "saved") if saved else "backward"
        rows.append(dict(bytes=size, kind=kind, where=node.name if kind == "tangent" else
                         _where(producers[node.name] if saved else node)))
    return peak, rows


def saved_tensors(cfg: tuple, d: int, layers: int, heads: int, batch: int, seq: int,
                  liveness: bool = False) -> list[dict] | tuple[list[dict], int, list[dict]]:
    """The saved tensors of one compiled training step: size and producing source line
    (with ``liveness``, also :func:`backward_peak` of its backward graph)."""
    graphs = {}

    def inner(gm, example_inputs, *args, **kwargs):
        graphs["backward" if kwargs.get("is_backward") else "forward"] = gm
        return compile_fx_inner(gm, example_inputs, *args, **kwargs)

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def backend(gm, example_inputs):
        if fused_merge and fuse_output_norms(gm.graph):  # as the depthrewrite backend does by default
            gm.recompile()
        if recompute:
            mark_recomputable(gm.graph, branch_outputs={"branch": True, "narrow": "narrow"}.get(recompute, False))
        return compile_fx(gm, example_inputs, inner_compile=inner)

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(GPTConfig(d_model=d, n_layer=layers, n_head=heads, max_seq_len=seq))
    scheme, options, recompute = (*cfg, False)[:3]
    fused_merge = options.get("fused_merge", False)
    if scheme is not None:
        model = depthrewrite.rewrite(model, scheme, **options)
    model = model.to(torch.bfloat16).train()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, 256, (batch, seq))
    # no cache: a cache hit would skip the partition this reads
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
            enable_autograd_cache=False):
        _, loss = compiled(ids, ids)
        loss.backward()
    producers = {n.name: n for n in graphs["forward"].graph.nodes}
    rows = []
    for node in graphs["backward"].graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        source = producers.get(node.name)
        if not _tensor_bytes(node) or source is None or source.op == "placeholder":
            continue  # parameters and inputs are kept anyway
        rows.append(dict(bytes=_tensor_bytes(node), where=_where(source)))
    if not liveness:
        return rows
    return (rows, *backward_peak(graphs["backward"].graph, producers))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemes", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=128, help="d (wider: the attention's own T x T tensors weigh less)")
    ap.add_argument("--top", type=int, default=6, help="source lines listed per scheme")
    ap.add_argument("--functorch", default="{}", metavar="JSON",
                    help='AOTAutograd partitioner settings for every configuration, e.g. '
                         '\'{"ban_recompute_materialized_backward": false}\' (torch._functorch.config)')
    ap.add_argument("--liveness", action="store_true",
                    help="also the backward graph's peak (each tensor freed after its last use, before Inductor) "
                         "and what is live there")
    args = ap.parse_args()
    patches = json.loads(args.functorch)
    d, heads, batch, seq = args.width, 4, 2, 64
    unit = batch * seq * d * 2
    base = None
    print(f"saved for the backward, units of one {batch * seq} x {d} bf16 activation ({unit} bytes); "
          f"{args.layers} layers")
    for name in args.schemes.split(","):
        with torch._functorch.config.patch(**patches):
            found = saved_tensors(CONFIGS[name], d, args.layers, heads, batch, seq, args.liveness)
        rows, peak, at_peak = found if args.liveness else (found, 0, [])
        total = sum(r["bytes"] for r in rows) / unit
        base = total if name == "baseline" else base
        extra = "" if base is None or name == "baseline" else f" (extra {total - base:+.1f})"
        print(f"{name}: {total:.1f} units in {len(rows)} tensors{extra}")
        by_line = collections.Counter()
        for r in rows:
            by_line[r["where"]] += r["bytes"] / unit
        for where, units in by_line.most_common(args.top):
            print(f"    {units:6.1f}  {where}")
        if args.liveness:
            by_kind, by_place = collections.Counter(), collections.Counter()
            for r in at_peak:
                by_kind[r["kind"]] += r["bytes"] / unit
                by_place[(r["kind"], r["where"])] += r["bytes"] / unit
            kinds = ", ".join(f"{kind} {units:.1f}" for kind, units in by_kind.most_common())
            print(f"  backward peak before Inductor: {peak / unit:.1f} units ({kinds})")
            for (kind, where), units in by_place.most_common(args.top):
                print(f"    {units:6.1f}  {kind:8s} {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
