"""The controller of the actor-layer partition scenario (test_partitions.py, scenario 4), run in the root
namespace: attaches to a `regent worker` inside a network namespace, starts a proc with an actor there, and
answers the test's commands on stdin, printing one JSON line per observation (with time.time()).

- "cut" (sent once the link is down): call the actor and report how the call ended (value, error, or still
  pending after --limit s) and whether supervision reported the proc within --limit s.
- "healed" (sent once the link is back): start a new proc mesh on the same host mesh and call an actor there.
- "quit": shut the host mesh down and exit.

Why a process of its own: the actor runtime is one per process, and its fault hook must not touch pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import regent.actor as actor_api
from regent.actor import Actor, MeshFailure, attach_to_workers, endpoint


class Where(Actor):
    """Answers where it runs: the host name (its UTS namespace's) and pid."""

    @endpoint
    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()


_out = threading.Lock()


def emit(kind: str, **fields: Any) -> None:
    """One JSON line; the fault hook's thread and the main thread both emit, so whole lines under a lock."""
    line = json.dumps({"t": time.time(), "kind": kind, **fields}, default=str) + "\n"
    with _out:
        sys.stdout.write(line)
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, help="tcp://HOST:PORT of the regent worker")
    ap.add_argument("--limit", type=float, default=20.0, help="how long to wait for a failure to be reported")
    args = ap.parse_args()
    supervised = threading.Event()

    def on_fault(failure: MeshFailure) -> None:
        emit("supervision", report=failure.report()[:400])
        supervised.set()

    actor_api.unhandled_fault_hook = on_fault
    hosts = attach_to_workers([args.worker])
    hosts.initialized.get(timeout=60)
    procs = hosts.spawn_procs(per_host={"procs": 1}, name="before")
    procs.initialized.get(timeout=60)
    where = procs.spawn("where", Where)
    emit("ready", where=where.where.call_one().get(timeout=60))
    for line in sys.stdin:
        command = line.strip()
        if command == "cut":
            start = time.time()
            call = where.where.call_one()
            try:
                value = call.get(timeout=args.limit)
                emit("call", outcome="value", value=value, seconds=time.time() - start)
            except TimeoutError:
                emit("call", outcome="pending", seconds=time.time() - start)
            except Exception as exc:  # noqa: BLE001 - what the call raised is the observation
                emit("call", outcome="error", error=f"{type(exc).__name__}: {exc}"[:400],
                     seconds=time.time() - start)
            seen = supervised.wait(max(0.0, start + args.limit - time.time()))
            emit("supervised", seen=seen, seconds=time.time() - start)
        elif command == "healed":
            start = time.time()
            try:
                again = hosts.spawn_procs(per_host={"procs": 1}, name="after")
                again.initialized.get(timeout=60)
                value = again.spawn("where", Where).where.call_one().get(timeout=60)
                emit("after_heal", outcome="value", value=value, seconds=time.time() - start)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                emit("after_heal", outcome="error", error=f"{type(exc).__name__}: {exc}"[:400],
                     seconds=time.time() - start)
        elif command == "quit":
            break
    try:
        hosts.shutdown().get(timeout=20)
    except Exception as exc:  # noqa: BLE001 - reported; the test kills what is left
        emit("shutdown", error=repr(exc)[:200])
    emit("bye")


if __name__ == "__main__":
    main()
