"""End-to-end training throughput and peak memory of the bundled GPT on one GPU: the
plain-residual baseline compiled with Inductor against each scheme compiled with the
``depthrewrite`` backend (the kernels issue's e2e goals).

    python3 benchmarks/e2e_throughput.py [--out DIR] [--schemes baseline block_attnres ...]
                                         [--wave 4] [--steps 10] [--trials 3] [--profile [TOP]]

Model: preset ``medium`` (d=1024, 24 layers, 16 heads, byte vocabulary), sequence 2048,
batch 8, bf16 weights, fused AdamW, one optimizer step per measured step.

How it measures: compiling a 24-layer model takes a minute or more, so one process per
configuration compiles and warms up at the same time as the others of its wave (the
compiles use the CPUs; the GPU holds several models at once), then the processes are timed
ONE AT A TIME while the others wait idle, so no two timed runs share the GPU. Each
process runs 5 warm-up steps (the first compiles) and empties its allocator cache while it
waits; when its turn comes, 2 more warm-up steps, then ``trials`` x ``steps`` optimizer
steps on fresh random tokens, CUDA events around each trial, and it reports the median
trial and the allocator's retries (cache flushes for lack of memory) during the
trials; peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps. The
backend's lowering report (routing ops per graph and the implementation they went to) is
recorded so the table shows that the fused kernels ran. ``--wave`` bounds how many models
are on the GPU at once (memory). The compiles of a wave overlap on the GPU too: a kernel
that Inductor tunes at its first run can then be tuned on a busy GPU (session 40: one fused
forward kernel 13x its time in one process of a wave of six, the same graph's kernel fast
in its sibling), so compare Inductor's kernels by name across rows, and compile one model
at a time (``--wave 1``) for a run that decides a default.

Also recorded: the host's time to issue a step (``host_ms``: ``step()`` returning, with the
GPU idle when it starts; close to the step time means the GPU waits for the host), the
process's host speed beside it (``host_op_us``: one tiny CUDA op's issue time; host times of
different processes compare only through it, session 21) and the allocator's peak reserved
memory, and per timed trial Python's garbage collections (``gc_ms``, ``gc_full``: their
milliseconds and full collections; a full one walks every object the compiles left, session
44) and the routing kernels' pointer tables made rather than found in their cache
(``tables_made``: an upload costs ~250 us of host time). The ``_gcfreeze`` configurations
call ``gc.freeze()`` after their warm-up, so that later collections skip those objects. The
``_cg`` configurations record the compiled step as
CUDA graphs (Inductor's ``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets) and are
compared with ``baseline_cg``, the baseline recorded the same way; their peak allocated
memory misses the graphs' pool, so their memory is compared by reserved GiB. The ``_cdt``
configurations have Inductor tune each generated kernel's launch by coordinate descent and
are compared with ``baseline_cdt``, the baseline tuned the same way. The ``_dyn``
configurations are compiled with ``dynamic=True`` (symbolic batch size and sequence length,
the graphs Dynamo makes when a run's sizes change) and compared with ``baseline_dyn``.

``--profile``: after the timed trials, each process also records ``PROFILE_STEPS`` steps
with ``torch.profiler`` and sums the GPU kernel time per category (``KERNEL_CATEGORIES``:
our routing kernels, matmuls, attention, Inductor's fused kernels, the optimizer, the rest),
per step, and the GPU's idle time between its first and last activity (waiting for the
host), and the host's largest costs (CPU self time per op); the profiler's own overhead
makes these a breakdown, not a step time.

Writes ``e2e.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import multiprocessing as mp
import os
import pathlib
import queue
import re
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: name -> (scheme or None for the baseline, options, throughput goal relative to the baseline)
CONFIGS = {
    "baseline": (None, {}, None),
    "block_attnres": ("block_attnres", {}, 0.95),
    # the same, routed site by site (no goal: the comparison that shows what two-phase buys)
    "block_attnres_1p": ("block_attnres", {"two_phase": False}, None),
    # two-phase keeping phase 1's outputs for the backward instead of recomputing them
    "block_attnres_keep": ("block_attnres", {"recompute": False}, None),
    "mhar_block": ("mhar", {"block_size": 6}, 0.93),
    # 4 more groups keeping phase 1 (keep_groups; by the count +0.75 GiB of peak at 350M,
    # one route_many forward a group less), and the same for block MHAR
    "block_attnres_kg4": ("block_attnres", {"keep_groups": 4}, None),
    "mhar_block_kg4": ("mhar", {"block_size": 6, "keep_groups": 4}, None),
    # the same routed site by site (the default until session 9: 2 % faster, 1.11x memory)
    "mhar_block_1p": ("mhar", {"block_size": 6, "two_phase": False}, None),
    "wav": ("wav", {}, 0.90),
    # WAV two-phase (off by default: slower), DAR site by site (two-phase is its default)
    "wav_2p": ("wav", {"two_phase": True}, None),
    "dar_block": ("dar", {"layers_per_block": 3}, 0.88),
    "dar_block_1p": ("dar", {"layers_per_block": 3, "two_phase": False}, None),
    # DAR two-phase keeping phase 1's outputs for the backward instead of recomputing them
    "dar_block_keep": ("dar", {"layers_per_block": 3, "recompute": False}, None),
    # the default: grouped full routing, the two-phase computation over groups of 4 sites
    "attnres": ("attnres", {}, 0.80),
    # routed site by site (the default until session 9); groups of G sites, phase 1
    # recomputed in the backward or kept
    "attnres_site": ("attnres", {"group_size": None}, None),
    "attnres_g6": ("attnres", {"group_size": 6, "recompute": True}, None),
    **{f"attnres_g{g}_keep": ("attnres", {"group_size": g, "recompute": False}, None) for g in (4, 6, 8, 12)},
    "mhar": ("mhar", {}, 0.78),
    "mhar_g6": ("mhar", {"group_size": 6}, None),
    # grouped full MHAR keeping phase 1, as full AttnRes's default (session 40): in groups of
    # 2 sites every site's phase 2 is one merge (none or one entry), which the fused merge
    # below ("_fm") does in route_merge's kernels; groups of 4 route 2-3 entries together
    **{f"mhar_g{g}_keep": ("mhar", {"group_size": g, "recompute": False}, None) for g in (2, 4)},
}
#: backend-option variants of the configurations above: their scheme and options, no goal.
#: Suffix -> backend options
BACKEND_VARIANTS = {
    # the long gradient sums fused whole, as Inductor does without the backend's fences
    "unfenced": {"max_sum_terms": None, "accumulate_grads": False},
    "sum8": {"max_sum_terms": 8, "accumulate_grads": False},
    # the gradient terms left for Inductor to sum (fenced), not added inside route_backward
    "noacc": {"accumulate_grads": False},
    # running sums for one-head calls only (session 7's default; multi-head calls fenced)
    "acc1": {"accumulate_max_heads": 1},
    # the whole compiled step recorded as CUDA graphs (Inductor's mode="reduce-overhead")
    "cg": {"triton.cudagraphs": True},
    # WAV's and DAR's partial sums kept for the backward, as before session 13 (the default
    # since: recomputed in it, depthrewrite.recompute)
    "keepsums": {"recompute_partial_sums": False},
    # the routing backwards' running sums as new tensors, as before session 14 (the default
    # since: written in place where safe, route_backward_into_; route_many_backward's since
    # session 48, route_many_backward_into_)
    "newsums": {"accumulate_in_place": False},
    # the branch outputs that the partial sums are rebuilt from recomputed too (their matmuls
    # run again in the backward)
    "branch": {"recompute_branch_outputs": True},
    # only those of linear layers no wider at their input than at their output (attention's
    # output projections, not the MLPs' down projections; session 43; timed in session 44:
    # about 1.1 ms of kernels a step for 0.66 GiB of peak)
    "narrow": {"recompute_branch_outputs": "narrow"},
    # Inductor tunes every generated kernel's launch by coordinate descent (slower compiles);
    # compared with "baseline_cdt", the plain model compiled the same way
    "cdt": {"coordinate_descent_tuning": True},
    # session 28, Inductor's settings for DAR block's slow reductions (session 22 run 5: the
    # transport chain's and the gates' reductions at 1.4-2.0 TB/s): reductions to a few
    # values in one cooperative launch instead of a split reduction's two
    "coop": {"triton.cooperative_reductions": True},
    # fewer nodes a fused kernel (default 64): the 35-40-input chain reductions split up
    "mfs16": {"max_fusion_size": 16},
    "mfs32": {"max_fusion_size": 32},
    # Inductor's own default: DAR's graphs get 16 from the backend since session 28 (graph_hints.py)
    "mfs64": {"max_fusion_size": 64},
    # reductions of different orders (per token, per channel) not fused into one kernel
    "mix0": {"triton.mix_order_reduction": False},
    # each reduction compiled persistent and looped, the faster picked at its first run
    "mk": {"triton.multi_kernel": 1},
    # Inductor's generated wrapper without its checks of the fallback ops' outputs and the
    # graph inputs (assert_size_stride, assert_alignment: on by default, off in fbcode for
    # alignment; the tiny DAR block graphs carried 424 of them, 164 for our ops' outputs;
    # session 47): host time only; compared with "baseline_noasserts"
    "noasserts": {"size_asserts": False, "alignment_asserts": False},
    # Inductor's combo kernels (experimental): independent kernels launched as one, only
    # where its benchmark finds them faster; fewer launches for the host to issue (DAR
    # block's step made ~1,540 Triton launches against the baseline's ~680, session 47)
    "combo": {"combo_kernels": True, "benchmark_combo_kernel": True},
    # Inductor's wrapper written in C++ (the routing calls with list results given flat
    # companions by the backend, depthrewrite.cpp_wrapper; session 58): the host's time a
    # Triton launch less, a routing call's more (it calls back into Python); compared with
    # "baseline_cpp"
    "cpp": {"cpp_wrapper": True},
}
#: the variants measured: base configuration -> suffixes
VARIANTS_OF = {
    "dar_block": ("unfenced", "sum8", "noacc", "cg", "keepsums", "branch", "cdt", "coop", "mfs16", "mfs32", "mix0",
                  "mk", "mfs64", "narrow", "noasserts", "combo", "cpp"),
    "attnres": ("unfenced", "sum8", "noacc", "cg", "mfs16", "noasserts", "newsums", "cpp"),
    "wav": ("unfenced", "noacc", "cg", "keepsums", "newsums", "branch", "cdt", "mfs16", "narrow", "noasserts", "combo",
            "cpp"),
    "mhar": ("unfenced", "noacc", "acc1", "cg", "newsums", "mfs16", "cpp"),
    "block_attnres": ("unfenced", "cg", "cdt", "mfs16", "mk", "cpp"),
    "mhar_block": ("unfenced", "cg", "mfs16", "mk"),
}
#: backend options per configuration (default: none)
BACKEND_OPTIONS = {f"{base}_{suffix}": BACKEND_VARIANTS[suffix] for base, suffixes in VARIANTS_OF.items()
                   for suffix in suffixes}
CONFIGS.update({f"{base}_{suffix}": CONFIGS[base][:2] + (None,) for base, suffixes in VARIANTS_OF.items()
                for suffix in suffixes})
#: the baseline recorded as CUDA graphs too, the reference of the "_cg" variants
for suffix in ("cg", "cdt", "noasserts", "cpp"):
    CONFIGS[f"baseline_{suffix}"] = (None, {}, None)
    BACKEND_OPTIONS[f"baseline_{suffix}"] = BACKEND_VARIANTS[suffix]
#: compiled with ``torch.compile(..., dynamic=True)``: graphs with symbolic batch size and
#: sequence length, as Dynamo makes them when a run's sizes change (session 50); compared
#: with "baseline_dyn", the plain model compiled so
DYNAMIC = "dyn"
CONFIGS.update({f"{base}_{DYNAMIC}": CONFIGS[base][:2] + (None,)
                for base in ("baseline", "block_attnres", "mhar_block", "wav", "dar_block", "attnres", "mhar")})
#: each block compiled alone and the rest of the model eager, as torchtitan compiles a model
#: (``torch.compile(block)`` registered back in place of each block; session 56); compared
#: with "baseline_pb", the plain model compiled so
PER_BLOCK = "pb"
CONFIGS.update({f"{base}_{PER_BLOCK}": CONFIGS[base][:2] + (None,)
                for base in ("baseline", "block_attnres", "mhar_block", "wav", "dar_block", "attnres", "mhar")})
#: compiled block by block with Inductor's wrapper in C++: the per-block compile's steps were
#: host-bound for DAR block and WAV (session 56); compared with "baseline_pb_cpp" (session 58)
for _base in ("baseline", "dar_block", "wav"):
    CONFIGS[f"{_base}_{PER_BLOCK}_cpp"] = CONFIGS[_base][:2] + (None,)
    BACKEND_OPTIONS[f"{_base}_{PER_BLOCK}_cpp"] = BACKEND_VARIANTS["cpp"]
#: compiled block by block, then each block and the root sharded with FSDP2 (``fully_shard``
#: on a one-rank mesh: torchtitan's order, without activation checkpointing), so that the
#: routing parameters are DTensors outside their block's forward; phase 1 gathers the next
#: block's since session 59 (depthrewrite.fsdp2), "_site" routes those sites one by one as
#: before (two_phase.GATHER_SHARDS). Compared with "baseline_pb_fsdp"
FSDP = "fsdp"
for _base in ("baseline", "block_attnres", "dar_block"):
    CONFIGS[f"{_base}_{PER_BLOCK}_{FSDP}"] = CONFIGS[_base][:2] + (None,)
#: the second phase through depthrewrite::route_merge's fused kernels (the scheme option
#: fused_merge; session 19; off by default, slower end to end in session 21: merge_partial's
#: torch ops, compiled by Inductor), the branch norm fused into it by the backend
#: (fuse_output_norms, on by default; session 20): "_fm"; the same with the branch norms
#: left to Inductor (each merge writes x, and the backward makes it again): "_fmnf". Until
#: session 27 these set the module flag two_phase.FUSED_MERGE, the same code path
FUSED_MERGE_BASES = ("block_attnres", "mhar_block", "dar_block", "attnres", "mhar_g2_keep", "mhar_g4_keep")
for _base in FUSED_MERGE_BASES:
    for _suffix in ("fm", "fmnf"):
        CONFIGS[f"{_base}_{_suffix}"] = (CONFIGS[_base][0], {**CONFIGS[_base][1], "fused_merge": True}, None)
    BACKEND_OPTIONS[f"{_base}_fmnf"] = {"fuse_output_norms": False}
    # the fused merge recorded as CUDA graphs: its steps wait for the host (session 29)
    CONFIGS[f"{_base}_fm_cg"] = CONFIGS[f"{_base}_fm"]
    BACKEND_OPTIONS[f"{_base}_fm_cg"] = BACKEND_VARIANTS["cg"]
#: kernel-launch variants: configuration suffix -> (base configurations, launch constants
#: set in that configuration's process before it compiles: ``route_triton``'s, or another
#: module's as ``module.CONSTANT``: ``route_many_triton``, ``route_merge_triton``,
#: ``two_phase``, ``kernels``, ``param_grads``, ``dar``), an A/B of a module default in one run
LAUNCH_VARIANTS = {
    # route's backward at d = 1024 as before session 12: the compiler's registers, 4 programs
    # per SM for one head and for several (since: capped at 96 with 5, and 8 programs)
    "launch11": (("wav", "mhar_block", "mhar", "attnres"),
                 {"CAPPED_BACKWARD_MAXNREG": None, "CAPPED_BACKWARD_PER_SM": 4, "MULTI_HEAD_BACKWARD_PER_SM": 4}),
    # two-phase: phase 1 recomputed for every group, the last site's and the readout's too
    # (before session 15; since, those two groups keep theirs)
    "recomputeall": (("block_attnres", "mhar_block", "dar_block"), {"two_phase.KEEP_LAST_PHASE_ONE": False}),
    # route_many's forward with one chunk's tokens after another (one launch per chunk of
    # queries before session 16; since, the chunks of a token side by side in one launch)
    "fwdcm": (("block_attnres", "mhar_block", "dar_block"), {"route_many_triton.FORWARD_ORDER": "chunk_major"}),
    # route_many's forward launch as in session 15 for calls without keys (one chunk's
    # tokens after another; one head: 2 warps; several heads: 2 queries, 4 warps)
    "fwd15": (("block_attnres", "mhar_block", "attnres"),
              {"route_many_triton.FORWARD_ORDER": "chunk_major", "route_many_triton.MANY_NARROW_FORWARD_WARPS": 2,
               "route_many_triton.MULTI_HEAD_FORWARD_QUERIES": 2, "route_many_triton.MULTI_HEAD_FORWARD_WARPS": 4}),
    # route_many's one-head forward as in session 16: one token per program, the register
    # prefetch (since session 17: runs of 8 tokens, the sources through Triton's pipeline)
    "fwd16": (("block_attnres", "dar_block", "attnres"),
              {"route_many_triton.ONE_HEAD_FORWARD_TOKENS": 1, "route_many_triton.ONE_HEAD_FORWARD_STAGES": 0}),
    # every route_many backward through the per-token kernel (DAR's calls are keyed: with
    # its sources pipelined; their default is the tiled kernel and the parameter reduction;
    # Block AttnRes's and full AttnRes's one-head calls at d = 1024 took it by default until session 18)
    "pertoken": (("dar_block", "block_attnres", "attnres"), {"route_many_triton.BACKWARD": "per_token"}),
    # the parameter reduction without Triton's software pipeline (before session 18)
    "ps0": (("dar_block", "mhar_block", "block_attnres", "mhar"), {"route_many_triton.PARAM_STAGES": 0}),
    # route's kernels with the register prefetch only (before session 18; since, the one-head
    # forward at d = 1024 and the one-head backward with running sums through the pipeline)
    "rs0": (("wav", "attnres", "mhar"), {"ROUTE_FORWARD_STAGES": 0, "ROUTE_BACKWARD_STAGES": 0}),
    # route_many's keyed forward without the register cap of 168 at d = 1024 (the default
    # since session 28: 7 % faster kernels inside the step, the step level; session 27 ran it
    # as fwdcap0 too, then fwdcap168 while the cap was off)
    "fwdcap0": (("dar_block",), {"route_many_triton.KEYED_FORWARD_MAXNREG": None}),
    # the backward kernels forming sum_j a_j <v_j, g> from the sources, read twice (session
    # 24; off by default: <out, g> from the saved output, the flash-attention shortcut)
    "exact": (("block_attnres", "dar_block", "mhar_block", "wav", "attnres", "mhar"),
              {"kernels.EXACT_SOFTMAX_GRAD": True}),
    # route_many's and route_merge's backward parameter sums finished by torch ops (before
    # session 30: the sums over the programs, the products and the casts, 3-7 launches a
    # call; since, one: param_grads.finish), on the models with a backward call per site,
    # recorded as CUDA graphs too (the GPU's time alone). Session 30 ran wav_cg_tfin too,
    # while route's backward took the kernel as well: no gain, so route keeps the torch ops
    "tfin": (("mhar_block_fm", "mhar_block_fm_cg", "dar_block_fm", "dar_block_fm_cg", "block_attnres_fm",
              "block_attnres_fm_cg", "block_attnres", "attnres", "attnres_cg"), {"param_grads.FUSED": False}),
    # route_merge's multi-head backward without the software pipeline (before session 30;
    # since, 3 stages: 12 % faster kernels in CUDA-graph replays; end to end 0.6 % faster, session 31)
    "mergepipe0": (("mhar_block_fm", "mhar_block_fm_cg"), {"route_merge_triton.MULTI_HEAD_BACKWARD_STAGES": 0}),
    # route_many's one-head per-token backward launched as in session 31 at every query count
    # (2 programs per SM, the compiler's registers; since session 32 by the queries a program
    # holds, route_many_triton.PER_TOKEN_LAUNCH; session 31 ran 3 programs at a cap of 168 for
    # every count as attnres_pp3cap168: 0.726x against 0.700x); then two other tables: one
    # query at 4 programs capped at 128 (the block phase's fastest at N = 3, session 32), and
    # 3 programs capped at 168 up to 4 queries
    "pt31": (("attnres",), {"route_many_triton.PER_TOKEN_LAUNCH": {1: (2, None)}}),
    "pt1x4": (("attnres",), {"route_many_triton.PER_TOKEN_LAUNCH": {1: (4, 128), 2: (4, None), 4: (3, 168),
                                                                  8: (2, None)}}),
    "pt3": (("attnres",), {"route_many_triton.PER_TOKEN_LAUNCH": {1: (3, 168), 8: (2, None)}}),
    # one query at 8 programs per SM (session 32's table; since session 33, 6: at 72
    # registers 7 fit, and 6 was the fastest at the readout's call)
    "pt1x8": (("attnres",), {"route_many_triton.PER_TOKEN_LAUNCH": {1: (8, None), 2: (4, None), 4: (3, 168),
                                                                  8: (2, None)}}),
    # one-head route_many calls of more than 4 queries through the tiled backward (Block
    # AttnRes's blocks of 6 and 7; full AttnRes makes none, so its pair shows the noise):
    # the per-token kernel spills there
    "tiled5": (("attnres", "block_attnres"), {"route_many_triton.PER_TOKEN_MAX_QUERIES": 4}),
    # the backward kernels' three row sums of a source reduced one by one (before session 33;
    # since, joined in one reduction: route_many's per-token backward and route's backward)
    "sums1": (("attnres", "block_attnres", "wav", "mhar"),
              {"route_many_triton.PER_TOKEN_FUSED_SUMS": False, "BACKWARD_FUSED_SUMS": False}),
    # the forwards' online softmax rescaled at every new maximum (before session 34; since,
    # only when a logit passes the running shift by route_triton.LAZY_RESCALE_MARGIN)
    "eager": (("attnres", "block_attnres", "wav", "mhar_block", "dar_block", "mhar"),
              {"LAZY_RESCALE": False}),
    # route_many without the forward's statistics table: the backward forms the logits and
    # rstd from the rows (before session 34; Block AttnRes keeps one for its readout only)
    "nostats": (("attnres", "block_attnres"), {"route_many.SAVE_STATS": False}),
    # route_many's per-token backward holding 6 queries as 8 padded rows (before session 66;
    # since, as two tiles of 4 + 2 rows: route_many_triton.SPLIT_QUERIES)
    "nosplit": (("block_attnres",), {"route_many_triton.SPLIT_QUERIES": False}),
    # route_many keeping its statistics table for calls of up to 8 queries (since session 34:
    # up to 4, route_many.STATS_MAX_QUERIES): Block AttnRes's 6-query backwards then read the
    # logits and rstd (as two tiles, its sm_90 code does not spill with them; session 66), level
    # end to end in session 67 (0.883x against 0.886x, docs/benchmarks.md)
    "stats8": (("block_attnres",), {"route_many.STATS_MAX_QUERIES": 8}),
    # the merges' logit differentiated by autograd through plain torch ops, its sum over the
    # tokens one of Inductor's reductions (before session 68; since, a matrix product in its
    # own backward: source_logit.MATMUL_TOKEN_SUM; two-phase WAV's scaled sources since
    # session 69)
    "plainlogit": (("block_attnres", "mhar_block", "dar_block", "wav_2p", "attnres"), {"source_logit.MATMUL_TOKEN_SUM": False}),
    # the merges' logit backward's sum over the tokens as the op token_weighted_sum, a Triton
    # kernel reading the source once (source_logit.TRITON_TOKEN_SUM; session 81, off until
    # timed), not cuBLAS's product of the weights' bf16 parts
    "tritonsum": (("block_attnres", "mhar_block", "dar_block", "wav_2p", "attnres"),
                  {"source_logit.TRITON_TOKEN_SUM": True}),
    # merge_routes' softmax over torch.stack of its logits (before session 70; since, term by
    # term: route_many.MERGE_SOFTMAX_BY_TERMS): two-phase WAV's merges, full AttnRes's of 2-3
    # group entries
    "stackedsoftmax": (("wav_2p", "attnres"), {"route_many.MERGE_SOFTMAX_BY_TERMS": False}),
    # the product's per-token weights as two bf16 parts (16 significant bits), the form
    # session 68's runs 2-5 timed; since its run 6, three (float32's 24)
    "parts2": (("block_attnres", "mhar_block", "dar_block"), {"source_logit.WEIGHT_PARTS": 2}),
    # DAR's gate, transport and beta scalars as per-token factors, their gradients summed
    # over each row first (dar.PER_TOKEN_SCALARS; prepared in session 68, the default since
    # session 69), and as they were before, each gradient one sum over every element
    "rowsums": (("dar_block",), {"dar.PER_TOKEN_SCALARS": True}),
    "wholesums": (("dar_block",), {"dar.PER_TOKEN_SCALARS": False}),
    # route_many's per-token backward requesting 3 or 4 sources ahead at every query count, or
    # 2 (before session 35; since, 4 for 5-8 queries: route_many_triton.PER_TOKEN_PREFETCH).
    # Session 35's runs 2-3 ran pf3 and pf4 while 2 was the default at every count
    **{f"pf{k}": (("attnres", "block_attnres"), {"route_many_triton.PER_TOKEN_PREFETCH": {1: k}}) for k in (2, 3, 4)},
    # full AttnRes's group entries (2-3 a site) merged by Inductor's ops, not one-query
    # route_many calls: 24 custom-op calls a step fewer (two_phase.DIRECT_MERGE_ENTRIES;
    # prepared in session 35; session 36: 1.5 % slower, not taken)
    "direct3": (("attnres", "attnres_cg"), {"two_phase.DIRECT_MERGE_ENTRIES": 3}),
    # route_many_backward's source gradients added to running sums in its kernels, not by
    # Inductor's adds (grad_accumulation.ACCUMULATED_OPS): in every call (manyacc; session
    # 36's runs 4-6, before the default took them in calls of at most 4 queries: for full
    # AttnRes, whose calls all qualify, the same as the default), in none (rbacc:
    # route_backward's only, as before session 36)
    "manyacc": (("attnres", "block_attnres", "mhar_block", "dar_block"),
                {"grad_accumulation.ROUTE_MANY_MAX_QUERIES": None}),
    "rbacc": (("attnres", "block_attnres", "mhar_block", "dar_block"),
              {"grad_accumulation.ACCUMULATED_OPS": ("route_backward",)}),
    # route_many_backward's calls of 16 heads with running sums too (the tiled kernel;
    # grad_accumulation.ROUTE_MANY_MULTI_HEAD; session 40)
    "mhsums": (("mhar_block", "mhar_g4_keep_fm", "mhar_g2_keep_fm"),
               {"grad_accumulation.ROUTE_MANY_MULTI_HEAD": True}),
    # route's 16-head forward on 2 tokens a program and 4 warps, as before session 42 (since,
    # one token on one warp: route_triton.MULTI_HEAD_FORWARD_TOKENS' comment)
    "rfw2": (("mhar",), {"MULTI_HEAD_FORWARD_TOKENS": 2, "MULTI_HEAD_FORWARD_WARPS": 4}),
    # route_many's 16-head forward on 2 warps, as from session 16 to 40 (since session 41, 1)
    "mhfw2": (("mhar_block", "mhar_g4_keep_fm"), {"route_many_triton.MULTI_HEAD_FORWARD_WARPS": 2}),
    # route's 16-head backward as before session 37 (the register prefetch, the compiler's
    # registers, 8 programs per SM); since, 3 stages at 128 registers and 4 programs per SM
    # (route_triton.MULTI_HEAD_BACKWARD_MAXNREG's comment; session 37's run 2 measured that
    # launch as mhar_mhs3r128 beside this one as the default)
    "mh0": (("mhar",), {"MULTI_HEAD_BACKWARD_STAGES": 0, "MULTI_HEAD_BACKWARD_MAXNREG": None,
                        "MULTI_HEAD_BACKWARD_PER_SM": 8}),
    # route_many's one-head per-token backward with running sums through the register
    # prefetch, as before session 38 (since, its sources through Triton's pipeline at 4
    # queries, and in session 38 at 1 too: route_many_triton.RUNNING_PER_TOKEN_STAGES).
    # Full AttnRes only: no call of Block AttnRes's gets running sums (its readout comes
    # first in the backward)
    "run0": (("attnres",), {"route_many_triton.RUNNING_PER_TOKEN_STAGES": {1: 0}}),
    # session 38's default: the pipeline at one query too (session 39 measured the one-query
    # calls over 2-3 sources slower with it, the four-query calls faster)
    "run13": (("attnres",), {"route_many_triton.RUNNING_PER_TOKEN_STAGES": {1: 3, 2: 0, 4: 3, 8: 0}}),
    # route_many's one-head forward (no keys, d <= 1024) with 4 queries a program and 4
    # warps (127 registers with the lazy rescale) instead of 2 queries and 1 warp (session 34)
    "fq4": (("attnres", "block_attnres"),
            {"route_many_triton.FORWARD_QUERIES": 4, "route_many_triton.MANY_NARROW_FORWARD_WARPS": 4}),
    # DAR's gate and transport as differences, one sum over the tokens per scalar use
    # (dar.MIX_FORM; the default is the spec's form)
    "mixd": (("dar_block",), {"dar.MIX_FORM": "difference"}),
    # DAR's transport at a block's closing site untagged, as before session 43 (since, tagged
    # for recomputation like every other site's: dar.TAG_CLOSING_TRANSPORT)
    "untag": (("dar_block",), {"dar.TAG_CLOSING_TRANSPORT": False}),
    # under FSDP2, the sites whose phase 1 would read the next block's shards routed one by
    # one, as before session 59 (two_phase.GATHER_SHARDS)
    "site": ((f"block_attnres_{PER_BLOCK}_{FSDP}", f"dar_block_{PER_BLOCK}_{FSDP}"), {"two_phase.GATHER_SHARDS": False}),
}
LAUNCH_PATCHES = {f"{base}_{suffix}": patch for suffix, (bases, patch) in LAUNCH_VARIANTS.items() for base in bases}
CONFIGS.update({name: CONFIGS[name.rsplit("_", 1)[0]][:2] + (None,) for name in LAUNCH_PATCHES})
for _name in LAUNCH_PATCHES:  # a variant of a configuration with backend options keeps them
    BACKEND_OPTIONS.setdefault(_name, BACKEND_OPTIONS.get(_name.rsplit("_", 1)[0], {}))
#: the kernels registered with the dispatcher directly (depthrewrite.kernels' "dispatcher"
#: registration, set in the configuration's process before it imports depthrewrite), each
#: beside its base configuration: the host time of a call, on the host-bound models (session 21;
#: full AttnRes since session 35: its GPU idles 6.3 ms a step against the baseline's 2.6)
RAW_REGISTRATION = tuple(f"{base}_raw" for base in ("wav", "dar_block", "block_attnres", "dar_block_fm",
                                                    "block_attnres_fm", "mhar_block_fm", "attnres"))


def _same_as_base(names) -> None:
    """Each of ``names`` (``<base>_<suffix>``) as its base configuration: the same model, launch
    constants and backend options, no goal of its own (the suffix changes the process only)."""
    for name in names:
        base = name.rsplit("_", 1)[0]
        CONFIGS[name] = CONFIGS[base][:2] + (None,)
        LAUNCH_PATCHES[name] = LAUNCH_PATCHES.get(base, {})
        BACKEND_OPTIONS[name] = BACKEND_OPTIONS.get(base, {})


_same_as_base(RAW_REGISTRATION)


def _with_variants(name: str, model: str, *suffixes: str) -> None:
    """``name``: the configuration ``model`` (its model and goal) with the backend options of
    the ``BACKEND_VARIANTS`` named by ``suffixes`` together."""
    CONFIGS[name] = CONFIGS[model]
    BACKEND_OPTIONS[name] = {key: value for suffix in suffixes for key, value in BACKEND_VARIANTS[suffix].items()}


#: DAR block's lowest-memory form: the second phase through route_merge with the branch
#: outputs recomputed too (the CPU saved set predicted 1.03-1.08x the baseline's peak at
#: 350M; session 26's run 2 measured 1.062x, steps 2.6 % longer than dar_block's)
_with_variants("dar_block_fm_branch", "dar_block_fm", "branch")
#: the same with only the attention projections' outputs recomputed (session 43: the CPU
#: saved set 12 units under the fused merge's at 12 layers, 0.75 GiB at 350M by the count;
#: session 44: 1.089x the baseline's peak, its kernels level with dar_block's)
_with_variants("dar_block_fm_narrow", "dar_block_fm", "narrow")
#: the same with its kernels registered with the dispatcher directly: is its step without
#: CUDA graphs, 6-16 % slower than dar_block's where the host is slow (sessions 44-45), the
#: custom op wrapper's host time? Session 46's run 1: no, 0.570x against 0.600x, both
#: host-bound (docs/benchmarks.md: the host time is our launchers')
RAW_REGISTRATION += ("dar_block_fm_narrow_raw",)
_same_as_base(("dar_block_fm_narrow_raw",))
#: the same recorded as CUDA graphs (mode="reduce-overhead"): the host out of the step,
#: where session 44 found it 6-16 % slower on slow hosts (session 45's run 1: 0.9 % slower
#: than dar_block_cg, 1.093x the baseline's reserved memory against 1.157x)
_with_variants("dar_block_fm_narrow_cg", "dar_block_fm", "narrow", "cg")
#: the same without Inductor's asserts in its wrapper (host time; session 47)
_with_variants("dar_block_fm_narrow_noasserts", "dar_block_fm", "narrow", "noasserts")
#: the same with Inductor's wrapper in C++: its steps host-bound on slow hosts (sessions
#: 44-47), is the wrapper's Python what the C++ one saves? (session 58)
_with_variants("dar_block_fm_narrow_cpp", "dar_block_fm", "narrow", "cpp")
#: WAV's forms short of memory recorded as CUDA graphs, beside wav_cg (WAV is host-bound
#: without them; session 44 timed these without)
_with_variants("wav_branch_cg", "wav", "branch", "cg")
_with_variants("wav_narrow_cg", "wav", "narrow", "cg")
#: DAR block's fused merge at Inductor's own max_fusion_size (its graphs get 16 from the
#: backend since session 28, measured on dar_block only)
_with_variants("dar_block_fm_mfs64", "dar_block_fm", "mfs64")
#: ``gc.freeze()`` after the warm-up: some timed trials ran 11-140 ms a step over their
#: siblings, and a full collection walks all the compiles' objects. Session 44's run 5: not
#: the collector (3-9 ms of collections a trial, none full); frozen, the slow first trial
#: and the median stayed (docs/benchmarks.md)
GC_FREEZE = tuple(f"{base}_gcfreeze" for base in ("baseline", "dar_block", "dar_block_fm_narrow", "wav"))
_same_as_base(GC_FREEZE)
#: block schemes whose peak memory should stay within 1.10x of the baseline's
BLOCK_SCHEMES = ("block_attnres", "mhar_block", "wav", "dar_block")
BATCH, SEQ = 8, 2048
#: steps before timing: the first compiles; the rest let the allocator and caches settle
WARMUP_STEPS = 5
#: steps when a process's turn comes, before its timed trials (its cache was emptied while it
#: waited); then more, up to REWARM_MAX_STEPS, until a step neither grows the allocator's pool
#: nor makes a pointer table. Session 45: DAR block's fused merge made 668 tables in its first
#: timed trial after 2 steps (0 in the next two; that trial 26 % slower); warmed so (5 steps),
#: its first trial still made 434, its addresses repeating for one step and then changing
REWARM_STEPS = 2
REWARM_MAX_STEPS = 12
PROFILE_STEPS = 3
#: (category, regular expression on the kernel name), first match wins
KERNEL_CATEGORIES = (
    ("inductor fused", r"^triton_"),  # first: a fused kernel's name lists the ops it holds
    ("routing (ours)", r"_route|_out_norm"),
    ("attention", r"flash|fmha|attention|sdpa"),  # before matmul: cuDNN's attention kernels use wgmma
    ("matmul", r"gemm|cutlass|nvjet|xmma|wgmma|cublas|gemv|splitk"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("other", r""),
)


def apply_launch_patches(name: str) -> list[tuple]:
    """Set configuration ``name``'s launch constants (:data:`LAUNCH_PATCHES`); returns
    ``(module, constant, previous value)`` for each, to put back."""
    import depthrewrite.kernels as kernels
    from depthrewrite.kernels import param_grads, route_many_triton, route_merge_triton, route_triton
    from depthrewrite import grad_accumulation
    from depthrewrite.passes import dar, two_phase

    # the module, not the function depthrewrite.ops exports under its name
    route_many = importlib.import_module("depthrewrite.ops.route_many")
    from depthrewrite.ops import source_logit

    modules = {"route_triton": route_triton, "route_many_triton": route_many_triton, "two_phase": two_phase,
               "kernels": kernels, "param_grads": param_grads, "route_merge_triton": route_merge_triton,
               "route_many": route_many, "grad_accumulation": grad_accumulation, "dar": dar,
               "source_logit": source_logit}
    previous = []
    for qualified, value in LAUNCH_PATCHES.get(name, {}).items():
        module, _, constant = qualified.rpartition(".")
        module = modules[module or "route_triton"]
        if not hasattr(module, constant):
            raise AttributeError(f"{name}: {module.__name__} has no launch constant {constant}")
        previous.append((module, constant, getattr(module, constant)))
        setattr(module, constant, value)
    return previous


@contextlib.contextmanager
def launch_patches(name: str):
    """Configuration ``name``'s launch constants set inside the block and put back after it
    (:func:`apply_launch_patches`; none for a name without patches, such as a base
    configuration). Yields ``(module, constant, previous value)`` for each."""
    previous = apply_launch_patches(name)
    try:
        yield previous
    finally:
        for module, constant, value in reversed(previous):
            setattr(module, constant, value)


class GcTimes:
    """Python's garbage collections while active (``gc.callbacks``): their total
    milliseconds and how many were full (generation 2) collections."""

    def __init__(self):
        self.ms, self.full, self._start = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.ms += (time.perf_counter() - self._start) * 1e3
        self.full += info["generation"] == 2

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def segments_and_tables() -> tuple[int, int]:
    """Counts since the process started: the CUDA allocator's segments allocated (its pool
    grown by cudaMalloc) and the routing kernels' pointer tables made (not found cached)."""
    import torch

    from depthrewrite.kernels.pointer_tables import cache_counts

    return torch.cuda.memory_stats().get("segment.all.allocated", 0), cache_counts()["made"]


def rewarm(step, least: int = REWARM_STEPS, most: int = REWARM_MAX_STEPS, counts=segments_and_tables) -> int:
    """Run ``step`` at least ``least`` times, then until one run of it changed neither
    count of ``counts`` (the addresses the routing calls get repeat), at most ``most``
    times; the number of runs. Both counts move on the host as a step is issued, so no
    synchronisation is needed between runs."""
    for n in range(1, most + 1):
        before = counts()
        step()
        if n >= least and counts() == before:
            return n
    return most


def _build(name: str):
    if name in RAW_REGISTRATION:  # read when depthrewrite.kernels is first imported, just below
        os.environ["DEPTHREWRITE_KERNEL_REGISTRATION"] = "dispatcher"
    import torch

    import depthrewrite
    from depthrewrite.backend import depthrewrite_backend
    from depthrewrite.models.gpt import gpt_from_preset

    apply_launch_patches(name)
    scheme, options, _ = CONFIGS[name]
    torch.manual_seed(0)
    model = gpt_from_preset("medium", max_seq_len=SEQ)
    backend_options = BACKEND_OPTIONS.get(name, {})
    if scheme is not None:
        model = depthrewrite.rewrite(model, scheme, **options)
    model = model.cuda().to(torch.bfloat16).train()
    dynamic = True if DYNAMIC in name.split("_") else None
    # the callable: the device has no pip-installed entry point
    backend = "inductor" if scheme is None else functools.partial(depthrewrite_backend, options=backend_options)
    options = (backend_options or None) if scheme is None else None
    if PER_BLOCK in name.split("_"):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend, options=options, dynamic=dynamic)
        if FSDP in name.split("_"):
            _shard_on_one_rank(model)
        return model, model
    return model, torch.compile(model, backend=backend, options=options, dynamic=dynamic)


def _shard_on_one_rank(model) -> None:
    """FSDP2 on each block, then the root, over a process group of this process alone."""
    import socket

    import torch
    from torch.distributed.fsdp import fully_shard

    if not torch.distributed.is_initialized():  # host_profile.py builds several models in one process
        with socket.socket() as s:  # a free port for the one-rank group's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _child(name: str, steps: int, trials: int, to_parent, go, profile: int = 0) -> None:
    import torch

    try:
        model, compiled = _build(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        vocab = model.config.vocab_size
        gen = torch.Generator(device="cuda").manual_seed(1)

        cudagraphs = BACKEND_OPTIONS.get(name, {}).get("triton.cudagraphs", False)

        def step():
            if cudagraphs:  # a new iteration: the previous step's graph outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            x = torch.randint(0, vocab, (BATCH, SEQ), device="cuda", generator=gen)
            opt.zero_grad(set_to_none=True)
            _, loss = compiled(x, x)
            loss.backward()
            opt.step()
            return loss

        start = time.time()
        for _ in range(WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        warm_s = time.time() - start
        if name in GC_FREEZE:  # the compiles' objects out of every later collection's walk
            gc.freeze()
        # while waiting, hand the cached blocks back: the others of the wave are timed
        # meanwhile, and a timed process short of memory has its allocator free and retry
        # (session 5: the heavy models' trials varied by up to 25 %)
        torch.cuda.empty_cache()
        to_parent.put(("ready", name, None))
        go.wait()
        # the cache grows back here, not inside the first timed trial
        rewarm_steps = rewarm(step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        trial_ms, collections, made = [], [], []
        for _ in range(trials):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = segments_and_tables()
            with GcTimes() as gc_times:
                t0.record()
                for _ in range(steps):
                    loss = step()
                t1.record()
                torch.cuda.synchronize()
            trial_ms.append(t0.elapsed_time(t1) / steps)
            collections.append(gc_times)
            made.append([now - then for now, then in zip(segments_and_tables(), before)])
        ms = statistics.median(trial_ms)
        row = dict(name=name, step_ms=ms, trial_ms=trial_ms, tokens_per_s=BATCH * SEQ / (ms * 1e-3),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   # CUDA graphs allocate from their own pool when recorded, not while replayed:
                   # max_memory_allocated misses them, the memory the allocator holds does not
                   reserved_gib=torch.cuda.max_memory_reserved() / 2**30, compile_and_warmup_s=warm_s,
                   loss=float(loss.detach()), lowering=_lowering(name),
                   alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before,
                   gc_ms=[c.ms for c in collections], gc_full=[c.full for c in collections],
                   rewarm_steps=rewarm_steps, segments_made=[m[0] for m in made],
                   tables_made=[m[1] for m in made])
        row["host_ms"] = host_issue_ms(step, steps)
        row["host_op_us"] = host_op_us()
        row["launchers"] = launcher_host_ms(step, steps)
        if profile:
            row["kernels"] = kernel_breakdown(step, PROFILE_STEPS, top=profile)
            row["host"] = host_breakdown(step, PROFILE_STEPS)
        to_parent.put(("result", name, row))
    except Exception as exc:  # one configuration failing must not sink the others: record why
        to_parent.put(("result", name, dict(name=name, error=f"{type(exc).__name__}: {exc}",
                                            trace=traceback.format_exc()[-3000:])))


def kernel_category(kernel: str) -> str:
    return next(cat for cat, pattern in KERNEL_CATEGORIES if re.search(pattern, kernel, re.IGNORECASE))


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def kernel_breakdown(step, steps: int, top: int = 12, name_chars: int | None = 120) -> dict:
    """GPU kernel time per category and the ``top`` largest kernels, in ms per step, over
    ``steps`` profiled steps, each kernel's name cut to ``name_chars`` (None: whole); and
    ``gpu_idle_ms``: per step, the time between the first and the last GPU activity in
    which none ran (the GPU waiting for the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    idle_ms = None
    if spans:
        span = max(end for _, end in spans) - min(start for start, _ in spans)
        idle_ms = (span - busy_time(spans)) / 1e3 / steps
    per_kernel: dict[str, list] = {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA or not evt.self_device_time_total:
            continue
        entry = per_kernel.setdefault(evt.key, [0.0, 0])
        entry[0] += evt.self_device_time_total / 1e3 / steps
        entry[1] += evt.count // steps
    categories: dict[str, float] = {cat: 0.0 for cat, _ in KERNEL_CATEGORIES}
    for kernel, (ms, _) in per_kernel.items():
        categories[kernel_category(kernel)] += ms
    largest = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(categories=categories, total_ms=sum(categories.values()), gpu_idle_ms=idle_ms,
                top=[dict(kernel=k[:name_chars], ms=ms, calls=n) for k, (ms, n) in largest])


def host_issue_ms(step, steps: int) -> float:
    """Median host time to issue one step (``step()`` returning, no synchronisation): when
    it is close to the step time, the GPU waits for the host."""
    import torch

    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()  # the next step starts on an idle GPU: its queue never throttles the host
    return statistics.median(times)


#: (module, function): our Triton launchers, which the ops' registered CUDA kernel functions
#: import at each call (so a module attribute replaced here is the one they call)
LAUNCHERS = (("route_triton", "route_forward"), ("route_triton", "route_backward"),
             ("route_many_triton", "route_many_forward"), ("route_many_triton", "route_many_backward"),
             ("route_merge_triton", "route_merge_forward"), ("route_merge_triton", "route_merge_backward"))


def launcher_host_ms(step, steps: int, synchronize=None) -> dict:
    """Host time inside each of our launchers (``LAUNCHERS``) while the step is issued, per
    step, over ``steps`` steps (each started on an idle GPU, as ``host_issue_ms``): launcher
    name -> ``{"ms": host ms per step, "calls": calls per step}``. The launchers' own time in
    a step, against what ``host_overhead.py`` measures for the same calls back to back
    (session 47: the profile put a fused-merge backward at ~860 us of host time in a step
    against ~200 us back to back). ``synchronize``: the GPU wait between steps (default
    ``torch.cuda.synchronize``)."""
    import torch

    synchronize = synchronize or torch.cuda.synchronize
    spent: dict[str, list[float]] = {}
    originals = []
    for module_name, fn_name in LAUNCHERS:
        module = importlib.import_module(f"depthrewrite.kernels.{module_name}")
        original = getattr(module, fn_name)
        spent[fn_name] = [0.0, 0]

        def timed(*args, _fn=original, _acc=spent[fn_name], **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _acc[0] += time.perf_counter() - t0
                _acc[1] += 1
        originals.append((module, fn_name, original))
        setattr(module, fn_name, timed)
    try:
        for _ in range(steps):
            synchronize()
            step()
        synchronize()
    finally:
        for module, fn_name, original in originals:
            setattr(module, fn_name, original)
    return {name: {"ms": total * 1e3 / steps, "calls": calls / steps} for name, (total, calls) in spent.items()
            if calls}


def host_op_us(ops: int = 2000, repeats: int = 5) -> float:
    """The host's microseconds to issue one tiny CUDA op (``torch.add`` of one-element
    tensors, the GPU's work negligible), median of ``repeats`` loops: this process's host
    speed, against which its ``host_ms`` can be read. Session 21 found the same 363
    ``aten::mm`` calls of a step taking 6.6-13.7 ms of host time in different processes
    (docs/benchmarks.md), so host times compare only with this beside them."""
    import torch

    a, b = torch.ones(1, device="cuda"), torch.ones(1, device="cuda")
    out = torch.empty(1, device="cuda")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ops):
            torch.add(a, b, out=out)
        times.append((time.perf_counter() - t0) / ops * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_breakdown(step, steps: int, top: int = 15) -> dict:
    """Host (CPU) time per step of the ``top`` ops and kernel launches with the largest
    self time, from ``torch.profiler`` (its own overhead included: a breakdown, not a step time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return dict(total_ms=total, top=[dict(op=e.key[:100], self_ms=e.self_cpu_time_total / 1e3 / steps,
                                          total_ms=e.cpu_time_total / 1e3 / steps, calls=e.count // steps)
                                     for e in events[:top]])


def _lowering(name: str) -> dict | None:
    """Routing ops per implementation, summed over every graph the backend compiled."""
    if CONFIGS[name][0] is None:
        return None
    from depthrewrite.backend import lowered_ops, reports

    return dict(graphs=len(reports()), ops=lowered_ops())


def run_wave(names: list[str], steps: int, trials: int, timeout_s: float, say, profile: int = 0) -> list[dict]:
    ctx = mp.get_context("spawn")
    to_parent = ctx.Queue()
    gos = {n: ctx.Event() for n in names}
    procs = {n: ctx.Process(target=_child, args=(n, steps, trials, to_parent, gos[n], profile)) for n in names}
    for p in procs.values():
        p.start()
    rows, ready = {}, []
    deadline = time.time() + timeout_s
    while len(ready) + len(rows) < len(names) and time.time() < deadline:
        try:
            kind, name, row = to_parent.get(timeout=max(1.0, deadline - time.time()))
        except queue.Empty:
            break
        if kind == "ready":
            ready.append(name)
            say(f"e2e {name}: compiled and warm")
        else:
            rows[name] = row
            say(f"e2e {name}: ERROR {row['error']}")
    for name in names:  # time them one at a time, in the order they are listed
        if name not in ready:
            continue
        gos[name].set()
        try:
            _, _, row = to_parent.get(timeout=600)
        except queue.Empty:
            row = dict(name=name, error="timed run did not report within 600 s")
        rows[name] = row
        say("e2e " + json.dumps({k: v for k, v in row.items() if k != "trace"}))
    for p in procs.values():
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return [rows.get(n, dict(name=n, error="did not compile within the time limit")) for n in names]


def run(names: list[str], wave: int, steps: int, trials: int, timeout_s: float, say=print,
        profile: int = 0) -> list[dict]:
    rows = []
    for i in range(0, len(names), wave):
        rows += run_wave(names[i : i + wave], steps, trials, timeout_s, say, profile)
    return rows


def breakdown_table(rows: list[dict]) -> str:
    """GPU kernel ms per step and category (rows measured with --profile), and each
    category's difference from the baseline's."""
    rows = [r for r in rows if "kernels" in r]
    if not rows:
        return ""
    cats = [cat for cat, _ in KERNEL_CATEGORIES]
    base = next((r["kernels"]["categories"] for r in rows if r["name"] == "baseline"), None)
    lines = ["| model | " + " | ".join(cats) + " | kernels total | GPU idle |", "| --- |" + " ---: |" * (len(cats) + 2)]
    for r in rows:
        k = r["kernels"]["categories"]
        cells = [f"{k[c]:.1f}" + (f" ({k[c] - base[c]:+.1f})" if base and r["name"] != "baseline" else "")
                 for c in cats]
        idle = r["kernels"].get("gpu_idle_ms")
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['kernels']['total_ms']:.1f} | "
                     + ("-" if idle is None else f"{idle:.1f}") + " |")
    return "\n".join(lines)


def host_table(rows: list[dict]) -> str:
    """Our launchers' host time per step (every row since session 47) and the largest
    host-side costs per model (rows measured with --profile)."""
    lines = []
    for r in rows:
        launchers = "; ".join(f"{n} {v['ms']:.1f} ms in {v['calls']:.0f} calls ({v['ms'] * 1e3 / v['calls']:.0f} us each)"
                              for n, v in (r.get("launchers") or {}).items())
        if launchers:
            lines.append(f"launchers {r['name']} (host ms a step, not profiled): {launchers}")
        if "host" not in r:
            continue
        speed = f" (a tiny CUDA op: {r['host_op_us']:.1f} us)" if "host_op_us" in r else ""
        lines.append(f"host {r['name']}: issue {r['host_ms']:.1f} ms/step{speed}, profiled self time "
                     f"{r['host']['total_ms']:.1f} ms/step; largest (self ms, total ms, calls per step):")
        lines += [f"    {e['self_ms']:7.2f} {e['total_ms']:7.2f} {e['calls']:5d}  {e['op']}" for e in r["host"]["top"]]
    return "\n".join(lines)


def trial_table(rows: list[dict]) -> str:
    """Each timed trial's step time beside the garbage collections that ran in it, the
    pointer tables it made and the allocator's segments it allocated (where recorded: since
    session 44's run 5 and session 45), and the steps run before the trials."""
    lines = []
    for r in rows:
        if "gc_ms" not in r:
            continue
        unknown = [None] * len(r["trial_ms"])
        made = zip(r.get("tables_made") or unknown, r.get("segments_made") or unknown)
        trials = ", ".join(f"{ms:.1f} ms/step (gc {gc_ms:.0f} ms, {full} full"
                           + ("" if tables is None else f"; {tables} tables made")
                           + ("" if segments is None else f", {segments} segments") + ")"
                           for ms, gc_ms, full, (tables, segments) in zip(r["trial_ms"], r["gc_ms"], r["gc_full"], made))
        rewarmed = "" if "rewarm_steps" not in r else f" after {r['rewarm_steps']} steps"
        lines.append(f"trials {r['name']}{rewarmed}: {trials}")
    return "\n".join(lines)


def baseline_of(name: str) -> str:
    """The configuration a row is compared with: the CUDA-graph, coordinate-descent,
    assert-free, C++-wrapper, dynamic and per-block variants with the baseline compiled the
    same way (each way the name says: ``dar_block_pb_cpp`` with ``baseline_pb_cpp``), the
    others with the plain Inductor baseline. A launch variant of a CUDA-graph configuration
    (``mhar_block_fm_cg_tfin``) is recorded as CUDA graphs too."""
    parts = [part for part in (PER_BLOCK, FSDP, "cg", "cdt", "noasserts", "cpp", DYNAMIC) if part in name.split("_")]
    return "_".join(["baseline", *parts])


#: a row whose host takes at least this share of its step to issue the step is marked
#: host-bound: its GPU waits for the host, so its step measures the host as much as the
#: kernels (session 35: full AttnRes's step 105.6 ms with 92.9 ms of host time in one
#: process, 112.5 ms with 108.5 in another, the same kernels)
HOST_BOUND_SHARE = 0.9


def host_bound(row: dict) -> bool:
    """Whether ``row``'s host took HOST_BOUND_SHARE of its step or more to issue it."""
    return row.get("host_ms", 0.0) >= HOST_BOUND_SHARE * row["step_ms"]


def table(rows: list[dict]) -> str:
    bases = {r["name"]: r for r in rows if r["name"].startswith("baseline") and "error" not in r}
    lines = [f"| model | backend | ms/step | host ms/step (us a tiny op; host-bound: >= {HOST_BOUND_SHARE:.0%} of the "
             "step) | tokens/s | x baseline (goal) | peak GiB "
             "| x baseline | reserved GiB | alloc retries | routing ops lowered |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | | error: {r['error'][:80]} | | | | | | | | |")
            continue
        goal = CONFIGS[r["name"]][2]
        base = bases.get(baseline_of(r["name"]))
        speed = f"{base['step_ms'] / r['step_ms']:.3f}" if base else "-"
        if goal is not None:
            speed += f" (>= {goal:.2f})"
        mem = f"{r['peak_gib'] / base['peak_gib']:.3f}" if base else "-"
        if baseline_of(r["name"]) == "baseline_cg":  # peak_gib misses the graphs' pool: compare reserved GiB
            both = base and "reserved_gib" in r and "reserved_gib" in base
            mem = f"- (reserved: {r['reserved_gib'] / base['reserved_gib']:.3f})" if both else "-"
        elif r["name"] in BLOCK_SCHEMES:
            mem += " (<= 1.10)"
        host = f"{r.get('host_ms', float('nan')):.1f}"
        if "host_op_us" in r:  # this process's host speed (host_op_us)
            host += f" ({r['host_op_us']:.1f})"
        if host_bound(r):
            host += " host-bound"
        low = r.get("lowering") or {}
        ops = ", ".join(f"{k}: {v}" for k, v in (low.get("ops") or {}).items())
        if low:
            ops += f" in {low['graphs']} graph(s)"
        lines.append(f"| {r['name']} | {'inductor' if CONFIGS[r['name']][0] is None else 'depthrewrite'} | "
                     f"{r['step_ms']:.1f} | {host} | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{r['peak_gib']:.2f} | {mem} | "
                     f"{r.get('reserved_gib', float('nan')):.2f} | {r.get('alloc_retries', '-')} | {ops or '-'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--schemes", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--wave", type=int, default=4, help="models compiled (and held on the GPU) at once")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--compile-timeout-s", type=float, default=400)
    ap.add_argument("--profile", type=int, nargs="?", const=12, default=0, metavar="TOP",
                    help="also a GPU kernel time breakdown per model, with its TOP (12) largest kernels")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    rows = run(args.schemes, args.wave, args.steps, args.trials, args.compile_timeout_s, profile=args.profile)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(rows, indent=1))
    print(host_table(rows))
    print(trial_table(rows))
    print(table(rows))
    print(breakdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
