"""Where a launcher's host time goes: each two-phase launcher (``route_many``'s and
``route_merge``'s, forward and backward, at the end-to-end model's sites) timed whole beside
its parts, interleaved repeat by repeat (``host_overhead.side_by_side_us``), on a few tokens
so that the host sets the pace.

    python3 benchmarks/launch_parts.py [--tokens 16] [--width 1024] [--calls 100] [--repeats 15]

Columns, us per call (median of ``repeats`` x ``calls``):

- ``launcher``: the function our registered CUDA kernel calls;
- ``triton run``: its Triton launches alone, replayed with the arguments it passed
  (``JITFunction.run``: binding, specialization, the cache lookup, the launch);
- ``compiled``: the same launches through the compiled kernels directly
  (:func:`compiled_launch`; route_merge's forward output checked against Triton's run's);
- ``tables``: its ``pointer_tables`` lookups, replayed (found in the cache);
- ``empty``: one ``torch.empty`` of a row block, and ``aten ops``: how many ATen ops one call
  of the launcher makes (allocations included), so ``empty x ops`` prices them.

Needs CUDA; prints the table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def compiled_launch(fn, compiled, args: tuple, kwargs: dict):
    """A callable that launches ``compiled`` (what ``fn.run`` returned for these arguments)
    again with them, as ``JITFunction.run`` does once it has found its kernel: every
    parameter's value in the signature's order, constexprs included."""
    import torch
    import triton

    grid = kwargs["grid"]
    grid = (*grid, 1, 1)[:3]
    full = list(args) + [kwargs[name] for name in fn.arg_names[len(args):]]
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    knobs = triton.knobs.runtime
    hooks = (knobs.launch_enter_hook, knobs.launch_exit_hook)

    def launch():
        stream = torch.cuda.current_stream().cuda_stream
        run(*grid, stream, function, packed, None, *hooks, *full)
    return launch


def print_triton_sources() -> None:
    """Triton's launch path in the installed version, for reading."""
    import inspect

    import triton.compiler.compiler as compiler
    import triton.runtime.jit as jit

    src = inspect.getsource(jit.JITFunction.run)
    print(src[src.index("kernel_cache.get"):][:2500])
    for attr in ("__getitem__", "launch_metadata"):
        print(inspect.getsource(getattr(compiler.CompiledKernel, attr)))
    print(inspect.getsource(compiler.CompiledKernel.run.fget if isinstance(compiler.CompiledKernel.run, property)
                            else compiler.CompiledKernel.run))


class Recorder:
    """The Triton launches and pointer-table lookups one launcher call makes."""

    def __init__(self):
        self.launches, self.tables = [], []

    def __enter__(self):
        import triton.runtime.jit as jit

        from depthrewrite.kernels import pointer_tables as pt

        self._jit, self._pt = jit, pt
        self._run, self._tables = jit.JITFunction.run, pt.pointer_tables
        recorder = self

        def run(fn, *args, **kwargs):
            compiled = recorder._run(fn, *args, **kwargs)
            recorder.launches.append((fn, args, kwargs, compiled))
            return compiled

        def tables(device, *groups):
            recorder.tables.append((device, groups))
            return recorder._tables(device, *groups)

        jit.JITFunction.run = run
        self._patched = [(m, name, getattr(m, name)) for m in _launcher_modules() for name in ("pointer_tables",)
                         if hasattr(m, name)]
        for m, name, _ in self._patched:
            setattr(m, name, tables)
        return self

    def __exit__(self, *exc):
        self._jit.JITFunction.run = self._run
        for m, name, original in self._patched:
            setattr(m, name, original)


def _launcher_modules():
    from depthrewrite.kernels import route_many_triton, route_merge_triton, route_triton

    return (route_triton, route_many_triton, route_merge_triton)


def aten_op_count(fn) -> int:
    """ATen ops one call of ``fn`` dispatches (factory functions included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def parts(name: str, launcher) -> dict:
    """The callables of one row (module docstring)."""
    import torch
    import triton.runtime.jit as jit

    from depthrewrite.kernels.pointer_tables import pointer_tables

    with Recorder() as rec:
        launcher()
    runs = [(fn, args, kwargs) for fn, args, kwargs, _ in rec.launches]
    try:
        direct = [compiled_launch(fn, compiled, args, kwargs) for fn, args, kwargs, compiled in rec.launches]
        direct[0]()
    except Exception as exc:  # another Triton's launch path: read print_triton_sources' output
        print(f"{name}: no compiled launch ({type(exc).__name__}: {exc})", flush=True)
        direct = []

    def triton_run():
        for fn, args, kwargs in runs:
            jit.JITFunction.run(fn, *args, **kwargs)

    def compiled():
        for launch in direct:
            launch()

    def tables():
        for device, groups in rec.tables:
            pointer_tables(device, *groups)

    if direct:
        _check_written(name, rec.launches, compiled)
    row = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    return {"launcher": launcher, "triton run": triton_run, "compiled": compiled, "tables": tables,
            "empty": lambda: torch.empty_like(row), "launches": len(runs), "aten ops": aten_op_count(launcher)}


def _check_written(name: str, launches, compiled) -> None:
    """For a launch whose output is an argument (route_merge's forward: ``x``, its 9th),
    the output after ``compiled`` over a NaN-filled buffer against Triton's run's."""
    import torch

    fn, args, kwargs, _ = launches[0]
    if "route_merge_fwd" not in fn.__name__:
        return
    x = args[8]
    import triton.runtime.jit as jit

    jit.JITFunction.run(fn, *args, **kwargs)
    want = x.clone()
    x.fill_(float("nan"))
    compiled()
    torch.cuda.synchronize()
    print(f"{name}: the compiled launch writes Triton's run's bits: {torch.equal(x, want)}", flush=True)


def cases(tokens: int, d: int) -> dict:
    import torch

    import depthrewrite.kernels  # noqa: F401  (registers the CUDA kernels)
    from depthrewrite.kernels import route_many_triton as many
    from depthrewrite.kernels import route_merge_triton as merge
    from route_merge_speed import make

    dt, found = torch.bfloat16, {}
    values = [torch.randn(tokens, d, device="cuda", dtype=dt) for _ in range(6)]
    queries, weights = torch.randn(8, d, device="cuda") * 0.1, torch.rand(8, d, device="cuda") + 0.5
    out, lse = many.route_many_forward(values, queries, weights, 1, 1e-6)
    grad_out, grad_lse = [torch.randn_like(o) for o in out], [torch.randn_like(t) for t in lse]
    found["route_many fwd (6 blocks, 8 sites)"] = lambda: many.route_many_forward(values, queries, weights, 1, 1e-6)
    found["route_many bwd (6 blocks, 8 sites)"] = lambda: many.route_many_backward(
        grad_out, grad_lse, out, lse, values, queries, weights, 1, 1e-6)
    for name, (j, keyed) in {"route_merge, normed, J=1": (1, False), "route_merge, normed, J=2 keyed": (2, True)}.items():
        inp = make(j, tokens, d, 1, keyed, True, "cuda", seed=11)
        args = (inp["outs"], inp["lses"], inp["values"], inp["keys"], inp["queries"], inp["key_norm_weights"],
                inp["mix"], 1, 1e-6, inp["out_norm_weight"], 1e-6)
        grad = torch.randn(tokens, d, device="cuda", dtype=dt)
        found[f"{name} fwd"] = lambda a=args: merge.route_merge_forward(*a)
        found[f"{name} bwd"] = lambda a=args, g=grad: merge.route_merge_backward(g, *a)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    import torch
    import triton

    from host_overhead import side_by_side_us

    print_triton_sources()

    columns = ("launcher", "triton run", "compiled", "tables", "empty")
    rows = {}
    with torch.no_grad():
        for name, launcher in cases(args.tokens, args.width).items():
            p = parts(name, launcher)
            rows[name] = (side_by_side_us([p[c] for c in columns], args.calls, args.repeats), p["launches"],
                          p["aten ops"])
    print(f"host us per call ({args.tokens} tokens, d={args.width}, bf16, Triton {triton.__version__}; "
          f"median of {args.repeats} x {args.calls}, columns interleaved)")
    print("| launcher | " + " | ".join(columns) + " | Triton launches | aten ops |")
    print("| --- |" + " ---: |" * (len(columns) + 2))
    for name, (times, launches, ops) in rows.items():
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {launches} | {ops} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
