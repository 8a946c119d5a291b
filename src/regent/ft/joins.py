"""Pre-decoded Quorum joins: what a Lighthouse front end sends the quorum owner for each Quorum call.

Why: with front ends (`regent.ft.frontends`) the owner is the one part of a quorum round that stays on one core,
and its work per join was decoding: the protobuf request, a `QuorumMember` with its JSON `data`, the lineage and
the accepted-loss report read from it, the member's entry in the round's plan. A front end decodes the request
anyway (to refuse a bad one), so it does all of that on its own core and sends per batch one `K_JOINS` frame:
a JSON list of short records (replica id, step, lineage, commit failures, shrink_only, the accepted-loss report,
whether it asked for the compact answer, the call id, the proof's nonce), then each join's plan entry and raw
request. The owner parses one JSON per batch, makes each record a `Join` in C (no per-join `__init__`) and
applies the batch in one pass (`quorum.apply_joins`).

A `Join` is also the member it joins as: it has `QuorumMember`'s attributes, those the decision and the plan read
eagerly, the others (address, data, ...) parsed from its raw request when read (full answers, RegentHolders, the
dashboard). So a TorchFT client's full answer is the same bytes as when the owner parsed every request (the wire
form round-trips, unknown fields and the exact `data` string included).
"""

from __future__ import annotations

import json
import struct
from collections import namedtuple
from typing import Any

from regent.ft.compact import plan_entry
from regent.ft.proto import torchft_pb2
from regent.ft.recovery import accepted_loss, state_version
from regent.ft.types import QuorumMember, decode_member_data

_JSON_LEN = struct.Struct(">I")
_DECODE = json.JSONDecoder().decode
_FIELDS = ("replica_id", "step", "lineage", "commit_failures", "shrink_only", "accepted", "compact", "call_id", "ms",
           "key", "entry_at", "raw_at", "raw_end")


class Join(namedtuple("_JoinFields", (*_FIELDS, "blob"))):
    """One pre-decoded Quorum call, and the member it joins as. `accepted`: the watermark (step, lineage) it accepts
    losing, or None (`recovery.accepted_loss`); `compact`: it asked for the compact answer (its group size and
    init_sync stay with its front end); (`ms`, `key`): its job-secret proof's nonce, zeros without a secret;
    `blob`: its batch's plan entries and raw requests, at `entry_at` / `raw_at` / `raw_end`."""

    __slots__ = ()

    @property
    def nonce(self) -> tuple[int, int]:
        return self[8], self[9]

    @property
    def plan_entry(self) -> bytes:
        """Its entry in a round's plan (`compact.plan_entry`, made by its front end)."""
        return self[13][self[10]:self[11]]

    @property
    def raw(self) -> bytes:
        """Its serialized LighthouseQuorumRequest, as the client sent it."""
        return self[13][self[11]:self[12]]

    def to_proto(self) -> torchft_pb2.QuorumMember:
        """The requester exactly as the client sent it (a fresh message each call)."""
        return torchft_pb2.LighthouseQuorumRequest.FromString(self.raw).requester

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
        return f"Join(replica_id={self[0]!r}, step={self[1]}, lineage={self[2]}, call_id={self[7]})"


def join_record(call_id: int, nonce: tuple[int, int], request: torchft_pb2.LighthouseQuorumRequest,
                raw: bytes) -> tuple[list, bytes, bytes]:
    """A front end's record of one decoded Quorum call (`request`, parsed from `raw`): (the JSON record without
    its offsets, the member's plan entry, the raw request). The member is read with the functions the owner used
    (`state_version`, `accepted_loss`, `plan_entry`), so it decides the same."""
    member = _Read(request.requester)
    accepted = accepted_loss(member)
    record = [member.replica_id, member.step, state_version(member)[1], member.commit_failures,
              member.shrink_only, list(accepted) if accepted else None, request.HasField("regent_compact"),
              call_id, nonce[0], nonce[1]]
    return record, plan_entry(member), raw


class _Read:
    """A requester's fields as `QuorumMember.from_proto` reads them (the same values, `data` decoded by the same
    function), each read from the message once: what `join_record` needs of the member, without building a
    dataclass per join (half of its cost on a front end; issue 37)."""

    __slots__ = ("replica_id", "address", "store_address", "step", "shrink_only", "data", "commit_failures")

    def __init__(self, msg: torchft_pb2.QuorumMember) -> None:
        self.replica_id = rid = msg.replica_id
        self.address = msg.address
        self.store_address = msg.store_address
        self.step = msg.step
        self.shrink_only = msg.shrink_only
        self.data = decode_member_data(msg.data, rid)
        self.commit_failures = msg.commit_failures


def encode_joins(records: list[tuple[list, bytes, bytes]]) -> bytes:
    """A `K_JOINS` payload: the JSON records' length, the records (each with its offsets in the blob), then the
    blob: each join's plan entry and raw request."""
    blob: list[bytes] = []
    rows = []
    at = 0
    for record, entry, raw in records:
        raw_at = at + len(entry)
        at = raw_at + len(raw)
        rows.append([*record, raw_at - len(entry), raw_at, at])
        blob += (entry, raw)
    head = json.dumps(rows, separators=(",", ":")).encode()
    return _JSON_LEN.pack(len(head)) + head + b"".join(blob)


def decode_joins(payload: bytes) -> list[Join]:
    """`encode_joins`'s payload back into joins: one JSON parse per batch, each record made a `Join` in C
    (ValueError if the frame is malformed)."""
    (length,) = _JSON_LEN.unpack_from(payload)
    start = _JSON_LEN.size + length
    records = _DECODE(payload[_JSON_LEN.size:start].decode())  # ASCII (`encode_joins`): no encoding sniffing
    blob = payload[start:]
    if not isinstance(records, list) or (records and (set(map(len, records)) != {len(_FIELDS)}
                                                      or records[-1][-1] != len(blob))):
        raise ValueError(f"a joins frame of {len(payload)} bytes does not hold its records")
    for record in records:
        record.append(blob)
    new = tuple.__new__
    return [new(Join, record) for record in records]
