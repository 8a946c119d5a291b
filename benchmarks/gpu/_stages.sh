# Shared by run_all.sh and run_x8.sh (sourced, with OUT and WORK set): environment, carried wheels, and
# `stage NAME DEFAULT_LIMIT COMMAND...`, which runs one bounded stage (STAGE_LIMIT_<NAME> overrides the limit)
# with its output in $WORK/NAME.log and a digest in $OUT/run.log.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
# Wheels for packages the machine lacks, carried in .whl/, go to /tmp/site (SKIP_WHEELS=1 skips this).
. benchmarks/gpu/_wheels.sh
if install_wheels; then
  export PYTHONPATH=src:/tmp/site
else
  export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
fi

stage() {  # stage NAME DEFAULT_LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  local var="STAGE_LIMIT_${name}"; limit=${!var:-$limit}
  echo "=== $(date -u +%H:%M:%S) stage $name (limit ${limit}s): $*" | tee -a "$OUT/run.log"
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  grep -v -E " INFO: | INFO " "$WORK/$name.log" | tail -n 60 >>"$OUT/run.log"
  echo "=== stage $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/run.log"
}
