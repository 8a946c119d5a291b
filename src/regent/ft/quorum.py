"""The Lighthouse's quorum decision, as pure functions over a plain state (no I/O, no clocks of its own).

The rules are TorchFT's (reference §1.2), in the order they are applied:

1. A replica is healthy if its last heartbeat (a Quorum request counts as one) is younger than
   `heartbeat_timeout_ms`.
2. Candidates are the healthy participants (replicas waiting in a Quorum call), sorted by replica id.
3. If any healthy participant asked for `shrink_only`, candidates not in the previous quorum are dropped.
4. Fast quorum: if every member of the previous quorum is a healthy participant again, the quorum is issued at
   once (any extra joiners already waiting ride along); the checks below are skipped. Regent's one exception
   (`holders_on_their_way`, `holder_grace_ms`): it waits a moment for a replica that holds the committed step
   but was not in the previous quorum (one just healed, on its way to this sync).
4b. Late members (Regent's, off unless `late_member_ms` > 0): once a strict majority of the previous quorum
   has joined, the others get `late_member_ms` more; then the quorum is issued without them (rules 5 and 6
   still apply; rule 7's join timeout does not wait for them). A member paused or hung at the sync otherwise
   holds every replica until it comes back or is declared dead; left out, it finds the committed step moved
   past its own at its next sync and pulls it from a holder (`regent.ft.local_sgd.DiLoCo`'s rejoin).
5. At least `min_replicas` healthy participants.
6. Split-brain guard: more than half of the heartbeating replicas must be participating.
7. Join timeout: while some heartbeating replica has not joined yet, wait until `join_timeout_ms` has passed
   since the first participant joined. Silent replicas (no heartbeat) are never waited for.

One addition (`note_incarnation`, `forget_replicas`): a replica group that restarts comes back under a new id
(TorchFT's Manager names itself "<group>:<uuid4>" per process start), while its dead incarnation's last
heartbeat still counts as healthy for `heartbeat_timeout_ms`. Under rules 6 and 7 that fresh-looking ghost makes
every survivor wait (5 s by default) before it can train on without it. So the first heartbeat or request of a
new incarnation retires the group's older ids, and a supervisor that saw a process die can retire its id at once.
Retiring is O(1) in the size of the table: since each new incarnation retires the one before, a group has at
most one id in the table, the one `LighthouseState.incarnations` names, so that map is the index. Every function
here that adds or removes a heartbeat (`note_heartbeat`, `note_incarnation`, `forget_replicas`,
`expire_heartbeats`) keeps it in step, so a storm of restarts costs O(restarts), not O(restarts x table).

The committed watermark (Regent's addition; `note_committed`, `holders`): the highest committed step (and its
lineage, the quorum id it was committed in) any replica has reported, from heartbeats and quorum requests. It is
what tells a quorum of freshly restarted replicas, all at step 0, that they would silently throw away committed
training (TorchFT would train on from step 0). It only goes down when a replica that restored older state (the
durable backstop) says so (it names the watermark it accepts losing): that is a counted lineage reset (`resets`).

`quorum_id` increases when the sorted list of member ids changes, or when the membership is the same but a
member reports `commit_failures > 0` (everyone must rebuild its process group after a failed commit).
Address or step changes alone keep the id.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import Any

from regent.ft.types import Quorum, QuorumMember


@dataclass(frozen=True)
class QuorumOptions:
    """The Lighthouse's tunables, named and defaulted like `torchft_lighthouse`'s flags."""

    min_replicas: int = 1
    join_timeout_ms: int = 60_000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5_000
    # Regent's addition (rule 4): how long a fast quorum waits for `holders_on_their_way`; 0 turns it off.
    holder_grace_ms: int = 2_000
    # Regent's addition (rule 4b, `late_members`): once a strict majority of the previous quorum has joined, how
    # long the quorum waits for its other members before it is issued without them; 0 turns it off (TorchFT's
    # rules: a member that heartbeats is waited for until the join timeout).
    late_member_ms: int = 0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        for name in ("join_timeout_ms", "heartbeat_timeout_ms", "holder_grace_ms", "late_member_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.quorum_tick_ms <= 0:
            raise ValueError(f"quorum_tick_ms must be > 0, got {self.quorum_tick_ms}")


@dataclass
class Participant:
    """A replica waiting for the next quorum. `joined` is a monotonic time in seconds."""

    joined: float
    member: QuorumMember


@dataclass
class Watermark:
    """The run's highest committed state: `step` committed in quorum `lineage`; `resets` lineage resets so far;
    `lost_lineage` the lineage of the watermark the last reset gave up (0: none yet). Every commit made after that
    reset is in a quorum issued after it, so its lineage is above `lost_lineage`; every commit made before it is
    at or below (the lost watermark was the highest). `seed_watermark` tells the two apart by it."""

    step: int = 0
    lineage: int = 0
    resets: int = 0
    lost_lineage: int = 0


@dataclass
class LighthouseState:
    """Everything the decision looks at. Times are monotonic seconds (time.monotonic())."""

    participants: dict[str, Participant] = field(default_factory=dict)
    prev_quorum: Quorum | None = None
    quorum_id: int = 0
    heartbeats: dict[str, float] = field(default_factory=dict)
    # group name -> its newest replica id, the group's only id in `heartbeats` (absent once that id is gone)
    incarnations: dict[str, str] = field(default_factory=dict)
    committed: dict[str, tuple[int, int]] = field(default_factory=dict)  # replica id -> (step, lineage) reported
    watermark: Watermark = field(default_factory=Watermark)
    # A restarted Lighthouse (`restart_grace`): the groups of the last quorum before the restart, and until when
    # it waits for them to heartbeat again before it issues a quorum.
    expected_groups: frozenset[str] = frozenset()
    not_before: float = 0.0
    # The holder grace (rule 4) in progress: the replicas a fast quorum is waiting for, and since when. The server
    # reads and clears them when it issues the quorum (`LighthouseServer._note_grace`).
    grace_awaited: set[str] = field(default_factory=set)
    grace_since: float | None = None
    # The last quorum's members rule 4b (`late_members`) left out of the quorum it decided; the server reads and
    # clears them when it issues that quorum (`LighthouseServer._note_late`).
    late_left_out: list[str] = field(default_factory=list)


def note_committed(state: LighthouseState, replica_id: str, step: int, lineage: int,
                   accepted: tuple[int, int] | None = None) -> bool:
    """Record what `replica_id` holds; returns whether the watermark changed. O(1).

    The watermark rises with any higher (step, lineage). It falls only when this replica restored older state
    and accepts losing exactly the current watermark (`accepted` is the watermark's (step, lineage) as the
    replica was told it): the reset is then counted, never silent. Naming the watermark, not just a step, makes
    the count exact: a late message from a replica whose loss was already counted (the watermark has moved on
    since) lowers nothing, and a second loss of the same step in a later lineage still counts."""
    state.committed[replica_id] = (step, lineage)
    w = state.watermark
    if accepted is not None and accepted[0] and tuple(accepted) == (w.step, w.lineage) and step < w.step:
        state.watermark = Watermark(step, lineage, w.resets + 1, max(w.lineage, w.lost_lineage))
        return True
    if (step, lineage) > (w.step, w.lineage):
        state.watermark = Watermark(step, lineage, w.resets, w.lost_lineage)
        return True
    return False


def seed_watermark(state: LighthouseState, step: int, lineage: int) -> bool:
    """Raise the watermark of a restarted Lighthouse to a commit it never heard of; returns whether it rose.

    While the Lighthouse is down, the replicas may go on committing (`regent.ft.quorum_reuse`); their heartbeats
    report those steps once it is back. If every replica dies first, only whoever watched the commits (the
    controller) knows them, and without this the restarted Lighthouse's watermark, and the loss it counts, would
    stop short of them (the loss must be counted in full). A commit from before the last counted reset
    (`lineage <= lost_lineage`) must not raise it again: that loss was accepted already, and raising the watermark
    would send the restored replicas to restore a second time."""
    w = state.watermark
    if step <= 0 or lineage <= w.lost_lineage or (step, lineage) <= (w.step, w.lineage):
        return False
    state.watermark = Watermark(step, lineage, w.resets, w.lost_lineage)
    return True


# A holder of the committed state counts as alive for this many heartbeat timeouts, not one. Being named a holder
# decides whether the run restores an older backstop (or stops); a holder that is only slow (a starved host, a
# long GC pause) must not be taken for a dead one. A holder that died is retired at once anyway (the supervisor's
# report, or its group's next incarnation), so only a silent host's loss waits the longer time.
HOLDER_ALIVE_TIMEOUTS = 3


def holders(now: float, state: LighthouseState, opts: QuorumOptions) -> list[str]:
    """Live replicas (`HOLDER_ALIVE_TIMEOUTS`) that hold the watermark's step (those at its lineage first), by id."""
    limit = HOLDER_ALIVE_TIMEOUTS * opts.heartbeat_timeout_ms / 1000.0
    w = state.watermark
    found = [rid for rid, (step, _) in state.committed.items()
             if step == w.step and now - state.heartbeats.get(rid, -1e18) < limit]
    return sorted(found, key=lambda rid: (state.committed[rid][1] != w.lineage, rid))


def group_name(replica_id: str) -> str | None:
    """The replica group in a TorchFT-style id "<group>:<uuid>"; None for an id without one."""
    name, sep, _ = replica_id.rpartition(":")
    return name if sep and name else None


def note_incarnation(state: LighthouseState, replica_id: str) -> list[str]:
    """Record a heartbeat or request from `replica_id`; when it is a new incarnation of its group, forget the
    heartbeats of the group's other ids (they are dead: a group runs one incarnation at a time). Returns the
    ids forgotten. O(1): the group's only other id in the table is its previous incarnation."""
    name = group_name(replica_id)
    if name is None:
        return []
    previous = state.incarnations.get(name)
    if previous == replica_id:
        return []
    state.incarnations[name] = replica_id
    if previous is None or state.heartbeats.pop(previous, None) is None:
        return []
    state.committed.pop(previous, None)
    return [previous]


def note_heartbeat(state: LighthouseState, replica_id: str, now: float) -> list[str]:
    """A heartbeat (or Quorum request) from `replica_id` at `now`: refresh it and retire its group's older
    incarnation (`note_incarnation`). Returns the ids retired. O(1)."""
    state.heartbeats[replica_id] = now
    return note_incarnation(state, replica_id)


@dataclass
class JoinsApplied:
    """What `apply_joins` did: each join's new participant (in order), the older incarnations retired (by the id
    that retired them) and the joins that moved the watermark (with the watermark before)."""

    participants: list[Participant]
    retired: dict[str, list[str]]
    watermark_moves: list[tuple[str, Watermark]]


def apply_joins(state: LighthouseState, joins: Iterable[Any], now: float) -> JoinsApplied:
    """A batch of Quorum calls' effects before they wait, in order: each is an implicit heartbeat
    (`note_heartbeat`), reports what it holds (`note_committed`) and joins as a `Participant` at `now`. The same
    state as those functions applied one join at a time (tested against them), in one pass: the common join (no
    new incarnation, the watermark not moved) inline, the others through those functions. Each join is the
    member that joins (`replica_id`, `step`, `lineage`, as `joins.Join`) with `accepted` (`note_committed`'s)."""
    heartbeats, incarnations, committed, participants = (state.heartbeats, state.incarnations, state.committed,
                                                         state.participants)
    joined: list[Participant] = []
    retired: dict[str, list[str]] = {}
    moves: list[tuple[str, Watermark]] = []
    w = state.watermark
    top = (w.step, w.lineage)
    for member in joins:
        rid = member.replica_id
        heartbeats[rid] = now
        name, sep, _ = rid.rpartition(":")
        if sep and name and incarnations.get(name) != rid:  # `group_name`'s rule; else `note_incarnation` is a no-op
            gone = note_incarnation(state, rid)
            if gone:
                retired[rid] = gone
        version = (member.step, member.lineage)
        if member.accepted is not None or version > top:
            before = state.watermark
            if note_committed(state, rid, member.step, member.lineage, member.accepted):
                moves.append((rid, before))
                w = state.watermark
                top = (w.step, w.lineage)
        else:
            committed[rid] = version  # what `note_committed` does when the watermark stays
        participant = Participant(now, member)
        participants[rid] = participant
        joined.append(participant)
    return JoinsApplied(joined, retired, moves)


def _unindex(state: LighthouseState, replica_id: str) -> None:
    """`replica_id` left the table: its group has no id there any more."""
    name = group_name(replica_id)
    if name is not None and state.incarnations.get(name) == replica_id:
        del state.incarnations[name]


def forget_replicas(state: LighthouseState, replica_ids: list[str]) -> list[str]:
    """Count these replicas as failed now instead of when their heartbeats time out. Returns those that were
    still counted healthy. A replica that is in fact alive counts again from its next heartbeat."""
    forgotten = []
    for rid in replica_ids:
        state.committed.pop(rid, None)
        if state.heartbeats.pop(rid, None) is not None:
            forgotten.append(rid)
        _unindex(state, rid)
    return forgotten


def expire_heartbeats(state: LighthouseState, cutoff: float, keep: Container[str] = ()) -> list[str]:
    """Forget the replicas whose last heartbeat is older than `cutoff` (except those in `keep`, e.g. replicas
    waiting in a Quorum call), with what they reported. Returns the ids forgotten. O(table): the server runs
    it every few seconds, not per heartbeat."""
    stale = [rid for rid, last in state.heartbeats.items() if last < cutoff and rid not in keep]
    for rid in stale:
        del state.heartbeats[rid]
        state.committed.pop(rid, None)
        _unindex(state, rid)
    return stale


def healthy_replicas(now: float, state: LighthouseState, opts: QuorumOptions) -> set[str]:
    """Replica ids whose last heartbeat is fresh."""
    limit = opts.heartbeat_timeout_ms / 1000.0
    return {rid for rid, last in state.heartbeats.items() if now - last < limit}


def restart_grace(state: LighthouseState, groups: list[str], now: float, opts: QuorumOptions) -> None:
    """A Lighthouse restarted from its state file knows nobody yet: the first replica to reconnect would be a
    quorum of one (rules 5-7 only wait for replicas that heartbeat), commit alone, and leave the others behind,
    so that its death right after loses committed state (seen in the soak). Wait for the last quorum's
    `groups` to heartbeat again, at most one heartbeat timeout (a group still silent by then is dead)."""
    state.expected_groups = frozenset(groups)
    state.not_before = now + opts.heartbeat_timeout_ms / 1000.0 if groups else 0.0


def restore_last_quorum(state: LighthouseState, members: list[str], created: datetime) -> None:
    """A Lighthouse restarted from its state file takes the last quorum's replica ids back as its previous quorum,
    so the same members coming back get the same quorum id (`next_quorum_id`) and keep their process groups,
    instead of a new id that makes every one of them rebuild its group after each Lighthouse restart. Only the ids
    are known: the members' addresses and steps come with their next requests."""
    if members and state.quorum_id:
        state.prev_quorum = Quorum(quorum_id=state.quorum_id, participants=[QuorumMember(replica_id=rid)
                                                                             for rid in sorted(members)],
                                   created=created)


def expect_first_groups(state: LighthouseState, groups: list[str], now: float, within_s: float) -> None:
    """A fresh run's first quorum waits for every replica group the launcher started to heartbeat (at most
    `within_s`). Under rules 5-7 alone, the groups whose trainers were built first form a quorum without the
    others, commit the first step alone and, in DiLoCo, train a whole round before the others can join (37 s of
    two idle replicas in the demo), while they are the only holders of the committed state. The same wait as
    `restart_grace`; a group that never comes delays the first quorum by `within_s`, no more."""
    if state.quorum_id or state.not_before or not groups:
        return  # a Lighthouse that has issued quorums before (restarted) uses restart_grace instead
    state.expected_groups = frozenset(groups)
    state.not_before = now + within_s


_SHRINK_ONLY = attrgetter("shrink_only")


def holders_on_their_way(state: LighthouseState, healthy: set[str], prev_ids: set[str]) -> list[str]:
    """Healthy replicas that hold the committed watermark's step, were not in the previous quorum and have not
    joined yet: replicas that just copied the committed state from a survivor (an early heal) and are training
    their way to the survivors' next sync. A fast quorum issued a moment before one arrives leaves it a whole
    round behind, the survivors the only holders of what they commit next (a CI run lost exactly that: the
    healed replica reached the sync 0.1-1 s after the survivor, whose fast quorum had formed without it; the
    survivor then died, and the committed step came back from the durable backstop instead of a live peer). A
    replica behind the watermark is not one of them: it would be healed at the quorum anyway."""
    w = state.watermark
    if w.step <= 0:
        return []
    return sorted(rid for rid, (step, _) in state.committed.items()
                  if step == w.step and rid in healthy and rid not in prev_ids and rid not in state.participants)


def late_members(now: float, state: LighthouseState, joined: dict[str, Participant], opts: QuorumOptions
                 ) -> list[str]:
    """Rule 4b: the previous quorum's members that have not joined although a strict majority of that quorum
    did at least `late_member_ms` ago (counted from the joining that made the majority), by id; [] while they
    are still within their time, or when no majority has joined.

    Why: the sync of a synchronous round waits for its slowest member. A member paused for seconds (a stalled
    host, a long GC) or hung (found only after the hang deadline, which must exceed any pause tolerated) kept
    every other replica idle for that long, at every such fault: most of the goodput a 16-core soak lost. Left
    out, the late member loses its own round's work instead and catches up from a holder; a member that is
    only slower than the others by less than `late_member_ms` is never left out."""
    assert state.prev_quorum is not None
    prev_ids = state.prev_quorum.replica_ids()
    arrived = sorted(joined[rid].joined for rid in prev_ids if rid in joined)
    majority = len(prev_ids) // 2 + 1
    if len(arrived) < majority or len(arrived) == len(prev_ids):
        return []
    if now - arrived[majority - 1] < opts.late_member_ms / 1000.0:
        return []
    return sorted(rid for rid in prev_ids if rid not in joined)


def quorum_compute(
    now: float, state: LighthouseState, opts: QuorumOptions
) -> tuple[list[QuorumMember] | None, str]:
    """Decide whether a quorum can be issued now. Returns (members sorted by id, or None; the reason)."""
    state.late_left_out = []  # only the decision just made names whom it leaves out (the dashboard computes too)
    healthy = healthy_replicas(now, state, opts)
    if state.not_before:
        back = {group_name(rid) or rid for rid in healthy}
        missing = state.expected_groups - back
        if missing and now < state.not_before:
            return None, (f"Lighthouse waiting {state.not_before - now:.1f} s more for the replica groups "
                          f"{sorted(missing)} to heartbeat (the last quorum's, or the first quorum's expected)")
        state.not_before = 0.0  # every group is back, or the grace is over
    healthy_participants = {rid: p for rid, p in state.participants.items() if rid in healthy}
    candidates = [healthy_participants[rid].member for rid in sorted(healthy_participants)]  # by replica id
    shrink_only = any(map(_SHRINK_ONLY, candidates))

    metadata = (
        f"[{len(healthy_participants)}/{len(state.participants)} participants healthy]"
        f"[{len(healthy)} heartbeating][shrink_only={str(shrink_only).lower()}]"
    )

    if state.prev_quorum is not None:
        prev_ids = set(state.prev_quorum.replica_ids())
        if shrink_only:
            candidates = [m for m in candidates if m.replica_id in prev_ids]
        if prev_ids <= healthy_participants.keys():
            if opts.holder_grace_ms and len(healthy) > len(healthy_participants) and not shrink_only:
                # someone healthy has not joined (O(1) check first: in steady state everyone has)
                coming = holders_on_their_way(state, healthy, prev_ids)
                first_joined = min((p.joined for p in healthy_participants.values()), default=now)
                left = opts.holder_grace_ms / 1000.0 - (now - first_joined)
                if coming and left > 0:
                    state.grace_awaited.update(coming)
                    state.grace_since = now if state.grace_since is None else state.grace_since
                    return None, (f"Fast quorum waiting {left:.1f} s more for {len(coming)} replicas that hold "
                                  f"the committed step and have not joined yet ({coming[:3]}) {metadata}")
            return candidates, f"Fast quorum found! {metadata}"

    late = (late_members(now, state, healthy_participants, opts)
            if opts.late_member_ms and state.prev_quorum is not None and not shrink_only else None)

    if len(healthy_participants) < opts.min_replicas:
        return None, (
            f"New quorum not ready, only have {len(healthy_participants)} participants, "
            f"need min_replicas {opts.min_replicas} {metadata}"
        )

    if len(healthy_participants) <= len(healthy) // 2:
        return None, (
            f"New quorum not ready, only have {len(healthy_participants)} participants, "
            f"need at least half of {len(healthy)} healthy workers {metadata}"
        )

    if late:
        state.late_left_out = late
        return candidates, f"Quorum without {len(late)} late members of the last one ({late[:3]}) {metadata}"

    all_healthy_joined = len(healthy_participants) == len(healthy)
    first_joined = min((p.joined for p in healthy_participants.values()), default=now)
    if not all_healthy_joined and (now - first_joined) < opts.join_timeout_ms / 1000.0:
        return None, (
            f"Valid quorum with {len(healthy_participants)} participants, waiting for "
            f"{len(healthy) - len(healthy_participants)} healthy but not participating stragglers "
            f"due to join timeout {metadata}"
        )

    return candidates, f"Valid quorum found {metadata}"


def quorum_possible(state: LighthouseState, opts: QuorumOptions) -> bool:
    """A cheap necessary condition for `quorum_compute` to return members (it never says False when a quorum
    could form). The server checks it on every request so that a round of N joins costs O(N), not O(N^2)."""
    if len(state.participants) >= opts.min_replicas:
        return True
    prev = state.prev_quorum
    if prev is None or len(state.participants) < len(prev.participants):  # distinct ids: one member must be missing
        return False
    return all(m.replica_id in state.participants for m in prev.participants)


def quorum_changed(a: list[QuorumMember], b: list[QuorumMember]) -> bool:
    """Membership changed iff the ordered replica-id lists differ (addresses and steps do not count)."""
    return [m.replica_id for m in a] != [m.replica_id for m in b]


def next_quorum_id(state: LighthouseState, members: list[QuorumMember]) -> int:
    """The id the quorum of `members` gets: bumped on a membership change or a reported commit failure."""
    if state.prev_quorum is None or quorum_changed(members, state.prev_quorum.participants):
        return state.quorum_id + 1
    if any(m.commit_failures > 0 for m in members):
        return state.quorum_id + 1
    return state.quorum_id


def issue_quorum(state: LighthouseState, members: list[QuorumMember], created: datetime) -> Quorum:
    """Record a decided quorum in `state`: bump the id by the rule, remember it, clear the participants."""
    state.quorum_id = next_quorum_id(state, members)
    quorum = Quorum(quorum_id=state.quorum_id, participants=list(members), created=created)
    state.prev_quorum = quorum
    state.participants.clear()
    return quorum
