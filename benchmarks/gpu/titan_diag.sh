#!/usr/bin/env bash
# Runs titan_diag.py's variants and `regent train` with one replica, TorchTitan's debugmodel, on one GPU.
#   OUT=/tmp/out bash benchmarks/gpu/titan_diag.sh
set -u
OUT=${OUT:-/tmp/titan_diag}; WORK=${WORK:-/tmp/titan_diag_work}
source benchmarks/gpu/_stages.sh
source benchmarks/gpu/_titan_site.sh
export TORCH_SHOW_CPP_STACKTRACES=1
for v in direct direct_nochunk direct_fp32 direct_anomaly; do
  echo "=== $v" >> "$OUT/diag.txt"
  timeout 120 $PY benchmarks/gpu/titan_diag.py $v >> "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
done
for b in nccl gloo; do
  echo "=== regent 1 replica ft.backend $b" >> "$OUT/diag.txt"
  timeout 120 $PY -m regent.cli train --replicas 1 --procs-per-replica 1 --no-live --seed 7 --steps 4 \
    --run-dir "$WORK/run_$b" --ft.backend $b --engine torchtitan --titan.config debugmodel --trainer-opt ac=off \
    "--titan.args=--training.seq_len 512 --training.local_batch_size 4" --ft.mode ddp --crash-loop-starts 1 \
    > "$WORK/regent_$b.log" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
  grep -v WARNING "$WORK/regent_$b.log" | tail -15 >> "$OUT/diag.txt"
  $PY -c "
import json,sys
for l in open('$WORK/run_$b/events.jsonl'):
    e=json.loads(l)
    if e.get('traceback'): print(e['traceback'][-6000:]); break
" >> "$OUT/diag.txt" 2>&1
done
