#!/usr/bin/env bash
# The GPU runs of the training and scaling issues, one device call per phase (each under
# the 10-minute limit of a call). Data: the corpora of ../shared/data copied into .devdata/
# (carried to the device).
#   OUT=... bash benchmarks/device_session.sh study    # validation study, all visible GPUs
#   OUT=... bash benchmarks/device_session.sh e2e      # 1-GPU throughput: Inductor baseline vs schemes
#   OUT=... bash benchmarks/device_session.sh fsdp2    # 2 GPUs: FSDP2 scaling runs
set -u
: "${OUT:?OUT must name the output folder}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "editable install failed"
DATA=.devdata/tinystories_sample.txt
RUN=benchmarks/scaling_run.py
LOG=$OUT/log.txt
nvidia-smi -L | tee -a "$LOG"
case "$1" in
study)
  timeout "${STUDY_SECONDS:-480}" python3 benchmarks/validation_study.py --data-dir .devdata --out "$OUT" \
      --steps "${STUDY_STEPS:-400}" --workers-per-gpu "${WORKERS:-10}" --extra-seeds 1 ${STUDY_ARGS:-} > "$OUT/study.txt" 2>&1
  tail -70 "$OUT/study.txt"
  ;;
e2e)
  for s in "none --backend inductor" "block_attnres" "dar --option layers_per_block=2"; do
    name=${s%% *}
    timeout 280 python3 $RUN --scheme $s --data $DATA --json $OUT/$name-1gpu.json >> "$LOG" 2>&1
  done
  grep -E "world=|Error|error" "$LOG" | tail -20
  ;;
fsdp2)
  for s in "block_attnres" "dar --option layers_per_block=2"; do
    name=${s%% *}
    torchrun --nproc-per-node 2 $RUN --distributed fsdp2 --scheme $s --data $DATA --json $OUT/$name-2gpu.json >> "$LOG" 2>&1
  done
  grep -E "world=|Error|error" "$LOG" | tail -20
  ;;
esac
