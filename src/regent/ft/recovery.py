"""Who heals from whom after a quorum: TorchFT's donor/recovery rules as one pure function.

Every rank of every replica runs this on the same `Quorum` and gets a consistent answer without talking
to anyone: the step counter is the version, so replicas at `max_step` are the up-to-date donors and the
others heal from them, round-robin, offset by the group rank so that the ranks of one healing replica pull
from different donor replicas and spread the bandwidth.
"""

from __future__ import annotations

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


def compute_quorum_results(replica_id: str, group_rank: int, quorum: Any, init_sync: bool = True) -> QuorumResult:
    """Recovery plan of `replica_id` at `group_rank` for `quorum` (anything with `quorum_id` and `participants`).

    Rules (TorchFT `compute_quorum_results`):
    - participants sorted by replica id; my index is my replica rank;
    - `max_step` = highest step; the members at it are the up-to-date ones (Regent: at the highest
      `state_version`, i.e. step then lineage; see `state_version`);
    - store primary (rendezvous TCPStore of this group rank's replicated group) =
      `max_participants[group_rank % len(max_participants)]`;
    - `init_sync` at step 0: everyone but the primary pulls the primary's weights;
    - healers (step != max_step, or forced by init sync) get donors round-robin from the up-to-date
      members, offset by `group_rank`;
    - `commit_failures` = max over participants (so every member reconfigures after a failed commit).
    """
    participants: Sequence[_Member] = sorted(quorum.participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in participants]
    if replica_id not in ids:
        raise ValueError(
            f"replica {replica_id!r} is not in quorum {quorum.quorum_id} (members: {ids}); "
            "the Lighthouse returned a quorum without the requester, which is a protocol bug"
        )
    replica_rank = ids.index(replica_id)
    max_version = max(state_version(m) for m in participants)
    max_step = max_version[0]
    max_participants = [m for m in participants if state_version(m) == max_version]
    max_ids = [m.replica_id for m in max_participants]
    max_replica_rank = max_ids.index(replica_id) if replica_id in max_ids else None
    primary = max_participants[group_rank % len(max_participants)]
    force_recover = init_sync and max_step == 0

    recover_dst: list[int] = []
    up_to_date: list[int] = []
    for rank, member in enumerate(participants):
        if state_version(member) != max_version or (force_recover and member.replica_id != primary.replica_id):
            recover_dst.append(rank)
        else:
            up_to_date.append(rank)

    src_of: dict[int, int] = {}
    for i, dst in enumerate(recover_dst):
        src_of[dst] = up_to_date[(i + group_rank) % len(up_to_date)]
    my_src = src_of.get(replica_rank)
    my_dsts = [dst for dst, src in src_of.items() if src == replica_rank]
    return QuorumResult(
        quorum_id=int(quorum.quorum_id),
        replica_rank=replica_rank,
        replica_world_size=len(participants),
        recover_src_manager_address=participants[my_src].address if my_src is not None else "",
        recover_src_replica_rank=my_src,
        recover_dst_replica_ranks=sorted(my_dsts),
        store_address=primary.store_address,
        max_step=int(max_step),
        max_replica_rank=max_replica_rank,
        max_world_size=len(max_participants),
        heal=my_src is not None,
        commit_failures=max(int(getattr(m, "commit_failures", 0)) for m in participants),
        replica_ids=ids,
        committed_step=int(getattr(quorum, "committed_step", 0) or 0),
    )
