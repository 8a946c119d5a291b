#!/usr/bin/env bash
# Run the GPU benchmarks in one go on a machine with 2 GPUs (CUDA or ROCm), from the repository root:
#
#   bash benchmarks/gpu/run_all.sh transfer speed1 overhead recovery speed2 case_ddp case_diloco
#   bash benchmarks/gpu/run_all.sh titan   # TorchTitan speed anchor (wheels from .whl/titan/, see titan_speed.py)
#
# Each stage has its own time limit (seconds, STAGE_LIMIT_<stage> overrides) so that a stuck stage cannot eat
# the others' time. Figures are appended to $OUT/results.jsonl (OUT defaults to runs/gpu-bench); all output
# goes to $OUT/run.log; per-stage logs and run directories are packed into $OUT/details.tgz at the end.
# CASE_FAULTS=benchmarks/gpu/case_faults.jsonl replays a fixed schedule (kill, exception, comm, kill) in the
# case-study stages instead of drawing faults at random.
# Optional: wheels for packages the machine lacks in .whl/ are installed to /tmp/site first.
set -u
OUT=${OUT:-runs/gpu-bench}
WORK=${WORK:-/tmp/regent-gpu-bench}
. benchmarks/gpu/_stages.sh
MODEL=${MODEL:-1b}
B=benchmarks/gpu

{ echo "=== $(date -u)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
    || rocm-smi 2>/dev/null; $PY -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__,
  "gpus", torch.cuda.device_count(), "grpc", grpc.__version__, "protobuf", p.__version__)'; } >>"$OUT/run.log" 2>&1

for s in "$@"; do
  case $s in
    speed1) stage speed1 110 $PY $B/train_speed.py --model "$MODEL" --gpus 1 --steps 15 --warmup 3 \
              --batch-size "${SPEED_BATCH:-4,8}" --compile "${SPEED_COMPILE:-0}" --out "$OUT" ;;
    speed1c) stage speed1c 200 $PY $B/train_speed.py --model "$MODEL" --gpus 1 --steps 15 --warmup 3 \
              --batch-size "${SPEED_BATCH:-8}" --compile 1 --out "$OUT" ;;
    speed2) stage speed2 120 $PY $B/train_speed.py --model "$MODEL" --gpus 2 --steps 15 --warmup 3 \
              --batch-size "${SPEED_BATCH2:-8}" --compile "${SPEED_COMPILE:-0}" --out "$OUT" ;;
    transfer) stage transfer 180 $PY $B/peer_transfer.py --shape "${TRANSFER_SHAPES:-1b,8b}" \
              --layouts "${TRANSFER_LAYOUTS:-contiguous,apart}" --http-shapes "${HTTP_SHAPES:-1b}" \
              --repeats "${TRANSFER_REPEATS:-3}" \
              --p2p-gb "${P2P_GB:-4}" --out "$OUT" ;;
    overhead) stage overhead 170 $PY $B/ft_overhead.py --model "$MODEL" --steps "${OVERHEAD_STEPS:-40}" \
              --batch-size "${OVERHEAD_BATCH:-4}" --modes "${OVERHEAD_MODES:-local,ddp,fsdp,ft_step,ft_diloco}" \
              --out "$OUT" ;;
    recovery) stage recovery 150 $PY $B/recovery_timeline.py --model "$MODEL" --trials cold,warm \
              --events-dir "$WORK/recovery" --out "$OUT" ;;
    case_ddp|case_diloco)
      mode=${s#case_}
      stage "$s" "${CASE_LIMIT:-300}" $PY -m regent.cli train --replicas 2 --procs-per-replica 1 --model "$MODEL" \
        --duration "${CASE_DURATION:-150s}" ${CASE_FAULTS:+--faults-file "$CASE_FAULTS"} \
        --fault-kinds kill,exception,comm --ft.mode "$mode" \
        --ft.sync-every 20 --train.seq-len "${SEQ_LEN:-2048}" --train.batch-size "${CASE_BATCH:-4}" \
        --train.lr 3e-4 --no-live ${CASE_EXTRA:-} --run-dir "$WORK/$s"
      [ -f "$WORK/$s/summary.json" ] && cp "$WORK/$s/summary.json" "$OUT/summary_$s.json" ;;
    case_fsdp)  # one replica of 2 GPUs with FSDP2 inside, under the orchestrator (the x8 topology's unit)
      stage case_fsdp "${CASE_LIMIT:-300}" $PY -m regent.cli train --replicas 1 --procs-per-replica 2 \
        --model "$MODEL" --duration "${FSDP_DURATION:-60s}" --no-faults --ft.mode ddp \
        --train.seq-len "${SEQ_LEN:-2048}" --train.batch-size "${CASE_BATCH:-4}" --train.lr 3e-4 --no-live \
        --run-dir "$WORK/case_fsdp"
      [ -f "$WORK/case_fsdp/summary.json" ] && cp "$WORK/case_fsdp/summary.json" "$OUT/summary_case_fsdp.json" ;;
    titan)  # TorchTitan's own trainer on the 1b shape (speed anchor); its wheels are carried in .whl/titan/
      if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/titan-site \
          .whl/titan/*.whl >>"$OUT/run.log" 2>&1; then
        PYTHONPATH="$PYTHONPATH:/tmp/titan-site" stage titan 240 bash -c "$PY $B/titan_speed.py --gpus 1 \
          --batch-size ${TITAN_BATCH:-4,8} --steps 15 --warmup 5 --compile ${TITAN_COMPILE:-0} \
          --loss ${TITAN_LOSS:-ce} --out $OUT --timeout 100; \
          $PY $B/titan_speed.py --gpus 2 --batch-size ${TITAN_BATCH2:-4} --steps 15 --warmup 5 \
          --compile ${TITAN_COMPILE:-0} --loss ${TITAN_LOSS:-ce} --out $OUT --timeout 100"
      else echo "=== stage titan: wheel install failed" | tee -a "$OUT/run.log"; fi ;;
    *) echo "unknown stage $s" | tee -a "$OUT/run.log" ;;
  esac
done
tar czf "$OUT/details.tgz" --exclude='*.pt' --exclude='*.distcp' --exclude=checkpoints -C "$WORK" . 2>/dev/null
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$OUT/run.log"
