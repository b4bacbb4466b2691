#!/usr/bin/env bash
# The GPU runs of the scaling and validation issues on one nvidia-h200-x2 machine, as two
# device calls (each under the 10-minute limit):
#   bash benchmarks/h200x2_session.sh single   # GPU0: 1-GPU scaling runs; GPU1: validation study
#   bash benchmarks/h200x2_session.sh fsdp2    # both GPUs: FSDP2 scaling runs, then the report
# Data: the corpora of ../shared/data copied into .devdata/ (carried to the device).
set -u
: "${OUT:?OUT must name the output folder}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "editable install failed"
DATA=.devdata/tinystories_sample.txt
RUN=benchmarks/scaling_run.py
LOG=$OUT/log.txt
case "$1" in
single)
  nvidia-smi -L | tee -a "$LOG"
  ( CUDA_VISIBLE_DEVICES=0 python3 $RUN --scheme block_attnres --data $DATA --json $OUT/block_attnres-1gpu.json
    CUDA_VISIBLE_DEVICES=0 python3 $RUN --scheme dar --option layers_per_block=2 --data $DATA --json $OUT/dar-1gpu.json
  ) >> "$LOG" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 500 python3 benchmarks/validation_study.py --data-dir .devdata --out "$OUT" \
      --steps 400 --workers-per-gpu 8 --extra-seeds 1 > "$OUT/study.txt" 2>&1
  wait
  tail -40 "$OUT/study.txt"; grep -E "world=|Error|error" "$LOG" | tail -20
  ;;
fsdp2)
  for s in "block_attnres" "dar --option layers_per_block=2"; do
    name=${s%% *}
    torchrun --nproc-per-node 2 $RUN --distributed fsdp2 --scheme $s --data $DATA --json $OUT/$name-2gpu.json >> "$LOG" 2>&1
  done
  grep -E "world=|Error|error" "$LOG" | tail -20
  ;;
esac
