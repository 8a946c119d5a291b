"""State votes: replicas that committed the same step must hold the same state; the majority decides who is wrong.

Every K commits each rank of each replica reports the digest of its agreed state (`TrainingSession._maybe_vote`).
The controller gathers them here per committed step; once every replica that trains has reported (or the vote
has waited long enough for the rest), it decides:
- one digest: the replicas agree;
- a strict majority: the others diverged; each is stopped and healed from a majority member;
- no majority (two replicas that differ, or every replica different): nobody's state can be trusted; every voter
  is stopped, and with no live holder left the run restores its backstop (a counted lineage reset).
A digest that arrives after its step was decided is compared with the decided majority.

A copy (a heal) is no witness in the next vote unless it is checked: the healer digests what it copied, and that
must be the state its step's vote decided or, at a step with no vote (DiLoCo), the state at least two other
replicas hold at that step (`witness_digest`: the controller asks the holders as soon as it hears of the heal,
`add_witness`). Without the check, a copy at a step with no vote tied the next vote whenever the third replica
was the one that diverged, and the run restored its backstop.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from regent.ft.digest import combine_rank_digests


@dataclass
class Verdict:
    """What a decided vote says: `diverged` replicas and what to do with them ("heal" or "backstop")."""

    manager_step: int
    voters: list[int]
    majority: str | None
    diverged: list[int]
    action: str | None  # "heal", "backstop", or None when they agree (or there was no one to compare with)
    late: bool = False
    undecided: bool = False  # replicas disagreed with no majority, and not everyone voted: left to the next vote
    generations: dict[int, int | None] = field(default_factory=dict)  # the voters' trainer generations
    differs: dict[int, list[str]] = field(default_factory=dict)  # diverged replica -> parts unlike the majority's

    reference: dict[int, dict[str, str]] = field(default_factory=dict)  # a majority member's part digests per rank

    def differs_from(self, ballot: _Ballot, replica: int) -> list[str]:
        """The parts ("rank 1 /trainer/optimizer") where `replica` differs from the majority member."""
        mine = ballot.parts.get(replica, {})
        return [f"rank {rank} {part}" for rank in sorted(mine) for part, d in sorted(mine[rank].items())
                if part in self.reference.get(rank, {}) and self.reference[rank][part] != d]

    @property
    def agreed(self) -> bool:
        return not self.diverged and not self.undecided


def origins(voters: list[int], heals: list[tuple[int, int]] | dict[int, int]) -> dict[int, int]:
    """Each voter's origin: whose state it holds, following the heals since the last vote in the order they
    happened. A heal gives the healer its donor's origin *at that moment*: a replica that copied 0 before 0
    copied 1 holds 0's old state, not 1's (following the chain instead let a flipped replica and its copy
    outvote the correct one in a soak)."""
    origin = {r: r for r in voters}
    for r, d in (heals.items() if isinstance(heals, dict) else heals):
        origin[r] = origin.get(d, d)
    return {r: origin[r] for r in voters}


def decide(step: int, digests: dict[int, str],
           copied_from: list[tuple[int, int]] | dict[int, int] | None = None) -> Verdict:
    """The verdict on one step's replica digests (replica -> digest).

    `copied_from`: the heals since the previous vote, (healer, donor) in the order they happened (or a dict of
    healer -> donor). A copy is no witness: a
    replica that copied a flipped donor before the vote agrees with it, and the two outvoted the one correct
    replica in a soak (the flip spread, and the correct state was "healed" away). So the replicas that hold
    copies of one origin cast one ballot when they agree; when they differ (the origin or a copy changed after
    the copy), each casts its own. A strict majority of ballots heals the others; no majority is a tie."""
    voters = sorted(digests)
    counts = Counter(digests.values())
    if len(counts) <= 1:
        return Verdict(step, voters, next(iter(counts), None), [], None)
    groups: dict[int, list[int]] = {}
    for r, o in origins(voters, copied_from or {}).items():
        groups.setdefault(o, []).append(r)
    ballots: Counter[str] = Counter()
    for members in groups.values():
        held = {digests[r] for r in members}
        if len(held) == 1:
            ballots[held.pop()] += 1
        else:
            ballots.update(digests[r] for r in members)
    top, n = ballots.most_common(1)[0]
    if n * 2 > sum(ballots.values()):
        return Verdict(step, voters, top, sorted(r for r in voters if digests[r] != top), "heal")
    return Verdict(step, voters, None, voters, "backstop")


@dataclass
class _Ballot:
    first: float
    ranks: dict[int, dict[int, str]] = field(default_factory=dict)  # replica -> rank -> digest
    world: dict[int, int] = field(default_factory=dict)  # replica -> ranks it has
    parts: dict[int, dict[int, dict[str, str]]] = field(default_factory=dict)  # replica -> rank -> part digests
    generation: dict[int, int | None] = field(default_factory=dict)

    def complete(self) -> set[int]:
        """The replicas every rank of which has reported."""
        return {r for r, ranks in self.ranks.items() if len(ranks) == self.world[r]}


class StateVotes:
    """Digests per committed step, and the verdicts on them."""

    def __init__(self, replicas: int, wait_s: float = 30.0) -> None:
        self.replicas = replicas
        self.wait_s = wait_s
        self._open: dict[int, _Ballot] = {}
        self._decided: dict[int, Verdict] = {}
        self._late: dict[int, _Ballot] = {}  # digests of steps decided already
        self._heals: list[tuple[int, int, int, int | None]] = []  # (replica, donor, committed step it healed to,
        #   its generation), in order
        self._heal_digests: dict[tuple[int, int | None, int], tuple[int, dict[int, str]]] = {}  # (replica,
        #   generation, step) -> (ranks, rank -> digest of the state it copied)
        self._witness: dict[int, _Ballot] = {}  # step -> the holders' digests of their committed state of that
        #   step, asked for because a replica copied it (`add_witness`); no vote: they only check copies
        self._declined: dict[int, set[int]] = {}  # step -> holders asked about it that no longer held it
        self._checks: dict[tuple[int, int | None, int], tuple[float, set[int]]] = {}  # (healer, generation, step)
        #   -> (when the holders were asked, whom): open copy checks, reported once by `checks_due`

    def add(self, step: int, replica: int, rank: int, ranks: int, digest: str, generation: int | None = None,
            now: float | None = None, parts: dict[str, str] | None = None) -> Verdict | None:
        """Record one rank's digest; a verdict for a late replica when its step was decided already."""
        now = time.time() if now is None else now
        decided = self._decided.get(step)
        ballots = self._open if decided is None else self._late
        ballot = ballots.setdefault(step, _Ballot(first=now))
        ballot.ranks.setdefault(replica, {})[rank] = digest
        ballot.parts.setdefault(replica, {})[rank] = parts or {}
        ballot.world[replica] = ranks
        ballot.generation[replica] = generation
        if decided is not None and len(ballot.ranks[replica]) == ranks:
            mine = _replica_digest(ballot.ranks[replica])
            if decided.majority is None or mine == decided.majority:
                return None
            return Verdict(step, [replica], decided.majority, [replica], "heal", late=True,
                           generations={replica: generation}, differs=decided.differs_from(ballot, replica))
        return None

    def due(self, live: set[int], expected: set[int] | None = None, now: float | None = None) -> list[Verdict]:
        """Verdicts on the open steps that are ready.

        `expected`: the replicas still in the run (not given up); `live`: those training now. A step is decided
        once every expected replica has reported; or once every live one has and the verdict needs nobody else
        (they agree, or a strict majority of the whole run agrees); or `wait_s` after its first digest, with
        whoever reported.

        A replica that is not live (restarting, or failed) brings no ballot of its own for the step: its state
        is gone, and whatever it holds next it copies from a peer (a copy is no witness, `decide`). So once
        every live replica has reported, the verdict stands without it, a tie included: a tie that nobody can
        break is a `backstop` (every voter is stopped; none can be trusted). Leaving it open let the restarting
        replica, then a tied one, heal from the flipped replica before the next vote, and all of them agreed on
        the flip from then on (a 60-minute soak, both modes). Only a tie that a live replica's missing ballot
        could still break (it timed out waiting for it) is left undecided (action None)."""
        now = time.time() if now is None else now
        expected = set(range(self.replicas)) if expected is None else expected
        out = []
        for step in sorted(self._open):
            ballot = self._open[step]
            complete = ballot.complete()
            digests = {r: _replica_digest(ballot.ranks[r]) for r in complete}
            verdict = decide(step, digests, self.copies(step))
            everyone = expected <= complete
            # only a live replica that has not healed since can still bring an independent ballot (the docstring)
            missing_live = {r for r in (expected & live) - complete if not self.healed_since(r, step)}
            if not (everyone or not missing_live or now - ballot.first >= self.wait_s):
                continue
            if verdict.action == "backstop" and missing_live:
                verdict = Verdict(step, verdict.voters, None, [], None, undecided=True)
            del self._open[step]
            verdict.generations = {r: ballot.generation.get(r) for r in complete}
            majority = [r for r in complete if r not in verdict.diverged]
            # no majority (a tie): what differs is told against the lowest voter, which then lists nothing
            verdict.reference = ballot.parts.get(majority[0] if majority else min(complete, default=-1), {})
            verdict.differs = {r: verdict.differs_from(ballot, r) for r in verdict.diverged}
            self._decided[step] = verdict
            out.append(verdict)
        for old in [s for s in self._decided if s < max(self._decided, default=0) - 1000]:
            del self._decided[old]  # late digests come within a few steps; keep memory bounded
            self._late.pop(old, None)
        for old in [s for s in self._witness if s < max(self._witness, default=0) - 1000]:
            del self._witness[old]  # a copy is checked within seconds of its heal
        for old in [s for s in self._declined if s < max(self._declined, default=0) - 1000]:
            del self._declined[old]
        return out


    def note_heal(self, replica: int, donor: int, step: int, generation: int | None = None) -> None:
        """`replica` copied `donor`'s state, committed step `step` (heal_done / early_heal_done)."""
        self._heals.append((replica, donor, step, generation))
        if len(self._heals) > 4096:
            del self._heals[:2048]

    def note_heal_digest(self, replica: int, generation: int | None, step: int, rank: int, ranks: int,
                         digest: str) -> None:
        """One rank of `replica` (incarnation `generation`) digested the state it copied at committed step `step`
        (`heal_digest`, sent by the healer's every rank right after an early heal)."""
        held = self._heal_digests.setdefault((replica, generation, step), (ranks, {}))
        held[1][rank] = digest
        if len(self._heal_digests) > 4096:
            for key in list(self._heal_digests)[:2048]:
                del self._heal_digests[key]

    def verified(self, replica: int, generation: int | None, step: int) -> bool:
        """Whether the copy `replica` (incarnation `generation`) made at committed step `step` is a state the
        replicas agreed on: every rank's digest of what it copied, combined, is the majority the vote of that step
        decided, or, at a step with no vote, what the holders asked for it reported (`witnessed`). Such a healer
        holds a vouched state and computes what follows on its own, so it is a witness in the next vote. A copy of
        a flip made after the donor's ballot, or one nobody checked, stays a copy."""
        mine = self._heal_digest(replica, generation, step)
        if mine is None:
            return False
        verdict = self._decided.get(step)
        if verdict is not None:
            return verdict.majority is not None and mine == verdict.majority
        return self.witnessed(replica, step, mine)

    def _heal_digest(self, replica: int, generation: int | None, step: int) -> str | None:
        """The healer's digest of what it copied, once every rank has sent its part."""
        ranks, digests = self._heal_digests.get((replica, generation, step), (0, {}))
        return _replica_digest(digests) if ranks and len(digests) >= ranks else None

    def witnessed(self, replica: int, step: int, digest: str) -> bool:
        """Whether `digest` is the state the holders asked about `replica`'s copy at `step` hold: their answers
        (every rank's digest) taken as a vote of that step (`decide`, copies since the vote before grouped with
        their donors) give `digest` as the majority, and at least two holders answered. Two, because one is the
        donor, whose agreement shows only that the copy is faithful, not that the donor was right."""
        ballot = self._witness.get(step)
        if ballot is None:
            return False
        held = {r: _replica_digest(ballot.ranks[r]) for r in ballot.complete() if r != replica}
        if len(held) < 2:
            return False
        since = self.previous(step)
        # every heal since the vote before counts as a copy here (`copies` would ask `verified`, and so this again)
        verdict = decide(step, held, [(r, d) for r, d, s, _ in self._heals if since <= s <= step and r != d])
        return verdict.majority == digest

    def open_check(self, replica: int, generation: int | None, step: int, asked: set[int],
                   now: float | None = None) -> None:
        """The controller asked the replicas `asked` for their digests of committed step `step`, to check the copy
        `replica` (incarnation `generation`) made of it (`checks_due` reports the outcome)."""
        self._checks[(replica, generation, step)] = (time.time() if now is None else now, set(asked))
        self._witness.setdefault(step, _Ballot(first=time.time() if now is None else now))

    def add_witness(self, step: int, replica: int, rank: int, ranks: int, digest: str) -> None:
        """One rank of `replica` digested its committed state of `step`, asked to check a copy of it."""
        ballot = self._witness.setdefault(step, _Ballot(first=time.time()))
        ballot.ranks.setdefault(replica, {})[rank] = digest
        ballot.world[replica] = ranks

    def decline_witness(self, step: int, replica: int) -> None:
        """`replica`, asked for its digest of committed step `step`, had moved past it: it cannot answer."""
        self._declined.setdefault(step, set()).add(replica)

    def checks_due(self, now: float | None = None, final: bool = False) -> list[dict[str, Any]]:
        """The copy checks that ended: verified, every holder asked has answered or declined, or `wait_s` passed
        (with `final`, the run's end: all of them). Each is a `copy_checked` event's fields: healer, step,
        verified, which holders answered and which declined (a holder that had committed a newer step when it was
        asked cannot answer: its state of `step` is gone, and it says so at once)."""
        now = time.time() if now is None else now
        out = []
        for (r, g, s), (asked_at, asked) in list(self._checks.items()):
            ballot = self._witness.get(s) or _Ballot(first=asked_at)
            answered = sorted(asked & ballot.complete())
            declined = sorted((asked & self._declined.get(s, set())) - set(answered))
            ok = self.verified(r, g, s)
            if not (ok or final or set(answered) | set(declined) >= asked or now - asked_at >= self.wait_s):
                continue
            del self._checks[(r, g, s)]
            out.append({"replica": r, "generation": g, "manager_step": s, "verified": ok, "asked": sorted(asked),
                        "answered": answered, "declined": declined,
                        "heal_digested": self._heal_digest(r, g, s) is not None,
                        "seconds": round(now - asked_at, 3)})
        return out

    def copies(self, step: int) -> list[tuple[int, int]]:
        """(replica, donor) of the heals to the committed steps from the previous decided vote's to `step`, in the
        order they were reported.

        A heal to a step after the previous vote copied a state no vote has judged. A heal to the previous vote's
        own step copied a state that vote judged, but the donor may have changed after its ballot: a bit flipped
        on the donor after its ballot, a heal at the next quorum copied it, and the flipped replica and its copy
        then outvoted the correct one (`test_bitflip_is_found_by_the_state_vote_and_healed[diloco]`). So both are
        copies, unless the healer digested what it copied (`heal_digest`, after an early heal) and it is the state
        that vote decided (`verified`): then it is a witness."""
        before = self.previous(step)
        return [(r, d) for r, d, s, g in self._heals if before <= s <= step and r != d and not self.verified(r, g, s)]

    def previous(self, step: int) -> int:
        """The step of the decided vote before `step` (-1 when none)."""
        return max((s for s in self._decided if s < step), default=-1)

    def healed_since(self, replica: int, step: int) -> bool:
        """Whether `replica` healed to committed step `step` or later: it holds a copy, and no state of its own
        at `step` to vote with."""
        return any(r == replica and s >= step for r, _, s, _ in self._heals)

    def forget_after(self, step: int) -> None:
        """A lineage reset went back to committed step `step`: the steps above it will be committed again, by
        another history; their old ballots and verdicts must not judge the new ones (after a backstop restore
        a soak had every replica "diverge" from the old lineage's majority at every step it retook)."""
        for book in (self._open, self._decided, self._late, self._witness, self._declined):
            for s in [s for s in book if s > step]:
                del book[s]
        for check in [k for k in self._checks if k[2] > step]:
            del self._checks[check]
        for key in [k for k in self._heal_digests if k[2] > step]:
            del self._heal_digests[key]  # copies of the old history: none can be verified against the new one


def _replica_digest(ranks: dict[int, str]) -> str:
    return combine_rank_digests([ranks[k] for k in sorted(ranks)])


def verdict_event(v: Verdict) -> dict[str, Any]:
    """The fields of a `state_vote` event."""
    return {"manager_step": v.manager_step, "voters": v.voters, "agreed": v.agreed, "diverged": v.diverged,
            "majority": (v.majority or "")[:16], "late": v.late, "undecided": v.undecided,
            "differs": {str(r): parts for r, parts in v.differs.items()}}
