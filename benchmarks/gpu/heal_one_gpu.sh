#!/usr/bin/env bash
# A restart with heal on ONE GPU: two replicas share the GPU (the cross-replica group on Gloo, since NCCL refuses
# two ranks on one device), replica 1 is killed mid-run, restarts in place and heals from replica 0's live state
# on the GPU; the replicas must end bit-identical. Built-in trainer (per-step and DiLoCo) and TorchTitan's trainer.
#   OUT=/tmp/out bash benchmarks/gpu/heal_one_gpu.sh [builtin_ddp builtin_diloco titan_ddp ...]
set -u
OUT=${OUT:-/tmp/heal_one_gpu}; WORK=${WORK:-/tmp/heal_one_gpu_work}
source benchmarks/gpu/_stages.sh
export OMP_NUM_THREADS=4
source benchmarks/gpu/_titan_site.sh
case_run() {  # case_run NAME KILL_AT EXTRA...
  local name=$1 at=$2; shift 2
  local run="$WORK/run_$name"; rm -rf "$run"
  echo "{\"at\": $at, \"replica\": 1, \"kind\": \"kill\", \"rank\": 0}" > "$WORK/faults_$name.jsonl"
  stage "$name" 140 $PY -m regent.cli train --replicas 2 --procs-per-replica 1 --no-live --seed 7 \
    --faults-file "$WORK/faults_$name.jsonl" --run-dir "$run" --ft.backend gloo "$@"
  mkdir -p "$OUT/$name"
  cp "$run"/summary.json "$run"/config.json "$run"/events.jsonl "$OUT/$name/" 2>/dev/null
  # the first few tracebacks in full (a crash loop's cause is in its first one)
  grep -n -A80 "Traceback (most recent call last)" "$WORK/$name.log" | head -400 > "$OUT/$name/tracebacks.txt"
  $PY benchmarks/gpu/heal_digest.py "$run" | tee -a "$OUT/run.log"
}
cases=${*:-builtin_ddp builtin_diloco titan_ddp}
for c in $cases; do
  case $c in
    builtin_ddp) case_run builtin_ddp 35 --model 150m --duration 80s --ft.mode ddp ;;
    builtin_diloco) case_run builtin_diloco 35 --model 150m --duration 80s --ft.mode diloco --ft.sync-every 20 ;;
    titan_ddp) case_run titan_ddp 40 --engine torchtitan --titan.config debugmodel --trainer-opt ac=off \
        "--titan.args=--training.seq_len 512 --training.local_batch_size 4" --duration 80s --ft.mode ddp ;;
    titan_diloco) case_run titan_diloco 40 --engine torchtitan --titan.config debugmodel --trainer-opt ac=off \
        "--titan.args=--training.seq_len 512 --training.local_batch_size 4" --duration 80s --ft.mode diloco \
        --ft.sync-every 10 ;;
  esac
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/run.log"
$PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" >> "$OUT/run.log"
