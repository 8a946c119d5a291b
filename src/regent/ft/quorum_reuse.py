"""Training on through a Lighthouse outage: the members of the last quorum agree among themselves to keep it.

Without the Lighthouse no quorum forms, so every sync waits for it to come back (TorchFT's behaviour: a
Lighthouse restart stalls the whole job). Yet the common case during an outage is that nothing changed: the
same replica groups, all holding the step they just committed together. Then the Lighthouse's next answer is
known in advance (the same quorum id and members, every member one step further, nobody healing), and the
members may issue it to themselves. Two parts:

- `reissue` (pure): whether the last quorum may be reused for this group's next step, and the quorum it
  becomes. Only the plain case qualifies: it was not the first step's, and this group committed exactly one
  step since, in that quorum, with no failed commit and no shrink-only request. Every member that qualifies
  holds the same state then (the quorum's highest step plus one, its lineage), whoever healed in it. A compact
  answer (a quorum of more than 64 groups, `regent.ft.compact`) qualifies too when nobody healed in it: a
  member's share names the store primaries of the up-to-date members only, so after a heal it lacks what a
  quorum of all of them would name.
- `agree_to_reuse`: reuse must be all or nothing, or the members that reused wait in a collective for one that
  went to the Lighthouse instead (up to the collective timeout). Each member that wants to reuse writes a vote
  in the TCPStore of the last quorum's store primary; the first member to see every member's vote, or to give
  up (its deadline, or the Lighthouse answering again), sets the one decision key with compare-and-set, and
  everyone follows that key. A member that did not vote (the Lighthouse looked up to it, or it died, or it is a
  new incarnation under a new id) makes the decision "ask the Lighthouse"; nobody reuses without every vote. A
  compact answer names no member ids, only how many members there are: then each member adds one to a counter
  instead (`agree_to_reuse_counted`; a member votes once per quorum and step).

A member that died after voting fails the reused step's collective, as it would fail any step: the survivors'
commits fail and their next quorum (with `commit_failures`) goes to the Lighthouse, since `reissue` refuses
after a failed commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from regent.ft.recovery import ACCEPTED_LOSS_KEY, LINEAGE_KEY, state_version
from regent.ft.types import Quorum

REUSE = b"reuse"
ASK = b"lighthouse"
VOTE_POLL_S = 0.02


def reissue(last: Quorum | None, step: int, lineage: int, commit_failures: int = 0,
            shrink_only: bool = False) -> Quorum | None:
    """The quorum `last` becomes for a group now at `step` with `lineage`, or None if it may not be reused."""
    if last is None or commit_failures or shrink_only:
        return None
    if last.compact is not None:
        return _reissue_compact(last, step, lineage)
    if not last.participants:
        return None
    # Members that healed in `last` held its highest step once healed; whoever committed in it is one step past
    # that, in its lineage. A member that did not commit (a failed heal, a failed collective) does not match
    # this and does not vote, so a reuse agreed by every member has every member here.
    last_step = max(state_version(m) for m in last.participants)[0]
    if last_step <= 0 or step != last_step + 1 or lineage != last.quorum_id:
        return None
    members = [replace(m, step=step, commit_failures=0,
                       data={**{k: v for k, v in m.data.items() if k != ACCEPTED_LOSS_KEY}, LINEAGE_KEY: lineage})
               for m in last.participants]
    return Quorum(quorum_id=last.quorum_id, participants=members, created=datetime.now(timezone.utc),
                  committed_step=last.committed_step)


def _reissue_compact(last: Quorum, step: int, lineage: int) -> Quorum | None:
    """`reissue` of a compact answer: this member's share, one step further, when nobody healed in `last`."""
    m = last.compact.msg
    if m.max_world_size != m.replica_world_size or len(m.recovery) or not m.store_addresses:
        return None  # someone healed in it: the share names the store primaries of the up-to-date members only
    if m.max_step <= 0 or step != m.max_step + 1 or lineage != last.quorum_id:
        return None
    msg = type(m)()
    msg.CopyFrom(m)
    msg.max_step, msg.max_lineage, msg.commit_failures = step, lineage, 0
    return Quorum(quorum_id=last.quorum_id, participants=[], created=datetime.now(timezone.utc),
                  committed_step=last.committed_step, compact=replace(last.compact, msg=msg))


def reused_step(quorum: Quorum) -> int:
    """The step every member of a reissued quorum is at."""
    return int(quorum.compact.msg.max_step) if quorum.compact is not None else quorum.participants[0].step


def vote_keys(quorum_id: int, step: int) -> tuple[str, str]:
    """(the prefix of the votes, the decision key) of one reuse: per quorum and step, so never reused."""
    base = f"regent/reuse/{quorum_id}/{step}"
    return base + "/vote/", base + "/decision"


def agree_to_reuse(store: Any, quorum_id: int, step: int, me: str, members: Sequence[str], deadline: float,
                   lighthouse_back: Callable[[], bool], poll_s: float = VOTE_POLL_S) -> bool:
    """Vote to reuse quorum `quorum_id` for `step` and return the members' one decision (True: reuse).

    `store` is a TCPStore client (`set`, `check`, `compare_set`, `get`). Gives up (the decision becomes "ask
    the Lighthouse") at `deadline` (monotonic) or once `lighthouse_back()` says the Lighthouse answers again."""
    votes, decision = vote_keys(quorum_id, step)
    store.set(votes + me, b"1")
    wanted = [votes + m for m in members]
    return _decide(store, decision, lambda: store.check(wanted), deadline, lighthouse_back, poll_s)


def agree_to_reuse_counted(store: Any, quorum_id: int, step: int, members: int, deadline: float,
                           lighthouse_back: Callable[[], bool], poll_s: float = VOTE_POLL_S) -> bool:
    """`agree_to_reuse` for a compact answer, which names no member ids: each of the `members` adds one to a
    counter. Only a member of the quorum knows its id and has committed its step, and each votes once (the
    Manager server votes once per round), so the count reaches `members` only when every member voted."""
    _, decision = vote_keys(quorum_id, step)
    counter = decision.removesuffix("/decision") + "/count"
    store.add(counter, 1)
    return _decide(store, decision, lambda: store.add(counter, 0) >= members, deadline, lighthouse_back, poll_s)


def _decide(store: Any, decision: str, all_voted: Callable[[], bool], deadline: float,
            lighthouse_back: Callable[[], bool], poll_s: float) -> bool:
    """Wait for every vote, or give up; the first to do either sets the one decision (compare-and-set)."""
    while True:
        if store.check([decision]):
            break
        if all_voted():
            store.compare_set(decision, b"", REUSE)
            break
        if time.monotonic() >= deadline or lighthouse_back():
            store.compare_set(decision, b"", ASK)
            break
        time.sleep(poll_s)
    return bytes(store.get(decision)) == REUSE
