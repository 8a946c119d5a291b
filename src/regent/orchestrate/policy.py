"""The restart policy of one replica, as a small state machine with no I/O.

Restarts carry a generation number; a failure report from an older generation (a second dying rank of a mesh
that is already being replaced) is ignored. A replica restarts in place (on its host, from a warm spare) as
long as its restarts work; after K consecutive starts that fail before making progress (the host may be bad:
a node that vanished, a broken GPU) the next restart asks the job layer for a fresh allocation. K = 0 asks for
one at every restart. When the job layer already knows the allocation is gone (scancel, preemption, a time
limit, a node down), the restart goes to a fresh allocation at once (`allocation_checked`). A restart that works costs a warm spare, well under a second; a fresh allocation costs a
cold start at least, so moving a replica that recovers fine would only make it slower.

There is no lifetime budget. A replica that recovers and trains between faults restarts as often as it is hit:
at one fault a minute that is 20,000 restarts over a two-week run, and each of them is the system working. What
ends a replica is a **crash loop**: `crash_loop_starts` consecutive starts that fail before making progress
(committing a step, or healing to the committed state from a peer). Consecutive failed starts also back off
exponentially (`backoff_s`, doubling, at most `max_backoff_s`), so a bad node or a broken environment does not
spin; the give-up names the count and the last error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(str, Enum):
    IGNORE = "ignore"
    RESTART_IN_PLACE = "restart_in_place"
    REALLOCATE = "reallocate"
    GIVE_UP = "give_up"


@dataclass
class RestartPolicy:
    in_place_restarts: int = 3  # K: consecutive failed starts before a fresh allocation (0: every restart)
    crash_loop_starts: int = 5  # give up after this many consecutive starts that never made progress
    backoff_s: float = 1.0  # wait before the 2nd consecutive failed start's restart; doubles after
    max_backoff_s: float = 60.0
    generation: int = 0
    attempts: int = 0  # restarts so far (reported, never a limit)
    failed_starts: int = 0  # consecutive generations that failed without progress
    restarting: bool = False
    gave_up: bool = False
    progressed: bool = False  # the current generation made progress

    def on_failure(self, generation: int) -> Action:
        """Decide what to do about a failure reported by `generation`. Call `restart_finished` afterwards."""
        if self.gave_up or self.restarting or generation != self.generation:
            return Action.IGNORE
        if not self.progressed:
            self.failed_starts += 1
            if self.failed_starts >= self.crash_loop_starts:
                self.gave_up = True
                return Action.GIVE_UP
        self.restarting = True
        self.attempts += 1
        if self.in_place_restarts == 0 or (self.failed_starts and self.failed_starts % self.in_place_restarts == 0):
            return Action.REALLOCATE
        return Action.RESTART_IN_PLACE

    def on_progress(self, generation: int) -> None:
        """`generation` committed a step or healed to the committed state: it is not crash-looping."""
        if generation == self.generation and not self.restarting:
            self.progressed = True
            self.failed_starts = 0

    def backoff(self) -> float:
        """Seconds to wait before the restart just decided: 0 unless the previous start failed too."""
        if self.failed_starts <= 1:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (self.failed_starts - 2))

    def give_up_reason(self) -> str:
        return (f"crash loop: {self.failed_starts} consecutive starts failed before committing a step or healing "
                f"(crash_loop_starts={self.crash_loop_starts}); fix the cause in the last traceback, or raise "
                f"--crash-loop-starts")

    def restart_finished(self) -> int:
        """The new mesh is up: bump the generation and accept failures from it."""
        self.generation += 1
        self.restarting = False
        self.progressed = False
        return self.generation


def allocation_checked(action: Action, allocation_problem: str | None) -> Action:
    """An in-place restart needs the replica's allocation: when the job layer says it is gone (cancelled,
    preempted, timed out, its node down), go to a fresh allocation at once instead of after K failed starts."""
    if action is Action.RESTART_IN_PLACE and allocation_problem:
        return Action.REALLOCATE
    return action


def at_the_end(*, gave_up: bool, ended_failed: bool, restarting: bool, trainers_up: bool) -> str:
    """What a replica does, once the run has asked it to finish, about its final state: "ask" its trainers,
    "wait" (a restart is in flight), or "done" (it has none to give). A restart is waited for in every phase,
    the reallocation and the respawn included, when the replica has no trainers at all: treating "no trainers"
    as "nothing to give" first ended runs whose last fault was still being recovered (seen in CI: the replica
    was left out of the final comparison and its restart cut short)."""
    if gave_up or ended_failed:
        return "done"
    if restarting:
        return "wait"
    return "ask" if trainers_up else "done"


def left_behind(final_at: dict[int, float], pending: list[int], now: float, grace_s: float,
                caught_up: set[int]) -> list[int]:
    """The replicas to catch up at the end of a run (`ReplicaActor.catch_up_at_end`).

    `final_at`: when each replica that holds a final state reported it; `pending`: those that have not. Once a
    replica has reported for `grace_s`, the run's last sync has committed, and a replica still without a final
    state missed that sync (it reached the boundary after the others' quorum formed): it waits for a quorum
    nobody will join. The grace covers a member of that sync that is only slower to report. Each replica is
    caught up once (`caught_up`)."""
    if not final_at or now - min(final_at.values()) < grace_s:
        return []
    return [r for r in sorted(pending) if r not in caught_up]


def supervisor_respawn(streak: int, step_now: int, step_at_last_respawn: int | None, limit: int) -> tuple[bool, int]:
    """Whether to respawn a replica whose own process (its ReplicaActor, the supervisor of its trainers) died, and
    the new count of consecutive such deaths without progress. A death after the replica trained past the step
    it was respawned at starts the count again; `limit` deaths in a row with no step in between is a crash loop
    (the replica gives up, as for trainers: `crash_loop_starts`)."""
    if step_at_last_respawn is None or step_now > step_at_last_respawn:
        streak = 0
    streak += 1
    return streak < limit, streak
