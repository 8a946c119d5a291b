"""The durable backstop: periodic asynchronous checkpoints of the committed state, for when no replica is left.

Peer healing keeps committed state alive as long as one replica holds it. When every holder dies within one
window (a rack, a switch, a run of bad luck), only disk can give it back. The backstop writes the committed
state (what a healer would receive: `Manager.full_state_dict()`) every `every_s` seconds, off the critical
path, and `Manager.recover_committed` restores the newest one only when no live donor exists, counting it as a
lineage reset (`state_lost`).

How a save works, and why it is cheap for training:
- At a commit boundary the training thread only collects references to the state (`state()`); a background
  thread copies it to host memory and writes it. The tensors must not change until the copy is done: the
  caller calls `wait_copied()` before it next changes them (the optimizer's pre-step hook in per-step mode, so
  the copy runs during the next forward and backward; before the next outer step in DiLoCo, whose committed
  state, the last global parameters and outer optimizer, does not change for a whole round, so nothing waits).
- The background thread writes the copy with `torch.save` to `<root>/step-<N>/rank<r>.pt.tmp`, renames it, and
  writes `rank<r>.done`. A directory counts as complete only when every rank's `.done` exists, so a crash in
  the middle of a save never leaves a checkpoint that looks whole. One save runs at a time; a boundary that
  comes while one is still writing is skipped (and counted).
- Per-rank files rather than DCP: a restore always goes back into the same replica shape (the same ranks
  and shards a peer heal would fill), so DCP's resharding buys nothing here, while its load needs a template
  with the optimizer state already built, which a freshly started replica does not have.
- Only one replica writes (replica rank 0 of the quorum): replicas at one step hold the same committed state.
- After each completed save, directories older than the newest `keep` complete ones are removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

COPY_TIMEOUT_S = 60.0


def host_copy(state: Any) -> Any:
    """A deep copy of `state` with every tensor cloned to host memory (DTensors as their local shard)."""
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        return t.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_copy(v) for v in state)
    return state


def complete_steps(root: Path, world_size: int) -> list[int]:
    """Steps under `root` that every rank finished writing, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        named = d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit()
        if named and all((d / f"rank{r}.done").exists() for r in range(world_size)):
            out.append(int(d.name[5:]))
    return sorted(out)


class Backstop:
    """Asynchronous durable checkpoints of one replica rank's committed state under `root`."""

    def __init__(self, root: str | os.PathLike[str], rank: int, world_size: int, every_s: float = 120.0,
                 keep: int = 2, on_event: Callable[[str, dict], None] | None = None) -> None:
        if every_s <= 0:
            raise ValueError(f"backstop every_s={every_s}: must be > 0")
        if keep < 1:
            raise ValueError(f"backstop keep={keep}: must be >= 1")
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.every_s = every_s
        self.keep = keep
        self._on_event = on_event or (lambda kind, details: None)
        # When the newest complete backstop was written (wall clock, from disk): a replica restarts far more
        # often than the interval under sustained faults, so a clock that started with the process would
        # never come due. No backstop yet: the first commit boundary saves one.
        self._last = self._newest_on_disk()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._abandoned = threading.Event()
        # The training thread never waits longer than this for a copy (a stuck disk or host copy must not
        # stop training; losing one backstop is the lesser harm).
        self.copy_timeout_s = COPY_TIMEOUT_S
        self.saves = 0
        self.skipped = 0
        self.snapshot_seconds = 0.0  # time spent on the training thread, in total
        self.last_error: str | None = None

    def _newest_on_disk(self) -> float:
        complete = complete_steps(self.root, self.world_size)
        if not complete:
            return float("-inf")
        try:
            return (self.root / f"step-{complete[-1]:08d}" / f"rank{self.rank}.done").stat().st_mtime
        except OSError:  # pruned meanwhile by another writer: a newer one exists
            return time.time()

    def due(self) -> bool:
        return time.time() - self._last >= self.every_s

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def maybe_save(self, step: int, state: Callable[[], Any], force: bool = False) -> bool:
        """At a commit boundary: start a save of `state()` (committed step `step`) if one is due (or `force`:
        the ranks of a replica agree on the boundary through their group rank 0, whose clock decides). Call
        `wait_copied()` before the tensors in `state()` next change."""
        if not (force or self.due()):
            return False
        self._last = time.time()
        if self.busy():
            self.skipped += 1
            logger.warning("backstop: the save of the previous interval is still writing; skipping step %d", step)
            return False
        t0 = time.perf_counter()
        refs = state()  # references only: the copy runs beside training (see the module docstring)
        self._abandoned.clear()
        self._copied.clear()
        self._thread = threading.Thread(target=self._write, args=(step, refs, t0), daemon=True,
                                        name="regent-backstop")
        self._thread.start()
        return True

    def wait_copied(self, timeout: float | None = None) -> float:
        """Block until the save in progress has its host copy (the live tensors may change after this), at most
        `timeout` (default `copy_timeout_s`). A copy that is not done by then is abandoned: training goes on and
        the snapshot, which the changing tensors would tear, is never written (`backstop_failed`).
        Returns the seconds waited: what the backstop cost the training thread."""
        if self._copied.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not self._copied.wait(self.copy_timeout_s if timeout is None else timeout):
            self._abandoned.set()  # read by the writer after its copy: it drops the torn snapshot
            logger.error("backstop: the host copy took longer than %.0f s; abandoning this save so that training "
                         "goes on (the previous backstop stays the newest)", self.copy_timeout_s)
        waited = time.perf_counter() - t0
        self.snapshot_seconds += waited
        return waited

    def _write(self, step: int, refs: Any, t0: float) -> None:
        directory = self.root / f"step-{step:08d}"
        try:
            try:
                snapshot = host_copy(refs)
            finally:
                self._copied.set()
            copy_s = time.perf_counter() - t0
            del refs
            if self._abandoned.is_set():
                raise TimeoutError(f"host copy took {copy_s:.1f} s, past copy_timeout_s={self.copy_timeout_s}; "
                                   "the tensors changed meanwhile, so this snapshot was dropped")
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"rank{self.rank}.pt"
            tmp = path.with_name(path.name + ".tmp")
            torch.save(snapshot, tmp)
            os.replace(tmp, path)
            (directory / f"rank{self.rank}.done").write_text(str(step))
            self.saves += 1
            self.last_error = None
            if self.rank == 0:
                self._prune()
            # `waited_s`: what the training thread has paid so far for backstop copies (it waits only when it
            # must change the tensors before the copy is done)
            self._on_event("backstop_saved", {"manager_step": step, "path": str(directory),
                                              "seconds": round(time.perf_counter() - t0, 4),
                                              "copy_s": round(copy_s, 4),
                                              "waited_s": round(self.snapshot_seconds, 4)})
        except Exception as err:  # noqa: BLE001 - reported; the backstop is a safety net, training goes on without this save
            self.last_error = f"{type(err).__name__}: {err}"
            logger.error("backstop: saving step %d to %s failed: %s", step, directory, self.last_error)
            self._on_event("backstop_failed", {"manager_step": step, "error": self.last_error})

    def _prune(self) -> None:
        complete = complete_steps(self.root, self.world_size)
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep]
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit() and int(d.name[5:]) < oldest_kept:
                shutil.rmtree(d, ignore_errors=True)

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # restore side (used by Manager.recover_committed)
    def latest(self) -> tuple[int, str] | None:
        """(step, directory) of the newest complete backstop, or None."""
        complete = complete_steps(self.root, self.world_size)
        if not complete:
            return None
        return complete[-1], str(self.root / f"step-{complete[-1]:08d}")

    def load(self, path: str, rank: int) -> Any:
        return torch.load(Path(path) / f"rank{rank}.pt", weights_only=False, map_location="cpu")
