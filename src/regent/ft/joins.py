"""Pre-decoded Quorum joins: what a Lighthouse front end sends the quorum owner for each Quorum call.

Why: with front ends (`regent.ft.frontends`) the owner is the one part of a quorum round that stays on one core,
and its work per join was decoding: the protobuf request, a `QuorumMember` with its JSON `data`, the lineage and
the accepted-loss report read from it, the member's entry in the round's plan. A front end decodes the request
anyway (to refuse a bad one), so it does all of that on its own core and sends per batch one `K_JOINS` frame:
a JSON list of short records (call id, the proof's nonce, replica id, step, lineage, commit failures,
shrink_only, the accepted-loss report, whether it asked for the compact answer), then each join's plan entry and raw request. The owner
parses one JSON per batch and applies the batch in one pass (`quorum.apply_joins`).

A member stays in its request's bytes (`JoinedMember.raw`): its full form (TorchFT's answer, RegentHolders, the
dashboard) is parsed from them only when asked, so a TorchFT client's full answer is the same bytes as when the
owner parsed every request (the wire form round-trips, unknown fields and the exact `data` string included).
"""

from __future__ import annotations

import json
import struct
from collections import namedtuple
from typing import Any, NamedTuple

from regent.ft.compact import plan_entry
from regent.ft.proto import torchft_pb2
from regent.ft.recovery import accepted_loss, state_version
from regent.ft.types import QuorumMember, decode_member_data

_JSON_LEN = struct.Struct(">I")


class JoinedMember(namedtuple("_Fields", "replica_id step lineage commit_failures shrink_only plan_entry raw")):
    """A member as a front end pre-decoded it: what the decision and the plan read, eagerly (`replica_id`,
    `step`, `commit_failures`, `shrink_only`, `lineage`, `plan_entry`); the rest of `QuorumMember`'s attributes
    parsed from the raw request when read (rare: full answers, the dashboard). A tuple: built in C, no per-join
    `__init__`."""

    __slots__ = ()

    def to_proto(self) -> torchft_pb2.QuorumMember:
        """The requester exactly as the client sent it (a fresh message each call)."""
        return torchft_pb2.LighthouseQuorumRequest.FromString(self[6]).requester

    @property
    def address(self) -> str:
        return self.to_proto().address

    @property
    def store_address(self) -> str:
        return self.to_proto().store_address

    @property
    def world_size(self) -> int:
        return self.to_proto().world_size

    @property
    def data(self) -> dict[str, Any]:
        return decode_member_data(self.to_proto().data, self[0])

    def to_json(self) -> dict[str, Any]:
        return QuorumMember.from_proto(self.to_proto()).to_json()

    def __repr__(self) -> str:
        return f"JoinedMember(replica_id={self[0]!r}, step={self[1]}, lineage={self[2]})"


class Join(NamedTuple):
    """One pre-decoded Quorum call, as the owner reads it from a `K_JOINS` frame."""

    call_id: int
    nonce: tuple[int, int]  # the job-secret proof's (ms, key) for `CallVerifier.spend`; (0, 0) without a secret
    member: JoinedMember
    accepted: tuple[int, int] | None  # the watermark the member accepts losing (`recovery.accepted_loss`)
    compact: bool  # asked for the compact answer (its group size and init_sync stay with the front end)


def join_record(call_id: int, nonce: tuple[int, int], request: torchft_pb2.LighthouseQuorumRequest,
                raw: bytes) -> tuple[list, bytes, bytes]:
    """A front end's record of one decoded Quorum call (`request`, parsed from `raw`): (the JSON record, the
    member's plan entry, the raw request). Read with the same functions as the owner would read the member."""
    member = QuorumMember.from_proto(request.requester)
    accepted = accepted_loss(member)
    entry = plan_entry(member)
    record = [call_id, nonce[0], nonce[1], member.replica_id, member.step, state_version(member)[1],
              member.commit_failures, int(member.shrink_only), list(accepted) if accepted else 0,
              int(request.HasField("regent_compact")),
              len(entry), len(raw)]
    return record, entry, raw


def encode_joins(records: list[tuple[list, bytes, bytes]]) -> bytes:
    """A `K_JOINS` payload: the JSON records' length, the records, then each join's plan entry and raw request."""
    head = json.dumps([r for r, _, _ in records], separators=(",", ":")).encode()
    parts = [_JSON_LEN.pack(len(head)), head]
    for _, entry, raw in records:
        parts.append(entry)
        parts.append(raw)
    return b"".join(parts)


def decode_joins(payload: bytes) -> list[Join]:
    """`encode_joins`'s payload back into joins: one JSON parse per batch, then slices (ValueError if malformed)."""
    (length,) = _JSON_LEN.unpack_from(payload)
    pos = _JSON_LEN.size + length
    records = json.loads(payload[_JSON_LEN.size:pos])
    out = []
    new = tuple.__new__
    for call_id, ms, key, rid, step, lineage, failures, shrink, accepted, compact, entry_len, raw_len in records:
        end = pos + entry_len
        entry = payload[pos:end]
        pos = end + raw_len
        member = new(JoinedMember, (rid, step, lineage, failures, bool(shrink), entry, payload[end:pos]))
        out.append(new(Join, (call_id, (ms, key), member, (accepted[0], accepted[1]) if accepted else None,
                              compact == 1)))
    if pos != len(payload):
        raise ValueError(f"a joins frame of {len(payload)} bytes held {pos}")
    return out
