"""Fault schedule: which replica gets which fault, and when. Pure and seeded, so runs can be reproduced."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlannedFault:
    at: float  # seconds since the first training step (start-up time is not counted)
    replica: int
    kind: str
    rank: int  # trainer rank inside the replica; ignored for `node`


class RandomFaultSchedule:
    """Every `every` seconds after `warmup`, one random trainer of one random eligible replica.

    A replica is eligible when it is running and its last restart is older than `holdoff` seconds, so a
    replica that is still recovering is left alone (as the article's injector does).
    """

    def __init__(self, kinds: list[str], every: float, warmup: float, holdoff: float, procs_per_replica: int,
                 seed: int = 0) -> None:
        if not kinds:
            raise ValueError("no fault kinds given")
        self.kinds = list(kinds)
        self.every = every
        self.warmup = warmup
        self.holdoff = holdoff
        self.procs = procs_per_replica
        self.rng = random.Random(seed)
        self.next_at = warmup

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def pick(self, now: float, healthy_since: dict[int, float | None]) -> PlannedFault | None:
        """Choose the next fault; `healthy_since[r]` is when replica r last became healthy (None: not healthy)."""
        eligible = sorted(r for r, since in healthy_since.items() if since is not None and now - since >= self.holdoff)
        if not eligible:
            return None  # try again at the next tick, do not skip the slot
        self.next_at = now + self.every
        return PlannedFault(
            at=now,
            replica=self.rng.choice(eligible),
            kind=self.rng.choice(self.kinds),
            rank=self.rng.randrange(self.procs),
        )


class ReplayFaultSchedule:
    """Replays a schedule file written by an earlier run (faults.jsonl) or by hand."""

    def __init__(self, faults: list[PlannedFault]) -> None:
        self.pending = sorted(faults, key=lambda f: f.at)

    @classmethod
    def from_file(cls, path: str | Path) -> ReplayFaultSchedule:
        faults = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                d = json.loads(line)
                faults.append(PlannedFault(float(d["at"]), int(d["replica"]), str(d["kind"]), int(d.get("rank", 0))))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{n}: expected a JSON object like "
                    '{"at": 30, "replica": 0, "kind": "kill", "rank": 0}' f"; got {line!r}"
                ) from exc
        return cls(faults)

    def due(self, now: float) -> bool:
        return bool(self.pending) and now >= self.pending[0].at

    def pick(self, now: float, healthy_since: dict[int, float | None]) -> PlannedFault | None:
        if not self.due(now):
            return None
        return self.pending.pop(0)


def fault_record(f: PlannedFault) -> str:
    return json.dumps(asdict(f))
