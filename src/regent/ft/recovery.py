"""Who heals from whom after a quorum: TorchFT's donor/recovery rules as one pure function.

Every rank of every replica runs this on the same `Quorum` and gets a consistent answer without talking
to anyone: the step counter is the version, so replicas at `max_step` are the up-to-date donors and the
others heal from them, round-robin, offset by the group rank so that the ranks of one healing replica pull
from different donor replicas and spread the bandwidth.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class _Member(Protocol):
    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    commit_failures: int


@dataclass(frozen=True)
class QuorumResult:
    """What one (replica, group rank) must do after a quorum (the fields of `ManagerQuorumResponse`)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str] = field(default_factory=list)
    # Regent: the run's committed watermark. Above `max_step`, no member holds the committed state: training
    # on would silently reset the lineage (see `Manager.recover_committed`).
    committed_step: int = 0
    # Regent: the membership's digest (`members_digest`; `replica_ids` is empty in a compact answer) and the
    # donor's replica id
    members_digest: bytes = b""
    recover_src_replica_id: str = ""

    @property
    def state_lost(self) -> bool:
        return self.committed_step > self.max_step


# Key in `QuorumMember.data` under which a Regent ManagerServer reports its replica's *lineage*: the quorum id
# in which it last committed a step.
LINEAGE_KEY = "regent_lineage"
# Key under which a replica that restored older state (the durable backstop) says which committed step it
# accepts losing (see `regent.ft.quorum.note_committed`).
ACCEPTED_LOSS_KEY = "regent_accepted_loss"  # [step, lineage] of the watermark accepted as lost


def state_version(member: Any) -> tuple[int, int]:
    """(step, lineage) of a member. The step alone is TorchFT's version; two quorums formed one after the other
    at the same step from different members (a replica that joined a sync round a moment too late) leave
    replicas at the same step with different weights. The lineage tells them apart, so the recovery rules heal
    the odd one out instead of letting them train on apart. Members that report none (TorchFT managers) have
    lineage 0, which makes the rule TorchFT's."""
    data = getattr(member, "data", None)
    lineage = data.get(LINEAGE_KEY, 0) if isinstance(data, dict) else 0
    try:
        lineage = int(lineage)
    except (TypeError, ValueError):
        lineage = 0
    return int(member.step), lineage


def accepted_loss(member: Any) -> tuple[int, int] | None:
    """The watermark (step, lineage) a member that restored older state accepts losing (`ACCEPTED_LOSS_KEY` in its
    `data`; `quorum.note_committed`), or None when it reports none or something malformed."""
    data = getattr(member, "data", None)
    accepted = data.get(ACCEPTED_LOSS_KEY) if isinstance(data, dict) else None
    if isinstance(accepted, list) and len(accepted) == 2 and all(isinstance(x, int) for x in accepted):
        return accepted[0], accepted[1]
    return None


def members_digest(ids: Sequence[str]) -> bytes:
    """BLAKE2b-128 of the sorted member ids: two quorums with the same digest have the same members. What a
    compact quorum answer carries instead of the list (and what the Manager keys its group rebuilds on)."""
    return hashlib.blake2b("\n".join(ids).encode(), digest_size=16).digest()


class QuorumPlan:
    """TorchFT's recovery rules for every member of one quorum at once: the members are sorted and split once,
    then each (member, group rank) is answered in O(1 + its destinations). The Lighthouse builds one per round to
    send compact answers; `compute_quorum_results` is one lookup in it.

    Rules (TorchFT `compute_quorum_results`):
    - participants sorted by replica id; my index is my replica rank;
    - `max_step` = highest step; the members at it are the up-to-date ones (Regent: at the highest
      `state_version`, i.e. step then lineage; see `state_version`);
    - store primary (rendezvous TCPStore of this group rank's replicated group) =
      `max_participants[group_rank % len(max_participants)]`;
    - `init_sync` at step 0: everyone but the primary pulls the primary's weights;
    - healers (step != max_step, or forced by init sync) get donors round-robin from the up-to-date
      members, offset by `group_rank`: the i-th healer heals from `up_to_date[(i + group_rank) % len]`;
    - `commit_failures` = max over participants (so every member reconfigures after a failed commit).
    """

    def __init__(self, quorum_id: int, participants: Sequence[Any], committed_step: int = 0) -> None:
        self.quorum_id = int(quorum_id)
        self.committed_step = int(committed_step or 0)
        self.members: list[Any] = sorted(participants, key=lambda m: m.replica_id)
        self.ids = [m.replica_id for m in self.members]
        self.rank = {rid: i for i, rid in enumerate(self.ids)}
        versions = [state_version(m) for m in self.members]
        self.max_version = max(versions)
        self.max_ranks = [i for i, v in enumerate(versions) if v == self.max_version]
        self._max_index = {r: j for j, r in enumerate(self.max_ranks)}
        self.recover_dst = [i for i, v in enumerate(versions) if v != self.max_version]
        self._dst_pos = {r: i for i, r in enumerate(self.recover_dst)}
        self.commit_failures = max(int(getattr(m, "commit_failures", 0)) for m in self.members)
        self.digest = members_digest(self.ids)

    @property
    def max_step(self) -> int:
        return int(self.max_version[0])

    def primary(self, group_rank: int) -> int:
        """The rank of group rank `group_rank`'s store primary."""
        return self.max_ranks[group_rank % len(self.max_ranks)]

    def max_index(self, rank: int) -> int | None:
        """Member `rank`'s index among the up-to-date members, or None if it is behind."""
        return self._max_index.get(rank)

    def recovery(self, rank: int, group_rank: int, init_sync: bool) -> tuple[int | None, list[int]]:
        """(the rank member `rank` heals from or None, the ranks it sends to) at `group_rank`."""
        if init_sync and self.max_step == 0:  # everyone but the primary pulls the primary's weights
            primary = self.primary(group_rank)
            if rank == primary:
                return None, [r for r in range(len(self.members)) if r != primary]
            return primary, []
        up = self.max_ranks
        pos = self._dst_pos.get(rank)
        if pos is not None:
            return up[(pos + group_rank) % len(up)], []
        if not self.recover_dst:
            return None, []
        first = (self._max_index[rank] - group_rank) % len(up)
        return None, self.recover_dst[first::len(up)]

    def result(self, replica_id: str, group_rank: int, init_sync: bool = True) -> QuorumResult:
        rank = self.rank.get(replica_id)
        if rank is None:
            raise ValueError(
                f"replica {replica_id!r} is not in quorum {self.quorum_id} (members: {self.ids[:20]}"
                f"{'...' if len(self.ids) > 20 else ''}); the Lighthouse returned a quorum without the requester, "
                "which is a protocol bug")
        src, dsts = self.recovery(rank, group_rank, init_sync)
        return QuorumResult(
            quorum_id=self.quorum_id,
            replica_rank=rank,
            replica_world_size=len(self.members),
            recover_src_manager_address=self.members[src].address if src is not None else "",
            recover_src_replica_rank=src,
            recover_dst_replica_ranks=dsts,
            store_address=self.members[self.primary(group_rank)].store_address,
            max_step=self.max_step,
            max_replica_rank=self.max_index(rank),
            max_world_size=len(self.max_ranks),
            heal=src is not None,
            commit_failures=self.commit_failures,
            replica_ids=self.ids,
            committed_step=self.committed_step,
            members_digest=self.digest,
            recover_src_replica_id=self.ids[src] if src is not None else "",
        )


def compute_quorum_results(replica_id: str, group_rank: int, quorum: Any, init_sync: bool = True) -> QuorumResult:
    """Recovery plan of `replica_id` at `group_rank` for `quorum` (anything with `quorum_id` and `participants`,
    or a quorum answered compactly: its `compact` part then holds the plan; see `QuorumPlan` for the rules)."""
    compact = getattr(quorum, "compact", None)
    if compact is not None:
        return compact.result(replica_id, group_rank, init_sync)
    return QuorumPlan(quorum.quorum_id, quorum.participants, getattr(quorum, "committed_step", 0)).result(
        replica_id, group_rank, init_sync)
