"""Where the output of procs goes: `LogRouter` (a proc mesh's stdout/stderr lines to this client, gathered or
not: `ProcMesh.logging_option`) and `HostEvents` (the exits and output a remote worker forwards)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from regent.actor._pickle import loads
from regent.actor._process import ActorRuntime
from regent.actor._shape import Point
from regent.actor._spawner import (
    LOG_SYNC_MARK,
    _write_output,
)

logger = logging.getLogger("regent.actor")
LOG_SYNC_TIMEOUT = 5.0  # how long logging_option waits for procs' earlier output to drain through the pipes


def _label(name: str, point: Point) -> str:
    coords = ",".join(f"{label}={point[label]}" for label in point) if len(point) else "0"
    return f"{name} {coords}"


class HostEvents:
    """Receives exit and output events about procs a remote worker started for this process."""

    def __init__(self, rt: ActorRuntime, output: Callable[[str, str, str], None] = _write_output) -> None:
        self.rt = rt
        self.output = output
        self.port_id = rt.new_port(self)

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        event = loads(body, buffers)
        if event[0] == "exits":
            self.rt.supervision.procs_gone([tuple(e) for e in event[1]])
        elif event[0] == "exit":
            self.rt.supervision.proc_gone(event[1], event[2])
        elif event[0] == "out":
            self.output(event[1], event[2], event[3])


class LogRouter:
    """Where the stdout/stderr lines of one proc mesh's procs go (`ProcMesh.logging_option`): to this client's
    stdout/stderr (prefixed with the proc), nowhere, or, with an aggregation window, gathered for that long
    and printed once per distinct line with its count (`[4 similar log lines] loss=0.1`), so N ranks printing
    the same line do not flood the terminal. Called on the runtime's loop."""

    def __init__(self, rt: ActorRuntime, stream: bool) -> None:
        self.rt = rt
        self.stream = stream
        self.window: float | None = None
        self.pending: dict[tuple[str, str], list] = {}  # (stream, line without the proc prefix) -> [count, line]
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.syncs: dict[str, tuple[set, asyncio.Future]] = {}  # token -> (pid/stream marks awaited, done)

    def expect(self, token: str, keys: set[tuple[str, str]]) -> asyncio.Future:
        """A future that completes once every (pid, stream) in `keys` printed the sync mark `token`."""
        done = self.rt.loop.create_future()
        self.syncs[token] = (set(keys), done)
        return done

    def _synced(self, pid: str, stream: str, token: str) -> None:
        entry = self.syncs.get(token)
        if entry is None:
            return
        entry[0].discard((pid, stream))
        if not entry[0]:
            del self.syncs[token]
            if not entry[1].done():
                entry[1].set_result(None)

    def set_mode(self, stream: bool, window: float | None) -> None:
        self.stream = stream
        self.window = window
        if window is None:
            self.flush()

    def __call__(self, pid: str, stream: str, text: str) -> None:
        if LOG_SYNC_MARK in text:
            before, _, token = text.partition(LOG_SYNC_MARK)
            self._synced(pid, stream, token.strip())
            if not _without_label(before).strip():
                return
            text = before + "\n"  # a partial line the proc printed just before the mark
        if not self.stream:
            return
        if self.window is None or self.closed:
            _write_output(pid, stream, text)
            return
        key = (stream, _without_label(text))
        entry = self.pending.get(key)
        if entry is None:
            self.pending[key] = [1, text]
        else:
            entry[0] += 1
        if self.timer is None:
            self.timer = self.rt.loop.call_later(self.window, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        pending, self.pending = self.pending, {}
        for (stream, line), (count, first) in pending.items():
            _write_output("", stream, first if count == 1 else f"[{count} similar log lines] {line}")

    def close(self) -> None:
        """The mesh stopped: print what is gathered; lines still draining from the pipes go out at once."""
        self.flush()
        self.closed = True


def _without_label(text: str) -> str:
    if text.startswith("[") and "] " in text:
        return text.split("] ", 1)[1]
    return text
