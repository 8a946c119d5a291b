"""A member of a replicated-group build tells its peers that it will issue none of the build's remaining collectives.

Why. A replica whose step has failed (an error reported to its Manager: an injected or real failure of one of its
own collectives, a failed heal, a lost quorum call) skips the step's remaining collectives, as TorchFT's Manager
does. Its peers, whose steps have not failed, issue them and wait: no process died, so nothing closes a
connection, and each waits out the whole collective timeout. Meanwhile the failed replica is already asking for
its next quorum, which cannot form without those peers, and gives up after its own quorum timeout. TorchFT's
integration tests set both to 10 s, so the outcome was a coin toss (`local_sgd_integ_test`'s commit-failure
cases failed about one run in four, and a stuck case then held the next case's port). With an orchestrator the
peers were told (`Manager.peer_failed`); without one nobody was.

How. The failed member writes one key into the build's store (the quorum's TCPStore, under the build's unique
prefix, so the key can never meet another build). A member whose collective has run far longer than its recent
ones reads that key and, if it is there, aborts the build: its collectives in flight fail at once, its step does
not commit, and the next quorum rebuilds the group (every member's step failed, so all of them rebuild).

Cost. Nothing in a healthy run: an operation is suspect only once it has been in flight for `SUSPECT_FACTOR`
times the median of the build's recent operations (and at least `MIN_SUSPECT_S`); then the key is read at
doubling intervals, at most once per `MIN_GAP_S` per build, on one background thread per group, never on the
training thread or the watchdog's.
"""

from __future__ import annotations

import atexit
import logging
import queue
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

KEY = "regent/abandoned"
SUSPECT_FACTOR = 4.0  # an operation is suspect past this many times the median of the recent ones
MIN_SUSPECT_S = 0.25  # ... and never before this
DEFAULT_SUSPECT_S = 1.0  # before any operation of the group has completed
MIN_GAP_S = 0.2  # at most one read of the store per build per this interval (many operations may be suspect)
RECENT = 16  # completed operations the median is taken over


def suspect_after(recent: Sequence[float], timeout: float) -> float:
    """Seconds an operation may run before its build's store is read: `SUSPECT_FACTOR` times the median of
    `recent` durations (`DEFAULT_SUSPECT_S` with none), at least `MIN_SUSPECT_S`, at most half the timeout."""
    base = SUSPECT_FACTOR * statistics.median(recent) if recent else DEFAULT_SUSPECT_S
    return min(max(base, MIN_SUSPECT_S), max(timeout / 2, MIN_SUSPECT_S))


def next_read_after(delay: float, timeout: float) -> float:
    """The wait before the next read of a still-running operation: double the last, at most a quarter of the
    timeout (so a slow writer is still seen well before the timeout)."""
    return min(2 * delay, max(timeout / 4, MIN_SUSPECT_S))


class _Build:
    def __init__(self, generation: int, store: Any, prefix: str) -> None:
        self.generation = generation
        self.store = dist.PrefixStore(prefix, store)
        self.last_read = 0.0
        self.abandoned_by: str | None = None


class BuildNotice:
    """One replicated group's side of the notice: announces for this member, watches for its peers.

    `schedule(delay, callback)` runs `callback` after `delay` seconds on a timer thread and must not block;
    `on_abandoned(generation, who)` aborts that build (called on this notice's own thread).
    """

    def __init__(self, schedule: Callable[[float, Callable[[], None]], Any],
                 on_abandoned: Callable[[int, str], None], timeout: Callable[[], float]) -> None:
        self._schedule = schedule
        self._on_abandoned = on_abandoned
        self._timeout = timeout
        self._lock = threading.Lock()
        self._build: _Build | None = None
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._busy_until = 0.0  # a store call in progress ends by then (see `_drain_at_exit`)

    # ---- the build -------------------------------------------------------------------------------------
    def set_build(self, generation: int, store: Any, prefix: str) -> None:
        """A new build is up: announcements and reads go to its store, and the recent durations start over."""
        with self._lock:
            self._build = _Build(generation, store, prefix)
            self._recent.clear()

    def clear(self) -> None:
        """The build is gone (aborted or replaced): nothing more is announced or read for it."""
        with self._lock:
            self._build = None

    def close(self) -> None:
        """The group is gone: drop the build and end the notice's thread."""
        self.clear()
        if self._thread is not None:
            self._queue.put(("stop",))

    # ---- this member -----------------------------------------------------------------------------------
    def announce(self, who: str) -> bool:
        """Tell the current build's peers that `who` will issue none of its remaining collectives. Returns at
        once (the store write runs on the notice's thread); False if there is no build to tell."""
        with self._lock:
            build = self._build
        if build is None:
            return False
        self._put(("announce", build, who))
        return True

    # ---- the peers ---------------------------------------------------------------------------------------
    def completed(self, seconds: float) -> None:
        """An operation of the current build completed after `seconds`."""
        with self._lock:
            self._recent.append(seconds)

    def watch(self, generation: int, running: Callable[[], bool]) -> None:
        """An operation of build `generation` was issued; `running()` says whether it is still in flight."""
        with self._lock:
            recent = list(self._recent)
        delay = suspect_after(recent, self._timeout())
        self._schedule(delay, lambda: self._suspect(generation, running, delay))

    def _suspect(self, generation: int, running: Callable[[], bool], delay: float) -> None:
        if running():  # on the timer's thread: only hand over, never block it
            self._put(("read", generation, running, delay))

    # ---- the notice's thread -----------------------------------------------------------------------------
    def _put(self, item: tuple) -> None:
        self._queue.put(item)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="regent-ft-build-notice", daemon=True)
                self._thread.start()
                _NOTICES.add(self)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item[0] == "stop":
                return
            try:
                if item[0] == "announce":
                    self._write(item[1], item[2])
                else:
                    self._read(*item[1:])
            except Exception:  # a notice must never end its thread; each failure is logged
                logger.exception("replicated group build notice failed")
            del item  # hold no build (its store) while waiting for the next

    def _claim_store(self) -> bool:
        """Mark a store call as in progress, unless the process is exiting (set first, then checked: the exit
        hook sets `_exiting` first, then reads the mark, so one of the two always sees the other)."""
        self._busy_until = time.monotonic() + self._timeout()
        if _exiting.is_set():
            self._busy_until = 0.0
            return False
        return True

    def _write(self, build: _Build, who: str) -> None:
        if not self._claim_store():
            return
        try:
            build.store.set(KEY, who)
            logger.info("told the peers of build %d that %s will issue none of its remaining collectives",
                        build.generation, who)
        except Exception as err:  # noqa: BLE001 - the store's host may be gone; the peers then time out as before
            logger.info("could not tell the peers of build %d that %s left it: %s", build.generation, who, err)
        finally:
            self._busy_until = 0.0

    def _read(self, generation: int, running: Callable[[], bool], delay: float) -> None:
        with self._lock:
            build = self._build if self._build is not None and self._build.generation == generation else None
        if build is None or not running():
            return
        now = time.monotonic()
        if build.abandoned_by is None and now - build.last_read >= MIN_GAP_S:
            build.last_read = now
            if not self._claim_store():
                return
            try:
                if build.store.check([KEY]):
                    build.abandoned_by = build.store.get(KEY).decode(errors="replace")
            except Exception as err:  # noqa: BLE001 - unreadable store: keep waiting; the timeout still ends it
                logger.debug("reading build %d's notice failed: %s", generation, err)
            finally:
                self._busy_until = 0.0
        if build.abandoned_by is not None:
            self._on_abandoned(generation, build.abandoned_by)
        elif running():
            later = next_read_after(delay, self._timeout())
            self._schedule(later, lambda: self._suspect(generation, running, later))


_NOTICES: weakref.WeakSet[BuildNotice] = weakref.WeakSet()
_exiting = threading.Event()  # set at exit: no new store call starts (the busy flag is set before the check)


@atexit.register
def _drain_at_exit() -> None:
    """Start no store call from here on, and let one in progress end before the interpreter finalizes: a thread
    returning from torch's C++ into a finalized interpreter aborts the process ("terminate called without an
    active exception"; see `process_group._await_abandoned_connects`)."""
    _exiting.set()
    for notice in list(_NOTICES):
        thread = notice._thread
        if thread is None or not thread.is_alive():
            continue
        # End the thread now, while freeing what its items hold is still safe (they hold operations' futures;
        # see `process_group._Watchdog.stop`), after any store call in progress.
        notice._queue.put(("stop",))
        thread.join(max(1.0, notice._busy_until - time.monotonic()))
