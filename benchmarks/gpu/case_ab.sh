#!/usr/bin/env bash
# Issue 34's owed GPU A/B: the case study (3 DiLoCo replicas sharing one GPU over Gloo, 150m model, a fault every
# 20 s) on this tree and on an older tree's src/ (carried as .old/src), alternated, same machine, same minutes:
#
#   git archive <old sha> src | tar -x -C .old     # here, then device run with carry [".old", ".whl"]
#   OUT=/tmp/ab bash benchmarks/gpu/case_ab.sh new old new old
#
# Prints each run's pace before its first fault, steps, faults/recoveries and `regent check`'s verdict (the
# checker's RSS-growth rule included); run directories stay under $WORK.
set -u
OUT=${OUT:-runs/case-ab}; WORK=${WORK:-/tmp/regent-case-ab}; DUR=${DUR:-75s}; EVERY=${EVERY:-20s}
mkdir -p "$OUT" "$WORK"
PY=${PY:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
SITE=""
. benchmarks/gpu/_wheels.sh
if install_wheels; then
  SITE=:/tmp/site
fi
i=0
for tree in "$@"; do
  i=$((i + 1))
  case $tree in new) src=$PWD/src ;; old) src=$PWD/.old/src ;; *) src=$tree ;; esac
  run=$WORK/$i-$tree
  echo "=== run $i: $tree ($src) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$src$SITE timeout -k 10 $((${DUR%s} + 90)) $PY -c 'from regent.cli import main; main()' train \
    --replicas 3 --procs-per-replica 1 --model "${MODEL:-150m}" --ft.backend gloo --duration "$DUR" --fault-every "$EVERY" \
    --seed 0 --no-live --run-dir "$run" >"$OUT/train-$i-$tree.log" 2>&1
  echo "rc=$?"
  grep -i -E 'steps/s|pace|faults|recover|lost|consistent|goodput' "$OUT/train-$i-$tree.log" | tail -12
  PYTHONPATH=$src$SITE timeout 120 $PY -c 'from regent.cli import main; main()' check "$run" \
    >"$OUT/check-$i-$tree.log" 2>&1
  echo "check rc=$?"; tail -8 "$OUT/check-$i-$tree.log"
done
