"""Registers, spills, SASS instructions and barriers, and global memory instructions of
routing kernels for sm_90, on a machine without a GPU.

    python benchmarks/kernel_registers.py [--width 1024] [--heads 1 16] [--ptxas PATH] [--forward-caps 0 64]
        [--many-queries 6 4 5]

Compiles with the installed Triton for ``GPUTarget("cuda", 90, 32)``: ``_route_bwd_kernel``
at the launch choices ``route_backward`` makes (bf16, no keys / bias / scale / norm), with and
without running sums (``HAS_ACC``, the backend's ``accumulate_grads``) and with its row sums
joined (the default) or one by one, ``_route_fwd_kernel`` at ``route_forward``'s (every bias /
scale / fused-norm combination; with ``--forward-caps`` also under those register caps, 0 for
none), ``_route_many_fwd_kernel`` at ``route_many_forward``'s (2 queries per program; 1 with
several heads), the per-token ``_route_many_bwd_kernel`` at ``route_many_backward``'s (6
queries, or ``--many-queries``; also with its row sums one by one and in its ``param="table"``
form), each without and with separate keys, ``token_weighted_sum_triton``'s kernel as launched
(also at 8 warps) and in its session-81 form (a weight gathered per term), and
``route_merge``'s forward and backward (J = 1 and 2, with and without the fused output norm)
at their launchers' choices; runs ``ptxas -v``
on the PTX, and ``nvdisasm`` (beside that ``ptxas``) on its machine code to count the SASS
instructions and the ``BAR.SYNC`` barriers, where a program's warps wait for each other.
Registers per thread set how many programs an SM holds (65,536 registers per SM on
H100/H200). The pointers and the widths ``D`` and ``C`` are declared 16-divisible, as Triton
specializes them at a launch with aligned tensors and d = 1024, so that the PTX's global loads
and stores (counted per instruction: ``ld.global.v4.b32`` moves 16 bytes, ``ld.global.b16``
2) are the ones the launch compiles. The Triton and ptxas here are this machine's, not
necessarily the device's: a lead, not a measurement of what the device runs.
Prints one line per variant.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

#: Triton argument types of the kernel's tensors and scalars (bf16 activations)
ARG_TYPES = dict(g_ptr="*bf16", out_ptr="*bf16", lse_ptr="*fp32", vtab="*i64", ktab="*i64", gvtab="*i64",
                 gktab="*i64", gvacc="*i64", gkacc="*i64", q_ptr="*fp32", w_ptr="*fp32", bias_ptr="*fp32",
                 scale_ptr="*fp32", part_r_ptr="*fp32", part_b_ptr="*fp32", gn_ptr="*bf16", onw_ptr="*fp32",
                 part_n_ptr="*fp32", normed_ptr="*bf16", T="i32", N="i32", D="i32", C="i32", H="i32", eps="fp32",
                 num_blocks="i32", out_norm_eps="fp32")


def ptxas_report(ptx: str, ptxas: str) -> tuple[int, int, str]:
    """(registers per thread, spill bytes stored, a summary of the machine code) that
    ``ptxas -v`` reports for sm_90a; the summary (SASS instructions and ``BAR.SYNC``
    barriers, counted in the whole kernel) comes from the ``nvdisasm`` beside ``ptxas``, and
    is empty without one."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = pathlib.Path(tmp) / "k.ptx", pathlib.Path(tmp) / "k.cubin"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", str(src), "-o", str(cubin)],
                             capture_output=True, text=True)
        text = out.stdout + out.stderr
        regs, spills = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
        if out.returncode or not regs:
            raise RuntimeError(f"{ptxas} failed on the kernel's PTX:\n{text[-800:]}")
        return int(regs.group(1)), int(spills.group(1)) if spills else 0, sass_summary(cubin, ptxas)


def describe(ptx: str, ptxas: str, warps: int, memory: bool = True) -> str:
    """One kernel's line: registers, spills, programs an SM holds by its registers, the SASS
    summary and (with ``memory``) the PTX's global memory instructions."""
    regs, spills, sass = ptxas_report(ptx, ptxas)
    line = f"{regs} registers, {spills} spill bytes, {65536 // (regs * warps * 32)} programs per SM by registers"
    line += f"; {sass}" if sass else ""
    return line + (f"; global memory instructions {memory_instructions(ptx)}" if memory else "")


def sass_summary(cubin: pathlib.Path, ptxas: str) -> str:
    """``"<n> SASS instructions, <b> barriers"`` of a cubin, by the ``nvdisasm`` in ``ptxas``'s
    folder ("" if there is none)."""
    nvdisasm = pathlib.Path(ptxas).with_name("nvdisasm")
    if not nvdisasm.exists():
        return ""
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return f"{len(lines)} SASS instructions, {sum('BAR.SYNC' in line for line in lines)} barriers"


def _compile(kernel, types: dict, constexprs: dict, warps: int, maxnreg: int | None = None,
             divisible: tuple[str, ...] = ("D", "C")) -> str:
    """PTX of ``kernel`` for sm_90 with what a launch specializes: 16-byte aligned pointers,
    the integer arguments ``divisible`` (the widths) divisible by 16. ``types``: Triton types of
    the runtime arguments; ``maxnreg``: the launch's register cap, if any."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: types.get(n, "constexpr") for n in names}
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(names)
             if signature[n].startswith("*") or n in divisible}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {})))
    return compiled.asm["ptx"]


def compile_backward(d: int, heads: int, has_acc: bool, fused_sums: bool | None = None):
    """route's backward as ``route_backward`` launches it (no keys, bias or scale;
    ``fused_sums`` None: BACKWARD_FUSED_SUMS)."""
    from depthrewrite.kernels.route_triton import (
        BACKWARD_FUSED_SUMS, _route_backward_residency, _route_backward_stages, _route_backward_warps,
        _route_bwd_kernel, _route_tokens, _row_blocks,
    )

    block_h, block_c = _row_blocks(d, heads)
    row = block_h * block_c
    block_t = _route_tokens(heads, row)
    constexprs = dict(HAS_KEYS=False, HAS_BIAS=False, HAS_SCALE=False, ONE_SOURCE=False, BLOCK_T=block_t,
                      BLOCK_H=block_h, BLOCK_C=block_c, ALIGNED=True, PREFETCH=True, HAS_NORM=False,
                      HAS_ACC=has_acc, STAGES=_route_backward_stages(heads, row, has_acc, False),
                      FUSED_SUMS=BACKWARD_FUSED_SUMS if fused_sums is None else fused_sums)
    warps = _route_backward_warps(heads, row, block_t)
    cap, _ = _route_backward_residency(heads, row, False, block_t, warps)
    return _compile(_route_bwd_kernel, ARG_TYPES, constexprs, warps, cap), block_t, warps


def compile_forward(d: int, heads: int, has_bias: bool = False, has_scale: bool = False, has_norm: bool = False,
                    maxnreg: int | None = None, lazy: bool | None = None):
    """route's forward as ``route_forward`` launches it (no keys), with ``maxnreg`` as the
    register cap (None: the launch's default cap, if any; 0: none, the compiler's choice) and
    ``lazy`` as its rescale (None: LAZY_RESCALE)."""
    from depthrewrite.kernels.route_triton import (
        LAZY_RESCALE, _route_forward_cap, _route_forward_stages, _route_forward_tokens, _route_forward_warps,
        _route_fwd_kernel, _row_blocks,
    )

    block_h, block_c = _row_blocks(d, heads)
    row = block_h * block_c
    block_t = _route_forward_tokens(heads, row)
    warps = _route_forward_warps(heads, row, block_t)
    constexprs = dict(HAS_KEYS=False, HAS_BIAS=has_bias, HAS_SCALE=has_scale, ONE_SOURCE=False, BLOCK_T=block_t,
                      BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=True, ALIGNED=True, HAS_NORM=has_norm,
                      PAIR_REDUCE=False, STAGES=_route_forward_stages(heads, row),
                      LAZY=LAZY_RESCALE if lazy is None else lazy)
    cap = maxnreg if maxnreg is not None else _route_forward_cap(heads, row, False, has_norm, block_t, warps)
    return _compile(_route_fwd_kernel, ARG_TYPES, constexprs, warps, cap or None), warps


MANY_TYPES = dict(like_ptr="*bf16", vtab="*i64", ktab="*i64", otab="*i64", ltab="*i64", qw_ptr="*fp32",
                  gtab="*i64", gltab="*i64", gvtab="*i64", acctab="*i64", gktab="*i64", kacctab="*i64",
                  param_ptr="*fp32", T="i32", N="i32", S="i32", D="i32", C="i32", H="i32",
                  S_CHUNK="i32", eps="fp32", tokens_per_program="i32", stats_ptr="*fp32", Q0="i32", runtab="*i64",
                  kruntab="*i64")


def compile_many_forward(d: int, heads: int, has_keys: bool, stages: int | None = None, lazy: bool | None = None,
                         queries: int = 4):
    """route_many's forward as its launcher compiles it for a call of ``queries`` queries
    (``lazy`` None: its default rescale; the stats table stored where the op keeps one)."""
    from depthrewrite.kernels.route_many_triton import (
        _many_forward_lazy, _many_forward_queries, _many_forward_stages, _many_forward_warps, _route_many_fwd_kernel,
    )
    from depthrewrite.kernels.route_triton import _row_blocks
    from depthrewrite.ops.route_many import saves_stats

    block_h, block_c = _row_blocks(d, heads)
    row = block_h * block_c
    constexprs = dict(BLOCK_Q=_many_forward_queries(heads, row), BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=True,
                      ALIGNED=True, HAS_KEYS=has_keys, TOKEN_MAJOR=True,
                      STAGES=_many_forward_stages(heads) if stages is None else stages,
                      LAZY=_many_forward_lazy(heads) if lazy is None else lazy,
                      SAVE_STATS=saves_stats(heads, True if has_keys else None, queries))
    warps = _many_forward_warps(heads, row)
    return _compile(_route_many_fwd_kernel, MANY_TYPES, constexprs, warps), warps


def compile_many_per_token_backward(d: int, heads: int, has_keys: bool, prefetch: int | None = None,
                                    queries: int = 6, param_table: bool = False, stages: int = 0,
                                    fused_sums: bool | None = None, saved_stats: bool | None = None,
                                    split: bool | None = None):
    """The per-token backward for ``queries`` queries in one chunk, as ``route_many_backward``
    launches it (one head: all queries that MANY_ELEMS allows; several heads: 2; ``prefetch``
    None: the default depth; the register cap of PER_TOKEN_LAUNCH); with ``param_table``, its
    ``param="table"`` form; ``fused_sums`` None: PER_TOKEN_FUSED_SUMS; ``saved_stats`` None:
    the forward's statistics read where the op keeps them (route_many.saves_stats); ``split``
    None: the queries as two tiles where the launcher takes them so (SPLIT_QUERIES)."""
    from depthrewrite.kernels.route_many_triton import (
        MULTI_HEAD_BACKWARD_WARPS, NUM_WARPS, PER_TOKEN_FUSED_SUMS, SPLIT_QUERIES, _backward_prefetch,
        _per_token_block_q, _per_token_launch, _query_tile_pair, _route_many_bwd_kernel,
    )
    from depthrewrite.kernels.route_triton import _row_blocks
    from depthrewrite.ops.route_many import saves_stats

    block_h, block_c = _row_blocks(d, heads)
    multi = heads > 1
    block_q = _per_token_block_q(queries, heads, block_h * block_c, {})
    tile_q, tile_q2 = _query_tile_pair(queries, block_q, {
        "split_queries": SPLIT_QUERIES if split is None else split, "exact_softmax_grad": False,
        "param": "table" if param_table else "registers"})
    if prefetch is None:
        prefetch = _backward_prefetch("per_token", block_h * block_c, block_q, two_tiles=tile_q2 > 0)
    constexprs = dict(BLOCK_Q=tile_q, BLOCK_Q2=tile_q2, BLOCK_H=block_h, BLOCK_C=block_c, PREFETCH=prefetch,
                      ALIGNED=True, ACC_IN=False,
                      ACC_OUT=False, ONE_SOURCE=False, HAS_KEYS=has_keys, PARAM_TABLE=param_table,
                      STAGES=stages, FUSED_SUMS=PER_TOKEN_FUSED_SUMS if fused_sums is None else fused_sums,
                      SAVED_STATS=(saves_stats(heads, True if has_keys else None, queries) if saved_stats is None
                                   else saved_stats))
    warps = MULTI_HEAD_BACKWARD_WARPS if multi else NUM_WARPS
    _, cap = _per_token_launch(block_q, heads, block_h * block_c)
    return _compile(_route_many_bwd_kernel, MANY_TYPES, constexprs, warps, cap), warps


def memory_instructions(ptx: str) -> dict[str, int]:
    """Global loads and stores of the PTX by kind (``ld.global.v4.b32``: 16 bytes each)."""
    counts: dict[str, int] = {}
    for line in ptx.splitlines():
        words = line.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        if op.startswith(("ld.global", "st.global")):
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


MERGE_TYPES = dict(otab="*i64", ltab="*i64", vtab="*i64", ktab="*i64", gotab="*i64", gltab="*i64", gvtab="*i64",
                   gktab="*i64", g_ptr="*bf16", x_ptr="*bf16", q_ptr="*fp32", w_ptr="*fp32", m_ptr="*fp32",
                   nw_ptr="*fp32", part_r_ptr="*fp32", part_m_ptr="*fp32", part_n_ptr="*fp32", T="i32", D="i32",
                   C="i32", H="i32", eps="fp32", norm_eps="fp32", num_blocks="i32")


def compile_merge(d: int, heads: int, results: int, has_keys: bool, has_norm: bool, backward: bool):
    """route_merge's forward or backward kernel as its launchers make it (default config)."""
    from depthrewrite.kernels import route_merge_triton as merge
    from depthrewrite.kernels.route_triton import _row_blocks

    block_h, block_c = _row_blocks(d, heads)
    launch = merge._launch(None, block_h * block_c, heads, results, has_norm)
    constexprs = dict(J=results, HAS_KEYS=has_keys, HAS_NORM=has_norm, BLOCK_T=launch["block_t"], BLOCK_H=block_h,
                      BLOCK_C=block_c, ALIGNED=True)
    if backward:  # the software pipeline's stages (a launch choice since session 27)
        constexprs["STAGES"] = launch["stages"]
    kernel = merge._route_merge_bwd_kernel if backward else merge._route_merge_fwd_kernel
    return _compile(kernel, MERGE_TYPES, constexprs, launch["num_warps"]), launch


TOKEN_SUM_TYPES = dict(weights_ptr="*fp32", stored_ptr="*bf16", partials_ptr="*fp32", tokens="i32", width="i32",
                       head_width="i32", heads="i32", tokens_per_run="i32")


def compile_token_sum(d: int, heads: int, gathered: bool, warps: int | None = None):
    """``token_weighted_sum_triton``'s kernel at its launcher's blocks for ``d`` and ``heads``
    (bf16 source), or with every term's weight gathered (``gathered``: the session-81 form);
    ``warps`` None: its NUM_WARPS. Returns (PTX, block rows, block columns, warps)."""
    from depthrewrite.kernels import token_sum_triton as ts

    block_d, one_head = ts.column_blocks(d, heads)
    if gathered:
        block_d, one_head = ts.MAX_BLOCK_D, False
    warps = warps or ts.NUM_WARPS
    constexprs = dict(BLOCK_T=ts.TILE // block_d, BLOCK_D=block_d, ONE_HEAD=one_head)
    ptx = _compile(ts._token_sum_partials, TOKEN_SUM_TYPES, constexprs, warps,
                   divisible=("width", "head_width", "tokens_per_run"))
    return ptx, ts.TILE // block_d, block_d, warps


def main() -> int:
    import triton

    default_ptxas = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ptxas", default=str(default_ptxas), help="a ptxas that reads the PTX version Triton emits")
    ap.add_argument("--prefetch", type=int, choices=(0, 1, 2, 3, 4), default=None,
                    help="route_many's per-token backward's prefetch depth (default: its default)")
    ap.add_argument("--many-queries", type=int, nargs="+", default=[6],
                    help="route_many's per-token backward compiled for these query counts (6: the block "
                         "phase's sites; 4 and 5: full AttnRes's groups)")
    ap.add_argument("--forward-caps", type=int, nargs="*", default=[],
                    help="route's forward also compiled with these register caps (0: uncapped)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, ptxas {args.ptxas}, d={args.width}, bf16, prefetch {args.prefetch}")
    for heads in args.heads:
        for has_acc, fused_sums in itertools.product((False, True), (None, False)):
            ptx, block_t, warps = compile_backward(args.width, heads, has_acc, fused_sums)
            sums = ", sums one by one" if fused_sums is False else ""
            print(f"route backward{sums} heads={heads:3d} running sums={str(has_acc):5s} block_t={block_t} "
                  f"warps={warps}: " + describe(ptx, args.ptxas, warps))
    for heads in args.heads:
        for bias, scale, norm in itertools.product((False, True), repeat=3):
            for cap in (None,) + tuple(args.forward_caps):
                ptx, warps = compile_forward(args.width, heads, bias, scale, norm, cap)
                print(f"route forward heads={heads:3d} bias={bias:d} scale={scale:d} norm={norm:d} warps={warps} "
                      f"cap={'launch default' if cap is None else cap or 'none'}: "
                      + describe(ptx, args.ptxas, warps, memory=False))
        ptx, warps = compile_forward(args.width, heads, lazy=False)
        print(f"route forward heads={heads:3d}, eager rescale, warps={warps}: "
              + describe(ptx, args.ptxas, warps, memory=False))
    kinds = [("forward", compile_many_forward),
             ("forward, eager rescale", functools.partial(compile_many_forward, lazy=False))]
    for queries in args.many_queries:
        per_token = functools.partial(compile_many_per_token_backward, prefetch=args.prefetch, queries=queries)
        kinds += [(f"per-token backward S={queries}", per_token),
                  (f"per-token backward S={queries}, sums one by one",
                   functools.partial(per_token, fused_sums=False, saved_stats=False)),
                  (f"per-token backward S={queries}, no saved stats", functools.partial(per_token, saved_stats=False)),
                  (f"per-token backward S={queries}, saved stats", functools.partial(per_token, saved_stats=True)),
                  (f"per-token backward S={queries}, param table", functools.partial(per_token, param_table=True)),
                  (f"per-token backward S={queries}, one tile", functools.partial(per_token, split=False))]
    for name, compile_fn in kinds:
        for heads in args.heads:
            for has_keys in (False, True):
                ptx, warps = compile_fn(args.width, heads, has_keys)
                print(f"route_many {name} heads={heads:3d} keys={str(has_keys):5s} warps={warps}: "
                      + describe(ptx, args.ptxas, warps))
    for heads in args.heads:
        for gathered, warps in ((False, None), (False, 8), (True, None)):
            ptx, block_t, block_d, warps = compile_token_sum(args.width, heads, gathered, warps)
            form = "a weight per term" if gathered else "as launched"
            print(f"token_sum {form} heads={heads:3d} block_t={block_t} block_d={block_d} warps={warps}: "
                  + describe(ptx, args.ptxas, warps))
    for backward in (False, True):
        for heads in args.heads:
            for results, has_keys, has_norm in ((1, False, False), (1, False, True), (2, True, False), (2, True, True)):
                ptx, launch = compile_merge(args.width, heads, results, has_keys, has_norm, backward)
                print(f"route_merge {'backward' if backward else 'forward'} heads={heads:3d} J={results} "
                      f"keys={str(has_keys):5s} norm={has_norm:d} block_t={launch['block_t']} "
                      f"warps={launch['num_warps']}: " + describe(ptx, args.ptxas, launch["num_warps"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
