"""The routing kernels' launches compiled for sm_90 on a machine without a GPU: how much shared
memory each takes. Run by ``test_shared_memory.py`` in a process of its own (Triton's
interpreter must be off when the kernels are defined).

    python tests/kernels/shared_memory_probe.py CASE...   # one JSON line per launch
    PROBE_ARCH=80 PROBE_SHARED=166912 python tests/kernels/shared_memory_probe.py CASE...  # an A100

Each case calls a launcher of ``depthrewrite.kernels`` with CPU tensors. The kernel launches
are recorded, not run. The device's shared memory is taken to be an H200's (``H200_SHARED``)
unless ``PROBE_SHARED`` gives another, so the launchers fit their pipeline stages to it as
they would there. Each recorded launch of a pipelined kernel carries the stage count and
bytes per stage that its launcher passed to ``fit_stages``. Then each launch is compiled with
the installed Triton for ``GPUTarget("cuda", 90, 32)`` (or ``PROBE_ARCH``'s), with pointers
16-byte aligned and ``D`` and ``C`` divisible by 16, as a launch with aligned tensors
specializes them, and its ``metadata.shared`` printed.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from depthrewrite.kernels import route_many_triton, route_merge_triton, route_triton, shared_memory  # noqa: E402
from depthrewrite.kernels import token_sum_triton  # noqa: E402

#: shared memory a program may take on an H200 (``shared_memory_per_block_optin``: 227 KiB)
H200_SHARED = 232448
#: the compute capability compiled for and its shared memory a program (environment
#: ``PROBE_ARCH`` / ``PROBE_SHARED``; an H200's by default)
ARCH = int(os.environ.get("PROBE_ARCH", "90"))
SHARED = int(os.environ.get("PROBE_SHARED", str(H200_SHARED)))
PIPELINED = {"_route_fwd_kernel", "_route_bwd_kernel", "_route_many_fwd_kernel", "_route_many_bwd_kernel",
             "_route_merge_bwd_kernel"}
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64"}
OPTIONS = ("num_warps", "maxnreg")

LAUNCHES: list[dict] = []
_last_fit: dict = {}


def _record_fits(module) -> None:
    fit = module.fit_stages

    def recording(op, stages, stage_bytes, device, configured):
        fitted = fit(op, stages, stage_bytes, device, configured)
        _last_fit.update(requested=stages, stages=fitted, stage_bytes=stage_bytes)
        return fitted

    module.fit_stages = recording


def _record_launch(self, grid):
    def launch(*args, **kwargs):
        entry = {"kernel": self, "args": args, "kwargs": kwargs}
        if self.fn.__name__ in PIPELINED:
            entry["fit"] = dict(_last_fit)
        LAUNCHES.append(entry)
    return launch


def _signature(kernel, args, kwargs) -> tuple[dict, dict, dict]:
    names = kernel.arg_names
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
    signature, constexprs = {}, {}
    for index, name in enumerate(names):
        value = values.get(name, kernel.params[index].default)
        if index in kernel.constexprs or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(names)
             if signature[n].startswith("*") or n in ("D", "C")}
    return signature, constexprs, attrs


def compiled_shared(entry: dict) -> int:
    kernel = entry["kernel"]
    signature, constexprs, attrs = _signature(kernel, entry["args"], entry["kwargs"])
    options = {k: entry["kwargs"][k] for k in OPTIONS if entry["kwargs"].get(k) is not None}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", ARCH, 32), options=options)
    return compiled.metadata.shared


# ------------------------------------------------------------------------ the cases


def _rows(n: int, tokens: int, d: int, dtype) -> list[torch.Tensor]:
    return [torch.randn(tokens, d).to(dtype) for _ in range(n)]


def route(d: int, heads: int, dtype, keys: bool, acc: bool, config: dict | None, tokens: int = 3, n: int = 3,
          norm: bool = False):
    values = _rows(n, tokens, d, dtype)
    key_rows = _rows(n, tokens, d, dtype) if keys else None
    query, weight = torch.randn(d), torch.rand(d) + 0.5
    norm_weight = torch.rand(d) + 0.5 if norm else None
    out, lse, _ = route_triton.route_forward(values, key_rows, query, weight, None, None, heads, 1e-6, norm_weight,
                                             config=config)
    running = _rows(n, tokens, d, dtype) if acc else None
    grad_normed = torch.randn(tokens, d).to(dtype) if norm else None
    route_triton.route_backward(torch.randn(tokens, d).to(dtype), out, lse, values, key_rows, query, weight, None,
                                None, heads, 1e-6, grad_normed, norm_weight, config=config, grad_values_acc=running)


def route_many(d: int, heads: int, dtype, keys: bool, acc: bool, config: dict | None, tokens: int = 3, n: int = 3,
               queries: int = 2):
    values = _rows(n, tokens, d, dtype)
    key_rows = _rows(n, tokens, d, dtype) if keys else None
    q, w = torch.randn(queries, d), torch.rand(queries, d) + 0.5
    out, lse = route_many_triton.route_many_forward(values, q, w, heads, 1e-6, config=config, keys=key_rows)
    grads = [torch.randn(tokens, d).to(dtype) for _ in range(queries)]
    grad_lse = [torch.zeros(tokens, heads) for _ in range(queries)]
    running = _rows(n, tokens, d, dtype) if acc else None
    # a pipeline is the per-token backward's (the tiled one, taken by default with keys or
    # several heads, has none)
    backward_config = None if config is None else {**config, "backward": "per_token"}
    route_many_triton.route_many_backward(grads, grad_lse, out, lse, values, q, w, heads, 1e-6,
                                          config=backward_config, keys=key_rows, grad_values_acc=running)


def route_merge(d: int, heads: int, dtype, keys: bool, norm: bool, config: dict | None, tokens: int = 3,
                results: int = 2):
    outs, values = _rows(results, tokens, d, dtype), _rows(results, tokens, d, dtype)
    key_rows = values[::-1] if keys else None
    lses = [torch.randn(tokens, heads) for _ in range(results)]
    q, w, mix = torch.randn(results, d), torch.rand(results, d) + 0.5, torch.rand(results)
    norm_weight = torch.rand(d) + 0.5 if norm else None
    args = (outs, lses, values, key_rows, q, w, mix, heads, 1e-6, norm_weight)
    route_merge_triton.route_merge_forward(*args, config=config)
    route_merge_triton.route_merge_backward(torch.randn(tokens, d).to(dtype), *args, config=config)


def token_sum(d: int, heads: int, dtype, tokens: int = 67):
    stored = torch.randn(tokens, d).to(dtype)
    token_sum_triton.token_weighted_sum_triton(torch.randn(tokens, heads), stored, heads)


OPS = {"route": route, "route_many": route_many, "route_merge": route_merge}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_case(case: str) -> list[dict]:
    """``case``: ``op:d:heads:dtype:flag,flag...:stages`` (op ``token_sum`` takes neither
    flags nor stages; flags ``keys``, ``acc``: running
    sums, ``norm``: the output norm, ``fused``: route's in its kernels; stages ``default`` or
    a number for the launch config)."""
    op, d, heads, dtype, flags, stages = case.split(":")
    flags = set(filter(None, flags.split(",")))
    config = None if stages == "default" else {"stages": int(stages)}
    if "fused" in flags:
        config = {**(config or {}), "fuse_norm": True}
    LAUNCHES.clear()
    if op == "token_sum":
        token_sum(int(d), int(heads), DTYPES[dtype])
    elif op == "route_merge":
        route_merge(int(d), int(heads), DTYPES[dtype], "keys" in flags, "norm" in flags, config)
    else:
        extra = {"norm": "norm" in flags} if op == "route" else {}
        OPS[op](int(d), int(heads), DTYPES[dtype], "keys" in flags, "acc" in flags, config, **extra)
    rows = []
    for entry in LAUNCHES:
        row = {"case": case, "kernel": entry["kernel"].fn.__name__, "stages": entry["kwargs"].get("STAGES"),
               "shared": compiled_shared(entry)}
        if "fit" in entry:
            row["fit"] = entry["fit"]
        rows.append(row)
    return rows


def main(cases: list[str]) -> None:
    shared_memory.device_limit = lambda device: SHARED
    for module in (route_triton, route_many_triton, route_merge_triton):
        _record_fits(module)
    JITFunction.__getitem__ = _record_launch
    for case in cases:
        for row in run_case(case):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
