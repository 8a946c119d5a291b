"""The run directory's event log: one JSON object per line, the contract tests and users rely on."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVENT_KINDS = (
    "run_started",
    "fault_injected",
    "failure_detected",
    "restart_started",
    "restart_done",
    "heal_started",
    "heal_done",
    "quorum",
    "quorum_reused",  # the last quorum's members kept it for a step while the Lighthouse was unreachable
    "commit",
    "peer_abort",
    "group_failed",
    "allocation",
    "allocation_lost",  # the scheduler says a replica's allocation ended (scancel, preemption, node down)
    "allocation_released",  # a resumed controller released an allocation whose owner died (it held no replica)
    "gave_up",
    "ended_failed",  # a replica failed after the run decided to stop: not restarted, left out of the final check
    "state_lost",  # no live replica held the committed state: restored from the backstop (or fatal)
    "early_heal_done",  # a restarted replica pulled the committed state from a live holder
    "round_joined",  # DiLoCo: a healed replica trains in the round in progress (from `round_position` on)
    "round_abandoned",  # DiLoCo: a live replica left out of a sync (late) gave up its round and pulled the state
    "trainer_built",  # a (re)started trainer is built: where its build time went ("phases")
    "recover_failed",
    "backstop_saved",
    "backstop_failed",
    "backstop_corrupt",  # a damaged backstop was passed over for the next older one
    "backstop_unvouched",  # a restore passed over backstops no state vote vouched for (or found none vouched)
    "replay_cut",  # a replayed fault file did not play to its end within the overrun past --duration
    "run_failed",
    "lighthouse_restarted",
    "state_digest",  # one rank's digest of its agreed state (regent.ft.digest): a ballot, not written to the log
    "heal_digest",  # one rank of a healed replica digested the state it copied (compared with that step's vote)
    "witness_digest",  # one rank of a holder digested its committed state of a step a peer copied: not logged
    "copy_checked",  # a copy at a step with no vote was checked against the holders' digests (vote.StateVotes)
    "state_vote",  # the controller compared the replicas' digests of one committed step (orchestrate/vote.py)
    "state_diverged",  # replicas whose state differed from the majority: stopped and healed (or the backstop)
    "bitflip_applied",  # the `bitflip` fault flipped one bit of a replica's state: where, and at which commit
    "left_behind",  # a replica missed the run's last sync (the others committed it and stopped): caught up
    "training_stopped",  # every replica reached the stop step (or the run was cut): the end of training
    "controller_restarted",  # `regent train --resume` took over after the controller was lost (how long, how)
    "run_finished",
)


# Ballots: a rank's digest sent to the controller's state votes (`orchestrate/vote.py`), not lines of events.jsonl
# (the `state_vote` and `copy_checked` events record what they decided).
BALLOT_KINDS = frozenset({"state_digest", "witness_digest"})


def make_event(
    kind: str,
    *,
    replica: int | None = None,
    generation: int | None = None,
    quorum_id: int | None = None,
    step: int | None = None,
    t: float | None = None,
    **details: Any,
) -> dict[str, Any]:
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
    return {
        "time": time.time() if t is None else t,
        "kind": kind,
        "replica": replica,
        "generation": generation,
        "quorum_id": quorum_id,
        "step": step,
        **details,
    }


class JsonlWriter:
    """Append-only JSON-lines file, flushed per line so a crash loses nothing already written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the run
        self._lock = threading.Lock()

    def write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, default=str, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return
    with open(p, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a killed run
