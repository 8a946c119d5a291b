"""Watching a `regent train` subprocess from an end-to-end test: its events as they are written, and waits on
them that fail fast when the run exits first."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from regent.orchestrate.events import read_jsonl


def read_events(path: Path) -> list[dict]:
    """The events written so far (a line being written right now is skipped)."""
    return list(read_jsonl(path))


def wait_for_events(proc: subprocess.Popen, events_path: Path, what: str, check: Callable[[list[dict]], bool],
                    timeout: float) -> list[dict]:
    """Poll the events until `check` holds; fail if the run exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_events(events_path)
        if check(events):
            return events
        if proc.poll() is not None:
            raise AssertionError(f"regent train exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def committed_after(events: list[dict], replica: int, after: float) -> int:
    """How many committed steps `replica` reported after `after`."""
    return sum(1 for e in events if e["kind"] == "commit" and e.get("committed") and e["replica"] == replica
               and e["time"] > after)
