"""The HBM floor of each scheme's routing in one training step: every routing op call of a
step, counted on the CPU, priced in bytes at the end-to-end benchmark's shape.

    python benchmarks/routing_floor.py [--schemes block_attnres mhar_block ...] [--width 64]

Each configuration of ``benchmarks/e2e_throughput.py`` (the bundled GPT's depth: 24 layers,
16 heads) is rewritten at a small width and trained for one step in eager mode on a few
tokens while a dispatch mode records every ``depthrewrite::`` routing call, forward and
backward (the backward's recomputation of phase 1 included), with its number of sources,
queries and separate keys. A call's floor is the rows it must move at least once: the
forward reads each source (and key) and writes its outputs (and the fused norm's); the
backward reads the output gradients, the outputs and each source (and key) and writes
their gradients. Running sums that a backward adds its gradients to are not counted (a
lower bound: whoever sums the gradients reads them), nor are the log-sum-exps (one float
per token and head). Rows are priced at 8 x 2048 tokens, d = 1024, bf16 (32 MiB) and
4.8 TB/s, as the end-to-end table's model (docs/benchmarks.md). The compiled step makes the
same calls (but for ``route_merge``'s recomputation, :func:`count`): the backend lowers
each routing op to one kernel call (``route_backward_into_`` for ``route_backward`` with
running sums). ``route_merge`` (the ``_fm`` configurations) prices the second phase too,
which the other configurations leave to Inductor's kernels: their merges
(``merge_partial``, ``merge_routes``) are counted as a column of their own, each call's
rows as a fused merge would move them (the forward reads each result and source once and
writes one row; the backward reads the result's gradient and those rows again and writes
a gradient for each). Per call: DAR's two merges a site read each stream's partial entry
twice, as one's value and the other's key, and write two rows the gate then mixes, where
its fused merge (``dar_block_fm``'s ``route_merge``) reads each once and writes one row.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from e2e_throughput import BACKEND_OPTIONS, BATCH, CONFIGS, SEQ, launch_patches  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
E2E_WIDTH = 1024
ROW_BYTES = BATCH * SEQ * E2E_WIDTH * 2  # one bf16 activation of the end-to-end model


def _rows(name: str, a: dict) -> int:
    """Rows a call of ``depthrewrite::<name>`` moves at least once (module docstring);
    ``a``: its arguments by schema name."""
    per_source = 2 if a.get("keys") is not None else 1  # a value and its key
    if name == "route":
        return len(a["values"]) * per_source + 1 + (a.get("out_norm_weight") is not None)
    if name in ("route_backward", "route_backward_into_"):
        return 2 + 2 * len(a["values"]) * per_source
    if name == "route_many":
        return len(a["values"]) * per_source + a["queries"].shape[0]
    if name in ("route_many_backward", "route_many_backward_into_"):
        return 2 * len(a["grad_out"]) + 2 * len(a["values"]) * per_source
    if name == "route_merge":  # the results' phase-1 rows and the entries read, x written
        return len(a["outs"]) + _distinct(a["values"], a.get("keys")) + 1
    if name == "route_merge_backward":  # x's gradient, the same rows read; a gradient per row argument written
        j = len(a["outs"])
        return 1 + j + _distinct(a["values"], a.get("keys")) + j + j * per_source
    raise ValueError(f"routing_floor: no floor for depthrewrite::{name}")


def _distinct(*lists) -> int:
    """Rows among ``lists`` read once each: a tensor given twice (DAR's merge: a stream's
    partial entry is one target's value and the other's key) counts once."""
    return len({t.data_ptr() for rows in lists if rows is not None for t in rows})


class RoutingCalls(TorchDispatchMode):
    """Counts the ``depthrewrite::`` calls below autograd: calls and rows per op name."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.rows: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "depthrewrite" and name != "fence_":
            self.calls[name] += 1
            named = dict(zip((arg.name for arg in func._schema.arguments), args), **(kwargs or {}))
            self.rows[name] += _rows(name, named)
        return func(*args, **(kwargs or {}))


class MergeCalls:
    """Counts the second phase's merges made of torch ops (``merge_partial``,
    ``merge_routes``), wrapped where the schemes look them up: ``calls`` and ``rows``."""

    SITES = (("attnres", "merge_partial"), ("attnres", "merge_routes"), ("dar", "merge_partial"),
             ("wav", "merge_routes"))

    def __init__(self):
        self.calls = 0
        self.rows = 0

    def _wrap(self, merge, rows_read):
        def counted(*args, **kwargs):
            read = rows_read(*args, **kwargs)
            self.calls += 1
            self.rows += (read + 1) + (1 + 2 * read)  # forward; backward
            return merge(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def counting(self):
        def partial_rows(out, lse, partial, *, partial_key=None, **_):
            return 2 + (partial_key is not None and partial_key is not partial)

        def routes_rows(results, sources=(), **_):
            return len(results) + len(sources)

        modules = [importlib.import_module(f"depthrewrite.passes.{name}") for name, _ in self.SITES]
        saved = [getattr(module, fn) for module, (_, fn) in zip(modules, self.SITES)]
        try:
            for module, (_, fn), merge in zip(modules, self.SITES, saved):
                setattr(module, fn, self._wrap(merge, partial_rows if fn == "merge_partial" else routes_rows))
            yield self
        finally:
            for module, (_, fn), merge in zip(modules, self.SITES, saved):
                setattr(module, fn, merge)


def count(config: str, width: int) -> RoutingCalls:
    """One eager training step of the end-to-end configuration ``config`` (the benchmark
    model's depth and heads, its launch constants: ``two_phase.FUSED_MERGE`` for ``_fm``) at
    ``width``, counted. Compiled with the backend's ``fuse_output_norms`` off and its
    ``recompute_partial_sums`` on (``_fmnf``), the backward makes each ``route_merge``
    result again (the partitioner recomputes the tagged call, docs/design.md): those calls
    are added as ``route_merge (recomputed)``, which eager mode does not run. With the
    norms fused (the default) a merge writes the normed row instead of ``x``, the same
    count of rows, and nothing is made again."""
    scheme, options, _ = CONFIGS[config]
    with launch_patches(config):
        counter = count_step(scheme, options, width)
    options = BACKEND_OPTIONS.get(config, {})
    if counter.calls["route_merge"] and options.get("recompute_partial_sums", True) \
            and not options.get("fuse_output_norms", True):
        counter.calls["route_merge (recomputed)"] = counter.calls["route_merge"]
        counter.rows["route_merge (recomputed)"] = counter.rows["route_merge"]
    return counter


def count_step(scheme: str, options: dict, width: int, layers: int | None = None, tokens: int = 64) -> RoutingCalls:
    """One eager training step of the bundled GPT ("medium": 24 layers, 16 heads; ``layers``
    overrides its depth) at ``width`` rewritten with ``scheme``, on ``tokens`` tokens, counted;
    its merges made of torch ops in the counter's ``merges`` (:class:`MergeCalls`)."""
    import depthrewrite
    from depthrewrite.models.gpt import gpt_from_preset

    torch.manual_seed(0)
    depth = {} if layers is None else {"n_layer": layers}
    model = gpt_from_preset("medium", d_model=width, max_seq_len=tokens, **depth)
    model = depthrewrite.rewrite(model, scheme, **options)
    x = torch.randint(0, model.config.vocab_size, (1, tokens))
    counter = RoutingCalls()
    counter.merges = MergeCalls()
    with counter, counter.merges.counting():
        model(x, x)[1].backward()
    return counter


def _floor_ms(rows: int) -> float:
    return rows * ROW_BYTES / HBM_BYTES_PER_S * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["block_attnres", "mhar_block", "wav", "dar_block", "attnres", "mhar"])
    ap.add_argument("--width", type=int, default=64, help="model width of the counted step (16 heads divide it)")
    args = ap.parse_args()
    print(f"routing floor per training step at {BATCH} x {SEQ} tokens, d = {E2E_WIDTH}, bf16, "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s (calls counted at d = {args.width})")
    print("| model | calls: forward / backward | rows moved (32 MiB each) | floor ms/step "
          "| merges of torch ops (Inductor's): calls, rows | their floor ms/step |")
    print("| --- | --- | ---: | ---: | --- | ---: |")
    for config in args.schemes:
        counter = count(config, args.width)
        forward = sum(n for op, n in counter.calls.items() if "backward" not in op)
        backward = sum(n for op, n in counter.calls.items() if "backward" in op)
        rows = sum(counter.rows.values())
        detail = ", ".join(f"{op} {n}" for op, n in sorted(counter.calls.items()))
        merges = counter.merges
        print(f"| {config} | {forward} / {backward} ({detail}) | {rows} | {_floor_ms(rows):.2f} | "
              f"{merges.calls}, {merges.rows} | {_floor_ms(merges.rows):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
