#!/usr/bin/env bash
# The GPU runs of the training and scaling issues, one device call per phase (each under
# the 10-minute limit of a call). Data: the corpora of ../shared/data copied into .devdata/
# (carried to the device).
#   OUT=... bash benchmarks/device_session.sh study    # validation study, all visible GPUs
#   OUT=... bash benchmarks/device_session.sh fsdp59   # phase 1 on FSDP2's shards: GPU test, per-block + FSDP2 end to end (session 59)
#   OUT=... bash benchmarks/device_session.sh table59  # every scheme end to end at HEAD (session 59)
#   OUT=... bash benchmarks/device_session.sh host66   # the launchers' host time at HEAD against a copy of the base's package in .ab_base/ (carried), then their GPU kernel tests (session 66)
#   OUT=... bash benchmarks/device_session.sh e2e66    # WAV and full AttnRes beside the baseline at HEAD, then the same in .ab_base/'s copy (session 66)
#   OUT=... bash benchmarks/device_session.sh host67   # a launcher call's host time in parts: dispatch, Triton's launches, our launcher's own work; cProfile tables (session 67)
#   OUT=... bash benchmarks/device_session.sh code68   # what Block AttnRes's Inductor kernels read and write, with their code (session 68)
#   OUT=... bash benchmarks/device_session.sh logit68  # Block AttnRes's Inductor kernels with the merges' logit backward as a matrix product (session 68)
#   OUT=... bash benchmarks/device_session.sh ab68     # the token sum's product layouts; Block AttnRes with it beside the plain ops' form (session 68)
#   OUT=... bash benchmarks/device_session.sh ab68b    # the same for block MHAR and DAR block, the layouts inside CUDA graphs (session 68)
#   OUT=... bash benchmarks/device_session.sh logit68gpu  # source_logit's tests on the GPU; Block AttnRes beside its plain-ops form (session 68)
#   OUT=... bash benchmarks/device_session.sh wav69  # DAR block's per-token scalars and two-phase WAV at HEAD, each beside its default (session 69)
#   OUT=... bash benchmarks/device_session.sh wav2p69  # two-phase WAV with its scaled sources' token sums as products, beside the plain ops and site by site (prepared in session 69)
#   OUT=... bash benchmarks/device_session.sh softmax70  # merge_routes' softmax term by term against the stacked one: two-phase WAV, full AttnRes, its direct merge (prepared in session 70)
#   OUT=... bash benchmarks/device_session.sh softmax70b  # the same for two-phase WAV alone, one wave of 3 (session 70)
#   OUT=... bash benchmarks/device_session.sh first71  # on an H200 every scheme at HEAD; on an H100 the new softmax against float64 on the GPU, then block MHAR's Inductor kernels (session 71)
#   OUT=... bash benchmarks/device_session.sh final72  # on an H200 every scheme at HEAD (table72); on an H100 the kernel tests and the op table beside FLA (carry [".whl"]; session 72)
#   OUT=... bash benchmarks/device_session.sh checks72  # on an H200 table72; on an H100 every kernel test, then every scheme against eager, on the GPU at HEAD (session 72)
#   OUT=... bash benchmarks/device_session.sh last72  # on an H200 the block schemes at HEAD beside the baseline; on an H100 every scheme against eager (session 72)
#   OUT=... bash benchmarks/device_session.sh ops72b  # the op table's d = 4096 rows beside FLA at HEAD (session 72; carry [".whl"])
#   OUT=... bash benchmarks/device_session.sh host71  # the launchers' host time in parts with block MHAR's fused merge among the cases; block MHAR with and without the fused merge (session 71)
#   OUT=... bash benchmarks/device_session.sh h200table77  # on an H200 table72; on an H100 only the card's name (session 77)
#   OUT=... bash benchmarks/device_session.sh h200table78  # on an H200 table72; on any card the harness's routing record on the GPU (session 78)
#   OUT=... bash benchmarks/device_session.sh token82  # tokensum82's speed and tests, then Block AttnRes with the Triton token sum beside its default and the baseline, in one call (session 82)
#   OUT=... bash benchmarks/device_session.sh tokensum82  # the token sum's Triton kernel with a weight a row where a block lies in one head: its GPU tests, its speed at several launch settings (session 82)
#   OUT=... bash benchmarks/device_session.sh blocke2e82  # Block AttnRes beside the baseline: its default, the logit as plain ops, the Triton token sum (session 82)
#   OUT=... bash benchmarks/device_session.sh tokensum81  # the token sum's Triton kernel: its GPU tests, its speed beside the products and Inductor's reduction, Block AttnRes with it beside its default and the baseline (prepared in session 81)
#   OUT=... bash benchmarks/device_session.sh logit81  # the merges' logit as plain ops beside the products: on an H200 Block AttnRes, on an H100 block MHAR, each beside its default and the baseline (session 81)
#   OUT=... bash benchmarks/device_session.sh h200logit80  # on an H200 Block AttnRes's logit as plain ops beside its default and the baseline; on an H100 the card's name (session 80)
#   OUT=... bash benchmarks/device_session.sh h200ops80b  # on an H200 the op table's d = 2048 rows beside FLA (carry [".whl"]); on an H100 the card's name (session 80)
#   OUT=... bash benchmarks/device_session.sh h200ops80  # on an H200 the op table's d = 4096 rows beside FLA (carry [".whl"]); on an H100 the card's name (session 80)
#   OUT=... bash benchmarks/device_session.sh h200table80  # on an H200 table72; on an H100 only the card's name (session 80)
#   OUT=... bash benchmarks/device_session.sh h200table79  # on an H200 table72; on an H100 the trained-model tests (session 79)
#   OUT=... bash benchmarks/device_session.sh h200last79  # on an H200 the block schemes beside the baseline; on an H100 the trained-model tests (session 79)
#   OUT=... bash benchmarks/device_session.sh trained79  # a trained run's model loaded back and sampled on the GPU (session 79)
#   OUT=... bash benchmarks/device_session.sh routing78  # the harness's routing record on the GPU: tests/e2e/test_routing_log.py (session 78)
#   OUT=... bash benchmarks/device_session.sh table72  # every scheme at HEAD, block MHAR's fused merge beside (prepared in session 71)
#   OUT=... bash benchmarks/device_session.sh wavcode70  # what two-phase WAV's and block MHAR's Inductor kernels read and write, with their code (session 70)
#   OUT=... bash benchmarks/device_session.sh table69  # every scheme at HEAD, DAR block's whole scalar sums beside (prepared in session 69)
#   OUT=... bash benchmarks/device_session.sh rowsums69  # DAR's per-token scalars against eager on the GPU: tiny, and 350M in bf16 (session 69)
#   OUT=... bash benchmarks/device_session.sh rowsums68  # DAR block with its scalars as per-token factors, beside the whole sums (prepared in session 68; the default since session 69)
#   OUT=... bash benchmarks/device_session.sh stats67  # Block AttnRes with its 6-query calls keeping the statistics table, beside its default and the baseline (prepared in session 66, run in session 67: level)
#   OUT=... bash benchmarks/device_session.sh host61   # host time a step by package, per-block + FSDP2 (session 61)
#   OUT=... bash benchmarks/device_session.sh fsdp2gpus60  # on 2 GPUs (kind nvidia-h100-x2): torchtitan's stack under FSDP2 against one process (session 60)
#   OUT=... bash benchmarks/device_session.sh kernels  # kernel tests, op table
#   OUT=... bash benchmarks/device_session.sh schemes  # every scheme compiled with the backend vs eager
#   OUT=... bash benchmarks/device_session.sh dynamic50  # new sizes through the backend on the GPU; the step compiled with dynamic=True (session 50)
#   OUT=... bash benchmarks/device_session.sh dynamic50b  # the same step for WAV and full AttnRes (session 50)
#   OUT=... bash benchmarks/device_session.sh ncu49  # where route_many's per-token backward stalls, per SASS instruction (session 49)
#   OUT=... bash benchmarks/device_session.sh ncu49fwd  # the same for route_many's forward (session 49)
#   OUT=... bash benchmarks/device_session.sh schemesinductor  # the routed schemes through Inductor and the backend vs Inductor alone (session 22)
#   OUT=... bash benchmarks/device_session.sh schemes350m  # the same at the 350M model, 2 x 1024 tokens (session 22; queries scaled, session 23)
#   OUT=... bash benchmarks/device_session.sh accuracy  # fp32 gradients vs float64 at 350M: kernels, reference, Inductor, backend (session 23; queries at 0.0625 since its run 3)
#   OUT=... bash benchmarks/device_session.sh accuracybf16  # DAR's bf16 gradients at 350M, every way of running, then 350M fp32 rows (session 24)
#   OUT=... bash benchmarks/device_session.sh exactops   # exact_softmax_grad: GPU tests, op accuracy, op timings (session 24, for 25)
#   OUT=... bash benchmarks/device_session.sh exactcheck  # DAR's bf16 gradients at 350M: with it and without, Inductor with eager's casts (session 24, for 25)
#   OUT=... bash benchmarks/device_session.sh exacte2e    # it end to end against the defaults (session 24, for 25)
#   OUT=... bash benchmarks/device_session.sh launch   # kernel launch variants against the defaults
#   OUT=... bash benchmarks/device_session.sh e2e      # 1-GPU training throughput: Inductor baseline vs schemes
#   OUT=... bash benchmarks/device_session.sh memory   # WAV and DAR block with and without recompute_branch_outputs, DAR block's fused-merge forms (session 26)
#   OUT=... bash benchmarks/device_session.sh keepgroups  # Block AttnRes and block MHAR with keep_groups=4
#   OUT=... bash benchmarks/device_session.sh fwdorder   # route_many's forward: the program orders
#   OUT=... bash benchmarks/device_session.sh fwdlaunch  # its launches: session 16's against 15's
#   OUT=... bash benchmarks/device_session.sh fwdruns    # its runs of tokens per program (session 17)
#   OUT=... bash benchmarks/device_session.sh fwdpipe    # the forward's new launch end to end (session 17)
#   OUT=... bash benchmarks/device_session.sh keyedbwd   # DAR's keyed backward: per-token against tiled
#   OUT=... bash benchmarks/device_session.sh sums       # joined row sums: kernel tests, kernel A/B (session 33)
#   OUT=... bash benchmarks/device_session.sh sumsab     # joined row sums end to end (session 33)
#   OUT=... bash benchmarks/device_session.sh sumsconfirm  # the same again for full AttnRes and WAV (session 33)
#   OUT=... bash benchmarks/device_session.sh sumslaunch   # the per-token backward's launches with them (session 33)
#   OUT=... bash benchmarks/device_session.sh readout    # one-query backwards at 6 programs per SM against 8, end to end (session 33)
#   OUT=... bash benchmarks/device_session.sh sumsfinal  # GPU kernel tests, full and Block AttnRes end to end (session 33)
#   OUT=... bash benchmarks/device_session.sh table33    # every scheme end to end with the session's defaults (session 33)
#   OUT=... bash benchmarks/device_session.sh lazy       # GPU kernel tests; the forwards' lazy rescale against the eager one: kernels, full and Block AttnRes end to end (session 34)
#   OUT=... bash benchmarks/device_session.sh stats      # route_many's GPU tests with the forward's statistics table, its kernels and full AttnRes with it and without (session 34)
#   OUT=... bash benchmarks/device_session.sh table34    # every scheme end to end with the session's defaults (session 34)
#   OUT=... bash benchmarks/device_session.sh stats35    # GPU kernel tests; full and Block AttnRes with the statistics table and without, end to end (session 35)
#   OUT=... bash benchmarks/device_session.sh prefetch35  # the per-token backward 3 or 4 sources ahead: kernels and full AttnRes end to end (session 35)
#   OUT=... bash benchmarks/device_session.sh final35    # host time per call before and after the session's trims, route_many's GPU tests, full and Block AttnRes end to end (session 35)
#   OUT=... bash benchmarks/device_session.sh direct36   # full AttnRes with its groups' entries merged by Inductor's ops, and as CUDA graphs (prepared in session 35)
#   OUT=... bash benchmarks/device_session.sh table36    # every scheme end to end, each model's 30 largest kernels (session 36)
#   OUT=... bash benchmarks/device_session.sh sums36     # route_many's running sums: GPU tests, kernel times, full and Block AttnRes end to end with and without (session 36)
#   OUT=... bash benchmarks/device_session.sh mhar37     # GPU kernel tests; route's launch variants at full MHAR's site shapes (session 37)
#   OUT=... bash benchmarks/device_session.sh mhar37e2e  # full MHAR with the 16-head backward's fastest launch against the old, end to end (session 37)
#   OUT=... bash benchmarks/device_session.sh final37    # GPU kernel tests; full MHAR new / old launch and full AttnRes end to end (session 37)
#   OUT=... bash benchmarks/device_session.sh running38  # route_many's per-token backward launches with running sums at full AttnRes's call shapes (session 38)
#   OUT=... bash benchmarks/device_session.sh sequence39   # full AttnRes's backward calls of a step replayed in order, two launches; end to end (session 39)
#   OUT=... bash benchmarks/device_session.sh matmuls39    # the same replay, also with matmuls between the calls (session 39)
#   OUT=... bash benchmarks/device_session.sh final39      # GPU tests; the replay with the final default, run0 and run13 (session 39)
#   OUT=... bash benchmarks/device_session.sh table39      # every scheme end to end at HEAD (session 39)
#   OUT=... bash benchmarks/device_session.sh grouped40    # grouped full MHAR (pairs of sites, the fused merge) checked against eager, then end to end against the default (session 40)
#   OUT=... bash benchmarks/device_session.sh mhsums40     # route_many's running-sum GPU tests; 16-head route_many calls with running sums, end to end (session 40)
#   OUT=... bash benchmarks/device_session.sh mhsumsab40   # block MHAR with and without them, one model compiled at a time (session 40)
#   OUT=... bash benchmarks/device_session.sh running38e2e  # route_many's GPU tests; full AttnRes with the pipeline for running sums against the register prefetch, end to end (session 38)
#   OUT=... bash benchmarks/device_session.sh fwdq4      # route_many's forward with 4 queries a program (2 or 4 warps) at full AttnRes's and the block phase's shapes, end to end (session 34)
#   OUT=... bash benchmarks/device_session.sh ncu        # Nsight Compute on route_many's kernels (session 18)
#   OUT=... bash benchmarks/device_session.sh paramstages  # the parameter reduction's pipeline (session 18)
#   OUT=... bash benchmarks/device_session.sh paramab    # its new defaults end to end against the old (session 18)
#   OUT=... bash benchmarks/device_session.sh routepipe  # route's kernels through the pipeline (session 18)
#   OUT=... bash benchmarks/device_session.sh pipeab     # both pipelines end to end against the old (session 18)
#   OUT=... bash benchmarks/device_session.sh fullbwd    # full AttnRes's backward kernel A/B, GPU tests (session 18)
#   OUT=... bash benchmarks/device_session.sh table      # every scheme end to end, 40 kernels each (session 19)
#   OUT=... bash benchmarks/device_session.sh fusedmerge   # route_merge: GPU tests, scheme check, kernel speed, e2e A/B (sessions 19-20)
#   OUT=... bash benchmarks/device_session.sh algorithms   # two-phase WAV, grouped full MHAR vs the defaults (session 19)
#   OUT=... bash benchmarks/device_session.sh inductorcode  # what Inductor's kernels read, their bandwidth (session 19)
#   OUT=... bash benchmarks/device_session.sh session21  # kernel tests, DAR fm check, host time per op, op table (carry .whl)
#   OUT=... bash benchmarks/device_session.sh opwide     # the op table's d = 4096 rows beside FLA (carry .whl; session 22)
#   OUT=... bash benchmarks/device_session.sh hostab     # the kernels' registration A/B on the host-bound models (session 21)
#   OUT=... bash benchmarks/device_session.sh graphtiming  # the routing calls' GPU time alone (CUDA-graph replays) against events per call (session 21)
#   OUT=... bash benchmarks/device_session.sh regcap   # route_many's kernels under register caps, DAR's lowest-memory form checked (session 27)
#   OUT=... bash benchmarks/device_session.sh mergelaunch  # route_merge's launch variants and backward pipeline, GPU tests (session 27)
#   OUT=... bash benchmarks/device_session.sh fme2e    # the fused merge end to end with route_merge's session-27 launches (session 27)
#   OUT=... bash benchmarks/device_session.sh fmcheck  # route_merge's GPU tests and the fused-merge scheme checks (session 27)
#   OUT=... bash benchmarks/device_session.sh fwdcap   # route_many's forward under register caps again (session 27)
#   OUT=... bash benchmarks/device_session.sh capab    # DAR block with the keyed forward's register cap against without (session 27)
#   OUT=... bash benchmarks/device_session.sh inductorab  # DAR block under Inductor settings for its reductions, and the keyed forward's cap (session 28)
#   OUT=... bash benchmarks/device_session.sh fusionab  # Inductor's max_fusion_size on DAR block and WAV, route_many's GPU tests (session 28)
#   OUT=... bash benchmarks/device_session.sh hintab    # DAR block with the backend's max_fusion_size=16 against 64, checked against Inductor alone (session 28)
#   AB_VARIANTS="..." OUT=... bash benchmarks/device_session.sh ab  # those configurations beside the baseline (session 29)
#   OUT=... bash benchmarks/device_session.sh mkab      # Inductor's multi_kernel on the block schemes (session 29)
#   OUT=... bash benchmarks/device_session.sh finab     # the parameter sums' finishing kernel: GPU tests, host per call, e2e against the torch ops (session 30)
#   OUT=... bash benchmarks/device_session.sh fmab      # GPU kernel tests; block MHAR's fused merge: its defaults, the 3-stage backward's A/B, the direct registration (for session 31)
#   OUT=... bash benchmarks/device_session.sh fullab   # full AttnRes: route_many's per-token backward at its call shapes (programs per SM, register caps, registers), then end to end by PER_TOKEN_LAUNCH tables (session 32)
#   OUT=... bash benchmarks/device_session.sh fullconfirm   # the kernel tests, then full AttnRes with PER_TOKEN_LAUNCH beside session 31's launch and the baseline (session 32)
#   OUT=... bash benchmarks/device_session.sh tiled5   # one-head route_many calls of more than 4 queries through the tiled backward, full and Block AttnRes (session 32)
#   OUT=... bash benchmarks/device_session.sh fullfwd   # route_many's forward launch variants at full AttnRes's call shapes (session 32)
#   OUT=... bash benchmarks/device_session.sh fullphase   # the per-token backward's variants at full AttnRes's corrected call shapes (session 32)
#   OUT=... bash benchmarks/device_session.sh blockq   # the block phase's queries in per-token chunks of 4 or 2 (session 32)
#   OUT=... bash benchmarks/device_session.sh launch47   # the two-phase launchers' host time: their parts, and inside DAR block's step (session 47)
#   OUT=... bash benchmarks/device_session.sh asserts47  # Inductor's wrapper without its asserts: DAR block, its fused merge with "narrow"; DAR block's combo kernels (session 47)
#   OUT=... bash benchmarks/device_session.sh ops48a   # GPU kernel tests, then the op table's d = 2048 rows beside FLA at HEAD (session 48; carry .whl)
#   OUT=... bash benchmarks/device_session.sh ops48b   # the param_grads GPU tests, the op table's d = 4096 rows beside FLA at HEAD (session 48; carry .whl)
#   OUT=... bash benchmarks/device_session.sh eager52  # the ops through eager autograd: our autograd kernel and the registration A/B, then the GPU kernel tests (session 52)
#   OUT=... bash benchmarks/device_session.sh checks53  # the kernels past 2**31 elements, the GPU kernel tests, eager_autograd.py once (session 53)
#   OUT=... bash benchmarks/device_session.sh checks55  # the GPU kernel tests, pipelines fitted to shared memory (session 55)
#   OUT=... bash benchmarks/device_session.sh checks56  # torchtitan's per-block compile with checkpointing on the GPU, then the GPU kernel tests (session 56)
#   OUT=... bash benchmarks/device_session.sh e2e56  # Block AttnRes and DAR block end to end beside the baseline (session 56)
#   OUT=... bash benchmarks/device_session.sh perblock56  # the plain model and Block AttnRes with each block compiled alone (session 56)
#   OUT=... bash benchmarks/device_session.sh perblock56b  # the same for DAR block and WAV (session 56)
#   OUT=... bash benchmarks/device_session.sh gpu58     # the C++ wrapper's GPU tests (refused on torch 2.11), then perblock57 (session 58)
#   OUT=... bash benchmarks/device_session.sh cpp58     # Inductor's C++ wrapper: the GPU tests, DAR block and WAV with it (session 58)
#   OUT=... bash benchmarks/device_session.sh cpp58b    # the same for WAV and DAR block's fused merge with "narrow" (session 58)
#   OUT=... bash benchmarks/device_session.sh cpp58c    # the same, each block compiled alone (torchtitan's way; session 58)
#   OUT=... bash benchmarks/device_session.sh perblock57  # the GPU per-block tests, then DAR block and WAV compiled block by block, with runtime.DepthCall (session 57)
#   OUT=... bash benchmarks/device_session.sh session55  # checks55, then DAR block and WAV end to end beside the baseline (session 55)
#   OUT=... bash benchmarks/device_session.sh ops52    # the op table's d = 2048 rows beside FLA with the flat autograd kernel (session 52; carry .whl)
#   OUT=... bash benchmarks/device_session.sh inplace48  # route_many_backward_into_: its GPU tests, full AttnRes with it and without (session 48)
#   OUT=... bash benchmarks/device_session.sh fsdp2    # 2 GPUs: FSDP2 scaling runs
set -u
: "${OUT:?OUT must name the output folder}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "editable install failed"
DATA=.devdata/tinystories_sample.txt
RUN=benchmarks/scaling_run.py
LOG=$OUT/log.txt
nvidia-smi -L | tee -a "$LOG"
# route_many's forward launch variants matching $1 at the block phase's shapes (at most $2 s),
# then the models $5... end to end with a kernel profile, $4 at a time (at most $3 s)
forward_launch_ab() {
  local variants=$1 phase_limit=$2 e2e_limit=$3 wave=$4
  shift 4
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "$phase_limit" python3 benchmarks/gpu_suite.py --block-phase-only --variants "$variants" --out "$OUT/bp" \
      > "$OUT/bp.txt" 2>&1
  grep -o "tokens=.*many_bwd=[^ ]*" "$OUT/bp.txt"
  timeout "$e2e_limit" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave "$wave" --profile 12 --schemes "$@" \
      > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -18
}
# the fla-core wheel carried in .whl/ (run's carry [".whl"]) installed into /tmp/site, which
# goes first on PYTHONPATH, for the op table's FLA column
with_fla() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD TRITON_DEFAULT_FP_FUSION=1
}
# the op table (gpu_suite.py, every column) at the DESIGN.md shapes of the widths "${@:3}",
# at most $1 s with its optional parts skipped past $2 s; its last 10 lines printed
op_table() {
  local seconds=$1 budget=$2
  shift 2
  timeout "$seconds" python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s "$budget" --no-e2e --no-block-phase \
      --widths "$@" > "$OUT/suite_log.txt" 2>&1
  tail -10 "$OUT/suite_log.txt"
}
# gpu_suite.py's end-to-end table for the comma-separated configurations $2 (at most $1 s),
# its last $3 lines printed
e2e_table() {
  timeout "$1" python3 benchmarks/gpu_suite.py --out "$OUT" --e2e-only --e2e-schemes "$2" > "$OUT/e2e_log.txt" 2>&1
  grep -v "^\s*$" "$OUT/e2e_log.txt" | grep -iv "warn" | tail -"$3"
}
# the GPU kernel tests (at most $1 s), their last two lines printed and logged
gpu_kernel_tests() {
  # the offsets past 2**31 hold ~30 GiB a test: run alone (large_offset_tests), not 8 at once
  timeout "$1" python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels \
      --ignore tests/kernels/test_large_offsets.py > "$OUT/kernel_tests.txt" 2>&1
  tail -2 "$OUT/kernel_tests.txt" | tee -a "$LOG"
}
# the kernels on sources of more than 2**31 elements, one test at a time (at most $1 s)
large_offset_tests() {
  timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_large_offsets.py \
      > "$OUT/large_offsets.txt" 2>&1
  tail -2 "$OUT/large_offsets.txt" | tee -a "$LOG"
}
# one kernel test file, tests/kernels/$2 (pytest's further arguments "${@:4}"), at most $1 s,
# its summary in $OUT/$3 and printed
kernel_test_file() {
  timeout "$1" python3 -m pytest -q -n 8 -p no:cacheprovider "tests/kernels/$2" "${@:4}" > "$OUT/$3" 2>&1
  tail -2 "$OUT/$3"
}
# the C++ wrapper's GPU tests (at most $1 s), their last two lines printed and logged
cpp_wrapper_gpu_tests() {
  timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/compile/test_cpp_wrapper.py -k on_the_gpu \
      > "$OUT/cpp_wrapper.txt" 2>&1
  tail -2 "$OUT/cpp_wrapper.txt" | tee -a "$LOG"
}
# the per-block compile's GPU tests (at most $1 s), their last two lines printed and logged
per_block_gpu_tests() {
  timeout "$1" python3 -m pytest -q -n 4 -p no:cacheprovider tests/compile/test_per_block_compile.py -k on_the_gpu \
      > "$OUT/per_block.txt" 2>&1
  tail -2 "$OUT/per_block.txt" | tee -a "$LOG"
}
# route_many's block-phase timings at gpu_suite's phase shapes $2 of the variants matching $3
# (gpu_suite's further arguments "${@:5}"), at most $1 s, into $OUT/$4.txt and $OUT/$4/
block_phase_run() {
  timeout "$1" python3 benchmarks/gpu_suite.py --block-phase-only --phase-shapes "$2" --variants "$3" "${@:5}" \
      --out "$OUT/$4" > "$OUT/$4.txt" 2>&1
}
# Nsight Compute on one launch of kernel $1 (after 2) for each case "name args...": warp states,
# scheduler, occupancy, memory and each SASS instruction's stall samples; $OUT/ncu49_<name>.txt,
# $OUT/ncu49_<name>_sass.csv, $OUT/ncu49_<name>_run.txt (route_many_launches.py's output)
ncu_per_instruction() {
  local kernel=$1 spec name
  shift
  local NCU
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for spec in "$@"; do
    set -- $spec
    name=$1
    shift
    timeout 200 "$NCU" --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
        -o "$OUT/ncu49_$name" python3 benchmarks/route_many_launches.py "$@" > "$OUT/ncu49_${name}_run.txt" 2>&1
    "$NCU" -i "$OUT/ncu49_$name.ncu-rep" --print-details all > "$OUT/ncu49_$name.txt" 2>&1
    "$NCU" -i "$OUT/ncu49_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu49_${name}_sass.csv" 2>&1
    rm -f "$OUT/ncu49_$name.ncu-rep"
    echo "== $name"; tail -2 "$OUT/ncu49_${name}_run.txt"
    grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issued Warp Per|No Eligible|DRAM Throughput|Stall" \
        "$OUT/ncu49_$name.txt" | head -16
  done
}
# the e2e table of the schemes "${@:4}" with a 12-kernel profile each, $2 models compiled at
# once, at most $1 s, E2E_TRIALS timed trials each (3 if unset); its last $3 table lines printed
e2e_run() {
  local seconds=$1 wave=$2 lines=$3
  shift 3
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "$seconds" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave "$wave" --profile 12 \
      --trials "${E2E_TRIALS:-3}" --schemes "$@" > "$OUT/e2e.txt" 2>&1
  grep "^trials" "$OUT/e2e.txt"; grep "^|" "$OUT/e2e.txt" | tail -"$lines"
}
# model $1 compiled and profiled in one process with Inductor's code logged (its $2 largest
# kernels, at most $3 s), joined by kernel_inputs.py: what each Inductor kernel reads and
# writes; $OUT/$1_{profile.txt,code.txt,kernels.md}
inductor_code() {
  local model=$1 top=$2 seconds=$3
  TORCH_LOGS=output_code timeout "$seconds" python3 benchmarks/kernel_code.py "$model" "$top" \
      > "$OUT/${model}_profile.txt" 2> "$OUT/${model}_code.txt"
  python3 benchmarks/kernel_inputs.py "$OUT/${model}_code.txt" "$OUT/${model}_profile.txt" \
      > "$OUT/${model}_kernels.md" 2>&1
}
# inductor_code's run of model $1 ($2 kernels, at most $3 s), then its kernel categories and
# the rows of its Inductor kernels and matmuls printed
inductor_code_summary() {
  inductor_code "$@"
  echo "== $1"; head -1 "$OUT/$1_profile.txt"
  grep "triton_\|gemv\|gemm\|nvjet" "$OUT/$1_kernels.md" | head -30 | cut -c1-240
}
# host_overhead.py's two-phase table (3 sources, 100 calls a repeat, at most $1 s a process,
# the rest of the arguments passed on) with the kernels registered each way, a process each:
# $OUT/host_overhead_{custom_op,dispatcher}.txt
host_overhead_each_registration() {
  local seconds=$1
  shift
  for registration in custom_op dispatcher; do
    DEPTHREWRITE_KERNEL_REGISTRATION=$registration timeout "$seconds" python3 benchmarks/host_overhead.py \
      --sources 3 --calls 100 --profile-top 0 "$@" > "$OUT/host_overhead_$registration.txt" 2>&1
    echo "registration: $registration"; grep "^|" "$OUT/host_overhead_$registration.txt" | tail -12
  done
}
# the e2e table of the schemes "$@" (up to 8), in waves of 4, each model's 30 largest
# kernels (at most 570 s); the tables printed
scheme_table() {
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 570 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 4 --profile 30 \
      --schemes "$@" > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -22
}
# every scheme end to end with the defaults (scheme_table)
every_scheme_table() {
  scheme_table baseline block_attnres mhar_block wav dar_block attnres mhar
}
# every scheme at HEAD with its defaults and block MHAR's fused merge beside (scheme_table)
table72_schemes() {
  scheme_table baseline block_attnres mhar_block dar_block wav mhar_block_fm attnres mhar
}
# the card's name printed; true where it is an H200 (the goals' card)
on_h200() {
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  echo "card: $gpu"
  [[ $gpu == *H200* ]]
}
# the token sum's kernel: its speed (token_sum_speed.py, at most 75 s), then its tests and
# source_logit's on the GPU (at most $1 s)
token_sum_speed_and_tests() {
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 75 python3 benchmarks/token_sum_speed.py 2>&1 | tee "$OUT/token_sum_speed.txt" | tail -24
  timeout "$1" python3 -m pytest -q -rs --durations=5 -p no:cacheprovider tests/kernels/test_token_sum_triton.py \
      tests/unit/test_source_logit.py 2>&1 | tee "$OUT/pytest_token_sum.txt" | tail -12
}
# the tests of tests/e2e/test_$1.py, its CUDA tests among them, into $OUT/pytest_$1.txt
# (carry [".whl", ".devdata"]: the tests read .devdata/tinyshakespeare.txt)
e2e_test_file() {
  PYTHONPATH=$PWD DEPTHREWRITE_DATA=$PWD/.devdata timeout 240 python -m pytest -q -rs -p no:cacheprovider \
    "tests/e2e/test_$1.py" 2>&1 | tee "$OUT/pytest_$1.txt" | tail -15
}
routing_log_tests() { e2e_test_file routing_log; }
trained_model_tests() { e2e_test_file trained_model; }
# every scheme compiled with the backend against eager (gpu_scheme_check.py, at most $1 s);
# its rows printed
every_scheme_check() {
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "$1" python3 benchmarks/gpu_scheme_check.py --device cuda > "$OUT/scheme_check.txt" 2>&1
  grep "scheme-check" "$OUT/scheme_check.txt" | tail -60 | cut -c1-200
}
# route_many's launch variants matching $1 at full AttnRes's call shapes, each one's registers
# as the device compiles it (at most $2 s); PER_TOKEN_VARIANTS: the per-token backward's
full_attnres_phase() {
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  block_phase_run "$2" full_attnres "$1" bp --phase-registers
  tail -10 "$OUT/bp.txt"
}
PER_TOKEN_VARIANTS='^_pertoken(_s31|_pp[3468]|_cap168_pp3|_cap128_pp4)?$|^_tiled$'
case "$1" in
study)
  timeout "${STUDY_SECONDS:-480}" python3 benchmarks/validation_study.py --data-dir .devdata --out "$OUT" \
      --steps "${STUDY_STEPS:-400}" --workers-per-gpu "${WORKERS:-10}" --extra-seeds 1 ${STUDY_ARGS:-} > "$OUT/study.txt" 2>&1
  tail -70 "$OUT/study.txt"
  ;;
kernels)
  # one device call (~7 minutes): the kernel tests and the op table side by side with FLA
  # (the wheel, pip download fla-core==0.6.0 --no-deps -d .whl, carried in .whl/: carry
  # [".whl"]); the table last
  with_fla
  gpu_kernel_tests 150
  timeout "${SUITE_SECONDS:-330}" python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s 250 --no-e2e --no-block-phase \
      > "$OUT/suite_log.txt" 2>&1
  tail -13 "$OUT/suite_log.txt"
  ;;
schemes)
  # every scheme compiled with the backend against eager (~4 minutes, 46 rows in session 22;
  # with the kernel tests and the op table it no longer fit in one call, session 13)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 500 python3 benchmarks/gpu_scheme_check.py --device cuda > "$OUT/scheme_check.txt" 2>&1
  grep "scheme-check" "$OUT/scheme_check.txt" | tail -40
  ;;
schemesinductor)
  # the routed schemes compiled the way training compiles them (the backend with Inductor
  # around the kernels) against Inductor alone on the reference ops (session 22, run in
  # session 23; ~1 minute a scheme: 4 compilations; SCHEMES picks others)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 560 python3 benchmarks/gpu_scheme_check.py --device cuda --inner inductor \
      --schemes ${SCHEMES:-block_attnres dar mhar wav attnres} > "$OUT/scheme_check_inductor.txt" 2>&1
  grep "scheme-check" "$OUT/scheme_check_inductor.txt" | tail -12
  ;;
schemes350m)
  # the same at the end-to-end benchmark's 350M model (24 layers, d = 1024; 2 x 1024 tokens):
  # Inductor's buffer reuse depends on the graph, and session 22's bug showed at 4 x 64
  # tokens, not 2 x 16. Queries at std 0.0625: at the check's default 0.5 the model's fp32
  # gradients are chaotic, in eager too (session 23, gpu_scheme_check.QUERY_STD). In bf16
  # at 0.0625 full AttnRes and WAV are 0.4-0.6 from float64 every way (session 25), so the
  # rule sees nothing there; QUERY_STD=0.0156 (logit scale 0.5, as trained routers) puts
  # full AttnRes at 3e-2 (CPU). About 3 minutes a row: SCHEMES and PRECISIONS pick them
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 560 python3 benchmarks/gpu_scheme_check.py --device cuda --inner inductor --preset medium --layers 0 \
      --batch 2 1024 --query-std ${QUERY_STD:-0.0625} --detail 6 --schemes ${SCHEMES:-dar} --precisions ${PRECISIONS:-fp32} \
      --json "$OUT/scheme_check_350m.json" \
      > "$OUT/scheme_check_350m.txt" 2>&1
  grep "scheme-check\|^    " "$OUT/scheme_check_350m.txt" | tail -20
  ;;
accuracy)
  # session 23, run 3: schemes350m's DAR fp32 row failed (transport gradient 1.2e-1 from
  # float64, Inductor alone 3.5e-3) because at the check's query std 0.5 the 350M model's
  # fp32 gradients are chaotic: eager on the reference ops was a median 62 % from float64.
  # Now (prepared for session 24) at std 0.0625, where run 4's backend row missed the rule by
  # 1.2x on one transport gradient: are the kernels less accurate than the reference ops
  # (per kind, eager with the kernels against eager without, seconds; Block AttnRes too),
  # and does the rule pass correct pairs (Inductor alone against eager) at 2 x 1024 tokens?
  # First the op alone: the kernels' backward shortcut (<out, g> from the saved output)
  # doubled the parameter gradients' fp32 error on the CPU (route_many_accuracy.py).
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 120 python3 benchmarks/route_many_accuracy.py --device cuda > "$OUT/route_many_accuracy.txt" 2>&1
  grep -v "Warning\|warn" "$OUT/route_many_accuracy.txt"
  for config in dar block_attnres; do
    timeout 120 python3 benchmarks/gradient_accuracy.py --config $config --query-std 0.0625 \
        --runs kernels reference > "$OUT/accuracy_$config.txt" 2>&1
    grep -v "Warning\|warn" "$OUT/accuracy_$config.txt"
  done
  timeout 360 python3 benchmarks/gradient_accuracy.py --config dar --query-std 0.0625 \
      --runs backend inductor kernels reference > "$OUT/accuracy_dar_compiled.txt" 2>&1
  grep -v "Warning\|warn" "$OUT/accuracy_dar_compiled.txt"
  ;;
accuracybf16)
  # session 24: schemes350m's DAR bf16 row failed (mix, transport: the backend 0.42 from
  # float64 where Inductor alone was 5.4e-3). Is that the backend, or how far bf16 rounding
  # alone moves these cancellation-bound scalars (eager and the kernels in eager too)? Every
  # gradient's error per run to JSON; then the 350M fp32 rows the last call did not reach
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 300 python3 benchmarks/gradient_accuracy.py --config dar --query-std 0.0625 --precision bf16 \
      --runs backend inductor kernels reference --json "$OUT/accuracy_dar_bf16.json" > "$OUT/accuracy_dar_bf16.txt" 2>&1
  grep -v "Warning\|warn\|__new__" "$OUT/accuracy_dar_bf16.txt"
  timeout "${ROWS_SECONDS:-230}" python3 benchmarks/gpu_scheme_check.py --device cuda --inner inductor --preset medium \
      --layers 0 --batch 2 1024 --query-std 0.0625 --detail 3 --schemes ${SCHEMES:-block_attnres mhar} --precisions fp32 \
      > "$OUT/scheme_check_350m.txt" 2>&1
  grep "scheme-check\|^    " "$OUT/scheme_check_350m.txt"
  ;;
exactops)
  # prepared in session 24: the backward kernels forming sum_j a_j <v_j, g> from the sources
  # (exact_softmax_grad; the sources read twice) instead of <out, g> from the output saved
  # in bf16. Their GPU tests, the op's accuracy (bf16: the shortcut put 1e-2 into the
  # parameter gradients in the interpreter, exact 4e-7), then their time beside the defaults at the
  # block phase's and the per-site shapes (~6 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels -k "exact or package_switch" \
      > "$OUT/exact_tests.txt" 2>&1
  tail -2 "$OUT/exact_tests.txt"
  for dtype in bf16 fp32; do
    timeout 50 python3 benchmarks/route_many_accuracy.py --device cuda --exact --dtype $dtype \
        > "$OUT/route_many_accuracy_$dtype.txt" 2>&1
    grep -v "Warning\|warn" "$OUT/route_many_accuracy_$dtype.txt"
  done
  timeout 160 python3 benchmarks/gpu_suite.py --block-phase-only --variants "_exact" --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  grep -v "^\[" "$OUT/bp.txt" | tail -12
  timeout 120 python3 benchmarks/gpu_suite.py --site-route-only --route-variants "_exact" --out "$OUT/sr" \
      > "$OUT/sr.txt" 2>&1
  grep -v "^\[" "$OUT/sr.txt" | tail -10
  ;;
exactcheck)
  # prepared in session 24: session 24's schemes350m DAR bf16 row failed (the backend's
  # mix and transport gradients 10-80x Inductor alone's error from float64). Two suspects:
  # the kernels' backward shortcut (emulated on the CPU under Inductor: such scalars up to
  # 4-6x worse), and the kernels' phase-1 results stored in bf16 where Inductor alone may
  # keep fp32 (inductor_casts: Inductor with eager's round trips). DAR at 350M in bf16,
  # the failing pair first, eager, then the backend without the shortcut and Inductor with
  # the casts (~9 minutes; the JSON is rewritten as each run ends)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 570 python3 benchmarks/gradient_accuracy.py --config dar --query-std 0.0625 --precision bf16 \
      --runs backend inductor reference backend_exact inductor_casts --json "$OUT/accuracy_dar_bf16.json" \
      > "$OUT/accuracy_dar_bf16.txt" 2>&1
  grep -v "Warning\|warn\|__new__" "$OUT/accuracy_dar_bf16.txt" | head -60
  ;;
exacte2e)
  # prepared in session 24: exact_softmax_grad end to end, side by side with the defaults
  # (the models compile in parallel, then are timed one at a time; ~8 minutes)
  export PYTHONPATH=$PWD
  timeout 560 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 \
      --schemes baseline block_attnres block_attnres_exact dar_block dar_block_exact > "$OUT/exact_e2e.txt" 2>&1
  grep "^|" "$OUT/exact_e2e.txt" | tail -8
  ;;
launch)
  # launch variants (~3 minutes): route_many in the block phase, route at the site and
  # DESIGN.md shapes, each against its default
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 240 python3 benchmarks/gpu_suite.py --block-phase-only --out "$OUT/block_phase" > "$OUT/block_phase.txt" 2>&1
  timeout 90 python3 benchmarks/gpu_suite.py --design-launch-only --out "$OUT/design_launch" > "$OUT/design_launch.txt" 2>&1
  grep -v "^\[" "$OUT/block_phase.txt" | tail -24; grep -v "^\[" "$OUT/design_launch.txt" | tail -6
  ;;
e2e)
  # training throughput and peak memory: the models compile in parallel, then are timed one
  # at a time (E2E_ARGS="--e2e-profile 40": with a kernel profile, each model's 40 largest)
  export PYTHONPATH=$PWD
  timeout "${E2E_SECONDS:-540}" python3 benchmarks/gpu_suite.py --out "$OUT" --e2e-only ${E2E_ARGS:-} \
      > "$OUT/e2e_log.txt" 2>&1
  grep -v "^\s*$" "$OUT/e2e_log.txt" | grep -iv "warn" | tail -30
  ;;
memory)
  # the backend's memory options, peak memory and step time side by side (the models compile
  # in two waves, then are timed one at a time): DAR block and WAV with their defaults and
  # with recompute_branch_outputs (session 15), and DAR block with the fused merge alone and
  # with both (session 26's run 2: 1.129x and 1.062x the baseline's peak).
  # Earlier A/Bs: session 13 --schemes baseline wav wav_keepsums dar_block
  # dar_block_keepsums; session 14 baseline wav wav_newsums mhar mhar_newsums
  export PYTHONPATH=$PWD
  timeout 560 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 4 --schemes baseline wav wav_branch \
      dar_block dar_block_branch dar_block_fm dar_block_fm_branch > "$OUT/memory.txt" 2>&1
  grep "^|" "$OUT/memory.txt" | tail -10
  ;;
keepgroups)
  # the two-phase schemes' keep_groups (session 15, not timed then): 4 more groups keep
  # phase 1 instead of recomputing it, side by side with the defaults (~4 minutes)
  export PYTHONPATH=$PWD
  timeout 500 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 \
      --schemes baseline block_attnres block_attnres_kg4 mhar_block mhar_block_kg4 > "$OUT/keepgroups.txt" 2>&1
  grep "^|" "$OUT/keepgroups.txt" | tail -8
  ;;
fwdorder)
  # route_many's forward in one launch, the chunks of a token side by side (session 16),
  # against one chunk's tokens after another (_cm, _fwdcm): the block phase's forward
  # variants, end to end with a kernel profile, then the scheme check and the kernel tests
  # of the new launch on the GPU (~9 minutes; session 16's run 2)
  forward_launch_ab "_cm|_q1|_q4|_w" 170 280 5 baseline block_attnres block_attnres_fwdcm dar_block dar_block_fwdcm
  timeout 90 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes block_attnres dar > "$OUT/check.txt" 2>&1
  tail -3 "$OUT/check.txt"
  timeout 50 python3 -m pytest -q -x tests/kernels/test_route_many_triton.py -k "order or chunks" 2>&1 | tail -2
  ;;
fwdlaunch)
  # session 16's forward launches (token-major, 1 warp for one head, 1 query and 2 warps
  # for several) against session 15's (_cm_w2 / _cm_w1 / _cm_q2w4, _fwd15), then end to
  # end side by side with a kernel profile (~8 minutes; session 16's run 3)
  forward_launch_ab "_cm_|_w2|_q1w2" 150 360 4 baseline block_attnres block_attnres_fwd15 mhar_block \
      mhar_block_fwd15 attnres attnres_fwd15 dar_block
  timeout 80 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes block_attnres mhar_g3 attnres \
      > "$OUT/check.txt" 2>&1
  tail -1 "$OUT/check.txt"
  ;;
fwdruns)
  # route_many's forward on runs of consecutive tokens per program and both kernels with
  # Triton's software pipeline (session 17): the block phase's variants, the GPU tests of
  # the new launches and the scheme check (~5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  grep -c "tokens_per_program" depthrewrite/kernels/route_many_triton.py
  grep -c "num_stages" depthrewrite/kernels/route_many_triton.py
  timeout 240 python3 benchmarks/gpu_suite.py --block-phase-only --variants "_r|_s[0-9]|_cm$|^_pertoken(_pf2)?$" \
      --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  grep -o "tokens=.*best_bwd=[^ ]*" "$OUT/bp.txt"
  timeout 90 python3 -m pytest -q tests/kernels/test_route_many_triton.py -k "order or grid or per_program or stages" \
      > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|E  )|passed|failed" "$OUT/pytest.txt" | head -20
  timeout 120 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes block_attnres dar mhar_g3 attnres \
      > "$OUT/check.txt" 2>&1
  tail -1 "$OUT/check.txt"
  ;;
fwdpipe)
  # the one-head forward's new launch (runs of 8 tokens, the sources through Triton's
  # pipeline) against session 16's (_fwd16), end to end side by side with a kernel profile;
  # the GPU tests of the new launches (~6 minutes; session 17's run 3)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  grep -c "ONE_HEAD_FORWARD_STAGES" depthrewrite/kernels/route_many_triton.py
  timeout 120 python3 -m pytest -q tests/kernels/test_route_many_triton.py -k "order or grid or per_program or stages" \
      > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|E  )|passed|failed" "$OUT/pytest.txt" | head -20
  timeout 400 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --profile 12 --schemes baseline \
      block_attnres block_attnres_fwd16 dar_block dar_block_fwd16 > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -12
  ;;
keyedbwd)
  # DAR block's keyed route_many backwards through the per-token kernel with its sources
  # pipelined (_pertoken) against the tiled default, end to end side by side (~5 minutes;
  # prepared in session 17, not run yet)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "${E2E_SECONDS:-330}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 3 --profile 40 \
      --schemes baseline dar_block dar_block_pertoken > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -8
  ;;
paramstages)
  # the parameter reduction through Triton's software pipeline and its programs per SM
  # (session 18): the block phase's backward variants, then the GPU tests of route_many
  # (~5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  grep -c "PARAM_STAGES" depthrewrite/kernels/route_many_triton.py
  timeout 300 python3 benchmarks/gpu_suite.py --block-phase-only --variants "^_tiled$|_tiled_ps|^_pertoken$|_pertoken_s3_table" \
      --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  grep -o "tokens=.*best_bwd=[^ ]*" "$OUT/bp.txt"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_route_many_triton.py > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  ;;
regcap)
  # session 27: route_many's GPU tests with register caps, DAR block's lowest-memory form
  # checked on the Triton kernels, then the block phase's kernels under register caps
  # against the defaults (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_route_many_triton.py \
      -k "maxnreg or bad_backward_launch" > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  timeout 150 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes dar_fm_branch --json "$OUT/check.json" \
      > "$OUT/check.txt" 2>&1
  tail -5 "$OUT/check.txt"
  timeout 380 python3 benchmarks/gpu_suite.py --block-phase-only --variants "^_pertoken$|^_tiled$|_cap" \
      --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  grep -o "tokens=.*best_bwd=[^ ]*" "$OUT/bp.txt"
  ;;
mergelaunch)
  # session 27: route_merge's GPU tests, then its launch variants (programs per SM, warps,
  # tokens, the backward's software pipeline) as CUDA-graph replays, every launch checked
  # against the reference (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_route_merge_triton.py > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  timeout 400 python3 benchmarks/route_merge_speed.py --graph > "$OUT/merge_speed.txt" 2>&1
  grep "^|" "$OUT/merge_speed.txt"
  ;;
fme2e)
  # session 27: Block AttnRes and DAR block with the fused merge (route_merge's 2-warp
  # launches since session 27) beside their defaults, side by side (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 560 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 \
      --schemes baseline block_attnres block_attnres_fm dar_block dar_block_fm > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -8
  ;;
fmcheck)
  # session 27: route_merge's GPU tests with its 2-warp launches, then every fused-merge
  # configuration of the scheme check (the fused_merge option) on the Triton kernels (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_route_merge_triton.py > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  timeout 300 python3 benchmarks/gpu_scheme_check.py --device cuda \
      --schemes block_attnres_fm mhar_block_fm dar_fm dar_fm_branch --json "$OUT/check.json" > "$OUT/check.txt" 2>&1
  grep "scheme-check" "$OUT/check.txt"
  ;;
fwdcap)
  # session 27: route_many's forward under register caps of 168-232 against the default,
  # twice in one run (the regcap phase's first row looked slow for the default) (~3 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  for pass in 1 2; do
    timeout 200 python3 benchmarks/gpu_suite.py --block-phase-only --variants "^_cap(168|200|232)$" \
        --out "$OUT/bp$pass" > "$OUT/bp$pass.txt" 2>&1
    grep -o "tokens=.*many_fwd_cap232=[^ ]*" "$OUT/bp$pass.txt"
  done
  ;;
capab)
  # session 27: DAR block with route_many's keyed forward capped at 168 registers against
  # without, side by side, then route_many's GPU tests (~6 minutes). Session 27 ran it with
  # the cap as the default (dar_block) against the variant fwdcap0 (without), then with the
  # cap off against fwdcap168; the cap is the default again since session 28
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 300 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 3 \
      --schemes baseline dar_block dar_block_fwdcap0 > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -5
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_route_many_triton.py -x > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  ;;
paramab)
  # session 18's backward defaults (the parameter reduction pipelined; one-head rows up to
  # d = 1024 through the tiled kernel, reverted in 79c3d20 after fullbwd) against the old,
  # end to end side by side with a kernel profile (~7 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 520 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --profile 12 --schemes baseline \
      block_attnres block_attnres_pertoken dar_block dar_block_ps0 > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -10
  ;;
routepipe)
  # route's forward and backward with the sources through Triton's software pipeline
  # (session 18): the per-site and DESIGN.md shapes' stage variants against the defaults,
  # then the GPU tests of the pipelined launches (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  grep -c "ROUTE_STAGES" depthrewrite/kernels/route_triton.py
  timeout 200 python3 benchmarks/gpu_suite.py --site-route-only --route-variants "_s[0-9]" --out "$OUT/site" \
      > "$OUT/site.txt" 2>&1
  grep "site-route " "$OUT/site.txt" | sed 's/^.*site-route //' | cut -c1-400
  timeout 150 python3 benchmarks/gpu_suite.py --design-launch-only --route-variants "_s[0-9]" --out "$OUT/design" \
      > "$OUT/design.txt" 2>&1
  grep "site-route" "$OUT/design.txt" | sed 's/^.*site-route //' | cut -c1-400
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_route_triton.py \
      -k "pipeline or launch_variants or bad_launch" > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  ;;
pipeab)
  # session 18's pipelines end to end side by side with the old launches: WAV and full
  # AttnRes (route, _rs0), block MHAR (the parameter reduction, _ps0), with a kernel
  # profile (~9 minutes: 7 models, 4 at a time)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "${E2E_SECONDS:-560}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 4 --profile 12 --schemes \
      baseline wav wav_rs0 attnres attnres_rs0 mhar_block mhar_block_ps0 > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -20
  ;;
fullbwd)
  # full AttnRes's one-head route_many backwards through the tiled kernel (session 18's
  # default) against the per-token kernel, end to end side by side; then the kernel tests
  # and the scheme check on the GPU (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 280 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 3 --profile 12 --schemes \
      baseline attnres attnres_pertoken > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -8
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels > "$OUT/kernel_tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel_tests.txt" | head -20
  timeout 120 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes block_attnres dar attnres mhar_g3 wav \
      > "$OUT/check.txt" 2>&1
  grep "scheme-check" "$OUT/check.txt" | tail -14
  ;;
ncu)
  # where route_many's kernels stall (session 18): Nsight Compute's warp states, scheduler,
  # occupancy and memory sections for one launch of each kernel at the block phase's
  # d = 1024 shapes (~2 minutes); the reports in $OUT/ncu_*.txt
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  profile() {  # name, kernel regex, arguments of route_many_launches.py
    local name=$1 kernel=$2
    shift 2
    timeout 120 "$NCU" --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/route_many_launches.py "$@" > "$OUT/ncu_$name.txt" 2>&1
    echo "== $name"; grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Memory Throughput|DRAM Throughput|Stall|ERR|rror" "$OUT/ncu_$name.txt" | head -14
  }
  profile pertoken_n4 "_route_many_bwd_kernel" --sources 4
  profile pertoken_n8 "_route_many_bwd_kernel" --sources 8
  profile tiled_keys_n8 "_route_many_bwd_tiled_kernel" --sources 8 --keys
  profile param_keys_n8 "_route_many_param_kernel" --sources 8 --keys
  profile forward_n4 "_route_many_fwd_kernel" --sources 4
  ;;
table)
  # the end-to-end table of every scheme with each model's 40 largest kernels and host
  # profile (session 19's command; ~7 minutes: 5 models, then 2)
  export PYTHONPATH=$PWD
  grep -c "PARAM_STAGES" depthrewrite/kernels/route_many_triton.py
  timeout "${E2E_SECONDS:-570}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --compile-timeout-s 300 \
      --profile 40 --schemes baseline block_attnres mhar_block wav dar_block attnres mhar > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -24
  ;;
fusedmerge)
  # depthrewrite::route_merge with the branch norms fused into it (sessions 19-20, prepared,
  # run in session 21; ~9 minutes): its kernel tests on the GPU, the scheme check with it, its
  # kernels against Inductor's and the floor with launch variants (session 20), then end to
  # end against merge_partial's torch ops in one wave, side by side with a kernel profile
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_merge_triton.py > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  timeout 80 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes block_attnres_fm mhar_block_fm dar_fm \
      > "$OUT/check.txt" 2>&1
  grep "scheme-check" "$OUT/check.txt" | tail -8
  timeout 120 python3 benchmarks/route_merge_speed.py --cases block_attnres block_attnres_normed dar_block \
      dar_block_normed > "$OUT/merge_speed.txt" 2>&1
  grep "^|" "$OUT/merge_speed.txt"
  timeout "${E2E_SECONDS:-280}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --profile 40 --schemes \
      baseline dar_block dar_block_fm block_attnres block_attnres_fm > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -10
  ;;
algorithms)
  # the forms whose routing floor fits their goal's budget (session 19: routing_floor.py)
  # against the defaults that cannot meet it: WAV two-phase, full MHAR in groups of 6,
  # side by side with a kernel profile (~6 minutes; prepared in session 19, run in session 21)
  export PYTHONPATH=$PWD
  timeout "${E2E_SECONDS:-560}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --compile-timeout-s 300 \
      --profile 40 --schemes baseline wav wav_2p mhar mhar_g6 > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -12
  ;;
code68)
  # what Block AttnRes's Inductor kernels read and write, and the bandwidth each reaches
  # (session 68, ~3 minutes): its merges' query and key-norm-weight gradients, reductions
  # over the tokens, took 2.1 ms in 40 launches (session 19)
  export PYTHONPATH=$PWD TORCHINDUCTOR_BENCHMARK_KERNEL=1
  inductor_code_summary block_attnres 40 300
  ;;
logit68)
  # the merges' logit with its sum over the tokens as a matrix product (session 68): what
  # torch's Inductor here allows a mix-order reduction, that the product runs, then Block
  # AttnRes's Inductor kernels with it (~3 minutes)
  export PYTHONPATH=$PWD TORCHINDUCTOR_BENCHMARK_KERNEL=1
  python3 - <<'PY'
import torch, torch._inductor.config as c
print("torch", torch.__version__, "mix_order_reduction", c.triton.mix_order_reduction,
      "max_reads", getattr(c.triton, "mix_order_reduction_max_reads", "absent"))
a = torch.randn(2, 16384, device="cuda").bfloat16(); b = torch.randn(16384, 1024, device="cuda").bfloat16()
r = torch.mm(a, b, out_dtype=torch.float32)
print("mm out_dtype:", r.dtype, (r.double() - a.double() @ b.double()).abs().max().item())
PY
  inductor_code_summary block_attnres 40 300
  ;;
ab68)
  # session 68: the token sum's layouts as products (token_sum_speed.py; run 3 ran its first
  # form, timed with the host between the kernels: dropped), then Block AttnRes with the
  # merges' logit backward as a matrix product (the default) beside the plain ops' form
  # (_plainlogit) and the baseline (~6 minutes; runs 3 and 5 ran two parts a weight: add
  # block_attnres_parts2 for that form)
  export PYTHONPATH=$PWD
  timeout 90 python3 benchmarks/token_sum_speed.py --parts 2 | tee "$OUT/token_sum_speed.txt"
  e2e_run 400 3 10 baseline block_attnres block_attnres_plainlogit
  ;;
ab68b)
  # session 68: the token sum's layouts timed inside CUDA graphs, then block MHAR and DAR
  # block with the merges' logit backward as a matrix product beside the plain ops' form
  # and the baseline (~7 minutes; run 4 ran two parts a weight: the _parts2 variants)
  export PYTHONPATH=$PWD
  timeout 90 python3 benchmarks/token_sum_speed.py --parts 2 | tee "$OUT/token_sum_speed.txt"
  e2e_run 420 3 14 baseline mhar_block mhar_block_plainlogit dar_block dar_block_plainlogit
  ;;
logit68gpu)
  # session 68, the three-part weights: source_logit's tests on the GPU (torch.mm with
  # out_dtype), then Block AttnRes beside its plain-ops form and the baseline (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/unit/test_source_logit.py 2>&1 | tail -3 | tee "$OUT/source_logit_tests.txt"
  e2e_run 240 3 10 baseline block_attnres block_attnres_plainlogit
  ;;
wav69)
  # session 69: DAR block with its scalars as per-token factors (dar.PER_TOKEN_SCALARS,
  # prepared in session 68) and two-phase WAV at HEAD (last timed in session 21), each beside
  # its default and the baseline; two waves of 3 and 2 (~7 minutes). Run before the per-token
  # scalars became the default: dar_block then was today's dar_block_wholesums
  e2e_run 560 3 14 baseline dar_block_wholesums dar_block wav wav_2p
  ;;
wav2p69)
  # prepared in session 69 (not yet run): two-phase WAV, whose merges' scaled partial details
  # take source_logit's matrix product since session 69, beside its plain-ops form and site
  # by site (the default), two waves of 2 (an H100's memory; ~7 minutes): how much of its
  # merges' Inductor time (+27 ms a step over site by site's on an H100, session 69) the
  # products take off
  e2e_run 560 2 12 baseline wav wav_2p wav_2p_plainlogit
  ;;
softmax70)
  # session 70 (prepared; runs 2-3 ran its parts): merge_routes' softmax term by term
  # (route_many.MERGE_SOFTMAX_BY_TERMS, the default since) beside the stacked one, for
  # two-phase WAV and full AttnRes, with site-by-site WAV, the baseline, and full AttnRes's
  # group entries merged by merge_routes' ops with the new softmax (direct3: slower in
  # session 36 with the stacked one); two waves of 4 (~9 minutes)
  e2e_run 560 4 16 baseline wav wav_2p_stackedsoftmax wav_2p attnres_stackedsoftmax attnres attnres_direct3
  ;;
softmax70b)
  # session 70: softmax70 for two-phase WAV alone, beside the baseline, one wave (~4 minutes)
  e2e_run 400 3 8 baseline wav_2p_stackedsoftmax wav_2p
  ;;
first71)
  # session 71's first call, by the card that comes: on an H200 every scheme at HEAD (the
  # goals' card; no H200 came in sessions 66-70); on an H100 merge_routes' term-by-term
  # softmax (session 70) against float64 on the GPU, through aot_eager and through Inductor,
  # then block MHAR's Inductor kernels with their code (~8 minutes either way)
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
  if [[ $gpu == *H200* ]]; then
    every_scheme_table
  else
    export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
    timeout 100 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes wav_2p attnres attnres_g3 \
        > "$OUT/scheme_check_softmax.txt" 2>&1
    timeout 170 python3 benchmarks/gpu_scheme_check.py --device cuda --inner inductor --schemes wav_2p attnres \
        >> "$OUT/scheme_check_softmax.txt" 2>&1
    grep "scheme-check" "$OUT/scheme_check_softmax.txt" | cut -c1-200
    TORCHINDUCTOR_BENCHMARK_KERNEL=1 inductor_code_summary mhar_block 60 250
  fi
  ;;
final72)
  # session 72's first call, by the card that comes: on an H200 table72 (every scheme at HEAD,
  # the goals' card; none came in sessions 65-71); on an H100, ops48a's work: every kernel
  # test at HEAD, then the op table's d = 2048 rows beside FLA (the wheel in .whl/, carried),
  # which no H100 has run (~8 minutes either way); ops72b has the d = 4096 rows
  if on_h200; then
    table72_schemes
  else
    with_fla
    gpu_kernel_tests 200
    op_table 340 320 2048
  fi
  ;;
checks72)
  # session 72, by the card that comes: on an H200 table72 (every scheme at HEAD, block
  # MHAR's fused merge beside: the goals' card); on an H100 every kernel test at HEAD
  # (final72's 200 s ended them at 86 % on a fresh machine, none failed), then every scheme
  # compiled with the backend against eager (the `schemes` phase; ~8 minutes either way)
  if on_h200; then
    table72_schemes
  else
    export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
    gpu_kernel_tests 300
    every_scheme_check 270
  fi
  ;;
last72)
  # session 72's last call (~5 minutes, what its device time left), by the card that comes:
  # on an H200 the baseline, Block AttnRes and block MHAR with and without the fused merge at
  # HEAD, one wave of 4 (no H200 has run sessions 65-71's changes); on an H100 every scheme
  # compiled with the backend against eager (the `schemes` phase)
  if on_h200; then
    e2e_run 300 4 12 baseline block_attnres mhar_block mhar_block_fm
  else
    every_scheme_check 300
  fi
  ;;
ops72b)
  # session 72: the op table's d = 4096 rows, every column, at HEAD (~9 minutes; carry [".whl"])
  with_fla
  op_table 520 470 4096
  ;;
host71)
  # session 71: the launchers' host time a call on the GPU's host, block MHAR's fused merge
  # (route_merge) among the cases, in parts (the op, the launcher called directly, the
  # launcher without its launches) with cProfile's 20 costliest functions a case; then block
  # MHAR with and without the fused merge side by side, one wave of 2, no baseline (~5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 150 python3 benchmarks/launcher_host.py --parts --profile 20 --label head \
      > "$OUT/launcher_host.jsonl" 2> "$OUT/launcher_host_profile.txt"
  python3 -c 'import json, sys
for r in map(json.loads, filter(str.strip, open(sys.argv[1]))):
    print(r["case"], r["us"], r.get("launcher_us"), r.get("no_launch_us"), r["aten_ops"], sep=" | ")' "$OUT/launcher_host.jsonl"
  e2e_run 250 2 8 mhar_block mhar_block_fm
  ;;
last74)
  # session 74's last call (what its device time left after failed starts), by the card that
  # comes: on an H200 one wave of 4 at HEAD (the baseline, Block AttnRes, block MHAR, and
  # WAV, whose graphs this session changed: zero_from); on an H100 every scheme compiled
  # with the backend against eager (this session's changes to zero_from and the checks)
  if on_h200; then
    e2e_run "${LAST_SECONDS:-420}" 4 12 baseline block_attnres mhar_block wav
  else
    every_scheme_check "${LAST_SECONDS:-400}"
  fi
  ;;
h200table77|h200table80)
  # session 77's first call: on an H200 (the goals' card; sessions 65-76 got only H100s)
  # table72 (every scheme at HEAD, block MHAR's fused merge beside); on an H100 nothing but
  # the card's name, since session 76 ran the same code's table and checks on an H100.
  # Session 80's first calls the same (h200table80: no H200 had run sessions 65-79's code;
  # sessions 78-80 changed no kernel and no compiled graph)
  if on_h200; then
    table72_schemes
  fi
  ;;
h200table78)
  # session 78: on an H200 table72 (no H200 has run sessions 65-77's code), then routing78; on
  # an H100 only routing78 (the kernels and compiled graphs are session 77's, which its H100s checked)
  if on_h200; then
    table72_schemes
  fi
  routing_log_tests
  ;;
tokensum82)
  # session 82: session 81's token-sum kernel ran at 1.35 TB/s (one head) and 0.60 (16 heads)
  # on an H100, under Inductor's reduction; now a row's weight is loaded once where a
  # program's columns lie in one head. Its speed at the launch settings of
  # token_sum_speed.py's TRITON_SETTINGS, then its GPU tests (session 81's run was cut at
  # 120 s: the slowest durations shown)
  token_sum_speed_and_tests "${TESTS_SECONDS:-270}"
  ;;
blocke2e82)
  # session 82: Block AttnRes at its default (the logit's token sums as products), with them
  # as plain ops (Inductor's reduction), and as the Triton kernel, beside the baseline: one
  # wave of 4 on whichever card comes
  e2e_run "${LAST_SECONDS:-420}" 4 11 baseline block_attnres block_attnres_plainlogit block_attnres_tritonsum
  ;;
token82)
  # session 82's one device call where machines came seldom (under 9 minutes of device time
  # left): tokensum82 (tests cut at 120 s), then Block AttnRes with the Triton token sum
  # beside its default and the baseline (at most 220 s)
  token_sum_speed_and_tests 120
  e2e_run 220 3 10 baseline block_attnres block_attnres_tritonsum
  ;;
tokensum81)
  # prepared in session 81 (no device machine lent): the merges' logit backward's sum over
  # the tokens as the op token_weighted_sum's Triton kernel (source_logit.TRITON_TOKEN_SUM)
  # on whichever card comes: its tests on the GPU, its speed beside cuBLAS's product layouts
  # and Inductor's reduction (token_sum_speed.py), then Block AttnRes with it beside its
  # default and the baseline, one wave of 3 (~7.5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_sum_triton.py \
      tests/unit/test_source_logit.py 2>&1 | tee "$OUT/pytest_token_sum.txt" | tail -3
  timeout 90 python3 benchmarks/token_sum_speed.py 2>&1 | tee "$OUT/token_sum_speed.txt" | tail -14
  e2e_run "${LAST_SECONDS:-270}" 3 10 baseline block_attnres block_attnres_tritonsum
  ;;
logit81)
  # session 81: the merges' logit as plain ops (MATMUL_TOKEN_SUM off) beside the products
  # and the baseline, one wave of 3 on whichever card comes: on an H200 Block AttnRes (an
  # H100 had it 1.1 % faster with plain ops in session 80), on an H100 block MHAR (not
  # measured since session 68)
  if on_h200; then
    e2e_run "${LAST_SECONDS:-300}" 3 10 baseline block_attnres block_attnres_plainlogit
  else
    e2e_run "${LAST_SECONDS:-330}" 3 10 baseline mhar_block mhar_block_plainlogit
  fi
  ;;
h200logit80)
  # session 80's last device time: on an H200 Block AttnRes with its merges' logit as plain
  # ops (MATMUL_TOKEN_SUM off, the form before session 68) beside its default and the
  # baseline, one wave of 3 (its step was 0.6-0.8 points under session 64's in this session's
  # H200 table, its host slower to issue it); on an H100 the card's name
  if on_h200; then
    e2e_run "${LAST_SECONDS:-300}" 3 10 baseline block_attnres block_attnres_plainlogit
  fi
  ;;
h200ops80b)
  # session 80's last device time (too little for h200ops80): on an H200 the op table's
  # d = 2048 rows beside FLA at HEAD, at most 300 s (carry [".whl"]); on an H100 the card's name
  if on_h200; then
    with_fla
    op_table 300 260 2048
  fi
  ;;
h200ops80)
  # session 80's device time after its H200 table: on an H200 the op table's d = 4096 rows
  # beside FLA at HEAD (16384x4096x9's forward+backward met 0.75x FLA by 0.4 % in sessions 22,
  # 48 and 51; carry [".whl"]), at most 480 s; on an H100 only the card's name
  if on_h200; then
    with_fla
    op_table 480 420 4096
  fi
  ;;
h200table79)
  # session 79 (repaired in session 80, where its labels had been crossed; none of its calls
  # got an H200): on an H200 table72 (no H200 has run sessions 65-79's code end to end); on
  # an H100 the trained-model tests
  if on_h200; then
    table72_schemes
  else
    trained_model_tests
  fi
  ;;
h200last79)
  # session 79's last device time (too little left for table72): on an H200 the block
  # schemes at HEAD beside the baseline, one wave of 4 (sessions 66-69 changed their graphs
  # and kernels; no H200 has run them); on an H100 the trained-model tests
  if on_h200; then
    e2e_run "${LAST_SECONDS:-380}" 4 12 baseline block_attnres mhar_block dar_block
  else
    trained_model_tests
  fi
  ;;
trained79)
  # session 79: a trained run's model loaded back and sampled on the GPU, any card
  on_h200
  trained_model_tests
  ;;
routing78)
  # session 78's last device time: the harness's routing record on the GPU, any card
  on_h200
  routing_log_tests
  ;;
table72)
  # prepared in session 71 (not run): every scheme at HEAD with its defaults, and block MHAR
  # with the fused merge beside them (2.9-3.1 % faster than its default on two H100s in
  # session 71), in two waves of 4, each model's 30 largest kernels (at most 570 s); meant
  # for an H200, the goals' card, which no call has got since session 64
  table72_schemes
  ;;
wavcode70)
  # session 70: two-phase WAV and block MHAR compiled and profiled with Inductor's code
  # logged (their 60 largest kernels), to find where their Inductor time over the
  # baseline's goes (~6 minutes)
  export PYTHONPATH=$PWD TORCHINDUCTOR_BENCHMARK_KERNEL=1
  inductor_code_summary wav_2p 60 280
  inductor_code_summary mhar_block 60 250
  ;;
table69)
  # session 69 (not run: no device): every scheme at HEAD with its defaults, and DAR block
  # with its scalars' whole sums beside them, in two waves of 4, each model's 30 largest kernels (at
  # most 570 s)
  scheme_table baseline block_attnres mhar_block dar_block wav dar_block_wholesums attnres mhar
  ;;
rowsums69)
  # session 69: DAR with its scalars as per-token factors against eager (the tiny model
  # through aot_eager; the 350M model in bf16 through Inductor at the trained routers' query
  # scale, as session 26; ~6 minutes: in session 69 the 350M row needed more than 230 s on a
  # fresh machine, 179 s on the warm one). wav69 times it end to end
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 100 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes dar dar_fm dar_narrow \
      --patches dar_block_rowsums --detail 3 > "$OUT/scheme_check_rowsums.txt" 2>&1
  grep "scheme-check\|patched" "$OUT/scheme_check_rowsums.txt" | cut -c1-200
  timeout 330 python3 benchmarks/gpu_scheme_check.py --device cuda --inner inductor --preset medium --layers 0 \
      --batch 2 1024 --query-std 0.0156 --detail 6 --schemes dar --precisions bf16 --patches dar_block_rowsums \
      > "$OUT/scheme_check_rowsums_350m.txt" 2>&1
  grep -v "Warn\|warn" "$OUT/scheme_check_rowsums_350m.txt" | tail -9 | cut -c1-200
  ;;
rowsums68)
  # prepared in session 68: DAR block with its scalars as per-token factors
  # (dar.PER_TOKEN_SCALARS, the default since session 69) beside the whole sums and the
  # baseline, then its Inductor kernels (~7 minutes)
  e2e_run 330 3 10 baseline dar_block_wholesums dar_block
  TORCHINDUCTOR_BENCHMARK_KERNEL=1 inductor_code_summary dar_block 60 200
  ;;
inductorcode)
  # what DAR block's and block MHAR's Inductor kernels read and write, and the bandwidth
  # each reaches (session 19, run in session 22; ~5 minutes): each model compiled and
  # profiled in one process with Inductor's code logged and its bytes estimated
  export PYTHONPATH=$PWD TORCHINDUCTOR_BENCHMARK_KERNEL=1
  for model in dar_block mhar_block; do
    inductor_code_summary "$model" 60 270
  done
  ;;
opwide)
  # the op table's d = 4096 rows beside FLA, both modes with every column (session 22, run 1;
  # ~3 minutes; session 21's session21 phase timed the d = 2048 rows): carry [".whl"]
  with_fla
  op_table 560 500 4096
  ;;
session21)
  # after fusedmerge's run (session 21): every kernel test on the GPU (route_merge's 48
  # did not finish in fusedmerge's 60 s), the DAR fused-merge check with gradients that are
  # exactly zero by symmetry measured against their kind's scale, the host's time per call
  # of the two-phase ops and where it goes, then the op table beside FLA (~9 minutes)
  with_fla
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels > "$OUT/kernel_tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel_tests.txt" | tail -12 | tee -a "$LOG"
  timeout 50 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes dar_fm > "$OUT/check.txt" 2>&1
  grep "scheme-check" "$OUT/check.txt" | tail -3
  timeout 60 python3 benchmarks/host_overhead.py --profile-top 14 > "$OUT/host.txt" 2>&1
  timeout 250 python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s 190 --no-e2e --no-block-phase \
      > "$OUT/suite_log.txt" 2>&1
  tail -13 "$OUT/suite_log.txt"; grep "^|" "$OUT/host.txt"
  ;;
hostab)
  # the kernels registered with the dispatcher directly (DEPTHREWRITE_KERNEL_REGISTRATION=
  # dispatcher) against the custom op's register_kernel (the default), where the host sets
  # the pace: each op's host time per call under both, then WAV and the fused merge (DAR
  # block, Block AttnRes) end to end, each registration in a process of its own, side by
  # side with a profile (session 21, run in session 22; ~7 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 60 python3 benchmarks/host_overhead.py --profile-top 0 > "$OUT/host.txt" 2>&1
  DEPTHREWRITE_KERNEL_REGISTRATION=dispatcher timeout 60 python3 benchmarks/host_overhead.py --profile-top 0 \
      > "$OUT/host_dispatcher.txt" 2>&1
  timeout "${E2E_SECONDS:-440}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --profile 12 --schemes \
      baseline wav wav_raw dar_block_fm dar_block_fm_raw block_attnres_fm block_attnres_fm_raw > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/host.txt" | tail -8; grep "^|" "$OUT/host_dispatcher.txt" | tail -8; grep "^|" "$OUT/e2e.txt" | tail -18
  ;;
graphtiming)
  # the routing calls' GPU time alone (CUDA-graph replays, gpu_suite.bench_graph) beside
  # the events around each call that every timing so far used, which count the host's issue
  # time where it is the longer (session 21, run in session 22; ~2 minutes):
  # route_merge's kernels and launch variants, then route_many's block phase (defaults)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 150 python3 benchmarks/route_merge_speed.py --graph --cases block_attnres_normed dar_block_normed \
      > "$OUT/merge_graph.txt" 2>&1
  timeout 150 python3 benchmarks/gpu_suite.py --block-phase-only --variants '^$' --graph-timing --out "$OUT/bpg" \
      > "$OUT/bp_graph.txt" 2>&1
  timeout 150 python3 benchmarks/gpu_suite.py --block-phase-only --variants '^$' --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  grep "^|" "$OUT/merge_graph.txt"; grep -o "tokens=.*best_bwd=[^ ]*" "$OUT/bp_graph.txt" "$OUT/bp.txt"
  ;;
inductorab)
  # session 28: DAR block under Inductor settings aimed at its slow reductions (session 22
  # run 5), and with the keyed forward capped at 168 registers, beside the defaults in one
  # wave with a kernel profile (~6 minutes; session 28's run 1, with the cap off by default
  # then, ran the variant fwdcap168: it is fwdcap0 now, the cap on by default)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  python3 -c "import torch._inductor.config as c; print('mix_order_reduction' in dir(c.triton), 'cooperative_reductions' in dir(c.triton))" | tee -a "$LOG"
  timeout "${E2E_SECONDS:-520}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 6 --profile 12 \
      --schemes baseline dar_block ${AB_VARIANTS:-dar_block_fwdcap0 dar_block_coop dar_block_mfs16 dar_block_mix0} \
      > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -24
  ;;
fusionab)
  # session 28: Inductor's max_fusion_size (default 64) at 16 and 32 on DAR block, at 16 on
  # WAV, beside the defaults in one wave with a kernel profile, then route_many's GPU tests
  # (the keyed forward's cap on by default; ~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "${E2E_SECONDS:-400}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 6 --profile 12 \
      --schemes baseline dar_block ${AB_VARIANTS:-dar_block_mfs16 dar_block_mfs32 wav wav_mfs16} \
      > "$OUT/e2e.txt" 2>&1
  timeout "${TEST_SECONDS:-150}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_many_triton.py \
      > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | head -20
  grep "^|" "$OUT/e2e.txt" | tail -24
  ;;
hintab)
  # session 28: DAR's graphs compiled with max_fusion_size=16 by default (graph_hints.py)
  # against Inductor's 64, and without the keyed forward's register cap, beside the baseline
  # with a kernel profile; then DAR checked through Inductor against Inductor alone (~6 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "${E2E_SECONDS:-330}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 4 --profile 12 \
      --schemes baseline dar_block dar_block_mfs64 dar_block_fwdcap0 > "$OUT/e2e.txt" 2>&1
  timeout "${CHECK_SECONDS:-200}" python3 benchmarks/gpu_scheme_check.py --device cuda --inner inductor \
      --schemes dar dar_fm > "$OUT/scheme_check_inductor.txt" 2>&1
  grep "scheme-check" "$OUT/scheme_check_inductor.txt" | tail -6
  grep "^|" "$OUT/e2e.txt" | tail -12
  ;;
finab)
  # session 30: the parameter sums' last step in one kernel (param_grads.finish): the kernel
  # tests, the host's time per call with it and with the torch ops it replaced, then end to
  # end against those torch ops (_tfin), recorded as CUDA graphs: the GPU's time alone
  # (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 150
  timeout 60 python3 benchmarks/host_overhead.py --profile-top 0 > "$OUT/host.txt" 2>&1
  tail -22 "$OUT/host.txt"
  AB_VARIANTS=${AB_VARIANTS:-mhar_block_fm_cg mhar_block_fm_cg_tfin wav_cg wav_cg_tfin dar_block_fm_cg dar_block_fm_cg_tfin}
  timeout "${E2E_SECONDS:-380}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 7 --profile 12 \
      --schemes baseline_cg $AB_VARIANTS > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -16
  ;;
fullab)
  # full AttnRes's routing is mostly route_many's per-token backward. Session 31 prepared this
  # and session 32 ran it (3 programs per SM under a cap of 168: 0.726x against 0.700x); since
  # session 32 the launch follows the queries a program holds (PER_TOKEN_LAUNCH): its call
  # shapes with the per-token variants and each one's registers as this device compiles
  # them, then the model with the new table beside session 31's launch and two other tables
  # (~6 minutes)
  full_attnres_phase "$PER_TOKEN_VARIANTS" 220
  e2e_run 320 4 10 attnres attnres_pt31 attnres_pt1x4 attnres_pt3
  ;;
fullconfirm)
  # session 32: the GPU kernel tests with PER_TOKEN_LAUNCH as the default (4 queries under a
  # register cap of 168), then full AttnRes with it beside session 31's launch and the
  # Inductor baseline, in one wave (~6 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 170
  e2e_run 300 3 8 baseline attnres attnres_pt31
  ;;
tiled5)
  # session 32: one-head route_many calls of more than 4 queries through the tiled backward
  # (PER_TOKEN_MAX_QUERIES=4), Block AttnRes and full AttnRes (which makes no such call: its
  # pair shows the noise) beside their defaults and the baseline, in one wave (~4 minutes)
  e2e_run 400 5 12 baseline attnres attnres_tiled5 block_attnres block_attnres_tiled5
  ;;
fullfwd)
  # session 32: route_many's forward launch variants (queries a program, warps, tokens a
  # program, pipeline stages, register caps) at full AttnRes's call shapes, each one's
  # registers as this device compiles it (~3 minutes)
  full_attnres_phase '^_(w[124]|q1w[12]|q4|q4w8|r(2|4|16|32)|r8_w2|s[2346]|s3_w2|cap(168|200|232))$' 300
  ;;
fullphase)
  # session 32: the per-token backward's variants at full AttnRes's call shapes as corrected
  # in session 32 (the readout's one query over 49 entries, the last group's 4 over 45),
  # with each one's registers (~2 minutes)
  full_attnres_phase "$PER_TOKEN_VARIANTS" 200
  ;;
blockq)
  # session 32: the block phase's one-head 6-7 queries through the per-token backward in
  # chunks of 4 or 2 queries (PER_TOKEN_LAUNCH's unspilled launches) against one chunk of 8
  # padded rows (2 programs per SM, spilling), with each one's registers (~2 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 200 python3 benchmarks/gpu_suite.py --block-phase-only --phase-registers \
      --variants '^_pertoken(_q[24]|_s31)?$|^_tiled$' --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  tail -12 "$OUT/bp.txt"
  ;;
sums)
  # session 33: the backward kernels' three row sums of a source joined in one reduction
  # (route_many's per-token backward and route's backward: 3 barriers a source instead of 9
  # in their sm_90 code): the GPU kernel tests with it as the default, then each kernel with
  # it and without at full AttnRes's call shapes, the block phase's and route's site shapes
  # (~5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 170
  full_attnres_phase '^_pertoken(_sums1)?$' 120
  timeout 100 python3 benchmarks/gpu_suite.py --block-phase-only --variants '^_pertoken(_sums1)?$' \
      --out "$OUT/bp_block" > "$OUT/bp_block.txt" 2>&1
  tail -6 "$OUT/bp_block.txt"
  timeout 100 python3 benchmarks/gpu_suite.py --site-route-only --route-variants '^(_sums1)?$' \
      --out "$OUT/site" > "$OUT/site.txt" 2>&1
  tail -8 "$OUT/site.txt"
  ;;
sumsab)
  # session 33: the models whose backward runs those kernels, with the joined sums (the
  # default) and with the sums one by one (_sums1), beside the baseline; DAR block with its
  # keyed calls through the per-token backward (run 1 of sums: with the joined sums faster
  # than the tiled default at the block phase's keyed shapes), in two waves (~6 minutes)
  e2e_run 560 5 14 baseline attnres attnres_sums1 block_attnres block_attnres_sums1 wav wav_sums1 dar_block \
      dar_block_pertoken
  ;;
sumslaunch)
  # session 33: with the joined sums (fewer barriers a source), the per-token backward's
  # launch variants again at full AttnRes's call shapes and the block phase's (~3 minutes)
  full_attnres_phase "$PER_TOKEN_VARIANTS|^_pertoken_w8\$" 200
  timeout 150 python3 benchmarks/gpu_suite.py --block-phase-only --phase-registers \
      --variants '^_pertoken(_pp3|_w8|_cap168_pp3|_q4|_sums1)?$' --out "$OUT/bp_block" > "$OUT/bp_block.txt" 2>&1
  tail -10 "$OUT/bp_block.txt"
  ;;
readout)
  # session 33: one-query per-token backwards at 6 programs per SM (the new default; 7 fit at
  # 72 registers) against session 32's 8, full AttnRes beside the baseline (~3 minutes)
  e2e_run 400 3 8 baseline attnres_pt1x8 attnres
  ;;
sumsfinal)
  # session 33: the GPU kernel tests on the session's final kernels and launches, then full
  # and Block AttnRes beside the baseline (~5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 170
  e2e_run 300 3 8 baseline attnres block_attnres
  ;;
table33)
  # session 33: every scheme end to end with the session's defaults, in two waves, each
  # model's 12 largest kernels (~5 minutes)
  e2e_run 400 4 20 baseline block_attnres mhar_block wav dar_block attnres mhar
  ;;
lazy)
  # session 34: the GPU kernel tests with the forwards' lazy rescale (route_triton.LAZY_RESCALE,
  # the new default), then route_many's forward with it and without (_eager) at full AttnRes's
  # and the block phase's call shapes, route's forward at its site shapes, and full and Block
  # AttnRes end to end with it and without, beside the baseline (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 170
  full_attnres_phase '^_eager$' 80
  timeout 80 python3 benchmarks/gpu_suite.py --block-phase-only --variants '^_eager$' --out "$OUT/bp_block" \
      > "$OUT/bp_block.txt" 2>&1
  grep -o "tokens=.*many_fwd_eager=[^ ]*" "$OUT/bp_block.txt"
  timeout 60 python3 benchmarks/gpu_suite.py --site-route-only --route-variants '^_eager$' --out "$OUT/sr" \
      > "$OUT/sr.txt" 2>&1
  grep -o "tokens=.*fwd_eager=[^ ]*" "$OUT/sr.txt"
  e2e_run 190 5 10 baseline attnres attnres_eager block_attnres block_attnres_eager
  ;;
fwdq4)
  # session 34: with the lazy rescale, route_many's one-head forward with 4 queries a program
  # at 2 or 4 warps (127 registers at 4 warps) or 8 at 4 warps, against 2 queries at 1 warp,
  # at full AttnRes's call shapes and the block phase's, then full and Block AttnRes end to
  # end with 4 queries and 4 warps (_fq4) beside the defaults (~6 minutes)
  full_attnres_phase '^_q4w[24]$|^_q8w4$' 90
  timeout 90 python3 benchmarks/gpu_suite.py --block-phase-only --variants '^_q4w[24]$|^_q8w4$|^_eager$' \
      --out "$OUT/bp_block" > "$OUT/bp_block.txt" 2>&1
  grep -o "tokens=.*many_fwd_q8w4=[^ ]*" "$OUT/bp_block.txt"
  e2e_run 200 5 10 baseline attnres attnres_fq4 block_attnres block_attnres_fq4
  ;;
stats)
  # session 34: route_many's statistics table (the forward's logits and rstd read by the
  # per-token backward): route_many's GPU kernel tests, its kernels with the table and without
  # (_nostats) at full AttnRes's call shapes, full AttnRes end to end with it and without (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 75 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_many_triton.py \
      tests/kernels/test_lazy_rescale.py > "$OUT/kernel_tests.txt" 2>&1
  tail -2 "$OUT/kernel_tests.txt"
  full_attnres_phase '^_nostats$' 40
  e2e_run 130 2 6 attnres attnres_nostats
  ;;
stats35)
  # session 35: full and Block AttnRes end to end with route_many's statistics table (the
  # default since session 34) and without, beside the baseline (session 34's pair was cut by
  # the budget), and full AttnRes with the kernels registered with the dispatcher directly
  # (_raw: its GPU idled 6.3 ms a step against the baseline's 2.6 in session 34's run 3);
  # then the GPU kernel tests at HEAD (~9 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  e2e_run 390 3 12 baseline attnres attnres_nostats attnres_raw block_attnres block_attnres_nostats
  gpu_kernel_tests 150
  ;;
prefetch35)
  # session 35: route_many's per-token backward with 3 or 4 sources requested ahead (_pf3,
  # _pf4) and through Triton's pipeline (_pertoken_s3, _s4) at full AttnRes's call shapes
  # and the block phase's, with registers; full AttnRes end to end with 3 and 4 (~7 minutes)
  full_attnres_phase '^_pf[34]$|^_pertoken_s[34]$' 110
  timeout 70 python3 benchmarks/gpu_suite.py --block-phase-only --variants '^_pf[34]$' --out "$OUT/bp_block" \
      > "$OUT/bp_block.txt" 2>&1
  grep -o "tokens=.*many_bwd_pf4=[^ ]*" "$OUT/bp_block.txt"
  e2e_run 300 4 10 baseline attnres attnres_pf3 attnres_pf4
  ;;
final35)
  # session 35: host time per routing call before this session's launcher trims (the tree of
  # 9dc59b5, extracted into .old35 for this call: git archive 9dc59b5 depthrewrite benchmarks)
  # and after, route_many's GPU tests, then full and Block AttnRes end to end (the models this
  # session's changes touch), Block AttnRes with the per-token backward 4 sources ahead (run 2:
  # its block-phase calls 5-10 % faster), full AttnRes and the baseline recorded as CUDA
  # graphs (the host's share of full AttnRes's step; ~9 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  (cd .old35 && timeout 60 python3 benchmarks/host_overhead.py --sources 3 --calls 100 --repeats 5 --profile-top 0 \
      > "$OUT/host_old.txt" 2>&1)
  timeout 70 python3 benchmarks/host_overhead.py --sources 3 --calls 100 --repeats 5 --profile-top 12 \
      > "$OUT/host_new.txt" 2>&1
  grep "route_many" "$OUT/host_old.txt" "$OUT/host_new.txt" | grep "|"
  timeout 70 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_many_triton.py \
      tests/kernels/test_lazy_rescale.py > "$OUT/kernel_tests.txt" 2>&1
  tail -1 "$OUT/kernel_tests.txt"
  e2e_run 330 3 16 baseline attnres block_attnres block_attnres_pf4 baseline_cg attnres_cg
  ;;
direct36)
  # prepared in session 35: full AttnRes with its groups' 2-3 entries merged by Inductor's ops
  # (two_phase.DIRECT_MERGE_ENTRIES = 3: 24 route_many calls a step fewer, forward and
  # backward) beside the default and the baseline, and both recorded as CUDA graphs (the
  # GPU's time alone: the host's share of the difference; ~8 minutes)
  e2e_run 500 4 14 baseline attnres attnres_direct3 baseline_cg attnres_cg attnres_cg_direct3
  ;;
table36)
  # session 36 (run 3): every scheme end to end with the session's defaults, each model's 30
  # largest kernels (the Inductor kernels that are not the baseline's; ~6 minutes)
  every_scheme_table
  ;;
sums36)
  # session 36 (runs 4-6 as one call): route_many_backward's running sums. Their GPU tests,
  # the backward with a running sum for every source at full AttnRes's call shapes against
  # without (_running), then end to end: full AttnRes with them (the default since session
  # 36) and without (_rbacc), Block AttnRes without (the default: its 6-query calls take
  # none) and with them in every call (_manyacc); ~8 minutes
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 60 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_many_triton.py -k running_sums \
      > "$OUT/kernel_tests.txt" 2>&1
  tail -1 "$OUT/kernel_tests.txt" | tee -a "$LOG"
  timeout 90 python3 benchmarks/gpu_suite.py --block-phase-only --phase-shapes full_attnres --variants '^_running$' \
      --out "$OUT/bp" > "$OUT/bp.txt" 2>&1
  grep "block-phase" "$OUT/bp.txt"
  e2e_run 330 3 10 baseline attnres attnres_rbacc block_attnres block_attnres_manyacc
  ;;
mhar37)
  # session 37: the GPU kernel tests at the session's HEAD, then route's launch variants at
  # full MHAR's site shapes (16 heads, N = 9 / 25 / 41, running sums; ~5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 170
  timeout 240 python3 benchmarks/gpu_suite.py --mhar-site-only --out "$OUT/mhsite" > "$OUT/mhsite.txt" 2>&1
  tail -8 "$OUT/mhsite.txt"
  ;;
mhar37e2e)
  # session 37 (run 2, while the old launch was the default): full MHAR with route's 16-head
  # backward in 3 stages at 128 registers and 4 programs per SM (then the e2e variant
  # mhar_mhs3r128, now the default) beside the old launch and the baseline (~5 minutes)
  e2e_run 420 3 10 baseline mhar mhar_mh0
  ;;
final37)
  # session 37's last call: the GPU kernel tests with the 16-head backward's new launch, then
  # full MHAR with it and with the old one (mh0), full AttnRes, beside the baseline (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 170
  e2e_run 400 4 12 baseline mhar mhar_mh0 attnres
  ;;
running38)
  # session 38: route_many's backward launch choices with a running sum for every source (as
  # full AttnRes's calls run since session 36) at its call shapes, each one's registers (~4 minutes)
  full_attnres_phase '^_running' 280
  grep -A 200 "^backward variants" "$OUT/bp.txt" | head -150
  ;;
running38e2e)
  # session 38: route_many's GPU tests with its running sums through the pipeline (the
  # default since), then full AttnRes with it and without (run0) beside the baseline (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_many_triton.py \
      > "$OUT/route_many_tests.txt" 2>&1
  tail -2 "$OUT/route_many_tests.txt"
  e2e_run 400 3 10 baseline attnres attnres_run0
  ;;
sequence39)
  # session 39: full AttnRes's route_many_backward calls of one step replayed in order, with
  # its default launch and run0's (in sequence and each alone), then end to end again (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 150 python3 benchmarks/backward_sequence.py --config attnres --variants default attnres_run0 \
      --rounds 9 --out "$OUT" > "$OUT/sequence.txt" 2>&1
  tail -12 "$OUT/sequence.txt"
  e2e_run 400 3 10 baseline attnres attnres_run0
  ;;
matmuls39)
  # session 39: full AttnRes's route_many_backward calls replayed with both launches, also
  # with 6 MLP-sized matmuls queued before each call (the step's work between them; ~3 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 200 python3 benchmarks/backward_sequence.py --config attnres --variants default attnres_run0 \
      --rounds 9 --between-matmuls 6 --out "$OUT" > "$OUT/sequence.txt" 2>&1
  tail -18 "$OUT/sequence.txt"
  ;;
final39)
  # session 39's last call: route_many's GPU tests, then full AttnRes's backward calls replayed
  # with the new default (the prefetch at one query), run0 (the prefetch at both) and run13
  # (session 38's: the pipeline at both), matmuls between the calls too (~3 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_route_many_triton.py \
      > "$OUT/route_many_tests.txt" 2>&1
  tail -2 "$OUT/route_many_tests.txt"
  timeout 150 python3 benchmarks/backward_sequence.py --config attnres \
      --variants default attnres_run0 attnres_run13 --rounds 9 --between-matmuls 6 --out "$OUT" \
      > "$OUT/sequence.txt" 2>&1
  tail -20 "$OUT/sequence.txt"
  ;;
grouped40)
  # session 40: full MHAR grouped in pairs of sites (phase 1 kept; each site's phase 2 one
  # route_merge with the branch norm fused, or merge_partial's torch ops) and in groups of 4,
  # first compiled against eager on the tiny GPT (fp32, bf16), then end to end beside the
  # default (site by site) and the baseline (~8 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 90 python3 benchmarks/gpu_scheme_check.py --device cuda --schemes mhar_g2_fm mhar_g3 mhar \
      > "$OUT/scheme_check.txt" 2>&1
  grep -E "^scheme-check" "$OUT/scheme_check.txt" | cut -c1-160
  e2e_run 480 5 8 baseline mhar mhar_g2_keep mhar_g2_keep_fm mhar_g4_keep_fm
  ;;
mhsums40)
  # session 40: route_many's running-sum GPU tests (16 heads among them), then block MHAR and
  # grouped full MHAR (groups of 4, the fused merge) with their 16-head route_many calls
  # taking running sums (grad_accumulation.ROUTE_MANY_MULTI_HEAD) beside without, full MHAR's
  # default and the baseline (~7 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  kernel_test_file 90 test_route_many_triton.py running_sums_tests.txt -k running_sums
  e2e_run 440 6 9 baseline mhar mhar_block mhar_block_mhsums mhar_g4_keep_fm mhar_g4_keep_fm_mhsums
  ;;
mhsumsab40)
  # session 40: block MHAR with its 16-head route_many calls taking running sums beside
  # without, each model compiled alone (--wave 1: in mhsums40 a kernel that Inductor tunes at
  # its first run took 13x its time in the process compiled beside five others; ~5 minutes)
  e2e_run 380 1 6 baseline mhar_block mhar_block_mhsums
  ;;
grouped41)
  # session 41: grouped full MHAR's and block MHAR's route_many calls (16 heads) as kernels:
  # the tiled backward with its parameter reduction (the default) against the per-token
  # kernel with all of a call's queries in one chunk (its parameter sums in registers, the
  # sources read once), with and without running sums (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  block_phase_run 330 grouped_mhar \
      '^_tiled$|^_pertoken$|^_pertoken_q[248]$|^_pertoken_q4_|^_running$|^_running_pertoken_q4$' bp
  tail -14 "$OUT/bp.txt"
  ;;
grouped41fwd)
  # session 41: the same calls' forward launches (queries a program, warps, runs of tokens,
  # the pipeline) against the default (one query a program on 2 warps for 16 heads; ~2 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  block_phase_run 200 grouped_mhar '^_w[124]$|^_q4|^_q8w[48]$|^_r[248]$|^_s3$|^_s3_w2$|^_cm$' bpf
  grep -E "^\[.*block-phase" "$OUT/bpf.txt" | sed -E 's/ many_bwd[^ ]*//g' | cut -c1-600
  ;;
pairs41)
  # session 41: route_many's tiled backward taking a source's queries two at a time
  # (query_pairs) at grouped full MHAR's and block MHAR's calls (16 heads) and DAR's keyed
  # block calls, beside the default (~3 minutes). Ran at 6b31885; slower at every shape, so
  # the kernel's query_pairs and the _qp variants were removed after the run (check out
  # 6b31885 to run it again)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  for shapes in grouped_mhar block; do
    block_phase_run 150 $shapes '^_qp' "bp_$shapes"
    grep -E "^\[.*block-phase" "$OUT/bp_$shapes.txt" | sed -E 's/ many_fwd[^ ]*//g; s/ per_site.*//' | cut -c1-400
  done
  ;;
fw1e2e41)
  # session 41: route_many's GPU tests with its 16-head forward on 1 warp (the default since),
  # then block MHAR with it and with 2 warps (mhfw2), each model compiled alone (~6 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  kernel_test_file 110 test_route_many_triton.py route_many_tests.txt
  e2e_run 420 1 6 baseline mhar_block mhar_block_mhfw2
  ;;
rfw41)
  # session 41 (prepared; ran as session 42's run 2 at 75db607): route's 16-head forward on
  # one token and one warp (then mhar_rfw1; the default since, and mhar_rfw2 the launch
  # before) beside the default and the baseline, each model compiled alone (~6 minutes)
  e2e_run 420 1 6 baseline mhar mhar_rfw2
  ;;
inplace48)
  # session 48: route_many_backward's running sums written in place (route_many_backward_into_):
  # its GPU kernel tests with running sums, then full AttnRes with them and as new tensors
  # beside the baseline, 3 trials, one wave (~6 minutes)
  kernel_test_file 80 test_route_many_triton.py inplace_tests.txt -k "in_place or running_sums"
  e2e_run 290 3 8 baseline attnres attnres_newsums
  grep "^launchers" "$OUT/e2e.txt"
  ;;
tests42)
  # session 42: every kernel test on the GPU (route's 16-head forward on one token and one warp)
  gpu_kernel_tests 400
  ;;
table42)
  # session 42: every scheme end to end at HEAD (table39 again; ~6 minutes)
  every_scheme_table
  ;;
darcode43)
  # session 43: DAR block's Inductor code and profile at HEAD (inductorcode for DAR block
  # alone, 80 kernels, the logged code gzipped so that it comes back; ~4 minutes)
  export PYTHONPATH=$PWD TORCHINDUCTOR_BENCHMARK_KERNEL=1
  inductor_code dar_block 80 300
  gzip -9 "$OUT/dar_block_code.txt"
  head -1 "$OUT/dar_block_profile.txt"; grep "triton_" "$OUT/dar_block_kernels.md" | head -30 | cut -c1-200
  ;;
mix43)
  # session 43 (run 2, at 396493a, when "difference" was dar.MIX_FORM's default): DAR's gate
  # and transport as differences (one sum over the tokens per scalar use) against the spec's
  # form (then dar_block_mixw; now the default, and the differences dar_block_mixd), each
  # model compiled alone (~8 minutes)
  e2e_run 570 1 6 baseline dar_block dar_block_mixd
  ;;
tag43)
  # session 43: the closing site's transport tagged for recomputation (the default since)
  # against untagged (dar_block_untag, before) and against the differences (dar_block_mixd),
  # in one wave (~6 minutes), 40 kernels each
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 560 python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 3 --profile 40 \
      --schemes dar_block dar_block_untag dar_block_mixd > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -10
  ;;
mixcheck43)
  # session 43: DAR compiled as training compiles it (the backend, Inductor around the
  # kernels) against Inductor alone on the reference ops, on the GPU (~3 minutes)
  SCHEMES="dar dar_recompute dar_fm" bash "$0" schemesinductor
  ;;
narrow44)
  # session 43 (prepared for session 44; no device time was left): the backend's
  # recompute_branch_outputs="narrow" (the attention projections' outputs recomputed, not
  # the MLPs') on WAV, DAR block and DAR block's fused merge beside their defaults and the
  # baseline, waves of 3 (~8 minutes)
  e2e_run 570 3 10 baseline wav wav_narrow dar_block dar_block_narrow dar_block_fm_narrow
  ;;
fmnarrow44)
  # session 44: DAR block's fused merge with and without "narrow" beside the default and
  # the baseline in one wave of 4: run 1's fm_narrow process was host-bound (~5 minutes)
  e2e_run 480 4 8 baseline dar_block dar_block_fm dar_block_fm_narrow
  ;;
memory44)
  # session 44: every block form that meets the memory goal or comes near it beside the
  # defaults and the baseline, waves of 3 (~7 minutes)
  e2e_run 570 3 10 baseline wav wav_narrow wav_branch dar_block dar_block_fm_narrow
  ;;
gc44)
  # session 44: Python's garbage collections in each timed trial, DAR block's fused merge
  # with "narrow" with and without gc.freeze() after its warm-up, one wave (~5 minutes)
  e2e_run 420 4 8 baseline dar_block dar_block_fm_narrow dar_block_fm_narrow_gcfreeze
  ;;
tables45)
  # session 44 (prepared for session 45): the pointer tables each timed trial made (e2e's
  # trial lines): does a slow first trial of the fused merge make tables the next two
  # find cached? Then DAR block's lowest-memory timed form recorded as CUDA graphs beside
  # the default recorded so (README's claim for mode="reduce-overhead"); waves of 3 (~8 minutes)
  e2e_run 570 3 10 baseline dar_block dar_block_fm_narrow baseline_cg dar_block_cg dar_block_fm_narrow_cg
  ;;
settle45)
  # session 45: each process warmed again until a step neither made a pointer table nor
  # grew the allocator's pool (tables45: DAR block's fused merge made 668 tables in its
  # first trial after 2 steps, that trial 26 % slower); DAR block's lowest-memory form
  # beside the defaults without CUDA graphs, 5 trials each, one wave (~5 minutes)
  E2E_TRIALS=5 e2e_run 480 3 10 baseline dar_block dar_block_fm_narrow
  ;;
memorycg45)
  # session 45: the forms short of memory recorded as CUDA graphs (the host out of the
  # step), each beside its scheme's default recorded so: WAV with recompute_branch_outputs
  # True and "narrow", DAR block's fused merge with "narrow" (run 1's pair again), waves
  # of 3 (~8 minutes)
  e2e_run 570 3 10 baseline_cg wav_cg wav_branch_cg wav_narrow_cg dar_block_cg dar_block_fm_narrow_cg
  ;;
ncu49)
  # session 49: where the per-token backward (_route_many_bwd_kernel) stalls at its two
  # end-to-end uses, with the forward's statistics as the op keeps them: full AttnRes's
  # group call (4 queries over 25 sources, running sums) and Block AttnRes's block phase (6
  # queries over 4). Nsight Compute's warp states, scheduler, occupancy and memory sections,
  # then the stall samples of each SASS instruction (~3 minutes): $OUT/ncu49_<case>.txt and
  # $OUT/ncu49_<case>_sass.csv
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  ncu_per_instruction _route_many_bwd_kernel "q4n25 --queries 4 --sources 25 --stats --running" \
      "q6n4 --queries 6 --sources 4 --stats"
  ;;
ncu49fwd)
  # session 49: the same for route_many's forward (_route_many_fwd_kernel) at those two calls'
  # shapes (the running sums are the backward's: not passed); $OUT/ncu49_fwd_<case>*
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  ncu_per_instruction _route_many_fwd_kernel "fwd_q4n25 --queries 4 --sources 25 --stats" \
      "fwd_q6n4 --queries 6 --sources 4 --stats"
  ;;
dynamic50)
  # session 50: new sizes through the backend on the GPU (tests/compile/test_dynamic_shapes.py
  # on the Triton kernels), then the 350M step compiled with dynamic=True beside the static
  # compile, the baseline and Block AttnRes, one wave (~9 minutes; DYNAMIC_TESTS_ONLY=1: the
  # tests alone, ~3 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/compile/test_dynamic_shapes.py \
      > "$OUT/dynamic_tests.txt" 2>&1
  grep -E "^E |^FAILED|passed|failed" "$OUT/dynamic_tests.txt" | tail -12
  [ -n "${DYNAMIC_TESTS_ONLY:-}" ] || e2e_run 420 4 8 baseline baseline_dyn block_attnres block_attnres_dyn
  ;;
dynamic50b)
  # session 50: the same for the two host-heavy schemes, WAV and full AttnRes, one wave of 6
  # (~9 minutes)
  e2e_run 560 6 12 baseline baseline_dyn wav wav_dyn attnres attnres_dyn
  ;;
ops48a)
  # session 48: the GPU kernel tests and the op table's d = 2048 rows, every column, at HEAD
  # (~8 minutes; carry [".whl"], the fla-core 0.6.0 wheel as for "kernels")
  with_fla
  gpu_kernel_tests 200
  op_table 340 320 2048
  ;;
ops48b)
  # session 48: test_param_grads.py again (its tolerance mended after ops48a), then the op
  # table's d = 4096 rows, every column, at HEAD (~9 minutes; carry [".whl"])
  with_fla
  kernel_test_file 40 test_param_grads.py param_grads_tests.txt
  op_table 520 470 4096
  ;;
eager52)
  # session 52: the routing ops through eager autograd for each autograd kernel ("flat", the
  # new default, and custom_op's) and CUDA registration, one round (eager_autograd.py, ~2.5
  # minutes), then the GPU kernel tests (the autograd kernel is theirs too)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 330 python3 benchmarks/eager_autograd.py --out "$OUT" --rounds 1 > "$OUT/eager_autograd.txt" 2>&1
  tail -12 "$OUT/eager_autograd.txt"
  gpu_kernel_tests 220
  ;;
checks53)
  # session 53: the kernels past 2**31 elements (test_large_offsets.py) and the GPU kernel
  # tests (the launchers' new checks, the widest rows d = 32768), then eager_autograd.py at
  # dac7d4f's form (gpu_suite's make and bench), one round (~2.5 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  large_offset_tests 150
  gpu_kernel_tests 240
  timeout 200 python3 benchmarks/eager_autograd.py --out "$OUT" --rounds 1 > "$OUT/eager_autograd.txt" 2>&1
  tail -12 "$OUT/eager_autograd.txt"
  ;;
checks55)
  # session 55: the GPU kernel tests after fit_stages (kernels/shared_memory.py): checks53's
  # run failed 12 of them at d = 32768 with Triton's OutOfResources (shared memory)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 400
  grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.txt" | head -20
  ;;
checks56)
  # session 56: torchtitan's set-up on the GPU (each block compiled, checkpointed or not,
  # Inductor and the fused kernels) against eager, then the GPU kernel tests (checks55's)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 180 python3 -m pytest -q -n 4 -p no:cacheprovider tests/compile/test_per_block_compile.py -k on_the_gpu \
      > "$OUT/per_block.txt" 2>&1
  tail -2 "$OUT/per_block.txt" | tee -a "$LOG"
  grep -E "^(FAILED|ERROR)" "$OUT/per_block.txt" | head -10
  gpu_kernel_tests 380
  grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.txt" | head -20
  ;;
e2e56)
  # session 56: Block AttnRes and DAR block end to end beside the Inductor baseline, with each
  # routed block in a class of its own (runtime.block_class): the whole-model compile unchanged?
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  e2e_table 450 baseline,block_attnres,dar_block 14
  ;;
perblock56)
  # session 56: each block compiled alone (torchtitan's per-block compile), the plain model
  # and Block AttnRes, end to end: what the per-block compile costs a routed model
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  e2e_table 230 baseline_pb,block_attnres_pb 8
  ;;
perblock56b)
  # session 56: the same for DAR block and WAV
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  e2e_table 300 baseline_pb,dar_block_pb,wav_pb 8
  ;;
fsdp59)
  # session 59: phase 1 gathers FSDP2's shards of the next block's routing parameters
  # (depthrewrite.fsdp2): the GPU test (one rank, each block compiled, checkpointed or not,
  # then sharded, against eager without FSDP2), then torchtitan's per-block compile with
  # FSDP2 on one rank, DAR block two-phase against its sites routed one by one as before
  # ("_site"), each against the plain model compiled and sharded the same way, in one wave
  # (FSDP_SCHEMES: others, such as block_attnres_pb_fsdp and its _site)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider tests/compile/test_per_block_compile.py \
      -k "on_the_gpu and fsdp2" > "$OUT/fsdp2_gpu_tests.txt" 2>&1
  tail -2 "$OUT/fsdp2_gpu_tests.txt"
  timeout "${E2E_SECONDS:-330}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 5 --trials 3 \
      --schemes ${FSDP_SCHEMES:-baseline_pb_fsdp dar_block_pb_fsdp dar_block_pb_fsdp_site} > "$OUT/e2e.txt" 2>&1
  grep "^trials" "$OUT/e2e.txt"; grep "^|" "$OUT/e2e.txt" | tail -8
  ;;
host61)
  # session 61: where the host time of a step goes, by package (benchmarks/host_profile.py):
  # the plain model and Block AttnRes and DAR block, each block compiled and sharded with
  # FSDP2 on one rank (torchtitan's set-up, host-bound on the device's hosts)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout "${HOST_SECONDS:-520}" python3 benchmarks/host_profile.py --steps 5 --top 40 \
      --schemes ${HOST_SCHEMES:-baseline_pb_fsdp dar_block_pb_fsdp block_attnres_pb_fsdp} > "$OUT/host_profile.txt" 2>&1
  grep -v -E "Warning|warn" "$OUT/host_profile.txt" | sed -n '/^host ms a step by package/,$p'
  ;;
fsdp2gpus60)
  # session 60: torchtitan's stack (each block checkpointed, compiled with the backend's
  # defaults, sharded with FSDP2) on 2 GPUs with nccl, against one eager process: phase 1's
  # gathers and its gradients added after FSDP2's own reduce-scatters, which run on FSDP2's
  # streams (one rank never shows them), and each block's forward checkpointed re-entrantly
  # (session 61: our addition waits for FSDP2's reductions); then the one-rank FSDP2 GPU tests
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_distributed.py -k "(titan or reentrant) and GPUs" -rs \
      > "$OUT/fsdp2_two_gpus.txt" 2>&1
  tail -3 "$OUT/fsdp2_two_gpus.txt"
  timeout 150 python3 -m pytest -q -n 4 -p no:cacheprovider tests/compile/test_per_block_compile.py \
      -k "on_the_gpu and fsdp2" > "$OUT/fsdp2_gpu_tests.txt" 2>&1
  tail -2 "$OUT/fsdp2_gpu_tests.txt"
  ;;
host66)
  # session 66: the launchers with fewer ATen ops and host work a call. launcher_host.py in
  # four processes, the base's copy (.ab_base/: `git archive` of the session's base, run's
  # carry) and HEAD in turn, then the kernel tests of the changed launchers (~4 minutes)
  export TRITON_DEFAULT_FP_FUSION=1
  for label in base new base new; do
    root=$PWD
    [ "$label" = base ] && root=$PWD/.ab_base
    PYTHONPATH=$root timeout 90 python3 "$root/benchmarks/launcher_host.py" --label $label \
        >> "$OUT/launcher_host.jsonl" 2>> "$OUT/launcher_host_err.txt"
  done
  python3 benchmarks/launcher_host.py --summarize "$OUT/launcher_host.jsonl" | tee "$OUT/launcher_host.md"
  export PYTHONPATH=$PWD
  kernel_test_file 150 test_route_triton.py route_tests.txt
  kernel_test_file 60 test_param_grads.py param_tests.txt
  kernel_test_file 60 test_pointer_tables.py table_tests.txt
  kernel_test_file 200 test_route_many_triton.py many_tests.txt -k "match or running or chunk or into or table"
  ;;
e2e66)
  # session 66: WAV and full AttnRes beside the baseline, at HEAD and then in the base's
  # copy (.ab_base/, carried), each version's own e2e_throughput.py run, one wave of 3
  export TRITON_DEFAULT_FP_FUSION=1
  for label in new base; do
    root=$PWD
    [ "$label" = base ] && root=$PWD/.ab_base
    mkdir -p "$OUT/$label"
    PYTHONPATH=$root timeout 280 python3 "$root/benchmarks/e2e_throughput.py" --out "$OUT/$label" --wave 3 \
        --profile 12 --schemes baseline wav attnres > "$OUT/e2e_$label.txt" 2>&1
    echo "== $label"; grep "^trials\|^launchers" "$OUT/e2e_$label.txt"; grep "^|" "$OUT/e2e_$label.txt" | head -6
  done
  ;;
host67)
  # session 67: where a routing op call's host time goes on the GPU machine's host: the op,
  # our launcher called directly and without its Triton launches (launcher_host.py --parts),
  # with each registration of the kernels in a process of its own; then cProfile's tables
  # (~1 minute)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  for registration in custom_op dispatcher; do
    DEPTHREWRITE_KERNEL_REGISTRATION=$registration timeout 150 python3 benchmarks/launcher_host.py --calls 200 \
        --repeats 7 --parts --label "$registration" >> "$OUT/launcher_parts.jsonl"
  done
  timeout 240 python3 benchmarks/launcher_host.py --calls 200 --repeats 5 --profile 35 > "$OUT/launcher_host.jsonl" \
      2> "$OUT/launcher_profile.txt"
  cat "$OUT/launcher_parts.jsonl"
  ;;
stats67)
  # prepared in session 66: route_many's statistics table for Block AttnRes's 6-query calls
  # (STATS_MAX_QUERIES 8 against 4), now that their two tiles leave registers for it; the
  # interpreter's and the GPU's tests of the saved-statistics backward first (~4 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  kernel_test_file 120 test_route_many_triton.py stats_tests.txt -k "two_tiles or stats or match_float64"
  e2e_run 300 3 10 baseline block_attnres block_attnres_stats8
  ;;
table59)
  # session 59: every scheme end to end at HEAD, side by side in one run (the last such
  # table: session 48), each model's 30 largest kernels
  every_scheme_table
  ;;
gpu58)
  # session 58's second call: the C++ wrapper's GPU tests (torch 2.11 refuses: its C++
  # wrapper cannot call ops that take lists of tensors), then perblock57
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  cpp_wrapper_gpu_tests 120
  per_block_gpu_tests 150
  e2e_table 290 baseline_pb,dar_block_pb,wav_pb 8
  ;;
cpp58)
  # session 58: Inductor's wrapper in C++ (cpp_wrapper=True; the backend gives the routing
  # calls with list results flat companions, depthrewrite.cpp_wrapper): the GPU tests against
  # eager, then DAR block and WAV with it beside DAR block without, each against the
  # baseline compiled the same way
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  cpp_wrapper_gpu_tests 200
  e2e_table 360 baseline,baseline_cpp,dar_block,dar_block_cpp,wav_cpp 14
  ;;
cpp58b)
  # session 58: the forms whose steps were host-bound on slow hosts, with the C++ wrapper
  # and without: DAR block's fused merge with "narrow" (1.089x peak), WAV
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  e2e_table 540 baseline,baseline_cpp,wav,dar_block_fm_narrow,dar_block_fm_narrow_cpp 14
  ;;
cpp58c)
  # session 58: torchtitan's per-block compile with Inductor's wrapper in C++: DAR block and
  # WAV compiled block by block were host-bound (session 56), against the plain model
  # compiled so too
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  e2e_table 540 baseline_pb,baseline_pb_cpp,dar_block_pb,dar_block_pb_cpp,wav_pb_cpp 14
  ;;
perblock57)
  # session 57: a block call no longer sets attributes on the block (runtime.DepthCall), which
  # Dynamo replayed after each block's graph; the per-block GPU tests, then DAR block and WAV
  # compiled block by block beside the plain model compiled the same way (perblock56b's table)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  per_block_gpu_tests 150
  e2e_table 300 baseline_pb,dar_block_pb,wav_pb 8
  ;;
session55)
  # session 55 in one call: checks55, then DAR block and WAV end to end beside the Inductor
  # baseline (session 54's zero-tie scalar ops, against sessions 48/50's 0.694x and 0.724x)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  gpu_kernel_tests 250
  grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.txt" | head -20
  timeout 300 python3 benchmarks/gpu_suite.py --out "$OUT" --e2e-only --e2e-schemes baseline,dar_block,wav \
      > "$OUT/e2e_log.txt" 2>&1
  grep -v "^\s*$" "$OUT/e2e_log.txt" | grep -iv "warn" | tail -14
  ;;
ops52)
  # session 52: the op table's d = 2048 rows, every column, with the routing ops' flat
  # autograd kernel (its "ours" column is the op through eager autograd; ~2.5 minutes; carry
  # [".whl"])
  with_fla
  op_table 340 320 2048
  ;;
launch47)
  # session 47: where the two-phase launchers' host time goes (launch_parts.py: the launcher
  # beside its Triton launches, those launches through the compiled kernels, its pointer
  # tables, ~1 minute), then DAR block and its fused merge with "narrow" end to end with our
  # launchers' host time per step measured inside the step (e2e_throughput.py's "launchers")
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  timeout 100 python3 benchmarks/launch_parts.py > "$OUT/launch_parts.txt" 2>&1
  grep -v "^ \|^$" "$OUT/launch_parts.txt" | tail -12
  E2E_TRIALS=5 e2e_run 420 3 6 baseline dar_block dar_block_fm_narrow
  grep "^launchers\|^host" "$OUT/e2e.txt"
  ;;
asserts47)
  # session 47: Inductor's wrapper without its size and alignment asserts (host time): DAR
  # block and its fused merge with "narrow" beside the baseline each way, and DAR block with
  # Inductor's combo kernels (fewer launches), 3 trials, waves of 3 (~8 minutes)
  e2e_run 560 3 8 baseline baseline_noasserts dar_block dar_block_noasserts dar_block_combo \
      dar_block_fm_narrow_noasserts
  grep "^launchers\|^host" "$OUT/e2e.txt"
  ;;
raw46)
  # session 46: DAR block's lowest-memory form without CUDA graphs with its kernels
  # registered through the custom op (the default) and with the dispatcher directly, beside
  # dar_block and the baseline, 5 trials each, one wave (~6 minutes), after the host time of
  # a call each way (host_overhead.py, under a minute each)
  host_overhead_each_registration 75
  E2E_TRIALS=5 e2e_run 420 4 8 baseline dar_block dar_block_fm_narrow dar_block_fm_narrow_raw
  ;;
opcost46)
  # session 46: where the route_merge/route_many ops' host time goes beyond our kernel
  # function (raw46: registering the kernels with the dispatcher made DAR block's fused
  # merge no faster): each op called as Inductor calls it and below the autograd keys,
  # 15 x 100 calls, both registrations (~1 minute each); run 3: the columns interleaved
  host_overhead_each_registration 150 --repeats 15
  ;;
narrowcheck44)
  # session 43 (prepared for session 44): "narrow" compiled as training compiles it against
  # Inductor alone on the reference ops, on the GPU (~2 minutes)
  SCHEMES="wav_narrow dar_narrow" bash "$0" schemesinductor
  ;;
final41)
  # session 41 (prepared; ran as session 42's run 1 at 75db607): route_many's "heads" layout
  # tests, then that layout's forward at grouped full MHAR's and block MHAR's calls (16 heads)
  # against the default (~2 minutes). 3.0-4.4x slower than the default at every shape, so the
  # layout (route_many_heads) and the _heads variants were removed after the run (check out
  # 75db607 to run it again)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  kernel_test_file 40 test_route_many_triton.py heads_tests.txt -k heads_layout
  block_phase_run 90 grouped_mhar '^_heads' bph
  grep -E "^\[.*block-phase" "$OUT/bph.txt" | sed -E 's/ many_bwd[^ ]*//g' | cut -c1-400
  ;;
table39)
  # session 39: every scheme end to end at HEAD (session 36's table36; ~6 minutes)
  every_scheme_table
  ;;
table34)
  # session 34: every scheme end to end with the session's defaults (the lazy rescale), in
  # two waves, each model's 12 largest kernels (~8 minutes)
  e2e_run 540 4 20 baseline block_attnres mhar_block wav dar_block attnres mhar
  ;;
sumsconfirm)
  # session 33: full AttnRes and WAV with the joined sums and without again, beside the
  # baseline (run 2 of the session: WAV host-bound, its step 7 % longer with the joined sums
  # while its kernels took 1 ms less; ~5 minutes)
  e2e_run 500 5 10 baseline wav_sums1 wav attnres_sums1 attnres
  ;;
ab|mkab|fmab)
  # AB_VARIANTS="..." beside the baseline, in one wave with a kernel profile (session 29:
  # block MHAR's fused merge); mkab, unless AB_VARIANTS says otherwise: Inductor's
  # multi_kernel (each reduction compiled persistent and looped, the faster picked at its
  # first run) on the block schemes beside their defaults (session 29, ~7 minutes); fmab,
  # for session 31: the kernel tests first (the whole GPU suite's first run with route_merge's
  # 3-stage multi-head backward as the default), then block MHAR's fused merge (its fastest
  # form where the host keeps up, session 30) against its defaults, with that backward before
  # session 30 (mergepipe0), with the kernels registered with the dispatcher directly (raw:
  # less host time a call, for the machines whose host sets the pace) and recorded as CUDA
  # graphs (~7 minutes)
  export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
  case "$1" in
  mkab)
    AB_VARIANTS=${AB_VARIANTS:-block_attnres block_attnres_mk mhar_block mhar_block_mk dar_block dar_block_mk}
    ;;
  fmab)
    gpu_kernel_tests 150
    AB_VARIANTS=${AB_VARIANTS:-mhar_block mhar_block_fm mhar_block_fm_mergepipe0 mhar_block_fm_raw baseline_cg mhar_block_fm_cg}
    E2E_SECONDS=${E2E_SECONDS:-420}  # the tests took up to 150 s of the call's 600
    ;;
  esac
  : "${AB_VARIANTS:?AB_VARIANTS must name the configurations}"
  timeout "${E2E_SECONDS:-560}" python3 benchmarks/e2e_throughput.py --out "$OUT" --wave 7 --profile 12 \
      --schemes baseline $AB_VARIANTS > "$OUT/e2e.txt" 2>&1
  grep "^|" "$OUT/e2e.txt" | tail -16
  ;;
fsdp2)
  for s in "block_attnres" "dar --option layers_per_block=2"; do
    name=${s%% *}
    torchrun --nproc-per-node 2 $RUN --distributed fsdp2 --scheme $s --data $DATA --json $OUT/$name-2gpu.json >> "$LOG" 2>&1
  done
  grep -E "world=|Error|error" "$LOG" | tail -20
  ;;
esac
