"""Plain value types for Lighthouse quorums, and their conversion to and from the wire messages.

Callers (the Manager, tests, dashboards) work with these dataclasses, never with protobuf objects, so the
wire format stays an implementation detail of the client and the server.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from regent.ft.proto import torchft_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as it asked to join a quorum.

    `step` is the version of the replica's state: members at the same step hold identical weights.
    `data` is free-form user JSON (sent as a JSON string on the wire, like TorchFT).

    Args:
        replica_id: the group's id.
        address: its ManagerServer's address.
        store_address: its TCPStore's address.
        step: the version of its state.
        world_size: its number of ranks.
        shrink_only: whether it only accepts a quorum without new members.
        data: free-form user JSON.
        commit_failures: how many commits in a row it has failed.
    """

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    commit_failures: int = 0

    def to_proto(self) -> torchft_pb2.QuorumMember:
        return torchft_pb2.QuorumMember(
            replica_id=self.replica_id,
            address=self.address,
            store_address=self.store_address,
            step=self.step,
            world_size=self.world_size,
            shrink_only=self.shrink_only,
            data=json.dumps(self.data) if self.data else "",
            commit_failures=self.commit_failures,
        )

    @classmethod
    def from_proto(cls, msg: torchft_pb2.QuorumMember) -> QuorumMember:
        return cls(
            replica_id=msg.replica_id,
            address=msg.address,
            store_address=msg.store_address,
            step=msg.step,
            world_size=msg.world_size,
            shrink_only=msg.shrink_only,
            data=decode_member_data(msg.data, msg.replica_id),
            commit_failures=msg.commit_failures,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "address": self.address,
            "store_address": self.store_address,
            "step": self.step,
            "world_size": self.world_size,
            "shrink_only": self.shrink_only,
            "data": self.data,
            "commit_failures": self.commit_failures,
        }


@dataclass(frozen=True)
class Quorum:
    """A membership decision of the Lighthouse. Participants are sorted by replica id.

    Args:
        quorum_id: increases with each new membership.
        participants: the members, sorted by replica id.
        created: when the Lighthouse formed it.
        committed_step: (Regent) the run's committed watermark when it was issued (0 from TorchFT's).
    """

    quorum_id: int
    participants: list[QuorumMember]
    created: datetime
    # Regent extension: the run's committed watermark when the quorum was issued (0 from a TorchFT Lighthouse)
    committed_step: int = 0
    # Regent extension: this member's share when the Lighthouse answered compactly (`regent.ft.compact`); then
    # `participants` is empty
    compact: Any = None

    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.participants]

    def to_proto(self) -> torchft_pb2.Quorum:
        msg = torchft_pb2.Quorum(
            quorum_id=self.quorum_id, participants=[m.to_proto() for m in self.participants]
        )
        msg.created.FromDatetime(self.created.astimezone(timezone.utc))
        return msg

    @classmethod
    def from_proto(cls, msg: torchft_pb2.Quorum) -> Quorum:
        created = (
            msg.created.ToDatetime(tzinfo=timezone.utc)
            if msg.HasField("created")
            else datetime.fromtimestamp(0, tz=timezone.utc)
        )
        return cls(
            quorum_id=msg.quorum_id,
            participants=[QuorumMember.from_proto(m) for m in msg.participants],
            created=created,
            committed_step=msg.regent_committed.step if msg.HasField("regent_committed") else 0,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "quorum_id": self.quorum_id,
            "participants": [m.to_json() for m in self.participants],
            "created": self.created.isoformat(),
        }


def decode_member_data(raw: str, replica_id: str = "") -> dict[str, Any]:
    """Decode `QuorumMember.data`. Non-JSON or non-object payloads are kept under "raw" rather than
    failing the quorum, because the field is user-owned and another client may put anything there."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        logger.warning("replica %s sent non-JSON quorum data; kept under 'raw'", replica_id)
        return {"raw": raw}
    return value if isinstance(value, dict) else {"raw": value}


def to_seconds(value: timedelta | float | int) -> float:
    """Accept TorchFT-style `timedelta` timeouts as well as plain seconds."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)
