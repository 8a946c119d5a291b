#!/usr/bin/env bash
# Issue 36's soak (DiLoCo, 3 replicas x 2 processes, every fault kind, a fault every 15 s, 15 minutes) on the GPU
# machine's host CPUs: 16 cores, a core per trainer, trainers on CPU (GPU_PLATFORM=cpu), the fault-free run beside
# it for as long (`soak.py --baseline-beside`). A 15-minute soak outlives one device call (10 minutes at most), so:
#
#   bash benchmarks/gpu/soak_host.sh start     # installs the wheels of .whl/, starts the soak in its own session
#   OUT=$OUT bash benchmarks/gpu/soak_host.sh wait   # progress until it ends or LIMIT s pass; then the files in $OUT
#
# Call `wait` again (on the same warm machine) until it prints "=== soak ended". DUR, EVERY, SEED, PPR, REPLICAS
# change the config; EXTRA adds `regent train` flags to both runs (e.g. EXTRA="--ft.sync-every 10"); WORK is where
# the runs go.
set -u
WORK=${WORK:-/tmp/regent-soak-host}
OUT=${OUT:-runs/soak-host}
PY=${PY:-python3}
LIMIT=${LIMIT:-540}
mkdir -p "$WORK" "$OUT"
. benchmarks/gpu/_wheels.sh
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH; else export PYTHONPATH=$PWD/src; fi
export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 GPU_PLATFORM=cpu CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1
case ${1:-start} in
start)
  if install_wheels; then
    export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH
  fi
  echo "=== src $(tree_id) $($PY -V) $(uname -r), $(getconf _NPROCESSORS_ONLN) cores," \
    "load $(cut -d' ' -f1-3 /proc/loadavg), start $(date -u +%H:%M:%S)"
  setsid nohup $PY benchmarks/soak.py --mode diloco --replicas "${REPLICAS:-3}" --procs-per-replica "${PPR:-2}" \
    --duration "${DUR:-15m}" --fault-every "${EVERY:-15s}" --seed "${SEED:-7}" --baseline-beside --out "$WORK/runs" \
    ${EXTRA:+-- $EXTRA} >"$WORK/soak.log" 2>&1 </dev/null &
  echo $! >"$WORK/pid"
  sleep 20
  tail -5 "$WORK/soak.log"
  ;;
wait)
  pid=$(cat "$WORK/pid")
  end=$((SECONDS + LIMIT))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do
    sleep 30
    soak=$(ls -d "$WORK"/runs/diloco-soak-*/ 2>/dev/null | tail -1)
    echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)," \
      "soak events: $(grep -c . "$soak/events.jsonl" 2>/dev/null), faults: $(grep -c fault_injected "$soak/events.jsonl" 2>/dev/null)"
  done
  if kill -0 "$pid" 2>/dev/null; then echo "=== still running: call wait again"; exit 0; fi
  echo "=== soak ended $(date -u +%H:%M:%S)"
  tail -60 "$WORK/soak.log"
  cp "$WORK/soak.log" benchmarks/results/soak_diloco.json "$OUT/" 2>/dev/null
  for d in "$WORK"/runs/*/; do
    n=$(basename "$d"); mkdir -p "$OUT/$n"
    cp "$d"/summary.json "$d"/events.jsonl "$OUT/$n/" 2>/dev/null
  done
  ;;
esac
