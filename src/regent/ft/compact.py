"""The compact quorum answer (a Regent extension of TorchFT's Lighthouse protocol): encode, decode, negotiate.

Why: TorchFT answers every member of a quorum with every member, O(N) bytes each and O(N^2) a round: 1.4 s of
Lighthouse CPU at 4,096 groups, ~14 s at 12,800 (docs/scaling.md). But a member only needs its own share:
its rank, the store primaries of its group ranks, whom it heals from or sends to, and a digest of the
membership (to know when the membership changed). The Lighthouse computes the recovery rules once per round
(`recovery.QuorumPlan`) and sends each member that share.

Negotiation: a requester asks by setting `LighthouseQuorumRequest.regent_compact` (field 1000, with its
`init_sync`, which the step-0 rule needs). TorchFT's clients never set it and get TorchFT's answer, byte for
byte what they got before; TorchFT's Lighthouse skips the field and answers in full, which `Quorum.compact`
being None tells the client (it then computes the plan from the members itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from regent.ft.proto import torchft_pb2
from regent.ft.recovery import LINEAGE_KEY, QuorumPlan, QuorumResult, state_version

_quote = json.encoder.encode_basestring_ascii  # json.dumps's escaper for str (ensure_ascii, its default)


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int (the wire's lengths and tags; also used by the load
    simulator, `regent.ft.simulate`, which writes heartbeats by hand)."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Wire tags (field << 3 | LEN): LighthouseQuorumResponse.quorum = 1, Quorum.regent_compact = 1001.
_RESPONSE_QUORUM_TAG = varint(1 << 3 | 2)
_QUORUM_COMPACT_TAG = varint(1001 << 3 | 2)


def compact_share(plan: QuorumPlan, replica_id: str, world_size: int, init_sync: bool) -> torchft_pb2.RegentCompactQuorum:
    """`replica_id`'s share of `plan` for group ranks 0..world_size-1."""
    rank = plan.rank[replica_id]
    ranks = max(1, world_size)
    m = len(plan.max_ranks)
    msg = torchft_pb2.RegentCompactQuorum(
        replica_rank=rank, replica_world_size=len(plan.members), max_step=plan.max_step,
        max_lineage=plan.max_version[1], max_world_size=m, commit_failures=plan.commit_failures,
        members_digest=plan.digest,
        store_addresses=[plan.members[plan.max_ranks[j]].store_address for j in range(min(ranks, m))])
    max_index = plan.max_index(rank)
    if max_index is not None:
        msg.max_replica_rank = max_index
    steps = [plan.recovery(rank, g, init_sync) for g in range(ranks)]
    if any(src is not None or dsts for src, dsts in steps):
        for src, dsts in steps:
            entry = msg.recovery.add(dst_ranks=dsts)
            if src is not None:
                entry.src_rank = src
                entry.src_address = plan.members[src].address
                entry.src_replica_id = plan.ids[src]
    return msg


def encode_compact_response(common: bytes, share: torchft_pb2.RegentCompactQuorum | bytes) -> bytes:
    """A serialized `LighthouseQuorumResponse` whose quorum is `common` (a serialized `Quorum` without members:
    id, created, watermark; encoded once per round) plus `share` (or its serialized bytes): protobuf merges
    concatenated fields, so only the share is encoded per member."""
    body = share if type(share) is bytes else share.SerializeToString()
    quorum = common + _QUORUM_COMPACT_TAG + varint(len(body)) + body
    return _RESPONSE_QUORUM_TAG + varint(len(quorum)) + quorum


# RegentCompactQuorum's per-member scalar fields, as protobuf encodes them (varint fields 1 and 6)
_RANK_TAG = varint(1 << 3)
_MAX_RANK_TAG = varint(6 << 3)


def plan_entry(member: Any) -> bytes:
    """One member's entry in a round's plan (`encode_plan`): what the recovery rules read (id, addresses, step,
    lineage, commit failures), as JSON. A front end encodes it once per join (`regent.ft.joins`), so the owner's
    plan is a join of these bytes."""
    data = member.data
    lineage = data.get(LINEAGE_KEY, 0) if type(data) is dict else 0
    if type(lineage) is not int:  # the rare odd value: `state_version`'s reading of it
        lineage = state_version(member)[1]
    rid, address, store, step, failures = (member.replica_id, member.address, member.store_address, member.step,
                                           member.commit_failures)
    if type(rid) is str and type(address) is str and type(store) is str and type(step) is int \
            and type(failures) is int:
        # What json.dumps writes for these types (its own C string escaper, ints in decimal), at a third of the
        # cost: a front end makes one per join (issue 37).
        return (f"[{_quote(rid)},{_quote(address)},{_quote(store)},{step},{lineage},{failures}]").encode()
    return json.dumps([rid, address, store, step, lineage, failures], separators=(",", ":")).encode()


def encode_plan(quorum_id: int, participants: list[Any], committed: torchft_pb2.RegentCommitted,
                created: Timestamp) -> bytes:
    """What a front end needs to make a round's compact shares (`RoundShares.from_plan`), O(N) bytes once per
    round and front end: the head's fields and per member its `plan_entry` (a member that carries one already,
    `joins.Join`, is not encoded again). Not TorchFT's full answer: decoding that and every member's JSON
    `data` took a front end ~100 ms at 12,800 members, on the round's critical path."""
    head = json.dumps([int(quorum_id), [created.seconds, created.nanos],
                       [committed.step, committed.lineage, committed.resets]], separators=(",", ":")).encode()
    entries = [getattr(m, "plan_entry", None) or plan_entry(m) for m in participants]
    return head[:-1] + b",[" + b",".join(entries) + b"]]"


class PlanMember:
    """A member as `encode_plan` carries it: the attributes `QuorumPlan` reads."""

    __slots__ = ("replica_id", "address", "store_address", "step", "lineage", "commit_failures")

    def __init__(self, replica_id: str, address: str, store_address: str, step: int, lineage: int,
                 commit_failures: int) -> None:
        self.replica_id, self.address, self.store_address = replica_id, address, store_address
        self.step, self.lineage, self.commit_failures = step, lineage, commit_failures

    @property
    def data(self) -> dict[str, int]:
        return {LINEAGE_KEY: self.lineage}  # what `state_version` reads


class RoundShares:
    """One round's compact answers: the plan (`QuorumPlan`, built once) and the members-less head (`common`,
    encoded once), then one share per member asking. The Lighthouse makes one per issued quorum; each of its
    front ends (`regent.ft.frontends`) makes one from `encode_plan`'s bytes, which cross the link once per round,
    so the owner's work per compact join stays the membership update and the shares are computed on the front
    ends' cores. Both give the same bytes (tested)."""

    def __init__(self, quorum_id: int, participants: list[Any], committed: torchft_pb2.RegentCommitted,
                 created: Timestamp) -> None:
        self.quorum_id = int(quorum_id)
        self.plan = QuorumPlan(self.quorum_id, participants, committed.step)
        head = torchft_pb2.Quorum(quorum_id=self.quorum_id, regent_committed=committed)
        head.created.CopyFrom(created)
        self.common = head.SerializeToString()
        self._pieces: dict[int, tuple[bytes, bytes]] = {}  # group size -> `_share_pieces`

    @classmethod
    def from_plan(cls, payload: bytes) -> RoundShares:
        """From `encode_plan`'s bytes."""
        quorum_id, (seconds, nanos), (step, lineage, resets), members = json.loads(payload)
        return cls(quorum_id, [PlanMember(*m) for m in members],
                   torchft_pb2.RegentCommitted(step=step, lineage=lineage, resets=resets),
                   Timestamp(seconds=seconds, nanos=nanos))

    def answer(self, replica_id: str, world_size: int, init_sync: bool) -> bytes:
        """`replica_id`'s serialized compact `LighthouseQuorumResponse` (KeyError if it is not a member).

        In a round where nobody heals (no member behind, not a step-0 init_sync), every share is the same but for
        the member's rank and its index among the up-to-date: those two varints are written per member, the rest
        (fields 2-5 and 7-9) is encoded once per group size. The bytes are `compact_share`'s (tested): protobuf
        writes fields in number order, so the pieces concatenate to its encoding."""
        plan = self.plan
        if plan.recover_dst or (init_sync and plan.max_step == 0):
            return encode_compact_response(self.common, compact_share(plan, replica_id, world_size, init_sync))
        rank = plan.rank[replica_id]
        ranks = max(1, world_size)
        pieces = self._pieces.get(ranks)
        if pieces is None:
            pieces = self._pieces[ranks] = _share_pieces(plan, ranks)
        max_index = plan.max_index(rank)
        body = ((_RANK_TAG + varint(rank) if rank else b"") + pieces[0]
                + (_MAX_RANK_TAG + varint(max_index) if max_index is not None else b"") + pieces[1])
        return encode_compact_response(self.common, body)


def _share_pieces(plan: QuorumPlan, ranks: int) -> tuple[bytes, bytes]:
    """The parts of `compact_share`'s encoding that every member of a round without healing shares, for a group
    of `ranks` ranks: fields 2-5, then fields 7-9."""
    m = len(plan.max_ranks)
    head = torchft_pb2.RegentCompactQuorum(replica_world_size=len(plan.members), max_step=plan.max_step,
                                           max_lineage=plan.max_version[1], max_world_size=m)
    tail = torchft_pb2.RegentCompactQuorum(
        commit_failures=plan.commit_failures, members_digest=plan.digest,
        store_addresses=[plan.members[plan.max_ranks[j]].store_address for j in range(min(ranks, m))])
    return head.SerializeToString(), tail.SerializeToString()


@dataclass(frozen=True)
class CompactQuorum:
    """A member's share of a quorum, as its client decoded it; `result` is what `compute_quorum_results` gives
    from the full member list."""

    replica_id: str
    quorum_id: int
    committed_step: int
    init_sync: bool
    msg: torchft_pb2.RegentCompactQuorum

    @property
    def max_lineage(self) -> int:
        return int(self.msg.max_lineage)

    def result(self, replica_id: str, group_rank: int, init_sync: bool) -> QuorumResult:
        m = self.msg
        if replica_id != self.replica_id:
            raise ValueError(f"compact quorum answer is {self.replica_id!r}'s, not {replica_id!r}'s")
        if init_sync != self.init_sync and m.max_step == 0:
            raise ValueError(f"compact quorum answer was computed for init_sync={self.init_sync}, "
                             f"asked with init_sync={init_sync}: ask the Lighthouse with the rank's own init_sync")
        slot = group_rank % max(1, m.max_world_size)
        if group_rank < 0 or slot >= len(m.store_addresses):
            raise ValueError(f"compact quorum answer covers {len(m.store_addresses)} group ranks, not {group_rank}")
        store = m.store_addresses[slot]
        src: int | None = None
        src_address = src_id = ""
        dsts: list[int] = []
        if m.recovery:
            if group_rank >= len(m.recovery):
                raise ValueError(f"compact quorum answer covers {len(m.recovery)} group ranks, not {group_rank}")
            entry = m.recovery[group_rank]
            dsts = list(entry.dst_ranks)
            if entry.HasField("src_rank"):
                src, src_address, src_id = int(entry.src_rank), entry.src_address, entry.src_replica_id
        return QuorumResult(
            quorum_id=self.quorum_id, replica_rank=int(m.replica_rank), replica_world_size=int(m.replica_world_size),
            recover_src_manager_address=src_address, recover_src_replica_rank=src, recover_dst_replica_ranks=dsts,
            store_address=store, max_step=int(m.max_step),
            max_replica_rank=int(m.max_replica_rank) if m.HasField("max_replica_rank") else None,
            max_world_size=int(m.max_world_size), heal=src is not None, commit_failures=int(m.commit_failures),
            replica_ids=[], committed_step=self.committed_step, members_digest=bytes(m.members_digest),
            recover_src_replica_id=src_id)
