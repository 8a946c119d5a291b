"""Controller A of tests/e2e/actor/test_adopt.py: spawns procs running counters, writes their references to a JSON
file, then waits to be stopped or killed. Started as `python -c "import adopt_controller; ..."` (not as a
script), so that the actor class is `adopt_controller:Counter` and the adopting controller can import it."""

from __future__ import annotations

import json
import os
import time

from regent.actor import Actor, endpoint, this_host
from regent.actor._process import get_runtime


class Counter(Actor):
    """State that must survive the change of controller."""

    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def add(self, k: int) -> int:
        self.n += k
        return self.n

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def boom(self) -> None:
        raise ValueError("boom")


def main(out: str, procs: int, detach_grace: float | None = None) -> None:
    """Spawn, count to 5 on every rank, write the references (atomically), then sleep until killed."""
    extra = {} if detach_grace is None else {"detach_grace": detach_grace}
    pm = this_host().spawn_procs(per_host={"procs": procs}, name="adoptees", **extra)
    counters = pm.spawn("counters", Counter)
    counters.add.call(5).get(timeout=60)
    pm.initialized.get(timeout=60)
    doc = {"procs": pm.reference(), "counters": counters.reference(),
           "pids": counters.pid.call().get(timeout=60).values(), "controller": get_runtime().proc_id}
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(out + ".tmp", out)
    time.sleep(600)
