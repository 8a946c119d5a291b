#!/usr/bin/env bash
# Issue 37 on the GPU machine's host CPUs (16 cores): the Lighthouse's control plane beside TorchFT's, one call.
# From the repository root, with the wheels the host lacks in .whl/ (py3.12 manylinux, `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64`): grpcio, protobuf, cloudpickle, hpack,
# pydantic (+ pydantic_core, annotated_types, typing_inspection), torchft-nightly and the opentelemetry packages it
# imports (api, sdk, semantic-conventions, exporter-otlp-proto-grpc and -common, proto, googleapis-common-protos):
#
#   OUT=/tmp/cp bash benchmarks/gpu/control_plane_host.sh          # full sizes (~8 min on 16 cores)
#   SMALL=1 OUT=/tmp/cp bash benchmarks/gpu/control_plane_host.sh  # a smoke run at small sizes
#   FE="8 10" CLIENTS=4 ...                                         # the front-end counts, the round client processes
#
# Writes one JSON file per part under $OUT and prints each part's table.
set -u
OUT=${OUT:-runs/control-plane-host}
mkdir -p "$OUT"
PY=${PY:-python3}
. benchmarks/gpu/_wheels.sh
if install_wheels; then
  export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD/src
fi
export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0
ulimit -n 262144 2>/dev/null || ulimit -n 65536 2>/dev/null
sysctl -qw net.ipv4.ip_local_port_range="15000 64999" 2>/dev/null
if [ -n "${SMALL:-}" ]; then G1=256; G2=1024; HB=1000; FE="2"; S=4; W=2
else G1=1024; G2=12800; HB=12800; FE=${FE:-"6 8"}; S=12; W=8; fi
B=benchmarks
part() { local name=$1 limit=$2; shift 2
  echo "=== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) cores $(nproc)"
  timeout "$limit" "$@" || echo "=== $name: exit $?"; }
echo "=== $(git rev-parse --short HEAD 2>/dev/null) $($PY -V) $(uname -r)"
# The anchors first: after the 12,800-connection parts, closed connections (TIME_WAIT) held the ports they chose.
part steady 100 $PY $B/scale_bench.py --only steady --groups $G1 4096 --servers regent torchft --seconds 8 \
  --json "$OUT/steady.json"
part owner 90 $PY $B/control_plane_sim.py --only owner --round-groups $G1 $G2 --rounds 5 --out "$OUT/owner.json"
part frontend 120 $PY $B/control_plane_sim.py --only frontend --round-groups $G1 $G2 --rounds 3 --out "$OUT/frontend.json"
# the joins from several client processes: the Lighthouse's time after the last join left a client (one client
# process's own Python was most of a 12,800-group round's wall time here, 2026-12-05)
part round 240 $PY $B/control_plane_sim.py --only round --round-groups $G1 $G2 --rounds 5 --frontends $FE \
  --round-clients ${CLIENTS:-4} --full-up-to 0 --torchft-rounds-up-to $G1 --round-heartbeat-timeout-ms 120000 \
  --out "$OUT/round.json"
part sim 150 $PY $B/control_plane_sim.py --only sim --groups $HB --interval-ms 100 --frontends $FE --seconds $S \
  --workers $W --no-torchft --out "$OUT/sim.json"
