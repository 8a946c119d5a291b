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

Integrity: `rank<r>.done` is a small JSON record of the snapshot: its step, its lineage (the quorum id of the
state, `regent.ft.recovery.state_version`; null when the state does not say), the sha256 and size of
`rank<r>.pt`, and a sha256 of the record itself. Nothing is loaded before it checks out: `load` refuses
(`BackstopCorruptError`, naming the file and what differs) a snapshot whose record is damaged, whose file
differs from the recorded digest or size, or whose step disagrees with its directory or its contents. `latest`
checks every rank's snapshot of a candidate and passes over a damaged one to the next older complete one,
logging an error and reporting `backstop_corrupt`; so a restore falls back instead of loading garbage.
(Records of older Regent versions hold only the step: accepted, with a warning that nothing can be checked.)

Vouching (`require_vouched`, on when the run votes on its state): a snapshot can be intact and still wrong. The
writing replica may carry a flipped bit that its next state vote has not found yet; every replica that restores
that snapshot then holds the same flip, and votes agree on it from then on. So with votes, saves fall on vote
steps and each rank's record carries its vote digest (`digest`); the controller writes each vote's majority
digest to `<root>/verdicts.json` (`record_verdict`); and `latest` takes the newest snapshot whose ranks'
digests combine to that step's majority. One that no vote vouched for is passed over (`backstop_unvouched`);
only when no vouched snapshot exists at all (the first minutes of a run) is the newest intact one taken, with
an error saying so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from regent.ft.digest import combine_rank_digests
from regent.integrity import file_sha256, self_digest

logger = logging.getLogger(__name__)

COPY_TIMEOUT_S = 60.0
RECORD_FORMAT = 1


class BackstopCorruptError(RuntimeError):
    """A backstop snapshot does not match its record (damaged, truncated, replaced or mislabelled): never loaded."""


def _record_digest(record: dict[str, Any]) -> str:
    return self_digest(record, "record_sha256")


VERDICTS = "verdicts.json"
VERDICTS_KEPT = 512  # vote steps remembered; far more than the snapshots `keep` leaves on disk


def make_record(step: int, lineage: int | None, sha256: str, nbytes: int, digest: str | None = None) -> str:
    """The text of `rank<r>.done`: what the snapshot is (step, lineage), how to know it is intact, and the rank's
    state-vote digest at that step (`digest`, when the run votes) by which a vote's majority vouches for it."""
    record: dict[str, Any] = {"format": RECORD_FORMAT, "step": step, "lineage": lineage, "sha256": sha256,
                              "bytes": nbytes}
    if digest is not None:
        record["digest"] = digest
    record["record_sha256"] = _record_digest(record)
    return json.dumps(record)


def read_record(done: Path) -> dict[str, Any]:
    """`rank<r>.done` parsed and checked against its own digest; raises `BackstopCorruptError`. A legacy record
    (a bare step number) comes back as {"step": N, "legacy": True}."""
    try:
        text = done.read_text()
    except OSError as err:
        raise BackstopCorruptError(f"backstop record {done} is unreadable: {err}") from None
    if text.strip().isdigit():
        return {"step": int(text.strip()), "legacy": True}
    try:
        record = json.loads(text)
    except ValueError:
        raise BackstopCorruptError(f"backstop record {done} is not valid JSON (damaged)") from None
    if type(record) is not dict or record.get("record_sha256") != _record_digest(record):
        raise BackstopCorruptError(f"backstop record {done} does not match its own digest (damaged or edited)")
    if type(record.get("step")) is not int or type(record.get("sha256")) is not str \
            or type(record.get("bytes")) is not int:
        raise BackstopCorruptError(f"backstop record {done} lacks step, sha256 or bytes")
    return record


def _lineage_of(state: Any) -> int | None:
    """The lineage a Manager state carries (`{"regent": {"lineage": L}}`), if any."""
    regent = state.get("regent") if isinstance(state, dict) else None
    lineage = regent.get("lineage") if isinstance(regent, dict) else None
    return lineage if type(lineage) is int else None


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


def read_verdicts(root: str | os.PathLike[str]) -> dict[int, str]:
    """Committed step -> the majority digest of its state vote, as the controller recorded them ({} if none)."""
    try:
        raw = json.loads((Path(root) / VERDICTS).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        logger.error("backstop: %s is unreadable (%s); no snapshot can be vouched for", Path(root) / VERDICTS, err)
        return {}
    return {int(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def record_verdict(root: str | os.PathLike[str], step: int, majority: str) -> None:
    """The controller's side of vouching: committed step `step`'s state vote found `majority` (atomic write)."""
    path = Path(root) / VERDICTS
    path.parent.mkdir(parents=True, exist_ok=True)
    verdicts = read_verdicts(root)
    verdicts[step] = majority
    kept = dict(sorted(verdicts.items())[-VERDICTS_KEPT:])
    tmp = path.with_name(f"{VERDICTS}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in kept.items()}))
    os.replace(tmp, path)


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
                 keep: int = 2, on_event: Callable[[str, dict], None] | None = None,
                 require_vouched: bool = False) -> None:
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
        self.require_vouched = require_vouched  # see "Vouching" in the module docstring
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
        self._verified: set[tuple[str, int, int, str]] = set()
        self._any_saved = False

    def _newest_on_disk(self) -> float:
        complete = complete_steps(self.root, self.world_size)
        if not complete:
            return float("-inf")
        try:
            return (self.root / f"step-{complete[-1]:08d}" / f"rank{self.rank}.done").stat().st_mtime
        except OSError:  # pruned meanwhile by another writer: a newer one exists
            return time.time()

    def any_saved(self) -> bool:
        """Whether a complete snapshot exists (remembered once true: snapshots are pruned, never all)."""
        if not self._any_saved:
            self._any_saved = bool(complete_steps(self.root, self.world_size))
        return self._any_saved

    def due(self) -> bool:
        return time.time() - self._last >= self.every_s

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def maybe_save(self, step: int, state: Callable[[], Any], force: bool = False,
                   lineage: int | None = None, digest: str | None = None) -> bool:
        """At a commit boundary: start a save of `state()` (committed step `step`) if one is due (or `force`:
        the ranks of a replica agree on the boundary through their group rank 0, whose clock decides). Call
        `wait_copied()` before the tensors in `state()` next change. `lineage` is recorded with it (default:
        the one `state()` carries under "regent", if any), and `digest`, this rank's state-vote digest of the
        same state, by which a vote vouches for the snapshot."""
        if not (force or self.due()):
            return False
        self._last = time.time()
        if self.busy():
            self.skipped += 1
            logger.warning("backstop: the save of the previous interval is still writing; skipping step %d", step)
            return False
        t0 = time.perf_counter()
        refs = state()  # references only: the copy runs beside training (see the module docstring)
        if lineage is None:
            lineage = _lineage_of(refs)
        self._abandoned.clear()
        self._copied.clear()
        self._thread = threading.Thread(target=self._write, args=(step, refs, t0, lineage, digest), daemon=True,
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

    def _write(self, step: int, refs: Any, t0: float, lineage: int | None = None, digest: str | None = None) -> None:
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
            sha256, nbytes = file_sha256(tmp)  # read back from the page cache: what is on disk is what is recorded
            os.replace(tmp, path)
            done = directory / f"rank{self.rank}.done"
            done_tmp = done.with_name(done.name + ".tmp")
            done_tmp.write_text(make_record(step, lineage, sha256, nbytes, digest))
            os.replace(done_tmp, done)
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
        spare = None  # the newest vouched snapshot outlives `keep`: a restore needs it when newer ones are not
        if self.require_vouched:
            verdicts = read_verdicts(self.root)
            spare = next((st for st in reversed(complete[:-self.keep]) if self.vouched(st, verdicts)), None)
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit() and int(d.name[5:]) < oldest_kept \
                    and int(d.name[5:]) != spare:
                shutil.rmtree(d, ignore_errors=True)

    def vouched(self, step: int, verdicts: dict[int, str] | None = None) -> bool:
        """Whether the state vote at `step` found, as its majority, the state this snapshot's ranks recorded."""
        verdicts = read_verdicts(self.root) if verdicts is None else verdicts
        if step not in verdicts:
            return False
        directory = self.root / f"step-{step:08d}"
        try:
            digests = [read_record(directory / f"rank{r}.done").get("digest") for r in range(self.world_size)]
        except BackstopCorruptError:
            return False
        return all(isinstance(d, str) for d in digests) and combine_rank_digests(digests) == verdicts[step]

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # restore side (used by Manager.recover_committed)
    def latest(self) -> tuple[int, str] | None:
        """(step, directory) of the newest complete backstop whose every rank's snapshot checks out, or None.
        A damaged one is passed over for the next older (logged as an error, reported as `backstop_corrupt`).
        With `require_vouched`, so is one no state vote vouched for (see the module docstring)."""
        verdicts = read_verdicts(self.root) if self.require_vouched else {}
        unvouched: list[int] = []
        first_intact: tuple[int, str] | None = None
        for step in reversed(complete_steps(self.root, self.world_size)):
            directory = self.root / f"step-{step:08d}"
            try:
                for rank in range(self.world_size):
                    self.verify(directory, rank)
            except BackstopCorruptError as err:
                logger.error("backstop: %s; falling back to an older backstop", err)
                self._on_event("backstop_corrupt", {"manager_step": step, "path": str(directory), "error": str(err)})
                continue
            if not self.require_vouched or self.vouched(step, verdicts):
                if unvouched:
                    logger.warning("backstop: passing over step(s) %s, which no state vote vouched for; restoring "
                                   "step %d, whose vote's majority held the recorded state", unvouched, step)
                    self._on_event("backstop_unvouched", {"manager_step": step, "passed_over": unvouched})
                return step, str(directory)
            unvouched.append(step)
            first_intact = first_intact or (step, str(directory))
        if first_intact is not None:
            logger.error("backstop: no snapshot was vouched for by a state vote (steps %s); restoring the newest "
                         "intact one, step %d, unchecked against the other replicas", unvouched, first_intact[0])
            self._on_event("backstop_unvouched", {"manager_step": first_intact[0], "passed_over": [],
                                                  "unchecked": True})
        return first_intact

    def verify(self, path: str | os.PathLike[str], rank: int) -> dict[str, Any]:
        """Check rank `rank`'s snapshot under `path` against its record (digest, size, step); returns the record.
        Raises `BackstopCorruptError`. Repeated checks of an unchanged file are remembered, not re-hashed."""
        directory = Path(path)
        pt, done = directory / f"rank{rank}.pt", directory / f"rank{rank}.done"
        record = read_record(done)
        named = directory.name[5:] if directory.name.startswith("step-") else ""
        if named.isdigit() and int(named) != record["step"]:
            raise BackstopCorruptError(f"backstop {pt} is recorded as step {record['step']} but lies in "
                                       f"{directory.name} (mislabelled)")
        if record.get("legacy"):
            logger.warning("backstop %s has a record without a checksum (older Regent): it cannot be checked", pt)
            return record
        try:
            st = pt.stat()
        except OSError as err:
            raise BackstopCorruptError(f"backstop snapshot {pt} is missing: {err}") from None
        key = (str(pt), st.st_mtime_ns, st.st_size, record["sha256"])
        if key in self._verified:
            return record
        if st.st_size != record["bytes"]:
            raise BackstopCorruptError(f"backstop snapshot {pt} is {st.st_size} bytes, recorded {record['bytes']} "
                                       "(truncated or replaced)")
        sha256, _ = file_sha256(pt)
        if sha256 != record["sha256"]:
            raise BackstopCorruptError(f"backstop snapshot {pt} does not match its recorded sha256 (damaged)")
        self._verified.add(key)
        return record

    def load(self, path: str, rank: int) -> Any:
        """Rank `rank`'s snapshot under `path`, only after `verify` passed and its contents name the recorded
        step and lineage; raises `BackstopCorruptError` otherwise (nothing is returned)."""
        record = self.verify(path, rank)
        state = torch.load(Path(path) / f"rank{rank}.pt", weights_only=False, map_location="cpu")
        regent = state.get("regent") if isinstance(state, dict) else None
        if isinstance(regent, dict):
            if "step" in regent and regent["step"] != record["step"]:
                raise BackstopCorruptError(f"backstop {path} rank {rank} holds step {regent['step']}, recorded as "
                                           f"step {record['step']} (mismatched)")
            lineage = record.get("lineage")
            if lineage is not None and regent.get("lineage", lineage) != lineage:
                raise BackstopCorruptError(f"backstop {path} rank {rank} holds lineage {regent.get('lineage')}, "
                                           f"recorded as lineage {lineage} (mismatched)")
        return state
