"""One training step's ``route_many_backward`` calls, replayed on the GPU in their order
under launch variants: whether a launch that is faster on a call timed alone is faster in
the step's sequence of calls too.

    python3 benchmarks/backward_sequence.py [--config attnres] [--variants default attnres_run0]
        [--rounds 7] [--between-matmuls K] [--out DIR]

First, on the CPU, the end-to-end configuration ``--config`` (``e2e_throughput.py``'s model:
24 layers, 16 heads) is rewritten at width 64, compiled with the depthrewrite backend
(Inductor replaced by ``aot_eager``, its passes as on the GPU: the running sums of
``depthrewrite.grad_accumulation`` included) and run forward and backward while a dispatch mode
records each ``route_many_backward`` call of the backward: its sources (by identity), its
queries, heads and which sources come with a running sum. Then, on the GPU, the calls are
made again in that order at the end-to-end shape (8 x 2048 tokens, d = 1024, bf16): one
source tensor per recorded source, shared by the calls as in the step, random output
gradients and the forward's outputs, log-sum-exps and statistics; a call with running sums
takes each source's latest gradient as its sum and its result becomes the next. Each round
times, per variant (the variants in a rotated order), the whole sequence (CUDA events
around every call, three passes, the median) and then each call alone (three times back to
back, as a kernel benchmark times a call; the median), and with ``--between-matmuls K``
the sequence again with K bf16 matmuls of the model's MLP shape queued before each call
(untimed: the step runs a layer's backward between two routing calls). ``--variants``:
``default`` (the launch constants as they are) and names of
``e2e_throughput.LAUNCH_PATCHES`` (their constants set for the variant's passes, then put
back). A call whose kernels are shorter than its host time (one query over 2-3 sources:
~0.4 ms) is timed from its start event to its kernels' end, host time included, unless
matmuls queued before it keep the GPU busy meanwhile; so is a sequence's first call.

Prints, last, per variant and form (in sequence, alone, between matmuls): the median over rounds of the
calls' total time and of its calls grouped by queries and running sums, and the ratio to
the first variant.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from e2e_throughput import BATCH, CONFIGS, LAUNCH_PATCHES, SEQ, launch_patches  # noqa: E402
from routing_floor import E2E_WIDTH  # noqa: E402

PASSES = 3  # timed passes of the sequence per variant and round (their median counts)


class BackwardCalls(TorchDispatchMode):
    """Records each ``depthrewrite::route_many_backward`` call (or its in-place form,
    ``route_many_backward_into_``, whose running sums are its outputs at ``values_acc_index``):
    ``sources`` (an id per distinct source tensor, numbered in order of first sight),
    ``queries``, ``heads``, ``keys`` (whether it has separate keys) and ``running`` (the
    indices of its sources that come with a running sum)."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []
        self._ids: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in ("depthrewrite::route_many_backward", "depthrewrite::route_many_backward_into_"):
            named = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
            if "values_acc_index" in named:
                running = sorted(named["values_acc_index"])
            else:
                sums = named.get("grad_values_acc") or [None] * len(named["values"])
                running = [i for i, acc in enumerate(sums) if acc is not None]
            self.calls.append(dict(
                sources=[self._ids.setdefault(t.data_ptr(), len(self._ids)) for t in named["values"]],
                queries=named["queries"].shape[0], heads=named["heads"], keys=bool(named.get("keys")), running=running))
        return func(*args, **(kwargs or {}))


def record_calls(config: str, width: int = 64, tokens: int = 64, layers: int | None = None) -> list[dict]:
    """The ``route_many_backward`` calls of one compiled training step of ``config`` (module
    docstring; ``layers`` overrides the model's depth), on the CPU."""
    import depthrewrite
    from depthrewrite.models.gpt import gpt_from_preset

    scheme, options, _ = CONFIGS[config]
    torch.manual_seed(0)
    depth = {} if layers is None else {"n_layer": layers}
    model = gpt_from_preset("medium", d_model=width, max_seq_len=tokens, **depth)
    model = depthrewrite.rewrite(model, scheme, **options)
    compiled = torch.compile(model.train(), backend="depthrewrite", fullgraph=True, options={"inner": "aot_eager"})
    x = torch.randint(0, model.config.vocab_size, (1, tokens))
    _, loss = compiled(x, x)
    recorder = BackwardCalls()
    with recorder:
        loss.backward()
    if not recorder.calls:
        raise ValueError(f"backward_sequence: configuration {config!r} makes no route_many_backward call")
    return recorder.calls


def _rows(count: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(BATCH * SEQ, E2E_WIDTH, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(count)]


def make_inputs(calls: list[dict], seed: int = 0) -> tuple[list[torch.Tensor], list[dict]]:
    """The sources (one per recorded id) and each call's own inputs, on the GPU (module
    docstring); the forward runs once per call for its outputs, log-sum-exps and table."""
    from depthrewrite.kernels import route_many_triton
    from depthrewrite.ops.route_many import stats_table

    if any(c["keys"] for c in calls):
        raise ValueError("backward_sequence: calls with separate keys are not replayed (DAR's); found some")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sources = _rows(1 + max(i for c in calls for i in c["sources"]), gen)
    prepared = []
    for c in calls:
        values = [sources[i] for i in c["sources"]]
        s, heads = c["queries"], c["heads"]
        q = torch.randn(s, E2E_WIDTH, device="cuda", generator=gen) / E2E_WIDTH**0.5
        w = torch.rand(s, E2E_WIDTH, device="cuda", generator=gen) + 0.5
        stats = stats_table(values, q, heads, None)
        with torch.no_grad():
            out, lse = route_many_triton.route_many_forward(values, q, w, heads, 1e-6, stats=stats)
        grads = _rows(s, gen)
        grad_lse = [torch.randn(BATCH * SEQ, heads, device="cuda", generator=gen) for _ in range(s)]
        prepared.append(dict(c, args=(grads, grad_lse, out, lse, values, q, w, heads, 1e-6), stats=stats))
    return sources, prepared


def _call(c: dict, sums: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Call ``c``'s backward with its sources' running sums; its source gradients."""
    from depthrewrite.kernels import route_many_triton

    acc = [sums[c["sources"][i]] if i in c["running"] else None for i in range(len(c["sources"]))]
    return route_many_triton.route_many_backward(*c["args"], stats=c["stats"],
                                                 grad_values_acc=acc if c["running"] else None)[0]


def run_sequence(prepared: list[dict], sums: dict[int, torch.Tensor], between=None) -> list[float]:
    """The calls once, in order; each call's GPU time (ms, CUDA events around it). ``sums``:
    the running sum per source id, replaced by each call's gradient for a source it has.
    ``between``: None, or work to queue before each call (not timed)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in prepared]
    with torch.no_grad():
        for (start, end), c in zip(events, prepared):
            if between is not None:
                between()
            start.record()
            grads = _call(c, sums)
            end.record()
            for i in c["running"]:
                sums[c["sources"][i]] = grads[i]
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def run_isolated(prepared: list[dict], sums: dict[int, torch.Tensor]) -> list[float]:
    """Each call alone: made PASSES times back to back (as a kernel benchmark times it),
    the median of its GPU times (ms); the sums are read, not replaced."""
    times = []
    with torch.no_grad():
        for c in prepared:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(PASSES)]
            for start, end in events:
                start.record()
                _call(c, sums)
                end.record()
            torch.cuda.synchronize()
            times.append(statistics.median(start.elapsed_time(end) for start, end in events))
    return times


def matmuls(count: int, seed: int = 1):
    """``count`` bf16 matmuls of the end-to-end model's MLP shape ((8 x 2048, 1024) @ (1024,
    4096), ~0.2 ms each on an H200), as one callable: the work a step does between two routing
    backwards (a layer's backward: ~1.6 ms of other kernels a call in full AttnRes's step)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(BATCH * SEQ, E2E_WIDTH, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(E2E_WIDTH, 4 * E2E_WIDTH, device="cuda", generator=gen).to(torch.bfloat16)

    def run():
        for _ in range(count):
            torch.mm(a, b)
    return run


def time_variants(prepared: list[dict], sources: list[torch.Tensor], variants: list[str], rounds: int,
                  between_matmuls: int = 0) -> dict:
    """Per form ("sequence", "isolated", and with ``between_matmuls`` "between matmuls":
    the sequence with that many matmuls queued before each call), variant and round: each
    call's time (ms; in sequence, the median over PASSES passes)."""
    sums = {i: torch.randn_like(t) for i, t in enumerate(sources)}
    forms = ("sequence", "isolated") + (("between matmuls",) if between_matmuls else ())
    between = matmuls(between_matmuls) if between_matmuls else None
    times = {form: {v: [] for v in variants} for form in forms}
    for r in range(rounds + 1):  # round 0 compiles every variant's kernels: not counted
        for name in variants[r % len(variants):] + variants[:r % len(variants)]:
            with launch_patches(name):  # "default" has none
                passes = [run_sequence(prepared, sums) for _ in range(PASSES)]
                isolated = run_isolated(prepared, sums)
                mixed = [run_sequence(prepared, sums, between) for _ in range(PASSES)] if between else None
            if r:
                times["sequence"][name].append([statistics.median(call) for call in zip(*passes)])
                times["isolated"][name].append(isolated)
                if mixed:
                    times["between matmuls"][name].append([statistics.median(call) for call in zip(*mixed)])
    return times


def _group(call: dict) -> str:
    queries = f"{call['queries']} {'query' if call['queries'] == 1 else 'queries'}"
    return f"{queries}, {'running sums' if call['running'] else 'no sums'}"


def table(calls: list[dict], times: dict, form: str) -> list[str]:
    """Per variant: the calls' total time (``form``: in sequence or each alone), the median
    over rounds, each group of calls' (the median of the rounds' sums) and the ratio to the
    first variant."""
    groups = sorted({_group(c) for c in calls})
    first = None
    columns = [f"{g} ({sum(_group(c) == g for c in calls)} calls) ms" for g in groups]
    lines = ["", f"calls {form}, ms", "| variant | all calls (x first) | " + " | ".join(columns) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in groups) + " |"]
    for name, rounds in times.items():
        total = statistics.median(sum(r) for r in rounds)
        first = first or total
        parts = [statistics.median(sum(t for t, c in zip(r, calls) if _group(c) == g) for r in rounds)
                 for g in groups]
        lines.append(f"| {name} | {total:.3f} ({total / first:.3f}) | " + " | ".join(f"{p:.3f}" for p in parts) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="attnres", help="the end-to-end configuration whose step is replayed")
    ap.add_argument("--variants", nargs="+", default=["default", "attnres_run0"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--between-matmuls", type=int, default=0, metavar="K",
                    help="also time the sequence with K MLP-sized matmuls queued before each call")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="writes backward_sequence.json there")
    args = ap.parse_args()
    unknown = [v for v in args.variants if v != "default" and v not in LAUNCH_PATCHES]
    if unknown:
        ap.error(f"--variants: {unknown} are neither 'default' nor e2e_throughput.LAUNCH_PATCHES names")
    if args.between_matmuls < 0:
        ap.error(f"--between-matmuls must be >= 0; found {args.between_matmuls}")
    if not torch.cuda.is_available():
        ap.error("the replay needs a CUDA device")
    calls = record_calls(args.config)
    print(f"{args.config}: {len(calls)} route_many_backward calls a step, recorded on the CPU", flush=True)
    sources, prepared = make_inputs(calls)
    times = time_variants(prepared, sources, args.variants, args.rounds, args.between_matmuls)
    if args.out:
        with open(os.path.join(args.out, "backward_sequence.json"), "w") as f:
            json.dump(dict(config=args.config, calls=calls, times=times), f, separators=(",", ":"))
    forms = {"sequence": "in sequence", "isolated": "each alone",
             "between matmuls": f"in sequence, {args.between_matmuls} matmuls before each"}
    print("\n".join(line for form, rows in times.items() for line in table(calls, rows, forms[form])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
