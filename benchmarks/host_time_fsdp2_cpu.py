"""Host time a training step of a model compiled block by block and sharded with FSDP2, on
the CPU: torchtitan's order (each block compiled with ``fullgraph=True``, then
``fully_shard`` on each block and the root) on one gloo rank, a small Llama
(tests/handwritten_models.py) with tensors so small that the step's time is mostly the
host's: Dynamo's guards, the hooks, the collectives' calls. A proxy for what a GPU step
spends on the host (its "host ms/step" in e2e_throughput.py), measured without one.

    python benchmarks/host_time_fsdp2_cpu.py --scheme block_attnres            # phase 1 gathers
    python benchmarks/host_time_fsdp2_cpu.py --scheme block_attnres --site     # routed site by site
    python benchmarks/host_time_fsdp2_cpu.py --scheme baseline                 # the plain model
    python benchmarks/host_time_fsdp2_cpu.py --scheme dar --layers 24 --eager   # not compiled
    python benchmarks/host_time_fsdp2_cpu.py --scheme dar --ignore-routing      # routing kept out of FSDP2

Prints one line: the median step time over ``--steps`` steps after three warm-up steps, and
the time a step spends finding the FSDP2 groups of the routing parameters phase 1 gathers
(``fsdp2._fsdp_groups_of``: once per graph compiled, at every phase-1 call eager).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import depthrewrite  # noqa: E402
from depthrewrite import fsdp2  # noqa: E402
from depthrewrite.passes import two_phase  # noqa: E402
from depthrewrite.passes.runtime import ROUTER_ATTR  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.handwritten_models import TitanLlama  # noqa: E402


def _model(scheme: str, layers: int, tokens: torch.Tensor, eager: bool) -> TitanLlama:
    torch.manual_seed(0)
    model = TitanLlama(n_layers=layers, dim=32)
    if scheme != "baseline":
        depthrewrite.rewrite(model, scheme, example_inputs=(tokens,))
    for name, layer in list(model.layers.items()) if not eager else ():
        if scheme == "baseline":
            compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        else:
            compiled = torch.compile(layer, backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager"})
        model.layers.register_module(name, compiled)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="block_attnres")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--site", action="store_true", help="phase 1 does not gather the shards (two_phase.GATHER_SHARDS)")
    parser.add_argument("--no-fsdp", action="store_true", help="compiled block by block, not sharded")
    parser.add_argument("--eager", action="store_true", help="the blocks not compiled")
    parser.add_argument("--ignore-routing", action="store_true",
                        help="the routing parameters left out of FSDP2 (fully_shard's ignored_params): what FSDP2's "
                             "work on them costs; their gradients are then not reduced, so for timing only")
    args = parser.parse_args(argv)
    two_phase.GATHER_SHARDS = not args.site
    tokens = torch.randint(0, 128, (1, 16))
    model = _model(args.scheme, args.layers, tokens, args.eager)
    if not args.no_fsdp:
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
        for layer in model.layers.values():
            fully_shard(layer, ignored_params=_routing_parameters(layer) if args.ignore_routing else None)
        fully_shard(model, ignored_params=_routing_parameters(model) if args.ignore_routing else None)

    def step() -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        return time.perf_counter() - start

    lookups = _timed_group_lookups()
    try:
        for _ in range(3):
            step()
        lookups.clear()
        median = statistics.median(step() for _ in range(args.steps))
    finally:
        fsdp2._fsdp_groups_of = lookups.original
        if not args.no_fsdp:
            torch.distributed.destroy_process_group()
    form = "not sharded" if args.no_fsdp else ("FSDP2, site by site" if args.site else "FSDP2")
    form += ", eager" if args.eager else ""
    form += ", routing not in FSDP2" if args.ignore_routing else ""
    print(f"{args.scheme} ({form}, {args.layers} blocks): {1e3 * median:.2f} ms/step "
          f"(median of {args.steps}; torch {torch.__version__}); finding FSDP2's groups: "
          f"{1e3 * lookups.seconds / args.steps:.2f} ms in {lookups.calls / args.steps:.0f} calls a step")


def _routing_parameters(module: torch.nn.Module) -> set:
    return {p for name, p in module.named_parameters() if f"{ROUTER_ATTR}." in name}


class _Lookups:
    """Time spent in ``fsdp2._fsdp_groups_of`` (replaced by a timed wrapper while it lives)."""

    def __init__(self, original):
        self.original, self.seconds, self.calls = original, 0.0, 0

    def clear(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _timed_group_lookups() -> _Lookups:
    lookups = _Lookups(fsdp2._fsdp_groups_of)

    def timed(params):
        start = time.perf_counter()
        try:
            return lookups.original(params)
        finally:
            lookups.seconds += time.perf_counter() - start
            lookups.calls += 1

    fsdp2._fsdp_groups_of = timed
    return lookups


if __name__ == "__main__":
    main()
