#!/usr/bin/env bash
# Stack dumps of every Regent process while a run goes on (a stuck replica's threads, for the record):
#   bash benchmarks/gpu/stack_dumps.sh OUTFILE START_S EVERY_S COUNT &
# needs py-spy (carried as a wheel in .whl/tools; installed to /tmp/tools).
out=$1; start=$2; every=$3; count=$4
python3 -m pip install -q --no-index --no-deps --target /tmp/tools .whl/tools/*.whl >/dev/null 2>&1
spy=/tmp/tools/bin/py-spy
sleep "$start"
for i in $(seq 1 "$count"); do
  for pid in $(pgrep -f "regent"); do
    { echo "##### t+$((start + (i - 1) * every))s pid $pid: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-200)"
      timeout 20 $spy dump --pid "$pid" 2>&1; } >> "$out"
  done
  sleep "$every"
done
