"""Fused Triton kernels for ``depthrewrite::route_many`` and its backward.

Same math as :mod:`depthrewrite.ops.route_many`: S queries route over the same N sources.
The point is the bytes: each source row is read ONCE for all S queries (the per-site
``route`` reads it once per site), and in the backward each source gradient is written once
with the contributions of all S queries summed on chip (autograd would otherwise add S
gradients one at a time).

Forward: a program routes one token at a time, holding a ``(Q, H, C)`` fp32 accumulator
for Q queries (an online softmax per query and head, as the ``route`` kernel), and writes
each query's output row and its log-sum-exp. Q queries per program (``FORWARD_QUERIES``, at
most ``MANY_ELEMS / row``; 1 with several heads): the forward is fastest with few at a
time. Every chunk of queries runs in one launch, the chunks of a token in neighbouring
programs (``FORWARD_ORDER``): they run at the same time and read the same source rows, so
the chunks after the first find them in L2 and each source is read from memory about once.
With one head a program takes a run of 8 consecutive tokens and its source rows come through
Triton's software pipeline (copied into shared memory two sources ahead:
``ONE_HEAD_FORWARD_TOKENS``, measured).

With separate keys (DAR) every kernel reads each source's key row next to its value row:
the logits and the key RMSNorm come from the key, the output from the value, and the
backward writes the value and key gradients separately (both backward kernels take keys;
the tiled one runs them by default: the per-token one with keys was as fast or 1-3 %
slower at DAR's shapes, docs/benchmarks.md sessions 10 and 11).

Two backward kernels, both deterministic (fixed summation order, no atomics), chosen per
call by ``_backward_kernel`` (measured):

- tiled (``_route_many_bwd_tiled_kernel``, the default with several heads or keys): ``BLOCK_T`` tokens
  per program (1, with one warp: the row reductions stay inside the warp). It first stores
  ``<g_s, out_s> - d lse_s`` per query and head in a small scratch table, then walks the
  sources; for each source it walks the queries one at a time (their output-gradient rows
  come from cache after the first source), accumulating ``sum_s a_s g_s`` and
  ``sum_s dz_s w_s q_s``, and writes the source gradient once. It writes ``dz * rstd`` per
  (source, query, token, head) to a table from which ``_route_many_param_kernel`` reduces
  the parameter gradients over tokens (reading the sources once more, its tiles through
  Triton's software pipeline: ``PARAM_STAGES``), so no program holds a ``(Q, d)`` accumulator;
- per-token (``_route_many_bwd_kernel``, the default with one head and no keys): a persistent grid,
  per token the Q output gradients, saved outputs and log-sum-exps as ``(Q, H, C)`` tiles,
  one walk over the sources for all queries at once, the parameter gradients accumulated
  per program in a ``(programs, Q, d)`` fp32 buffer; more queries than fit on chip are taken
  in chunks, each adding into an fp32 partial gradient that the earlier chunks wrote (the
  gradient is rounded to the activation dtype once, by the last chunk).

Both take ``sum_j a_j <v_j, g>`` as ``<out, g>`` from the saved output by default, as
flash-attention does (no second pass over the sources), and the weights ``a_j`` as
``exp(z_j - lse)`` with the forward's ``lse``. Either rounds along another path than the
terms of the sum, and the difference enters every ``dz_j`` of a token alike: where the
sources are nearly equal, the query and key-norm-weight gradients (sums of ``dz_j`` over
them) come out about 2x as far from float64 as the reference's in fp32; in bf16 the saved
output is rounded to bf16, and they come out far off (route_many_accuracy.py: 1.2e-2
against 3.7e-7 at spread 1, 94x their own norm at spread 0.01, in the interpreter).
With the config's ``exact_softmax_grad`` (for the registered kernels:
:func:`depthrewrite.kernels.set_exact_softmax_grad`) both kernels first walk the sources to
form ``sum_j a_j <v_j, g>`` and ``sum_j a_j`` from the same terms as the gradient walk, and
take their ratio, as the reference's normalized softmax does: within 1.04-1.16x of the
reference's error in fp32 and bf16 (docs/benchmarks.md session 24), the sources read twice.

Outputs and their gradients are separate tensors (the op returns lists): the kernels reach
them through int64 pointer tables, as they reach the sources; all tables of a call go up in
one host-to-device copy.

Speed, measured (H200, docs/benchmarks.md): forward + backward at 3-5x the memory floor.
Both backward kernels are latency-bound: per (source, query) pair a token needs two row
reductions before its gradient can be formed, and few tokens are in flight per SM (the
per-token kernel holds ``(Q, H, C)`` fp32 tiles: 250 registers at one head, d = 1024, 4
warps, with 6 queries as two tiles of 4 + 2 rows since session 66, 255 and a spill as one
tile of 8 padded rows before (SPLIT_QUERIES); the tiled one walks its pairs one after
another). A tensor-core formulation (tiles of tokens, the reductions as
``tl.dot``) was built and measured slower (2x in the backward at these shapes: N and S
padded to 16, split fp32 factors); it is in the history (commit 9091829), not here. So
is a split forward (commit 5112666: the logits and log-sum-exps of all queries in one
pass over the keys, then the outputs in a streaming pass over the values, no reduction
across threads): slower at every block-phase shape (0.41 against 0.38 ms at N = 4, 0.71
against 0.36 at N = 8, 7-8x with 16 heads; docs/benchmarks.md session 14). So is a split
backward for one head (commit 76396d7, ``backward="split"``: every row reduction of a tile
of tokens in one kernel, into small ``(N, S, T)`` tables, then the gradient rows in a second
kernel without reductions, the parameter terms through ``tl.dot``): at d = 1024, S = 6,
its best forms took 0.375 + 0.367 ms at N = 4 and 0.724 + 0.719 at N = 8 against the
per-token kernel's 0.579 and 1.035 (at N = 4 the two kernels 5.4x and 3.7x their own
floors: as latency-bound as the one-pass kernels; docs/benchmarks.md session 29). So is a
second tensor-core backward for one head (commits 0733273 and 477daad, ``backward="mma"``:
one token at a time, its sources in blocks of 16, the logits from the forward's statistics,
``<g, v>`` and the gradient rows as ``tl.dot`` over column chunks of the row, no reduction
across threads; 96 registers, no spill): 2.3-2.7x the per-token kernel's time at full
AttnRes's group calls (4 queries over 13-45 sources), 3.9-4.0x at the readout's one query
over 49, 1.7-2.7x at the block phase's; its fastest launch (3 stages) still 1.45-1.71x at
the group calls and 2.6x at the readout, running sums on both sides: each token walks its
row chunk by chunk three times, and every chunk waits on its loads (docs/benchmarks.md
session 38).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .route_triton import (
    NARROW_ROW, _backward_programs, _check_block_t, _check_saved, _check_stages, _check_supported,
    _configured, _contiguous, PREFETCH_DEPTHS, _check_prefetch, _forward_warps, _load_source, _next_pow2, _next_source,
    _normalized_sum, _positive_int, _register_cap, _row_blocks, _src_ptr, check_flag, check_gradient, running_sum_row,
    default_fused_sums, online_softmax_update, three_row_sums,
)
from . import route_triton
from .grid import cdiv
from .param_grads import PartialSums, finish
from .pointer_tables import pointer_tables
from .shared_memory import fit_stages
from ..ops.route import _check_acc
from ..ops.route_many import _check_inputs as check_route_many_inputs

__all__ = ["route_many_forward", "route_many_backward", "MANY_ELEMS"]

#: the most fp32 elements of one ``(Q, H, C)`` array a program keeps on chip (Q queries
#: of a padded row); more queries are taken in chunks
MANY_ELEMS = 8192
#: Launch choices, measured on H200 (bf16, 16384 tokens, S = 6 queries; d = 1024 with N = 4
#: and 8 sources, heads 1 and 16; d = 2048, N = 4; ms in docs/benchmarks.md). Forward: 2
#: queries per program at every shape (session 9; with a launch per chunk the sources were
#: read S / 2 times, but the (Q, H, C) accumulator stays small: 0.29 ms vs 0.40 with all 6
#: queries at d = 1024, N = 4). Backward, one head: as many queries as MANY_ELEMS allows
#: (0.73 ms vs 1.19 with 2); 16 heads: 2 queries and 8 warps (1.27 ms vs 3.83 with all 6:
#: the per-head statistics spill registers). 4 warps otherwise (the per-source reductions
#: cross fewer warps), except the forward's one-head rows up to d = 1024 (route_triton._forward_warps: 2 warps; 1 warp
#: with separate keys: 0.305 / 0.522 ms against 0.341 / 0.581 with 2 at N = 4 / 8 in session
#: 9's run 1, 0.302 / 0.521 against 0.339 / 0.578 in session 10's run 1, docs/benchmarks.md;
#: without keys 1 warp is as fast as 2 at d = 1024 and 2.4x slower at d = 2048).
#: Since session 16 (one launch, token-major order; docs/benchmarks.md session 16): one-head
#: rows up to d = 1024 with 1 warp, with keys (as before) or without, and several heads 1
#: query per program and 2 warps: against session 15's launches (chunk-major, 2 warps; 16
#: heads 2 queries and 4 warps) 0.236 / 0.317 ms against 0.217 / 0.349 at N = 4 / 8 (one
#: head: the one shape where the old launch stays faster), 16 heads 0.265 / 0.440 against
#: 0.280 / 0.466, with keys 0.251 / 0.419 against 0.289 / 0.502 (session 16's run 3).
#: Several heads on 1 warp since session 41 (its run 2, 16 heads, d = 1024, docs/benchmarks.md):
#: 0.487 / 0.998 / 1.499 ms against 0.516 / 1.055 / 1.583 with 2 warps at grouped full MHAR's
#: calls (S = 4, N = 13 / 29 / 45), 0.278 / 0.467 against 0.301 / 0.500 at block MHAR's (S =
#: 6, N = 4 / 8); 4 queries a program, 4 warps and runs of tokens level or slower, the pipeline
#: 2-3 % faster at 4 queries and level at 6 (on 2 warps; not timed with one).
FORWARD_QUERIES = 2
MANY_NARROW_FORWARD_WARPS = 1
MULTI_HEAD_FORWARD_QUERIES = 1
MULTI_HEAD_FORWARD_WARPS = 1
#: the forward's program order (one launch holds every chunk of queries): "token_major"
#: (the chunks of a token run side by side and share its source rows through L2) or
#: "chunk_major" (one chunk's tokens after another: each chunk reads every source from
#: memory, as the one launch per chunk before session 16)
FORWARD_ORDER = "token_major"
#: Since session 17 (H200, bf16, 16384 tokens, S = 6, side by side in one run, session 17's
#: run 2, docs/benchmarks.md): one-head forwards take runs of ONE_HEAD_FORWARD_TOKENS
#: consecutive tokens per program (the query rows loaded once per run) with the sources
#: copied ahead by Triton's software pipeline in ONE_HEAD_FORWARD_STAGES stages (two rows in
#: flight that cost no registers): 0.189 / 0.311 ms against 0.231 / 0.324 at d = 1024, N =
#: 4 / 8; with keys 0.224 / 0.379 against 0.265 / 0.451; d = 2048 0.431 against 0.436; d =
#: 4096 0.878 against 0.977. Several heads keep one token and the register prefetch (the
#: pipeline within 2 % either way, runs of tokens up to 21 % slower). The per-token
#: backward pipelines its sources (WIDE_PER_TOKEN_STAGES) for rows wider than NARROW_ROW:
#: 1.181 / 2.745 ms against 1.248 / 3.176 at d = 2048 / 4096, N = 4; at d = 1024 it was
#: 0.640 / 1.078 (3 stages) and 0.614 / 1.013 (4) against 0.606 / 1.059 (not taken). With
#: separate keys (not its default kernel: ``backward="per_token"``) it pipelines them too:
#: 0.704 / 1.179 ms against 0.707 / 1.255 at N = 4 / 8 (and the tiled default's 0.694 /
#: 1.222; run 5: 0.707 / 1.188 against the tiled 0.734 / 1.295: not switched untimed).
ONE_HEAD_FORWARD_TOKENS = 8
ONE_HEAD_FORWARD_STAGES = 3
#: a register cap for the forward's one-head calls with separate keys (DAR's) on rows of
#: NARROW_ROW padded elements (None: the compiler's choice). Session 27 (H200, bf16, 16384
#: tokens, S = 6, d = 1024, docs/benchmarks.md): with 168 the kernel took 0.205 / 0.345 ms
#: against 0.225 / 0.379 at N = 4 / 8, the same in three runs; 200 and 232 level with none;
#: without keys and with 16 heads 168 was level (within 2 %), at d = 2048 slower (0.497
#: against 0.432); 64-128 were 2.3-9.7x slower with one head at d = 1024 and 4096 (spills).
#: End to end (DAR block, 350M): the step level with the cap and without (session 28: 118.5
#: against 118.4 ms; session 27's one run, 121.8 against 117.8, had its trials spread over
#: 117.5-126.7 ms), the kernel 7 % faster inside the step (6.63 against 7.12 ms a step,
#: session 28's profile). The host sets that step's pace, so the GPU time saved would show
#: only in a step where the host does not. The default since session 28 (e2e variant
#: ``dar_block_fwdcap0``: none)
KEYED_FORWARD_MAXNREG = 168
WIDE_PER_TOKEN_STAGES = 3
#: the one-head per-token backward's pipeline stages on rows up to NARROW_ROW when its
#: gradients are added to running sums (full AttnRes's calls since session 36,
#: grad_accumulation), by the padded queries a program holds (BLOCK_Q; a block size not
#: listed takes the entry of the largest listed one below it; 0: the register prefetch,
#: PER_TOKEN_PREFETCH). Session 38 (H200, bf16, 16384 tokens, d = 1024, running sums; run 2,
#: docs/benchmarks.md) against the register prefetch, at full AttnRes's call shapes: 4 queries
#: 0.695 / 1.408 / 2.109 ms against 0.714 / 1.474 / 2.232 at N = 13 / 29 / 45 (20 bytes
#: spilled at the cap of 168 against 2); one query 1.252 against 1.330 at N = 49; 2 queries
#: slower (0.559 against 0.475 at N = 13); 8 queries (no scheme adds running sums there) untimed.
#: Session 39 (benchmarks/backward_sequence.py: full AttnRes's 37 backward calls of a step
#: replayed in order, 6 MLP-sized matmuls queued before each as in the step): its 12 four-query
#: calls 15.21 against 15.48 ms a step with the pipeline, but its 24 one-query calls (over 2-3
#: sources) 3.01 against 2.79 (slower in every round), the sum level, as the training step's
#: profile had it (17.33-17.36 against 17.38 ms). So one query keeps the prefetch; the one-query
#: call the pipeline helped (N = 49, the readout) never has running sums: it comes first
RUNNING_PER_TOKEN_STAGES = {1: 0, 2: 0, 4: 3, 8: 0}
FORWARD_ORDERS = ("token_major", "chunk_major")
#: CUDA's limit on a launch's first grid dimension
MAX_PROGRAMS = 2**31 - 1
MULTI_HEAD_BACKWARD_QUERIES = 2
NUM_WARPS = 4
#: the one-head per-token backward's launch by its padded queries a program (BLOCK_Q):
#: (persistent programs per SM: its config's ``per_sm``; register cap: ``maxnreg``, None for
#: the compiler's choice). The registers grow with the queries: 72, 127, 219 and 255 (30
#: bytes spilled) at 1, 2, 4 and 8 on the H200's Triton 3.6 (``gpu_suite.py
#: --phase-registers``), and the kernel waits on memory, so it takes as many programs as the
#: SM's 65,536 registers hold. At 4 queries a cap of 168 fits 3 without a spill; uncapped, a
#: third program does not fit and runs after the other two (1.08 ms). Session 32 (H200, bf16,
#: 16384 tokens, d = 1024, docs/benchmarks.md) against 2 programs uncapped for every count:
#: 4 queries 0.676 / 1.389 ms against 0.835 / 1.712 at N = 13 / 29; 2 queries 0.451 against
#: 0.700; 1 query 0.148-0.182 against 0.173-0.257 at N = 2-4; full AttnRes's step 0.724x the
#: baseline against 0.700x. 8 keep 2 (5 queries over 45 sources, padded to 8, capped at 168
#: spill more: 8.5 against 5.2 ms).
#: One query: 6 programs since session 33. At 72 registers 7 fit an SM, so session 32's 8
#: left the persistent grid's eighth program of each SM waiting for a slot: at the readout
#: (one query over 49 sources) 6 took 1.084 ms against 1.346 with 8, 1.312 with 4 and 1.587
#: with 3 (session 33's run 4; session 32's run 6: 1.135 against 1.434).
#: A block size not listed takes the entry of the largest listed one below it. Rows wider
#: than NARROW_ROW and several heads were not timed with more programs: they keep
#: OTHER_PER_TOKEN_LAUNCH
PER_TOKEN_LAUNCH = {1: (6, None), 2: (4, None), 4: (3, 168), 8: (2, None)}
OTHER_PER_TOKEN_LAUNCH = (2, None)
MULTI_HEAD_BACKWARD_WARPS = 8
#: which backward runs: "tiled" (BLOCK_T tokens per program, the queries one at a time,
#: parameter gradients by a separate reduction) or "per_token" (one pass, (Q, H, C) tiles);
#: None: the measured choice (_backward_kernel). With the parameter reduction pipelined
#: (session 18) the tiled kernel beat the per-token one at Block AttnRes's phase-1 shapes
#: (0.565 / 0.983 ms against 0.605 / 1.057 at d = 1024, S = 6, N = 4 / 8; run 2), but end
#: to end it was level for Block AttnRes (90.7 against 90.7 ms a step, run 3) and slower
#: for full AttnRes (117.3 against 114.3, run 6: its phase-2 calls route one query over 2-3
#: entries, and the reduction reads every source again): one-head calls without keys stay
#: per-token
BACKWARD = None
BACKWARD_CHOICES = ("tiled", "per_token")
#: one-head calls with more queries than this take the tiled backward (None: no limit). From
#: 5 queries the per-token kernel holds 8 padded rows and spills (255 registers at d =
#: 1024); the tiled kernel holds one query at a time and was faster at 5 queries over 45
#: sources (4.39 against 5.24 ms), but with 4 here Block AttnRes (blocks of 6 and 7 sites)
#: was level end to end (session 32, run 4, docs/benchmarks.md)
PER_TOKEN_MAX_QUERIES = None
#: the per-token backward's parameter gradients: "registers" (a (Q, H, C) fp32 sum over
#: the program's tokens, then over the programs) or "table" (``dz * rstd`` per source,
#: query, token and head stored, then the tiled backward's parameter reduction, which reads
#: the keys again; its sm_90 PTX at d = 1024 with 6 queries uses 245 registers and does not
#: spill, against 255 and 116 bytes of spill: kernel_registers.py). Timed in
#: docs/benchmarks.md session 11: 10-20 % slower up to d = 2048, 1 % faster at d = 4096.
PER_TOKEN_PARAM = "registers"
#: the per-token backward reduces a source's three row sums (the key's squares, ``<k, qw>``
#: and ``<v, g>`` per query) joined in one ``tl.sum``: the program's warps meet at 3 barriers
#: a source instead of 9 (sm_90 code of the device's Triton 3.6 at d = 1024, 4 queries, 168
#: registers either way: 440 instructions a source against 450; ``benchmarks/kernel_registers.py``).
#: Session 33 (H200, bf16, 16384 tokens, docs/benchmarks.md): 1.924 against 2.102 ms at 4
#: queries over 45 sources, 1.342 against 1.411 at one over 49, 0.535 / 0.904 against 0.595 /
#: 1.046 at 6 queries over 4 / 8; full AttnRes's step 0.731-0.736x the baseline against
#: 0.727x, Block AttnRes's 0.890x against 0.885x. False reduces them one by one (the
#: config's ``fused_sums``); the interpreter's default is False (route_triton.default_fused_sums)
PER_TOKEN_FUSED_SUMS = True
PARAM_CHOICES = ("registers", "table")
#: the per-token backward holds a call's queries as two tiles where that pads fewer rows than
#: one (6 queries, Block AttnRes's block phase: 4 + 2 rows, not 8; :func:`_query_tile_pair`),
#: the second tile's row sums joined in a reduction of their own (the config's
#: ``split_queries``). Session 66 (H100, bf16, 16384 tokens, d = 1024, docs/benchmarks.md; the
#: kernel alone): 0.314 / 0.448 / 0.658 ms against 0.325 / 0.488 / 0.796 at N = 2 / 4 / 7 with
#: 4 sources ahead for both, no register spilled against 30 bytes (250 against 255 registers,
#: the device's Triton 3.6); Block AttnRes's step 93.3 against 94.1 ms, its routing kernels 7.1
#: against 7.8 ms a step
SPLIT_QUERIES = True
#: the per-token backward's prefetch depth with two tiles (session 66, as SPLIT_QUERIES' comment,
#: two runs: 2 ahead 0.308-0.309 / 0.436 / 0.635-0.636 ms against 4 ahead's 0.314-0.316 / 0.447-0.448
#: / 0.657-0.658 at N = 2 / 4 / 7, 3 ahead 0.310 / 0.468 / 0.663, 1 ahead 0.348 / 0.489 / 0.695;
#: capped at 168 registers for 3 programs per SM 1.31-1.41x, at 200 1.09-1.22x, both spilling)
TWO_TILE_PREFETCH = 2
#: the per-token backward requests two or more sources ahead (PER_TOKEN_PREFETCH) for padded
#: rows of at most this many elements, one ahead for wider rows (H200, bf16, 16384 tokens, S = 6, one
#: head, docs/benchmarks.md session 11 run 1: 0.606 / 1.058 / 1.249 ms against 0.640 / 1.095
#: / 1.287 at d = 1024 with N = 4 / 8 and d = 2048 with N = 4; at d = 4096 slower, 3.440
#: against 3.186)
PER_TOKEN_PREFETCH2_ROW = 2048
#: the per-token backward's deeper prefetch depths (sources requested ahead in registers,
#: beyond the other kernels' 0 and 1; 3 and 4 since session 35)
PER_TOKEN_PREFETCH_DEPTHS = (2, 3, 4)
#: its depth up to PER_TOKEN_PREFETCH2_ROW by the padded queries a program holds (BLOCK_Q; a
#: block size not listed takes the entry of the largest listed one below it). Session 35
#: (H200, bf16, 16384 tokens, d = 1024, one head, docs/benchmarks.md): at 8 (Block AttnRes's
#: block phase, 6-7 queries) 4 ahead took 0.483 / 0.858 ms against 0.535 / 0.904 at N = 4 /
#: 8, and Block AttnRes's step 90.2 against 90.5 ms (its routing kernels 7.3 against 7.7); at
#: 4 (full AttnRes's groups) 3 or 4 ahead were level or slower (1.769 / 1.807 against 1.761
#: ms at N = 45, 168 registers each way), and at 1 level (1.050 against 1.055 at N = 49).
#: At 8 the kernel spills either way (sm_90, 255 registers: 124 bytes with 4 ahead, 108 with 2)
PER_TOKEN_PREFETCH = {1: 2, 8: 4}
#: the tiled backward's tokens per program and warps, and the padded row one warp reduces
#: (measured: 1 token and 1 warp, so that the row reductions stay in a warp, up to d = 1024;
#: one more warp per 1024 elements). It runs the calls with several heads or separate keys;
#: one-head calls without keys go to the per-token backward (faster at every measured width
#: since its loads of the output gradients carry alignment hints: 0.61 vs 0.66 ms at d = 1024,
#: N = 4; 1.01 vs 1.15 at N = 8; 1.22 vs 1.62 at d = 2048; docs/benchmarks.md, session 9;
#: session 18: BACKWARD's comment)
TILED_TOKENS = 1
TILED_WARPS = 1
TILED_MAX_ROW = 1024
#: the parameter-gradient reduction: queries and columns per program, fp32 elements of its
#: (tokens, queries, columns) accumulator, programs per SM
PARAM_QUERIES = 8
PARAM_COLUMNS = 64
PARAM_ELEMS = 8192
PARAM_PER_SM = 4
#: the parameter-gradient reduction's software pipeline stages (0: none). Nsight Compute
#: (session 18, DAR's keyed shape, N = 8): without it the kernel issued an instruction every
#: 4.3 cycles per scheduler, 59 % of its stalls waiting on its global loads, at 15 % of DRAM
#: bandwidth. With 3 stages (session 18's run 2, block phase, docs/benchmarks.md) the tiled
#: backward with its reduction: 0.605 / 1.058 ms against 0.689 / 1.217 with keys at N = 4 /
#: 8, 0.594 / 1.032 against 0.677 / 1.191 with 16 heads (2 stages 5 % slower, 4 stages 2 %;
#: 3 or 8 programs per SM as fast as 4, 2 slower)
PARAM_STAGES = 3


@triton.jit
def _table_ptrs(tab, q, qmask, ptr_ty, ALIGNED: tl.constexpr = False):
    """Entries ``q`` (a vector of query indices) of a pointer table as typed pointers.
    ALIGNED (the launcher checked every tensor behind the table for 16-byte alignment)
    tells the compiler so: without the hint the rows behind them were read and written
    with one 2-byte instruction per element (sm_90 PTX: the forward's output stores,
    ``st.global.b16``), with it 16 bytes at a time (``st.global.v4.b32``)."""
    p = tl.load(tab + q, mask=qmask, other=0).to(ptr_ty)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _source_ahead(vtab, ktab, i, depth: tl.constexpr, offs, hh, N, cmask, ptr_ty, ALIGNED: tl.constexpr,
                  HAS_KEYS: tl.constexpr):
    """The rows of source ``i + depth``, prefetched ``depth`` sources ahead while source ``i``
    is used (``i = -1``: before the first); past the last source the mask is off, so the
    load moves no bytes."""
    more = cmask & ((tl.zeros_like(hh) + i + depth) < N)[:, None]  # a tensor also in the interpreter
    return _load_source(vtab, ktab, tl.minimum(i + depth, N - 1), offs, more, ptr_ty, ALIGNED, HAS_KEYS)


@triton.jit
def _query_tiles(qw_ptr, D, C, H, S_CHUNK, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """Index vectors, masks and the ``(Q, H, C)`` fp32 tile of ``w_s * g_s`` for a chunk of
    queries: query ``qq``, head ``hh``, column ``col`` (H, C) of a row, and the masks of
    real columns, queries, (query, column) and (query, head)."""
    qq = tl.arange(0, BLOCK_Q)
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    col = hh[:, None] * C + cc[None, :]
    cmask = (hh[:, None] < H) & (cc[None, :] < C)
    qmask = qq < S_CHUNK
    qmask3 = qmask[:, None, None] & cmask[None, :, :]
    hq = qmask[:, None] & (hh[None, :] < H)
    qw = tl.load(qw_ptr + qq[:, None, None] * D + col[None, :, :], mask=qmask3, other=0.0)
    return qq, hh, col, cmask, qmask, qmask3, hq, qw


@triton.jit
def _route_many_fwd_kernel(
    like_ptr, vtab, ktab, otab, ltab, qw_ptr, T, N, S, D, C, H, eps, tokens_per_program, stats_ptr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr, HAS_KEYS: tl.constexpr, TOKEN_MAJOR: tl.constexpr = True, STAGES: tl.constexpr = 0,
    LAZY: tl.constexpr = False, SAVE_STATS: tl.constexpr = False,
):
    """A run of ``tokens_per_program`` consecutive tokens and one chunk of BLOCK_Q queries
    per program, every chunk in one launch. TOKEN_MAJOR: the chunks of a run of tokens are
    neighbouring programs, which run at the same time and read the same source rows, so
    that the chunks after the first find them in L2 and each source is read from memory
    about once per call; otherwise the programs run one chunk's tokens after another (the
    order of one launch per chunk). The source rows come in one of two ways: STAGES >= 2
    lets Triton's software pipeliner copy them into shared memory STAGES - 1 sources ahead
    (asynchronous copies: rows in flight cost no registers); otherwise PREFETCH requests
    source i + 1 into registers while source i is used, and within a run it crosses tokens
    (the next token's first source requested with the current token's last, so that its
    load overlaps that source's sums and the output stores; the query rows are loaded once
    per run). SAVE_STATS: each source's logits and key ``rstd`` are stored to the
    ``(T, N, S * H + 1)`` table at ``stats_ptr`` for the backward (:func:`_stats_rows`)."""
    chunks = tl.cdiv(S, BLOCK_Q)
    runs = tl.cdiv(T, tokens_per_program)
    pid = tl.program_id(0).to(tl.int64)  # int64: tok * D overflows int32
    if TOKEN_MAJOR:
        run, q0 = pid // chunks, (pid % chunks) * BLOCK_Q
    else:
        run, q0 = pid % runs, (pid // runs) * BLOCK_Q
    t_start = run * tokens_per_program
    t_end = tl.minimum(t_start + tokens_per_program, T)
    act = like_ptr.dtype.element_ty  # the activation dtype: sources and outputs
    ptr_ty = tl.pointer_type(act)
    otab, ltab = otab + q0, ltab + q0
    qq, hh, col, cmask, qmask, qmask3, hq, qw = _query_tiles(qw_ptr + q0 * D, D, C, H, S - q0, BLOCK_Q, BLOCK_H,
                                                             BLOCK_C)
    out_ptrs = _table_ptrs(otab, qq, qmask, ptr_ty, ALIGNED)
    lse_ptrs = _table_ptrs(ltab, qq, qmask, tl.pointer_type(tl.float32))
    REGISTER_PREFETCH: tl.constexpr = PREFETCH and STAGES < 2
    if REGISTER_PREFETCH:
        v_raw, k_raw = _load_source(vtab, ktab, 0, t_start * D + col, cmask, ptr_ty, ALIGNED, HAS_KEYS)
    for t in range(t_start, t_end):
        tok = tl.full((), 0, tl.int64) + t  # int64 (t may be a Python int in the interpreter)
        offs = tok * D + col
        m = tl.full((BLOCK_Q, BLOCK_H), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_Q, BLOCK_H), tl.float32)
        acc = tl.zeros((BLOCK_Q, BLOCK_H, BLOCK_C), tl.float32)
        if STAGES >= 2:
            for i in tl.range(0, N, num_stages=STAGES):
                v_raw, k_raw = _load_source(vtab, ktab, i, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
                m, l, acc = _online_softmax_step(v_raw, k_raw, qw, m, l, acc, D, eps, LAZY, stats_ptr, tok, i, N,
                                                 S, H, q0, qq, hh, hq, SAVE_STATS)
        else:
            for i in range(N):
                if not REGISTER_PREFETCH:
                    v_raw, k_raw = _load_source(vtab, ktab, i, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
                v_cur, k_cur = v_raw, k_raw
                if REGISTER_PREFETCH:
                    # after the last source: the next token's first (off past the run's end)
                    wrap = (i + 1) // N
                    nxt_tok = tok + wrap
                    v_raw, k_raw = _load_source(vtab, ktab, i + 1 - wrap * N, offs + wrap * D,
                                                cmask & ((tl.zeros_like(hh) + nxt_tok) < t_end)[:, None], ptr_ty,
                                                ALIGNED, HAS_KEYS)
                m, l, acc = _online_softmax_step(v_cur, k_cur, qw, m, l, acc, D, eps, LAZY, stats_ptr, tok, i, N,
                                                 S, H, q0, qq, hh, hq, SAVE_STATS)
        acc = acc / l[:, :, None]
        lse = m + tl.log(l)
        tl.store(out_ptrs[:, None, None] + offs[None, :, :], acc.to(act), mask=qmask3)
        tl.store(lse_ptrs[:, None] + (tok * H + hh)[None, :], lse, mask=hq)


@triton.jit
def _online_softmax_step(v_raw, k_raw, qw, m, l, acc, D, eps, LAZY: tl.constexpr, stats_ptr, tok, i, N, S, H, q0, qq,
                         hh, hq, SAVE_STATS: tl.constexpr):
    """One source into the running softmax of every query and head: its logits from the key
    row (the source's own row without separate keys) RMS-normalized, then the running shift
    ``m``, sum ``l`` and weighted sum ``acc`` (route_triton.online_softmax_update). With
    SAVE_STATS the logits of this chunk's queries, and the key's ``rstd`` (by the first
    chunk's program), are stored to the stats table."""
    v = v_raw.to(tl.float32)
    k = k_raw.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 1), 0) / D + eps)
    z = tl.sum(k[None, :, :] * qw, 2) * rstd
    if SAVE_STATS:
        z_rows, r_row = _stats_rows(stats_ptr, tok, i, N, S, H, q0, qq, hh)
        tl.store(z_rows, z, mask=hq)
        tl.store(r_row, rstd, mask=q0 == 0)
    return online_softmax_update(z, v[None, :, :], m, l, acc, LAZY)


@triton.jit
def _stats_rows(stats_ptr, tok, i, N, S, H, q0, qq, hh):
    """Where the forward keeps source ``i``'s statistics of token ``tok`` for the backward:
    the ``(Q, H)`` logits of queries ``q0 + qq`` and the key's ``rstd``, in the
    ``(T, N, S * H + 1)`` float32 table (a token's row of each source: S * H logits, then
    ``rstd``). int64: the table can pass 2**31 elements."""
    row = stats_ptr + (tok.to(tl.int64) * N + i) * (S * H + 1)
    return row + ((q0 + qq) * H)[:, None] + hh[None, :], row + S * H


@triton.jit
def _store_source_grad(gtab, acctab, i, offs, mask, grad, ptr_ty, ALIGNED: tl.constexpr, ACC_IN: tl.constexpr,
                       ACC_OUT: tl.constexpr, RUNNING: tl.constexpr, run):
    """Store row block ``offs`` of source ``i``'s gradient. Chunks of queries: the earlier
    chunks' part is kept in fp32 (ACC_IN / ACC_OUT, table ``acctab``), so that the gradient
    is rounded to the activation dtype only once. RUNNING (the last chunk only): the row
    ``run`` of the source's running sum (:func:`_running_row`) is added before the rounding."""
    f32_ty = tl.pointer_type(tl.float32)
    if ACC_IN:
        grad += tl.load(_src_ptr(acctab, i, f32_ty, ALIGNED) + offs, mask=mask, other=0.0)
    if ACC_OUT:
        tl.store(_src_ptr(acctab, i, f32_ty, ALIGNED) + offs, grad, mask=mask)
    else:
        if RUNNING:
            grad += run.to(tl.float32)
        tl.store(_src_ptr(gtab, i, ptr_ty, ALIGNED) + offs, grad.to(ptr_ty.element_ty), mask=mask)


@triton.jit
def _running_row(runtab, i, N, offs, mask, ptr_ty, ALIGNED: tl.constexpr):
    """Row block ``offs`` of source ``i``'s running sum as stored (depthrewrite.grad_accumulation),
    zeros where the source has none (table entry 0) or ``i`` is past the last source: those
    loads are masked off and move no bytes. ALIGNED: vector loads (the sums are checked)."""
    idx = tl.full((), 0, tl.int32) + i  # a tensor also where i is a Python int (the interpreter)
    address = tl.load(runtab + idx, mask=idx < N, other=0)  # past the last source: 0, as no sum
    return running_sum_row(address, offs, mask, ptr_ty, ALIGNED)


@triton.jit
def _route_many_bwd_kernel(
    like_ptr, gtab, otab, ltab, gltab, vtab, gvtab, acctab, ktab, gktab, kacctab, qw_ptr, param_ptr,
    T, N, S, D, C, H, S_CHUNK, eps, stats_ptr, Q0, runtab, kruntab,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr, ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr, ONE_SOURCE: tl.constexpr,
    HAS_KEYS: tl.constexpr, PARAM_TABLE: tl.constexpr = False, STAGES: tl.constexpr = 0,
    EXACT: tl.constexpr = False, FUSED_SUMS: tl.constexpr = False, SAVED_STATS: tl.constexpr = False,
    RUNNING: tl.constexpr = False, BLOCK_Q2: tl.constexpr = 0,
):
    """The one-pass backward: one token at a time per program, all queries of the chunk
    at once, each source (and its key, with HAS_KEYS) read once; ``param_ptr`` takes the
    parameter gradients' per-program partial sums, or with PARAM_TABLE their ``dz * rstd``
    coefficients in the ``(N, S, T, H)`` table (this chunk's first query at ``param_ptr``),
    for ``_route_many_param_kernel``: no ``(Q, H, C)`` accumulator held across tokens.
    The source rows come through Triton's software pipeline with STAGES >= 2 (copied into
    shared memory STAGES - 1 sources ahead), else PREFETCH: 0, 1 (the next source requested
    while one is used) or 2 to 4 (that many ahead, the first ones requested with the output
    gradients; PER_TOKEN_PREFETCH's depths up to PER_TOKEN_PREFETCH2_ROW). EXACT: ``sum_j a_j
    <v_j, g>`` over ``sum_j a_j`` from a first walk over the sources instead of ``<out, g>`` (the config's
    ``exact_softmax_grad``). SAVED_STATS: each source's logits and key ``rstd`` come from the
    forward's stats table at ``stats_ptr`` (queries from ``Q0``) instead of two of the three
    row sums (:func:`_per_token_sums`). RUNNING (the last chunk of queries): each gradient
    is stored plus its running sum (tables ``runtab``, ``kruntab``); a value's running sum is
    requested one source ahead, as the source rows are, not at its store. BLOCK_Q2 > 0: the
    chunk's queries past the first BLOCK_Q are a second tile of BLOCK_Q2 (6 queries as 4 + 2
    rows, not 8 padded ones), its parameter sums the program's rows BLOCK_Q onwards; not with
    EXACT or PARAM_TABLE."""
    tl.static_assert(BLOCK_Q2 == 0 or not (EXACT or PARAM_TABLE), "a second tile of queries takes neither")
    pid = tl.program_id(0)
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    qq, hh, col, cmask, qmask, qmask3, hq, qw = _query_tiles(qw_ptr, D, C, H, S_CHUNK, BLOCK_Q, BLOCK_H, BLOCK_C)
    g_ptrs = _table_ptrs(gtab, qq, qmask, ptr_ty, ALIGNED)
    o_ptrs = _table_ptrs(otab, qq, qmask, ptr_ty, ALIGNED)
    l_ptrs = _table_ptrs(ltab, qq, qmask, f32_ty)
    gl_ptrs = _table_ptrs(gltab, qq, qmask, f32_ty)
    r_acc = tl.zeros((BLOCK_Q, BLOCK_H, BLOCK_C), tl.float32)  # sum over tokens, sources of dz * norm
    # the second tile's (with BLOCK_Q2 = 0 the first tile's, passed along and unused)
    qq2, qmask2, qmask32, hq2, qw2, r_acc2 = qq, qmask, qmask3, hq, qw, r_acc
    g2_ptrs, o2_ptrs, l2_ptrs, gl2_ptrs = g_ptrs, o_ptrs, l_ptrs, gl_ptrs
    if BLOCK_Q2 > 0:
        tile2 = _query_tiles(qw_ptr + BLOCK_Q * D, D, C, H, S_CHUNK - BLOCK_Q, BLOCK_Q2, BLOCK_H, BLOCK_C)
        qq2, qmask2, qmask32, hq2, qw2 = tile2[0], tile2[4], tile2[5], tile2[6], tile2[7]
        g2_ptrs = _table_ptrs(gtab + BLOCK_Q, qq2, qmask2, ptr_ty, ALIGNED)
        o2_ptrs = _table_ptrs(otab + BLOCK_Q, qq2, qmask2, ptr_ty, ALIGNED)
        l2_ptrs = _table_ptrs(ltab + BLOCK_Q, qq2, qmask2, f32_ty)
        gl2_ptrs = _table_ptrs(gltab + BLOCK_Q, qq2, qmask2, f32_ty)
        r_acc2 = tl.zeros((BLOCK_Q2, BLOCK_H, BLOCK_C), tl.float32)
    REGISTER_PREFETCH: tl.constexpr = PREFETCH if STAGES < 2 else 0

    for t in range(pid, T, tl.num_programs(0)):
        tok = tl.full((), 0, tl.int64) + t  # int64 (t may be a Python int in the interpreter)
        offs = tok * D + col
        hoffs = (tok * H + hh)[None, :]
        g = tl.load(g_ptrs[:, None, None] + offs[None, :, :], mask=qmask3, other=0.0).to(tl.float32)
        g_lse = tl.load(gl_ptrs[:, None] + hoffs, mask=hq, other=0.0)
        if REGISTER_PREFETCH >= 2:  # the first sources requested with the gradients, before the sums below
            v_nx, k_nx = _load_source(vtab, ktab, 0, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
            v_nx2, k_nx2 = _source_ahead(vtab, ktab, -1, 2, offs, hh, N, cmask, ptr_ty, ALIGNED, HAS_KEYS)
            if REGISTER_PREFETCH >= 3:
                v_nx3, k_nx3 = _source_ahead(vtab, ktab, -1, 3, offs, hh, N, cmask, ptr_ty, ALIGNED, HAS_KEYS)
            if REGISTER_PREFETCH >= 4:
                v_nx4, k_nx4 = _source_ahead(vtab, ktab, -1, 4, offs, hh, N, cmask, ptr_ty, ALIGNED, HAS_KEYS)
        lse = g_lse  # only read with several sources
        s_ada = g_lse
        if not ONE_SOURCE:
            lse = tl.load(l_ptrs[:, None] + hoffs, mask=hq, other=0.0)
            if EXACT:  # sum_j a_j <v_j, g> as the walk below forms its terms; d lse / d z_j = a_j joins it
                total, weight = tl.zeros_like(g_lse), tl.zeros_like(g_lse)
                for j in range(N):
                    v_raw, k_raw = _load_source(vtab, ktab, j, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
                    z_rows, r_row = _stats_rows(stats_ptr, tok, j, N, S, H, Q0, qq, hh)
                    a, share = _per_token_share(v_raw, k_raw, g, qw, lse, hq, D, eps, HAS_KEYS, FUSED_SUMS, z_rows,
                                                r_row, SAVED_STATS)
                    total += share
                    weight += a
                s_ada = _normalized_sum(total, weight, hq) - g_lse
            else:
                o = tl.load(o_ptrs[:, None, None] + offs[None, :, :], mask=qmask3, other=0.0).to(tl.float32)
                # sum_j a_j <v_j, g> = <out, g> per query and head; d lse / d z_j = a_j joins it
                s_ada = tl.sum(g * o, 2) - g_lse
        g2, g_lse2, lse2, s_ada2 = g, g_lse, lse, s_ada
        if BLOCK_Q2 > 0:
            g2, g_lse2, lse2, s_ada2 = _second_tile_rows(g2_ptrs, o2_ptrs, l2_ptrs, gl2_ptrs, offs, hoffs, qmask32,
                                                         hq2, ONE_SOURCE)
        if STAGES >= 2:
            for i in tl.range(0, N, num_stages=STAGES):
                v_raw, k_raw = _load_source(vtab, ktab, i, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
                run_v = v_raw  # read only with RUNNING
                if RUNNING:
                    run_v = _running_row(runtab, i, N, offs, cmask, ptr_ty, ALIGNED)
                r_acc, r_acc2 = _source_grads(
                    v_raw, k_raw, i, tok, offs, g, g_lse, lse, s_ada, qw, r_acc, qq, hq, g2, g_lse2, lse2, s_ada2, qw2,
                    r_acc2, qq2, hq2, hh, cmask, gvtab, acctab, gktab, kacctab, param_ptr, stats_ptr, Q0, T, N, S, D, H,
                    eps, ptr_ty, ALIGNED, ACC_IN, ACC_OUT, ONE_SOURCE, HAS_KEYS, PARAM_TABLE, FUSED_SUMS, SAVED_STATS,
                    kruntab, RUNNING, run_v, BLOCK_Q, BLOCK_Q2)
        else:
            if REGISTER_PREFETCH == 1:
                v_nx, k_nx = _load_source(vtab, ktab, 0, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
            if RUNNING:
                run_nx = _running_row(runtab, 0, N, offs, cmask, ptr_ty, ALIGNED)
            for i in range(N):
                if REGISTER_PREFETCH:  # the sources ahead move up a slot; the deepest is requested
                    v_raw, k_raw = v_nx, k_nx
                    if REGISTER_PREFETCH >= 2:
                        v_nx, k_nx = v_nx2, k_nx2
                    if REGISTER_PREFETCH >= 3:
                        v_nx2, k_nx2 = v_nx3, k_nx3
                    if REGISTER_PREFETCH >= 4:
                        v_nx3, k_nx3 = v_nx4, k_nx4
                    v_new, k_new = _source_ahead(vtab, ktab, i, REGISTER_PREFETCH, offs, hh, N, cmask, ptr_ty,
                                                 ALIGNED, HAS_KEYS)
                    if REGISTER_PREFETCH == 1:
                        v_nx, k_nx = v_new, k_new
                    elif REGISTER_PREFETCH == 2:
                        v_nx2, k_nx2 = v_new, k_new
                    elif REGISTER_PREFETCH == 3:
                        v_nx3, k_nx3 = v_new, k_new
                    else:
                        v_nx4, k_nx4 = v_new, k_new
                else:
                    v_raw, k_raw = _load_source(vtab, ktab, i, offs, cmask, ptr_ty, ALIGNED, HAS_KEYS)
                run_v = v_raw  # read only with RUNNING
                if RUNNING:  # this source's running sum, the next one's requested
                    run_v = run_nx
                    run_nx = _running_row(runtab, i + 1, N, offs, cmask, ptr_ty, ALIGNED)
                r_acc, r_acc2 = _source_grads(
                    v_raw, k_raw, i, tok, offs, g, g_lse, lse, s_ada, qw, r_acc, qq, hq, g2, g_lse2, lse2, s_ada2, qw2,
                    r_acc2, qq2, hq2, hh, cmask, gvtab, acctab, gktab, kacctab, param_ptr, stats_ptr, Q0, T, N, S, D, H,
                    eps, ptr_ty, ALIGNED, ACC_IN, ACC_OUT, ONE_SOURCE, HAS_KEYS, PARAM_TABLE, FUSED_SUMS, SAVED_STATS,
                    kruntab, RUNNING, run_v, BLOCK_Q, BLOCK_Q2)

    if not PARAM_TABLE:
        part = param_ptr + pid.to(tl.int64) * (BLOCK_Q + BLOCK_Q2) * D
        tl.store(part + qq[:, None, None] * D + col[None, :, :], r_acc, mask=qmask3)
        if BLOCK_Q2 > 0:
            tl.store(part + (BLOCK_Q + qq2)[:, None, None] * D + col[None, :, :], r_acc2, mask=qmask32)


@triton.jit
def _source_grads(v_raw, k_raw, i, tok, offs, g, g_lse, lse, s_ada, qw, r_acc, qq, hq, g2, g_lse2, lse2, s_ada2, qw2,
                  r_acc2, qq2, hq2, hh, cmask, gvtab, acctab, gktab, kacctab, param_ptr, stats_ptr, Q0, T, N, S, D, H,
                  eps, ptr_ty, ALIGNED: tl.constexpr, ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr,
                  ONE_SOURCE: tl.constexpr, HAS_KEYS: tl.constexpr, PARAM_TABLE: tl.constexpr,
                  FUSED_SUMS: tl.constexpr, SAVED_STATS: tl.constexpr, kruntab, RUNNING: tl.constexpr, run_v,
                  BLOCK_Q: tl.constexpr, BLOCK_Q2: tl.constexpr):
    """Source ``i``'s part of the per-token backward for the chunk's queries in one tile
    (:func:`_per_token_source_grads`) or, with BLOCK_Q2 > 0, two (:func:`_per_token_source_grads2`);
    returns both tiles' parameter-sum accumulators (the second passed through with one tile)."""
    z_rows, r_row = _stats_rows(stats_ptr, tok, i, N, S, H, Q0, qq, hh)
    if BLOCK_Q2 > 0:
        z_rows2 = _stats_rows(stats_ptr, tok, i, N, S, H, Q0 + BLOCK_Q, qq2, hh)[0]
        r_acc, r_acc2 = _per_token_source_grads2(
            v_raw, k_raw, i, offs, g, g_lse, lse, s_ada, qw, r_acc, hq, g2, g_lse2, lse2, s_ada2, qw2, r_acc2, hq2,
            cmask, gvtab, acctab, gktab, kacctab, N, D, eps, ptr_ty, ALIGNED, ACC_IN, ACC_OUT, ONE_SOURCE, HAS_KEYS,
            FUSED_SUMS, z_rows, z_rows2, r_row, SAVED_STATS, kruntab, RUNNING, run_v)
    else:
        r_acc = _per_token_source_grads(
            v_raw, k_raw, i, tok, offs, g, g_lse, lse, s_ada, qw, r_acc, qq, hq, cmask, gvtab, acctab, gktab, kacctab,
            param_ptr, T, N, S, D, H, eps, ptr_ty, ALIGNED, ACC_IN, ACC_OUT, ONE_SOURCE, HAS_KEYS, PARAM_TABLE,
            FUSED_SUMS, z_rows, r_row, SAVED_STATS, kruntab, RUNNING, run_v)
    return r_acc, r_acc2


@triton.jit
def _second_tile_rows(g_ptrs, o_ptrs, l_ptrs, gl_ptrs, offs, hoffs, qmask3, hq, ONE_SOURCE: tl.constexpr):
    """A token's output gradients, log-sum-exp gradients and log-sum-exps of the second tile
    of queries, and ``<out, g> - d lse`` per query and head (the first tile's loads, without
    EXACT)."""
    g = tl.load(g_ptrs[:, None, None] + offs[None, :, :], mask=qmask3, other=0.0).to(tl.float32)
    g_lse = tl.load(gl_ptrs[:, None] + hoffs, mask=hq, other=0.0)
    lse, s_ada = g_lse, g_lse  # only read with several sources
    if not ONE_SOURCE:
        lse = tl.load(l_ptrs[:, None] + hoffs, mask=hq, other=0.0)
        o = tl.load(o_ptrs[:, None, None] + offs[None, :, :], mask=qmask3, other=0.0).to(tl.float32)
        s_ada = tl.sum(g * o, 2) - g_lse
    return g, g_lse, lse, s_ada


@triton.jit
def _fp32_rows(v_raw, k_raw, HAS_KEYS: tl.constexpr):
    """A source's value and key rows as stored, in fp32 (the key is the value unless HAS_KEYS)."""
    v = v_raw.to(tl.float32)
    k = v
    if HAS_KEYS:
        k = k_raw.to(tl.float32)
    return v, k


@triton.jit
def _per_token_sums(v, k, g, qw, lse, hq, D, eps, FUSED_SUMS: tl.constexpr, z_rows, r_row, SAVED_STATS: tl.constexpr):
    """Per query and head of the chunk, a source's weight ``a = exp(z - lse)``, logit ``zr``
    and ``da = <v, g>``, and the key's ``rstd``, from its fp32 value and key rows. With
    SAVED_STATS the logits and ``rstd`` are the forward's (at ``z_rows``, ``r_row``) and
    ``<v, g>`` the one row sum; else the three row sums (the key's squares, ``<k, qw>``,
    ``<v, g>``) in one reduction with FUSED_SUMS (:func:`three_row_sums`), or one by one."""
    if SAVED_STATS:
        zr = tl.load(z_rows, mask=hq, other=0.0)
        da = tl.sum(v[None, :, :] * g, 2)
        return tl.where(hq, tl.exp(zr - lse), 0.0), zr, tl.load(r_row), da
    if FUSED_SUMS:
        squares, dots, da = three_row_sums(tl.broadcast_to((k * k)[None, :, :], qw.shape), k[None, :, :] * qw,
                                           v[None, :, :] * g)
        # every query row holds the same sum of squares: the row's is their largest
        rstd = tl.rsqrt(tl.max(tl.sum(squares, 1), 0) / D + eps)
    else:
        rstd = tl.rsqrt(tl.sum(tl.sum(k * k, 1), 0) / D + eps)
        dots, da = tl.sum(k[None, :, :] * qw, 2), tl.sum(v[None, :, :] * g, 2)
    zr = dots * rstd
    return tl.where(hq, tl.exp(zr - lse), 0.0), zr, rstd, da


@triton.jit
def _per_token_share(v_raw, k_raw, g, qw, lse, hq, D, eps, HAS_KEYS: tl.constexpr, FUSED_SUMS: tl.constexpr, z_rows,
                     r_row, SAVED_STATS: tl.constexpr):
    """A source's weight ``a`` and term ``a <v, g>`` of ``sum_j a_j <v_j, g>`` (per query and
    head), computed as :func:`_per_token_source_grads` computes ``a`` and ``<v, g>``."""
    v, k = _fp32_rows(v_raw, k_raw, HAS_KEYS)
    a, _, _, da = _per_token_sums(v, k, g, qw, lse, hq, D, eps, FUSED_SUMS, z_rows, r_row, SAVED_STATS)
    return a, a * da


@triton.jit
def _per_token_source_grads(v_raw, k_raw, i, tok, offs, g, g_lse, lse, s_ada, qw, r_acc, qq, hq, cmask, gvtab,
                            acctab, gktab, kacctab, param_ptr, T, N, S, D, H, eps, ptr_ty, ALIGNED: tl.constexpr,
                            ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr, ONE_SOURCE: tl.constexpr,
                            HAS_KEYS: tl.constexpr, PARAM_TABLE: tl.constexpr, FUSED_SUMS: tl.constexpr, z_rows,
                            r_row, SAVED_STATS: tl.constexpr, kruntab, RUNNING: tl.constexpr, run_v):
    """Source ``i``'s part of the per-token backward for every query of the chunk: its value
    (and key) gradient stored, its ``dz * norm`` added to ``r_acc`` (returned) or, with
    PARAM_TABLE, ``dz * rstd`` stored to the parameter table. RUNNING: ``run_v`` is the
    value's running sum row; a key's is loaded here (table ``kruntab``)."""
    v, k = _fp32_rows(v_raw, k_raw, HAS_KEYS)
    a, zr, rstd, da = _per_token_sums(v, k, g, qw, lse, hq, D, eps, FUSED_SUMS, z_rows, r_row, SAVED_STATS)
    if ONE_SOURCE:
        # weight exactly 1 and out = v: dz = a (<v, g> - <out, g> + d lse) is d lse
        # exactly (computed, the two sums would leave rounding noise where 0 is exact)
        a = tl.where(hq, 1.0, 0.0)
        dz = g_lse
    else:
        dz = a * (da - s_ada)
    mt = tl.sum(tl.sum(dz * zr, 1), 0) / D  # mean_c(d_norm * norm), all queries
    norm = k * rstd
    if PARAM_TABLE:
        hh = tl.arange(0, hq.shape[1])
        rows = (_query_base(i, 0, S, T, H) + (qq[:, None].to(tl.int64) * T + tok) * H) + hh[None, :]
        tl.store(param_ptr + rows, dz * rstd, mask=hq)
    else:
        r_acc += dz[:, :, None] * norm[None, :, :]
    d_key = rstd * (tl.sum(dz[:, :, None] * qw, 0) - norm * mt)
    d_value = tl.sum(a[:, :, None] * g, 0)
    _store_source_grads(d_value, d_key, i, offs, cmask, gvtab, acctab, gktab, kacctab, N, ptr_ty, ALIGNED, ACC_IN,
                        ACC_OUT, HAS_KEYS, kruntab, RUNNING, run_v)
    return r_acc


@triton.jit
def _store_source_grads(d_value, d_key, i, offs, cmask, gvtab, acctab, gktab, kacctab, N, ptr_ty,
                        ALIGNED: tl.constexpr, ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr, HAS_KEYS: tl.constexpr,
                        kruntab, RUNNING: tl.constexpr, run_v):
    """Source ``i``'s value and key gradients stored (one sum without separate keys)."""
    if HAS_KEYS:
        _store_source_grad(gvtab, acctab, i, offs, cmask, d_value, ptr_ty, ALIGNED, ACC_IN, ACC_OUT, RUNNING, run_v)
        run_k = run_v
        if RUNNING:
            run_k = _running_row(kruntab, i, N, offs, cmask, ptr_ty, ALIGNED)
        _store_source_grad(gktab, kacctab, i, offs, cmask, d_key, ptr_ty, ALIGNED, ACC_IN, ACC_OUT, RUNNING, run_k)
    else:
        _store_source_grad(gvtab, acctab, i, offs, cmask, d_value + d_key, ptr_ty, ALIGNED, ACC_IN, ACC_OUT,
                           RUNNING, run_v)


@triton.jit
def _per_token_source_grads2(v_raw, k_raw, i, offs, g, g_lse, lse, s_ada, qw, r_acc, hq, g2, g_lse2, lse2, s_ada2,
                             qw2, r_acc2, hq2, cmask, gvtab, acctab, gktab, kacctab, N, D, eps, ptr_ty,
                             ALIGNED: tl.constexpr, ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr,
                             ONE_SOURCE: tl.constexpr, HAS_KEYS: tl.constexpr, FUSED_SUMS: tl.constexpr, z_rows,
                             z_rows2, r_row, SAVED_STATS: tl.constexpr, kruntab, RUNNING: tl.constexpr, run_v):
    """:func:`_per_token_source_grads` for a chunk of queries held as two tiles (the second's
    tensors suffixed 2), each with its own parameter-sum accumulator (returned as a pair);
    the key's ``rstd`` comes from the first tile's row sums."""
    v, k = _fp32_rows(v_raw, k_raw, HAS_KEYS)
    a, zr, rstd, da = _per_token_sums(v, k, g, qw, lse, hq, D, eps, FUSED_SUMS, z_rows, r_row, SAVED_STATS)
    a2, zr2, da2 = _second_tile_sums(v, k, g2, qw2, lse2, hq2, rstd, FUSED_SUMS, z_rows2, SAVED_STATS)
    if ONE_SOURCE:  # as in _per_token_source_grads: dz is d lse exactly
        a, a2 = tl.where(hq, 1.0, 0.0), tl.where(hq2, 1.0, 0.0)
        dz, dz2 = g_lse, g_lse2
    else:
        dz, dz2 = a * (da - s_ada), a2 * (da2 - s_ada2)
    mt = (tl.sum(tl.sum(dz * zr, 1), 0) + tl.sum(tl.sum(dz2 * zr2, 1), 0)) / D  # mean_c(d_norm * norm), all queries
    norm = k * rstd
    r_acc += dz[:, :, None] * norm[None, :, :]
    r_acc2 += dz2[:, :, None] * norm[None, :, :]
    d_key = rstd * (tl.sum(dz[:, :, None] * qw, 0) + tl.sum(dz2[:, :, None] * qw2, 0) - norm * mt)
    d_value = tl.sum(a[:, :, None] * g, 0) + tl.sum(a2[:, :, None] * g2, 0)
    _store_source_grads(d_value, d_key, i, offs, cmask, gvtab, acctab, gktab, kacctab, N, ptr_ty, ALIGNED, ACC_IN,
                        ACC_OUT, HAS_KEYS, kruntab, RUNNING, run_v)
    return r_acc, r_acc2


@triton.jit
def _second_tile_sums(v, k, g, qw, lse, hq, rstd, FUSED_SUMS: tl.constexpr, z_rows, SAVED_STATS: tl.constexpr):
    """The second tile's weights ``a``, logits ``zr`` and ``<v, g>`` per query and head, with the
    key's ``rstd`` given: its two row sums (``<k, qw>``, ``<v, g>``) joined in one reduction with
    FUSED_SUMS, or with SAVED_STATS the logits from the forward's table and ``<v, g>`` alone."""
    if SAVED_STATS:
        zr = tl.load(z_rows, mask=hq, other=0.0)
        da = tl.sum(v[None, :, :] * g, 2)
    else:
        if FUSED_SUMS:
            dots, da = tl.split(tl.sum(tl.join(k[None, :, :] * qw, v[None, :, :] * g), 2))
        else:
            dots, da = tl.sum(k[None, :, :] * qw, 2), tl.sum(v[None, :, :] * g, 2)
        zr = dots * rstd
    return tl.where(hq, tl.exp(zr - lse), 0.0), zr, da


@triton.jit
def _query_base(i, s, S, T, H):
    """Start of the ``(T, H)`` slab of source ``i`` and query ``s`` in an ``(N, S, T, H)``
    buffer, in int64 (the buffer can pass 2**31 elements)."""
    return ((tl.full((), 0, tl.int64) + i) * S + s) * T * H


@triton.jit
def _tiled_rstd(k, D, eps):
    """Per token of a tile, the key rows' ``rstd`` (``k``: (T, H, C) fp32)."""
    return tl.rsqrt(tl.sum(tl.sum(k * k, 2), 1) / D + eps)


@triton.jit
def _tiled_weight(k, qw, rstd, lse, hmask):
    """Per token and head of a tile, one query's weight of a source ``a = exp(z - lse)``
    and its logit ``zr``."""
    zr = tl.sum(k * qw[None, :, :], 2) * rstd[:, None]
    return tl.where(hmask, tl.exp(zr - lse), 0.0), zr


@triton.jit
def _route_many_bwd_tiled_kernel(
    like_ptr, gtab, otab, ltab, gltab, vtab, gvtab, ktab, gktab, qw_ptr, sada_ptr, coef_ptr, T, N, S, D, C, H, eps,
    runtab, kruntab,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr, ONE_SOURCE: tl.constexpr, HAS_KEYS: tl.constexpr, EXACT: tl.constexpr = False,
    RUNNING: tl.constexpr = False,
):
    act = like_ptr.dtype.element_ty
    ptr_ty = tl.pointer_type(act)
    f32_ty = tl.pointer_type(tl.float32)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    tmask = tok < T
    col = hh[:, None] * C + cc[None, :]
    cmask = (hh[:, None] < H) & (cc[None, :] < C)
    offs = tok[:, None, None] * D + col[None, :, :]
    mask = tmask[:, None, None] & cmask[None, :, :]
    hoffs = tok[:, None] * H + hh[None, :]
    hmask = tmask[:, None] & (hh < H)[None, :]

    # per query and head: <g_s, out_s> - d lse_s (with one source: d lse_s, the whole dz;
    # EXACT: sum_j a_j <v_j, g_s> over sum_j a_j from a walk over the sources), into a
    # scratch slab of this program's tokens, read back once per source below
    for s in range(S):
        g_lse = tl.load(_src_ptr(gltab, s, f32_ty, False) + hoffs, mask=hmask, other=0.0)
        if ONE_SOURCE:
            s_ada = g_lse
        else:
            g = tl.load(_src_ptr(gtab, s, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
            if EXACT:
                qw = tl.load(qw_ptr + s * D + col, mask=cmask, other=0.0)
                lse = tl.load(_src_ptr(ltab, s, f32_ty, False) + hoffs, mask=hmask, other=0.0)
                total, weight = tl.zeros_like(g_lse), tl.zeros_like(g_lse)
                for j in range(N):
                    v_raw, k_raw = _load_source(vtab, ktab, j, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
                    v = v_raw.to(tl.float32)
                    k = k_raw.to(tl.float32)
                    a = _tiled_weight(k, qw, _tiled_rstd(k, D, eps), lse, hmask)[0]
                    total += a * tl.sum(v * g, 2)
                    weight += a
                s_ada = _normalized_sum(total, weight, hmask) - g_lse
            else:
                o = tl.load(_src_ptr(otab, s, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
                s_ada = tl.sum(g * o, 2) - g_lse
        tl.store(sada_ptr + _query_base(0, s, S, T, H) + hoffs, s_ada, mask=hmask)
    tl.debug_barrier()  # other threads of the program read these values back

    if PREFETCH:
        v_nx, k_nx = _load_source(vtab, ktab, 0, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
    for i in range(N):
        if PREFETCH:
            v = v_nx.to(tl.float32)
            k = k_nx.to(tl.float32)
            nxt, more = _next_source(tok, i, N, mask)
            v_nx, k_nx = _load_source(vtab, ktab, nxt, offs, more, ptr_ty, ALIGNED, HAS_KEYS)
        else:
            v_raw, k_raw = _load_source(vtab, ktab, i, offs, mask, ptr_ty, ALIGNED, HAS_KEYS)
            v = v_raw.to(tl.float32)
            k = k_raw.to(tl.float32)  # the source itself unless HAS_KEYS
        rstd = _tiled_rstd(k, D, eps)
        acc_g = tl.zeros((BLOCK_T, BLOCK_H, BLOCK_C), tl.float32)  # sum_s a_s g_s
        acc_q = tl.zeros((BLOCK_T, BLOCK_H, BLOCK_C), tl.float32)  # sum_s dz_s w_s q_s
        mt = tl.zeros((BLOCK_T,), tl.float32)  # sum over queries and heads of dz_s z_s (the norm's term)
        # the queries one at a time: their output-gradient rows are read from cache once per
        # source (the first source brought them in), so a program holds a few rows, not S
        if PREFETCH:
            g_nx = tl.load(_src_ptr(gtab, 0, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0)
        for s in range(S):
            qw = tl.load(qw_ptr + s * D + col, mask=cmask, other=0.0)
            if PREFETCH:  # the next query's rows are requested before this one's are used
                g = g_nx.to(tl.float32)
                nxt, more = _next_source(tok, s, S, mask)
                g_nx = tl.load(_src_ptr(gtab, nxt, ptr_ty, ALIGNED) + offs, mask=more, other=0.0)
            else:
                g = tl.load(_src_ptr(gtab, s, ptr_ty, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
            s_ada = tl.load(sada_ptr + _query_base(0, s, S, T, H) + hoffs, mask=hmask, other=0.0)
            if ONE_SOURCE:
                # weight exactly 1 and out = v: dz is d lse exactly (see the per-token kernel)
                zr = tl.sum(k * qw[None, :, :], 2) * rstd[:, None]
                a = tl.where(hmask, 1.0, 0.0)
                dz = s_ada
            else:
                lse = tl.load(_src_ptr(ltab, s, f32_ty, False) + hoffs, mask=hmask, other=0.0)
                a, zr = _tiled_weight(k, qw, rstd, lse, hmask)
                dz = a * (tl.sum(v * g, 2) - s_ada)
            acc_g += a[:, :, None] * g
            acc_q += dz[:, :, None] * qw[None, :, :]
            mt += tl.sum(dz * zr, 1)
            # d z / d (w q) is the normalized key: the parameter gradients are a separate
            # reduction over tokens of dz * rstd * k (_route_many_param_kernel)
            tl.store(coef_ptr + _query_base(i, s, S, T, H) + hoffs, dz * rstd[:, None], mask=hmask)
        d_key = rstd[:, None, None] * (acc_q - k * (rstd * mt / D)[:, None, None])
        run_v, run_k = v, k  # read only with RUNNING: the running sums' rows
        if RUNNING:
            run_v = _running_row(runtab, i, N, offs, mask, ptr_ty, ALIGNED)
            if HAS_KEYS:
                run_k = _running_row(kruntab, i, N, offs, mask, ptr_ty, ALIGNED)
        if HAS_KEYS:
            _store_source_grad(gvtab, gvtab, i, offs, mask, acc_g, ptr_ty, ALIGNED, False, False, RUNNING, run_v)
            _store_source_grad(gktab, gktab, i, offs, mask, d_key, ptr_ty, ALIGNED, False, False, RUNNING, run_k)
        else:
            _store_source_grad(gvtab, gvtab, i, offs, mask, acc_g + d_key, ptr_ty, ALIGNED, False, False, RUNNING,
                               run_v)


@triton.jit
def _route_many_param_kernel(
    like_ptr, vtab, coef_ptr, part_ptr, T, N, S, D, C, H, tokens_per_program, query_chunks,
    BLOCK_TT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_CC: tl.constexpr, ALIGNED: tl.constexpr,
    STAGES: tl.constexpr = 0,
):
    """``r[s, col] = sum over tokens t and sources i of coef[i, s, t, head(col)] * v_i[t, col]``
    for one head, one block of its columns, one chunk of queries and one range of tokens;
    the ranges' partial sums are added in a fixed order afterwards (deterministic). With
    STAGES >= 2 each source's tiles come through Triton's software pipeline (copied into
    shared memory STAGES - 1 tiles ahead; without it a program waits for every tile)."""
    ptr_ty = tl.pointer_type(like_ptr.dtype.element_ty)
    h = tl.program_id(0) // query_chunks
    q0 = (tl.program_id(0) % query_chunks) * BLOCK_Q
    split = tl.program_id(2)
    cc = tl.program_id(1) * BLOCK_CC + tl.arange(0, BLOCK_CC)
    col = h * C + cc
    cmask = cc < C
    qq = q0 + tl.arange(0, BLOCK_Q)
    qmask = qq < S
    t_start = split.to(tl.int64) * tokens_per_program
    t_end = tl.minimum(t_start + tokens_per_program, T)
    acc = tl.zeros((BLOCK_TT, BLOCK_Q, BLOCK_CC), tl.float32)
    for i in range(N):
        v_ptr = _src_ptr(vtab, i, ptr_ty, ALIGNED)
        if STAGES >= 2:
            for t0 in tl.range(t_start, t_end, BLOCK_TT, num_stages=STAGES):
                acc = _param_tile(acc, v_ptr, coef_ptr, i, t0, t_end, col, cmask, qq, qmask, h, S, T, D, H, BLOCK_TT)
        else:
            for t0 in range(t_start, t_end, BLOCK_TT):
                acc = _param_tile(acc, v_ptr, coef_ptr, i, t0, t_end, col, cmask, qq, qmask, h, S, T, D, H, BLOCK_TT)
    r = tl.sum(acc, 0)
    out = part_ptr + split.to(tl.int64) * S * D
    tl.store(out + qq[:, None] * D + col[None, :], r, mask=qmask[:, None] & cmask[None, :])


@triton.jit
def _param_tile(acc, v_ptr, coef_ptr, i, t0, t_end, col, cmask, qq, qmask, h, S, T, D, H, BLOCK_TT: tl.constexpr):
    """``acc`` plus source ``i``'s terms for the BLOCK_TT tokens from ``t0``."""
    tt = t0 + tl.arange(0, BLOCK_TT).to(tl.int64)
    tm = tt < t_end
    v = tl.load(v_ptr + tt[:, None] * D + col[None, :], mask=tm[:, None] & cmask[None, :], other=0.0)
    cf = tl.load(coef_ptr + _query_base(i, 0, S, T, H) + (qq[None, :].to(tl.int64) * T + tt[:, None]) * H + h,
                 mask=tm[:, None] & qmask[None, :], other=0.0)
    return acc + cf[:, :, None] * v.to(tl.float32)[:, None, :]


# ------------------------------------------------------------------------ launchers


def _query_block(s: int, row: int, config: dict, preferred: int | None) -> int:
    """Queries per launch: ``config["block_q"]``, else ``preferred``, else all S (padded to a
    power of two), never more than fit the on-chip budget ``many_elems``."""
    fit = max(1, config.get("many_elems", MANY_ELEMS) // row)
    fit = 1 << (fit.bit_length() - 1)  # round down to a power of two
    want = config.get("block_q") or preferred or _next_pow2(s)
    return min(_next_pow2(s), _next_pow2(want), fit)


def _per_query_rows(queries: Tensor, key_norm_weights: Tensor) -> Tensor:
    # the logit needs only w_s * g_s (fp32): one (S, d) table instead of two
    return (queries.to(torch.float32) * key_norm_weights.to(torch.float32)).contiguous()


def route_many_forward(values: Sequence[Tensor], queries: Tensor, key_norm_weights: Tensor, heads: int, eps: float,
                       config: dict | None = None, keys: Sequence[Tensor] | None = None, stats: Tensor | None = None
                       ) -> tuple[list[Tensor], list[Tensor]]:
    """Fused forward; inputs as checked by ``depthrewrite.ops.route_many``. Returns the first
    two of what ``depthrewrite::route_many`` returns: S outputs and S float32 log-sum-exps
    (its third, the statistics table, is filled into ``stats``, below). ``config``
    overrides the launch choices (``block_q``, ``many_elems``, ``num_warps``, ``prefetch``,
    ``order``: FORWARD_ORDER's choices, ``tokens_per_program``: consecutive tokens per
    program, ``stages``: the sources' software pipeline, 0 for the register prefetch,
    ``maxnreg``: a register cap, None for none; ``lazy_rescale``: the online softmax's
    rescale; unset: the measured choices, ONE_HEAD_FORWARD_TOKENS' and
    KEYED_FORWARD_MAXNREG's comments, :func:`_many_forward_lazy`). ``stats``: a float32
    ``(T, N, S * H + 1)`` tensor the kernel fills with each source's logits and key ``rstd``
    for :func:`route_many_backward` (``depthrewrite::route_many``'s ``stats``), or None.
    One token per program: several (the layout of ``route``'s forward) was slower at every
    measured shape, up to 4x with 16 heads (docs/benchmarks.md, session 9)."""
    _check_route_many_call(values, queries, key_norm_weights, heads, eps, keys)
    cfg = {"prefetch": True, **(config or {})}
    prefetch = _check_prefetch(cfg["prefetch"], "route_many")
    s, d = queries.shape[0], values[0].shape[-1]
    block_h, block_c = _row_blocks(d, heads, "route_many")
    # the kernels take (tokens, d) rows behind each pointer: contiguous tensors of any batch shape
    flat_v = _contiguous(values)
    flat_k = _contiguous(keys) if keys is not None else []
    shape = values[0].shape
    tokens = _tokens(flat_v)
    out = [torch.empty_like(flat_v[0]) for _ in range(s)]
    lse = [torch.empty(shape[:-1] + (heads,), dtype=torch.float32, device=flat_v[0].device) for _ in range(s)]
    _check_stats(stats, tokens, len(values), s, heads, flat_v[0].device)
    if tokens == 0:
        return out, lse
    qw = _per_query_rows(queries, key_norm_weights)
    tables = pointer_tables(flat_v[0].device, flat_v, out, lse, flat_k)
    vtab, otab, ltab, ktab = tables
    if not flat_k:  # the keys are the values (an empty table is never read)
        ktab = vtab
    aligned = tables.all_aligned(0, 1, 3)  # the rows' tables: values, outputs, keys
    row = block_h * block_c
    block_q = _query_block(s, row, cfg, _many_forward_queries(heads, row))
    order = _checked_choice("order", cfg.get("order") or FORWARD_ORDER, FORWARD_ORDERS)
    chunks = cdiv(s, block_q)
    per_program = cfg.get("tokens_per_program")
    per_program = _positive_int("route_many", "tokens_per_program",
                                _many_forward_tokens(heads) if per_program is None else per_program)
    runs = cdiv(tokens, per_program)
    _check_grid(tokens, runs, per_program, chunks, block_q)
    # per pipeline stage: one token's source row (and key row), which the program's queries share
    stage_bytes = row * (1 + bool(flat_k)) * flat_v[0].dtype.itemsize
    stages = fit_stages("route_many", _check_stages(cfg.get("stages"), _many_forward_stages(heads), "route_many"),
                        stage_bytes, flat_v[0].device, _configured(config, "stages"))
    _route_many_fwd_kernel[(runs * chunks,)](
        flat_v[0], vtab, ktab, otab, ltab, qw, tokens, len(values), s, d, d // heads, heads,
        float(eps), per_program, qw if stats is None else stats, BLOCK_Q=block_q, BLOCK_H=block_h,
        BLOCK_C=block_c, PREFETCH=prefetch, SAVE_STATS=stats is not None,
        ALIGNED=aligned, HAS_KEYS=bool(flat_k), TOKEN_MAJOR=order == "token_major",
        STAGES=stages,
        LAZY=check_flag(cfg.get("lazy_rescale", _many_forward_lazy(heads)), "lazy_rescale", "route_many"),
        num_warps=cfg.get("num_warps") or _many_forward_warps(heads, row),
        **_register_cap({"maxnreg": _many_forward_cap(heads, row, bool(flat_k)), **cfg}, "route_many"))
    return out, lse


def _check_stats(stats: Tensor | None, tokens: int, n: int, s: int, heads: int, device) -> None:
    """``stats`` None, or the float32 ``(T, N, S * H + 1)`` contiguous table of these calls."""
    if stats is None:
        return
    shape = (tokens, n, s * heads + 1)
    if (not isinstance(stats, Tensor) or tuple(stats.shape) != shape or stats.dtype != torch.float32
            or not stats.is_contiguous() or stats.device != device):
        found = (f"{tuple(stats.shape)} {stats.dtype} on {stats.device}, contiguous={stats.is_contiguous()}"
                 if isinstance(stats, Tensor) else type(stats).__name__)
        raise ValueError(f"route_many (Triton): `stats` must be a contiguous float32 tensor of shape {shape} "
                         f"(tokens, sources, queries * heads + 1) on {device}; found {found}")


def _checked_choice(name: str, choice: str, choices: tuple) -> str:
    """``choice``, the launch config's entry ``name``, if it is one of ``choices``."""
    if choice not in choices:
        raise ValueError(f"route_many (Triton): config {name} must be one of {choices}; found {choice!r}")
    return choice


def _check_grid(tokens: int, runs: int, per_program: int, chunks: int, block_q: int) -> None:
    """A one-dimensional launch holds at most 2**31 - 1 programs (CUDA's grid limit): the
    forward's ``runs`` runs of tokens times its ``chunks`` chunks of queries (the message is
    made only when it is raised: every call pays this check)."""
    programs = runs * chunks
    if programs > MAX_PROGRAMS:
        raise ValueError(f"route_many (Triton): a forward launch of {tokens} tokens in {runs} runs of at most "
                         f"{per_program} x {chunks} chunks of {block_q} queries = {programs} programs; "
                         f"at most {MAX_PROGRAMS} are supported (pass fewer tokens per call)")


def _narrow_multi_head(heads: int, row: int) -> bool:
    return heads > 1 and row <= NARROW_ROW


def _many_forward_queries(heads: int, row: int) -> int:
    """The forward's preferred queries per program for a padded row (measured, FORWARD_QUERIES'
    comment): 1 for several heads up to d = 1024, else 2."""
    return MULTI_HEAD_FORWARD_QUERIES if _narrow_multi_head(heads, row) else FORWARD_QUERIES


def _many_forward_tokens(heads: int) -> int:
    """Consecutive tokens per forward program (measured, ONE_HEAD_FORWARD_TOKENS' comment)."""
    return ONE_HEAD_FORWARD_TOKENS if heads == 1 else 1


def _many_forward_stages(heads: int) -> int:
    """The forward's pipeline stages (measured, ONE_HEAD_FORWARD_TOKENS' comment)."""
    return ONE_HEAD_FORWARD_STAGES if heads == 1 else 0


def _many_forward_lazy(heads: int) -> bool:
    """The forward's rescale (route_triton.LAZY_RESCALE's comment): lazy for one head.
    Several heads keep the eager rescale: the branch's maximum over the heads crosses the
    program's warps (a barrier a source), and a head's rescale multiplies only its C
    columns. Session 34 (H200, bf16, 16384 tokens, d = 1024, S = 6, 16 heads): 0.314 / 0.521
    ms lazy against 0.300 / 0.501 eager at N = 4 / 8 (docs/benchmarks.md)."""
    return route_triton.LAZY_RESCALE and heads == 1


def _many_forward_cap(heads: int, row: int, has_keys: bool) -> int | None:
    """The forward's register cap (KEYED_FORWARD_MAXNREG's comment): KEYED_FORWARD_MAXNREG
    for one head with separate keys on rows of NARROW_ROW, else none."""
    return KEYED_FORWARD_MAXNREG if heads == 1 and has_keys and row == NARROW_ROW else None


def _many_forward_warps(heads: int, row: int) -> int:
    """The forward's warps for a padded row (measured, FORWARD_QUERIES' comment): with keys
    or without, since session 16."""
    if _narrow_multi_head(heads, row):
        return MULTI_HEAD_FORWARD_WARPS
    return _forward_warps(heads, row, NUM_WARPS, MANY_NARROW_FORWARD_WARPS)


def route_many_backward(grad_out: Sequence[Tensor], grad_lse: Sequence[Tensor], out: Sequence[Tensor],
                        lse: Sequence[Tensor], values: Sequence[Tensor], queries: Tensor, key_norm_weights: Tensor,
                        heads: int, eps: float, config: dict | None = None, keys: Sequence[Tensor] | None = None,
                        stats: Tensor | None = None, grad_values_acc: Sequence[Tensor | None] | None = None,
                        grad_keys_acc: Sequence[Tensor | None] | None = None,
                        grad_values_out: Sequence[Tensor] | None = None, grad_keys_out: Sequence[Tensor] | None = None,
                        ) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    """Fused backward; ``out``, ``lse`` and ``stats`` (None: not kept) are what
    :func:`route_many_forward` (or the reference op) returned for these inputs; the
    per-token backward reads the logits and key statistics from ``stats``, the tiled one
    recomputes them. Returns what ``depthrewrite::route_many_backward``
    returns (the key gradients empty without keys). ``grad_values_acc`` /
    ``grad_keys_acc``: running sums (None, or None or a tensor shaped like its source per
    source) that each gradient is added to as it is stored, in float32, rounded once
    (depthrewrite.grad_accumulation puts them there). ``grad_values_out`` /
    ``grad_keys_out``: the tensors to write the source gradients into (one per source; a
    running sum may be its own source's output: ``depthrewrite::route_many_backward_into_``),
    by default new ones. ``config`` overrides ``backward``
    ("tiled" or "per_token"), ``param`` (the per-token backward's: "registers" or "table"),
    ``block_t``, ``block_q``, ``many_elems``, ``num_warps``, ``per_sm``, ``prefetch`` (False,
    True, or 2-4: that many sources ahead, per-token backward only; unset: ``_backward_prefetch``),
    ``stages`` (per-token backward only: 2 or more pipelines the source loads, PREFETCH then
    unused; unset: ``_backward_stages``), the parameter reduction's (tiled backward, or
    ``param="table"``) ``param_stages`` and ``param_per_sm`` (unset: PARAM_STAGES, PARAM_PER_SM),
    ``maxnreg`` (a register cap for the backward kernel; unset: the per-token backward's
    PER_TOKEN_LAUNCH, none for the tiled one), ``fused_sums`` (the per-token backward's;
    unset: PER_TOKEN_FUSED_SUMS) and
    ``exact_softmax_grad`` (False by default: the module docstring)."""
    _check_route_many_call(values, queries, key_norm_weights, heads, eps, keys)
    cfg = {"prefetch": None, "backward": BACKWARD, **(config or {})}
    if "per_sm" in cfg:
        _positive_int("route_many", "per_sm", cfg["per_sm"])
    cfg["param"] = _param_gradients(cfg)
    cfg["exact_softmax_grad"] = check_flag(cfg.get("exact_softmax_grad", False), "exact_softmax_grad", "route_many")
    cfg["fused_sums"] = check_flag(cfg.get("fused_sums", default_fused_sums(PER_TOKEN_FUSED_SUMS)), "fused_sums",
                                   "route_many")
    cfg["split_queries"] = check_flag(cfg.get("split_queries", SPLIT_QUERIES), "split_queries", "route_many")
    s = queries.shape[0]
    _check_saved_many(out, lse, values, s, heads, grad_out, grad_lse)
    _check_stats(stats, _tokens(values), len(values), s, heads, values[0].device)
    _check_acc("grad_values_acc", grad_values_acc, values, "route_many_backward")
    _check_acc("grad_keys_acc", grad_keys_acc, keys, "route_many_backward")
    dtype = values[0].dtype
    flat_v = _contiguous(values)
    flat_k = _contiguous(keys) if keys is not None else []
    g = [t.to(dtype).contiguous() for t in grad_out]
    gl = [t.to(torch.float32).contiguous() for t in grad_lse]
    o, ls = _contiguous(out), _contiguous(lse)
    kernel = _backward_kernel(heads, cfg, bool(flat_k), s)
    row = math.prod(_row_blocks(queries.shape[1], heads, "route_many"))
    block_q = _per_token_block_q(s, heads, row, cfg)
    cfg["tiles"] = _query_tile_pair(s, block_q, cfg) if kernel == "per_token" else (block_q, 0)
    if cfg["prefetch"] is None:
        cfg["prefetch"] = _backward_prefetch(kernel, row, block_q, two_tiles=cfg["tiles"][1] > 0)
    allowed = PREFETCH_DEPTHS + PER_TOKEN_PREFETCH_DEPTHS if kernel == "per_token" else PREFETCH_DEPTHS
    cfg["prefetch"] = _check_prefetch(cfg["prefetch"], "route_many", allowed, f"the {kernel} backward")
    running = RunningSums.of(grad_values_acc, grad_keys_acc, len(flat_v))
    outputs = SourceGradients.of(flat_v, flat_k, grad_values_out, grad_keys_out)
    cfg["stages"] = _check_stages(cfg.get("stages"), _backward_stages(kernel, row, bool(flat_k), running.any, block_q),
                                  "route_many")
    if kernel == "tiled" and cfg["stages"] >= 2:
        raise ValueError(f"route_many (Triton): config stages={cfg['stages']} pipelines the per_token backward "
                         "only; the tiled backward takes 0 or 1")
    # per pipeline stage: one token's source row (and key row) and, past the first chunk of
    # queries, those rows' float32 partial gradients, and with running sums (typed like the
    # sources) theirs
    per_row = dtype.itemsize * (1 + running.any) + 4 * (cdiv(s, block_q) > 1)
    stage_bytes = row * (1 + bool(flat_k)) * per_row
    cfg["stages"] = fit_stages("route_many", cfg["stages"], stage_bytes, flat_v[0].device,
                               _configured(config, "stages"))
    backward = _per_token_backward if kernel == "per_token" else _tiled_backward
    grad_v, grad_k, r = backward(g, gl, o, ls, flat_v, flat_k, queries, key_norm_weights, heads, eps, cfg, stats,
                                 running, outputs)
    grad_queries, grad_weights = finish(r, queries, key_norm_weights)
    return grad_v, grad_k, grad_queries, grad_weights


def _backward_kernel(heads: int, cfg: dict, has_keys: bool, queries: int) -> str:
    """The backward kernel of a call: ``cfg["backward"]`` (checked), else the measured choice
    (BACKWARD's comment): per-token for one head without separate keys and at most
    PER_TOKEN_MAX_QUERIES queries (None: any number), tiled otherwise (with 16 heads the
    per-token kernel's per-head statistics make it 2x slower; with keys 12-16 % slower than
    the tiled kernel with its pipelined parameter reduction)."""
    choice = cfg["backward"]
    if choice is None:
        few = PER_TOKEN_MAX_QUERIES is None or queries <= PER_TOKEN_MAX_QUERIES
        return "per_token" if heads == 1 and not has_keys and few else "tiled"
    return _checked_choice("backward", choice, BACKWARD_CHOICES)


def _backward_prefetch(kernel: str, row: int, block_q: int, two_tiles: bool = False) -> int:
    """The prefetch depth a backward kernel takes for rows of ``row`` padded elements and
    ``block_q`` padded queries a program unless a config sets it (measured): in the
    per-token backward up to PER_TOKEN_PREFETCH2_ROW, TWO_TILE_PREFETCH for queries held as
    two tiles, else PER_TOKEN_PREFETCH's entry (that of the largest listed block size up to
    ``block_q``); one elsewhere."""
    if kernel != "per_token" or row > PER_TOKEN_PREFETCH2_ROW:
        return 1
    if two_tiles:
        return TWO_TILE_PREFETCH
    return _entry_by_queries(PER_TOKEN_PREFETCH, block_q)


def _entry_by_queries(table: dict, block_q: int):
    """A per-token table's entry for ``block_q`` padded queries a program: that of the largest
    listed block size up to ``block_q``, or of the smallest listed (PER_TOKEN_LAUNCH,
    PER_TOKEN_PREFETCH)."""
    listed = [q for q in table if q <= block_q] or [min(table)]
    return table[max(listed)]


def _per_token_block_q(s: int, heads: int, row: int, cfg: dict) -> int:
    """The padded queries a per-token backward program holds (the call's ``s`` in chunks)."""
    return _query_block(s, row, cfg, MULTI_HEAD_BACKWARD_QUERIES if heads > 1 else None)


def _backward_stages(kernel: str, row: int, has_keys: bool, running: bool, block_q: int) -> int:
    """The pipeline stages a backward kernel takes unless a config sets them (measured,
    ONE_HEAD_FORWARD_TOKENS' comment): the per-token backward WIDE_PER_TOKEN_STAGES for rows
    wider than NARROW_ROW or with separate keys (two rows a source), RUNNING_PER_TOKEN_STAGES'
    entry for ``block_q`` padded queries with running sums, else 0 (the tiled backward: always)."""
    if kernel != "per_token":
        return 0
    if row > NARROW_ROW or has_keys:
        return WIDE_PER_TOKEN_STAGES
    return _entry_by_queries(RUNNING_PER_TOKEN_STAGES, block_q) if running else 0


def _param_gradients(cfg: dict) -> str:
    """How the per-token backward forms the parameter gradients: ``cfg["param"]`` (checked),
    else PER_TOKEN_PARAM."""
    return _checked_choice("param", cfg.get("param") or PER_TOKEN_PARAM, PARAM_CHOICES)


def _tiled_backward(g, gl, o, ls, flat_v, flat_k, queries, key_norm_weights, heads, eps, cfg,
                    stats, running: RunningSums, outputs: SourceGradients
                    ) -> tuple[list[Tensor], list[Tensor], PartialSums]:
    """Value gradients (and key gradients, with keys) from ``_route_many_bwd_tiled_kernel``,
    then the partial sums of ``r`` (the gradient of ``w_s * q_s``, (S, d)) from
    ``_route_many_param_kernel``. ``stats`` is not read: each tile forms its logits from the
    key rows it loads anyway (the tiled calls, several heads or separate keys, get none from
    the op)."""
    s, d = queries.shape
    block_h, block_c = _row_blocks(d, heads, "route_many")
    tokens, device = _tokens(flat_v), flat_v[0].device
    grad_v, grad_k = outputs.values, outputs.keys
    if tokens == 0:
        return running.no_tokens(grad_v, grad_k, outputs.given) + (_no_sums(s, d, device),)
    n = len(flat_v)
    block_t = _check_block_t(cfg.get("block_t") or TILED_TOKENS, "route_many")
    sada = torch.empty((s, tokens, heads), dtype=torch.float32, device=device)
    coef = torch.empty((n, s, tokens, heads), dtype=torch.float32, device=device)
    qw = _per_query_rows(queries, key_norm_weights)
    tables = pointer_tables(device, g, o, ls, gl, flat_v, grad_v, flat_k, grad_k, *running.tables(flat_k))
    gtab, otab, ltab, gltab, vtab, gvtab, ktab, gktab, runtab, kruntab = tables
    if not flat_k:  # the keys are the values (empty tables are never read)
        ktab, gktab, kruntab = vtab, gvtab, runtab
    _route_many_bwd_tiled_kernel[(cdiv(tokens, block_t),)](
        flat_v[0], gtab, otab, ltab, gltab, vtab, gvtab, ktab, gktab, qw, sada, coef, tokens, n, s, d, d // heads,
        heads, float(eps), runtab, kruntab, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_C=block_c,
        PREFETCH=cfg["prefetch"], ALIGNED=tables.all_aligned(0, 1, 4, 5, 6, 7, 8, 9),  # all but the fp32 rows
        ONE_SOURCE=n == 1, HAS_KEYS=bool(flat_k), EXACT=cfg["exact_softmax_grad"], RUNNING=running.any,
        num_warps=cfg.get("num_warps") or max(TILED_WARPS, block_h * block_c // TILED_MAX_ROW),
        **_register_cap(cfg, "route_many"),
    )
    # the logits' normalized rows are the keys': the parameter reduction reads them
    r = _param_reduction(ktab, flat_v[0], coef, s, d, heads, tokens, n, tables.all_aligned(6 if flat_k else 4), cfg)
    return grad_v, grad_k, r


def _param_reduction(vtab, like, coef, s, d, heads, tokens, n, aligned, cfg) -> PartialSums:
    """``r``'s partial sums (fp32, (splits, S, d)) from the ``dz * rstd`` table ``coef`` and the
    sources, over ranges of tokens by ``_route_many_param_kernel``, to be added in a fixed order.
    ``cfg``: the backward's launch config (``param_stages``, ``param_per_sm``, checked)."""
    c = d // heads
    block_q = min(_next_pow2(s), PARAM_QUERIES)
    block_cc = min(_next_pow2(c), PARAM_COLUMNS)
    block_tt = max(1, PARAM_ELEMS // (block_q * block_cc))
    query_chunks = cdiv(s, block_q)
    column_blocks = cdiv(c, block_cc)
    others = heads * query_chunks * column_blocks
    # token ranges: enough programs in all to fill the GPU, each range a whole number of tiles
    per_sm = cfg.get("param_per_sm")
    per_sm = PARAM_PER_SM if per_sm is None else _positive_int("route_many", "param_per_sm", per_sm)
    tiles = cdiv(tokens, block_tt)
    splits = max(1, _backward_programs(like.device, tiles * others, per_sm) // others)
    per_program = cdiv(cdiv(tokens, splits), block_tt) * block_tt
    splits = cdiv(tokens, per_program)
    part = torch.empty((splits, s, d), dtype=torch.float32, device=like.device)
    _route_many_param_kernel[(heads * query_chunks, column_blocks, splits)](
        like, vtab, coef, part, tokens, n, s, d, c, heads, per_program, query_chunks,
        BLOCK_TT=block_tt, BLOCK_Q=block_q, BLOCK_CC=block_cc, ALIGNED=aligned,
        STAGES=_check_stages(cfg.get("param_stages"), PARAM_STAGES, "route_many", "param_stages"),
        num_warps=NUM_WARPS,
    )
    return PartialSums.of(part)


def _per_token_backward(g, gl, o, ls, flat_v, flat_k, queries, key_norm_weights, heads, eps, cfg,
                        stats, running: RunningSums, outputs: SourceGradients
                        ) -> tuple[list[Tensor], list[Tensor], PartialSums]:
    """The one-pass backward of ``_route_many_bwd_kernel`` (one token at a time per program),
    reading the forward's logits and rstd from ``stats`` unless it is None."""
    s, d = queries.shape
    block_h, block_c = _row_blocks(d, heads, "route_many")
    tokens, device = _tokens(flat_v), flat_v[0].device
    dtype = flat_v[0].dtype
    grad_v, grad_k = outputs.values, outputs.keys
    multi_head = heads > 1
    block_q = _per_token_block_q(s, heads, block_h * block_c, cfg)
    warps = cfg.get("num_warps") or (MULTI_HEAD_BACKWARD_WARPS if multi_head else NUM_WARPS)
    chunks = list(range(0, s, block_q))
    if tokens == 0:
        return running.no_tokens(grad_v, grad_k, outputs.given) + (_no_sums(s, d, device),)
    per_sm, cap = _per_token_launch(block_q, heads, block_h * block_c)
    cfg = {"per_sm": per_sm, "maxnreg": cap, **cfg}
    programs = _backward_programs(device, tokens, cfg["per_sm"])
    param_table = cfg["param"] == "table"
    tile_q, tile_q2 = cfg["tiles"]
    n = len(flat_v)
    # the parameter gradients' (N, S, T, H) dz * rstd table, or per chunk of queries the
    # per-program partial sums. With several chunks they are zeroed: the padded query rows of
    # a short last chunk stay unwritten (and are summed, then cut off). One chunk's are not:
    # its padded rows are never read (PartialSums below reads the first s rows of each program)
    sums = torch.zeros if len(chunks) > 1 else torch.empty
    param = (torch.empty((n, s, tokens, heads), dtype=torch.float32, device=device) if param_table else
             sums((len(chunks), programs, tile_q + tile_q2, d), dtype=torch.float32, device=device))
    qw = _per_query_rows(queries, key_norm_weights)
    # fp32 partial gradients between chunks of queries (the gradients themselves if fp32:
    # then the gradients' tables are theirs, not uploaded twice; not where the outputs were
    # given, since a running sum among them is read by the last chunk only and must not
    # hold an earlier chunk's part by then)
    one_pass = len(chunks) == 1 or (dtype == torch.float32 and not outputs.given)
    partial_v = [] if one_pass else [torch.empty(t.shape, dtype=torch.float32, device=device) for t in grad_v]
    partial_k = [] if one_pass else [torch.empty(t.shape, dtype=torch.float32, device=device) for t in grad_k]
    tables = pointer_tables(device, g, o, ls, gl, flat_v, grad_v, partial_v, flat_k, grad_k, partial_k,
                            *running.tables(flat_k))
    gtab, otab, ltab, gltab, vtab, gvtab, acctab, ktab, gktab, kacctab, runtab, kruntab = tables
    if one_pass:
        acctab, kacctab = gvtab, gktab
    if not flat_k:  # no separate keys (empty tables are never read)
        ktab, gktab, kacctab, kruntab = vtab, gvtab, acctab, runtab
    aligned = tables.all_aligned(0, 1, 4, 5, 6, 7, 8, 9, 10, 11)  # all but the fp32 log-sum-exps' tables
    for c, q0 in enumerate(chunks):
        _route_many_bwd_kernel[(programs,)](
            flat_v[0], _rows_from(gtab, q0), _rows_from(otab, q0), _rows_from(ltab, q0), _rows_from(gltab, q0),
            vtab, gvtab, acctab, ktab, gktab, kacctab, _rows_from(qw, q0),
            _chunk_sums(param, c, q0, param_table), tokens, n, s, d, d // heads, heads,
            min(block_q, s - q0), float(eps), qw if stats is None else stats, q0, runtab, kruntab, BLOCK_Q=tile_q,
            BLOCK_Q2=tile_q2,
            BLOCK_H=block_h, BLOCK_C=block_c, RUNNING=running.any and c == len(chunks) - 1,
            PREFETCH=cfg["prefetch"], ALIGNED=aligned, ACC_IN=c > 0, ACC_OUT=c < len(chunks) - 1, ONE_SOURCE=n == 1,
            HAS_KEYS=bool(flat_k), PARAM_TABLE=param_table, STAGES=cfg["stages"], EXACT=cfg["exact_softmax_grad"],
            FUSED_SUMS=cfg["fused_sums"], SAVED_STATS=stats is not None, num_warps=warps,
            **_register_cap(cfg, "route_many"),
        )
    if param_table:  # the normalized rows are the keys' (the values without separate keys)
        return grad_v, grad_k, _param_reduction(ktab, flat_v[0], param, s, d, heads, tokens, n,
                                                tables.all_aligned(7 if flat_k else 4), cfg)
    # the second pass of the deterministic reduction sums over the programs, in order
    if len(chunks) == 1:  # the first s of each program's rows (param[0] starts where param does)
        return grad_v, grad_k, PartialSums(param, programs, (tile_q + tile_q2) * d, s * d)
    return grad_v, grad_k, PartialSums.of(param.sum(1).reshape(1, -1)[:, : s * d])


def _query_tile_pair(s: int, block_q: int, cfg: dict) -> tuple[int, int]:
    """The per-token backward's padded query rows as (first tile, second tile): a call of one
    chunk (``s`` queries padded to ``block_q``) as ``block_q / 2`` and the rest padded on its
    own where that holds fewer rows (6 queries as 4 + 2, 5 as 4 + 1, 3 as 2 + 1), with the
    config's ``split_queries`` (SPLIT_QUERIES) and neither ``exact_softmax_grad`` nor
    ``param="table"``; else ``(block_q, 0)``, one tile."""
    if not cfg["split_queries"] or s > block_q or cfg["exact_softmax_grad"] or cfg["param"] == "table":
        return block_q, 0
    first = block_q // 2
    second = _next_pow2(s - first) if s > first else 0
    return (first, second) if 0 < second and first + second < block_q else (block_q, 0)


def _rows_from(t: Tensor, start: int) -> Tensor:
    """``t[start:]``: the rows a chunk of queries starts at. The kernels take only its
    address, and the first chunk's is ``t``'s own, so ``t`` itself then (no slice op on the host)."""
    return t[start:] if start else t


def _chunk_sums(param: Tensor, c: int, q0: int, table: bool) -> Tensor:
    """Where chunk ``c`` (its first query ``q0``) writes its parameter terms: the ``(N, S, T, H)``
    table from query ``q0``, or the chunk's own ``(programs, block_q, d)`` partial sums, whose
    address for the first chunk is ``param``'s (:func:`_rows_from`)."""
    if table:
        return param[:, q0:] if q0 else param
    return param[c] if c else param


def _per_token_launch(block_q: int, heads: int, row: int) -> tuple[int, int | None]:
    """(programs per SM, register cap) of the per-token backward with ``block_q`` queries a
    program and padded rows of ``row`` elements unless a config sets them: PER_TOKEN_LAUNCH's
    entry (that of the largest listed block size up to ``block_q``) for one head and rows of
    at most NARROW_ROW, else OTHER_PER_TOKEN_LAUNCH."""
    if heads > 1 or row > NARROW_ROW:
        return OTHER_PER_TOKEN_LAUNCH
    return _entry_by_queries(PER_TOKEN_LAUNCH, block_q)


class RunningSums(NamedTuple):
    """The running sums a backward call adds its source gradients to (``grad_values_acc`` /
    ``grad_keys_acc``): one entry per source, None where that source has none."""

    values: list[Tensor | None]
    keys: list[Tensor | None] | None

    @classmethod
    def of(cls, values_acc, keys_acc, n: int) -> RunningSums:
        values = _contiguous(values_acc) if values_acc is not None else [None] * n
        return cls(values, _contiguous(keys_acc) if keys_acc is not None else None)

    @property
    def any(self) -> bool:
        return bool(self.present())

    def present(self) -> list[Tensor]:
        return [t for t in self.values + (self.keys or []) if t is not None]

    def tables(self, flat_k: Sequence[Tensor]) -> tuple[list, list]:
        """The two pointer-table groups (values', keys'), empty when no source has one (the
        kernels then read neither)."""
        if not self.any:
            return [], []
        return self.values, (self.keys or [None] * len(flat_k)) if flat_k else []

    def no_tokens(self, grad_v: list[Tensor], grad_k: list[Tensor], in_place: bool = False
                  ) -> tuple[list[Tensor], list[Tensor]]:
        """The gradients of a call with no tokens: zeros, or the running sums (copied: outputs
        may not alias inputs); ``in_place``: written into ``grad_v`` and ``grad_k``, the
        outputs given (a running sum among them is left as it is)."""
        def fill(grads, acc):
            acc = acc or [None] * len(grads)
            if in_place:
                return [t.zero_() if a is None else t if t is a else t.copy_(a) for t, a in zip(grads, acc)]
            return [torch.zeros_like(t) if a is None else a.clone() for t, a in zip(grads, acc)]
        return fill(grad_v, self.values), fill(grad_k, self.keys)


class SourceGradients(NamedTuple):
    """Where a backward call writes its source gradients: the tensors its caller gave
    (``given``), or new ones."""

    values: list[Tensor]
    keys: list[Tensor]
    given: bool

    @classmethod
    def of(cls, flat_v: Sequence[Tensor], flat_k: Sequence[Tensor], values_out: Sequence[Tensor] | None,
           keys_out: Sequence[Tensor] | None) -> SourceGradients:
        if (flat_k and (values_out is None) != (keys_out is None)) or (not flat_k and keys_out):
            raise ValueError("route_many_backward (Triton): `grad_values_out` and `grad_keys_out` come together "
                             f"where there are keys, the latter empty or None without; found {_given(values_out)} "
                             f"and {_given(keys_out)} for {len(flat_k)} keys")
        like, n, nk = flat_v[0], len(flat_v), len(flat_k)
        values = route_triton._gradient_outputs(n, like.shape, like.dtype, like.device, torch.empty, values_out,
                                                "grad_values_out", "route_many_backward")
        keys = (route_triton._gradient_outputs(nk, like.shape, like.dtype, like.device, torch.empty, keys_out,
                                               "grad_keys_out", "route_many_backward") if nk else [])
        return cls(values, keys, values_out is not None)


def _given(outputs) -> str:
    return "none" if outputs is None else f"{len(outputs)} tensors"


def _no_sums(s: int, d: int, device) -> PartialSums:
    """``r``'s partial sums with no tokens: one row of zeros."""
    return PartialSums.of(torch.zeros((1, s * d), dtype=torch.float32, device=device))


def _tokens(sources: Sequence[Tensor]) -> int:
    return math.prod(sources[0].shape[:-1])


def _check_route_many_call(values, queries, key_norm_weights, heads, eps, keys) -> None:
    """``depthrewrite.ops.route_many``'s checks, made again at every launch (a compiled graph
    or a caller of ``torch.ops.depthrewrite.route_many`` reaches the launchers unchecked:
    route_triton's ``_check_route_call``), then the dtypes the kernels take."""
    check_route_many_inputs(values, queries, key_norm_weights, heads, eps, keys)
    _check_supported(values, keys, ("queries", queries), ("key_norm_weights", key_norm_weights), op="route_many")


def _saved_many_fit(out, lse, like: Tensor, heads: int, grad_out, grad_lse) -> bool:
    """Whether every entry passes :func:`_check_saved_many`'s checks, in one pass of quick
    tests a list (every backward call pays this; the checks one by one then only name the
    culprit): outputs typed and shaped like ``like`` (the first source), float32
    log-sum-exps of shape ``(*batch, heads)``, floating gradients shaped like those, all on
    ``like``'s device."""
    shape, dtype, device = like.shape, like.dtype, like.device
    lse_shape = (*shape[:-1], heads)

    def alike(tensors, shape, dtype=None) -> bool:
        return all(isinstance(t, Tensor) and t.shape == shape and t.device == device
                   and (t.dtype is dtype if dtype is not None else t.is_floating_point()) for t in tensors)

    return (alike(out, shape, dtype) and alike(lse, lse_shape, torch.float32)
            and (grad_out is None or alike(grad_out, shape)) and (grad_lse is None or alike(grad_lse, lse_shape)))


def _check_saved_many(out, lse, values, s: int, heads: int, grad_out=None, grad_lse=None) -> None:
    """``out`` and ``lse`` as the forward returned them for these values; ``grad_out`` and
    ``grad_lse`` (None: not checked) their gradients, one per query too."""
    lists = {"out": out, "lse": lse, "grad_out": grad_out, "grad_lse": grad_lse}
    lengths = {name: len(entries) for name, entries in lists.items() if entries is not None}
    if any(n != s for n in lengths.values()):
        raise ValueError(f"route_many (Triton): {', '.join(f'`{name}`' for name in lengths)} must hold one tensor "
                         f"per query ({s}); found {lengths}")
    if _saved_many_fit(out, lse, values[0], heads, grad_out, grad_lse):
        return
    for i, (o, t) in enumerate(zip(out, lse)):  # something does not: name it
        _check_saved(o, t, values, heads, op="route_many", which=f"[{i}]")
        if grad_out is not None:
            check_gradient(f"grad_out[{i}]", grad_out[i], o, "route_many")
        if grad_lse is not None:
            check_gradient(f"grad_lse[{i}]", grad_lse[i], t, "route_many")
