"""Fault schedule: which replicas get which fault, and when. Pure and seeded, so runs can be reproduced.

Most kinds hit one trainer of one replica (`replica`, `rank`). Two kinds are different, like the failures a
cluster really has:
- `correlated` kills several whole replicas within a short window (a rack or a switch going down): `replicas`
  lists them in kill order and `offsets` says when each is hit, in seconds after `at` (`replica` is None);
- `lighthouse` kills the Lighthouse and starts a new one on the same address: no replica is hit (`replica` is
  None, `replicas` empty).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MULTI_REPLICA_KINDS = ("correlated",)
NO_REPLICA_KINDS = ("lighthouse",)
# Kinds after which the replica hit does not fail: it reconfigures its group (comm), runs slow (straggler), nothing
# of it is hit (lighthouse), or it trains on with a flipped bit until a state vote stops it (bitflip).
NON_FAILING_KINDS = ("comm", "straggler", "lighthouse", "bitflip")


def failure_expected_within(kind: str, hang_timeout_s: float) -> float | None:
    """How long after its injection a fault of `kind` should have been reported as a failure of the replica it
    hit, or None when the kind does not fail a replica. A hang is found by the liveness watchdog (up to the hang
    timeout); every other kind ends or breaks a process, which its supervisor sees within a second or two."""
    if kind in NON_FAILING_KINDS:
        return None
    if kind == "hang":
        return hang_timeout_s + 10.0
    return 10.0


@dataclass(frozen=True)
class PlannedFault:
    at: float  # seconds since the first training step (start-up time is not counted)
    replica: int | None  # the replica hit; None for the multi-replica and no-replica kinds
    kind: str
    rank: int  # trainer rank inside the replica; ignored for `node`, `correlated` and `lighthouse`
    replicas: tuple[int, ...] = ()  # `correlated`: every replica hit, in kill order
    offsets: tuple[float, ...] = ()  # `correlated`: when each of `replicas` is hit, seconds after `at`

    @property
    def targets(self) -> tuple[int, ...]:
        """Every replica this fault hits (empty for `lighthouse`)."""
        if self.replicas:
            return self.replicas
        return () if self.replica is None else (self.replica,)


def parse_correlated_size(value: int | str) -> int | None:
    """`faults.correlated_size` as a count; None means every eligible replica ("all")."""
    text = str(value).strip().lower()
    if text == "all":
        return None
    size = int(text)
    if size < 2:
        raise ValueError(f"a correlated fault hits 2 or more replicas, not {size}")
    return size


FIRST_FAULT_GRACE_S = 120.0  # how long past the warmup the first fault waits for every replica to train


class RandomFaultSchedule:
    """Every `every` seconds after `warmup`, one random fault among `kinds`.

    A replica is eligible when it is running and its last restart is older than `holdoff` seconds, so a
    replica that is still recovering is left alone (as the article's injector does). A single-replica kind hits
    one random trainer of one eligible replica; `correlated` hits `correlated_size` distinct eligible replicas
    (all of them with "all"; fewer when fewer are eligible), the first at once and the others at random moments
    within `correlated_window` seconds; `lighthouse` hits no replica, but also waits until one is eligible, so
    the Lighthouse is not killed while the run is still recovering from the previous fault.
    """

    def __init__(self, kinds: list[str], every: float, warmup: float, holdoff: float, procs_per_replica: int,
                 seed: int = 0, correlated_size: int | str = 2, correlated_window: float = 2.0) -> None:
        if not kinds:
            raise ValueError("no fault kinds given")
        self.kinds = list(kinds)
        self.every = every
        self.warmup = warmup
        self.holdoff = holdoff
        self.procs = procs_per_replica
        self.correlated_size = parse_correlated_size(correlated_size)
        self.correlated_window = correlated_window
        self.rng = random.Random(seed)
        self.next_at = warmup
        self.first = True

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def not_delivered(self, fault: PlannedFault) -> str:
        """`fault` could not be delivered (its replica is restarting): skipped, the next one comes on time."""
        return "skipped"

    def pick(self, now: float, healthy_since: dict[int, float | None]) -> PlannedFault | None:
        """Choose the next fault; `healthy_since[r]` is when replica r last became healthy (None: not healthy)."""
        eligible = sorted(r for r, since in healthy_since.items() if since is not None and now - since >= self.holdoff)
        if not eligible:
            return None  # try again at the next tick, do not skip the slot
        untrained = any(since is None for since in healthy_since.values())
        if self.first and untrained and now < self.warmup + FIRST_FAULT_GRACE_S:
            # The first fault waits until every replica has trained (start-up on a busy machine can take far
            # longer than the warmup): hitting the only replica that has committed anything yet tests start-up
            # luck, not recovery. Bounded, so a replica that never starts does not stop the faults.
            return None
        self.first = False
        self.next_at = now + self.every
        # the same draws, in the same order, as before the multi-replica kinds: old seeds give old schedules
        replica = self.rng.choice(eligible)
        kind = self.rng.choice(self.kinds)
        rank = self.rng.randrange(self.procs)
        if kind in NO_REPLICA_KINDS:
            return PlannedFault(at=now, replica=None, kind=kind, rank=0)
        if kind in MULTI_REPLICA_KINDS:
            n = len(eligible) if self.correlated_size is None else min(self.correlated_size, len(eligible))
            others = self.rng.sample([r for r in eligible if r != replica], n - 1)
            offsets = sorted(round(self.rng.uniform(0.0, self.correlated_window), 3) for _ in others)
            return PlannedFault(at=now, replica=None, kind=kind, rank=0, replicas=(replica, *others),
                                offsets=(0.0, *offsets))
        return PlannedFault(at=now, replica=replica, kind=kind, rank=rank)


class ReplayFaultSchedule:
    """Replays a schedule file written by an earlier run (faults.jsonl) or by hand.

    One JSON object a line: `{"at": 30, "replica": 0, "kind": "kill", "rank": 0}`; for `lighthouse` no replica
    (`{"at": 30, "kind": "lighthouse"}`); for `correlated` the list of replicas and, optionally, when each is
    hit (`{"at": 30, "kind": "correlated", "replicas": [0, 2], "offsets": [0, 1.5]}`; default: all at once).
    """

    def __init__(self, faults: list[PlannedFault]) -> None:
        self.pending = sorted(faults, key=lambda f: f.at)

    @classmethod
    def from_file(cls, path: str | Path) -> ReplayFaultSchedule:
        faults = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                faults.append(_planned_from_json(json.loads(line)))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{n}: expected a JSON object like "
                    '{"at": 30, "replica": 0, "kind": "kill", "rank": 0}' f"; got {line!r} ({exc})"
                ) from exc
        return cls(faults)

    def due(self, now: float) -> bool:
        return bool(self.pending) and now >= self.pending[0].at

    def pick(self, now: float, healthy_since: dict[int, float | None]) -> PlannedFault | None:
        if not self.due(now):
            return None
        return self.pending.pop(0)

    def not_delivered(self, fault: PlannedFault) -> str:
        """`fault` could not be delivered (its replica is restarting): a reproduction wants every fault, so it
        is tried again at the next tick."""
        self.pending.insert(0, fault)
        return "waits until it trains again"


def _planned_from_json(d: dict[str, Any]) -> PlannedFault:
    at, kind = float(d["at"]), str(d["kind"])
    if kind in NO_REPLICA_KINDS:
        return PlannedFault(at, None, kind, 0)
    if kind in MULTI_REPLICA_KINDS:
        replicas = tuple(int(r) for r in d["replicas"])
        offsets = tuple(float(x) for x in d.get("offsets") or [0.0] * len(replicas))
        if len(replicas) < 1 or len(offsets) != len(replicas) or len(set(replicas)) != len(replicas):
            raise ValueError("a correlated fault needs distinct `replicas` and one offset per replica")
        return PlannedFault(at, None, kind, 0, replicas=replicas, offsets=offsets)
    return PlannedFault(at, int(d["replica"]), kind, int(d.get("rank", 0)))


def fault_record(f: PlannedFault) -> str:
    """One line of faults.jsonl: replayable by ReplayFaultSchedule, and says which replicas were hit."""
    record: dict[str, Any] = {"at": f.at, "kind": f.kind, "replica": f.replica, "rank": f.rank,
                              "replicas": list(f.targets)}
    if f.offsets:
        record["offsets"] = list(f.offsets)
    return json.dumps(record)
