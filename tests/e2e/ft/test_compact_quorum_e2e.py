"""The compact quorum answer through a real Lighthouse with front-end processes: the cases that start processes
(the others: tests/unit/ft/test_compact_quorum.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from regent.ft.compact import CompactQuorum, RoundShares
from regent.ft.lighthouse import LighthouseServer
from regent.ft.proto import torchft_pb2
from regent.ft.recovery import compute_quorum_results
from regent.ft.types import Quorum, QuorumMember


def _ask_raw(address: str, requests: list[torchft_pb2.LighthouseQuorumRequest]) -> list[bytes]:
    """Send Quorum calls at once and return the raw answer bytes (no decoding on the way)."""
    target = address.replace("http://", "")
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/torchft.LighthouseService/Quorum",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda b: b)
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda r: call(r, timeout=20), requests))


@pytest.mark.parametrize("frontends", [0, 2])
def test_lighthouse_answers_torchft_requests_in_full_and_regent_requests_compactly(frontends: int) -> None:
    """The same bytes from the single process and from front ends (which compute the share themselves)."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=60000, quorum_tick_ms=20,
                              secret=b"", frontends=frontends)
    try:
        members = [torchft_pb2.QuorumMember(replica_id=f"r{i}:1", address=f"mgr{i}", store_address=f"st{i}",
                                            step=[3, 5, 5][i], world_size=2) for i in range(3)]
        requests = [torchft_pb2.LighthouseQuorumRequest(requester=m) for m in members]
        requests[2].regent_compact.init_sync = True
        requests[2].regent_compact.SetInParent()
        raw = _ask_raw(server.address(), requests)
        full = torchft_pb2.LighthouseQuorumResponse.FromString(raw[0])
        # byte for byte TorchFT's answer (plus the watermark field TorchFT skips), the same for both full askers
        assert raw[0] == raw[1]
        expected = torchft_pb2.LighthouseQuorumResponse(quorum=torchft_pb2.Quorum(
            quorum_id=full.quorum.quorum_id, participants=members, created=full.quorum.created,
            regent_committed=full.quorum.regent_committed))
        assert raw[0] == expected.SerializeToString()
        assert not full.quorum.HasField("regent_compact")
        compact = torchft_pb2.LighthouseQuorumResponse.FromString(raw[2]).quorum
        assert compact.HasField("regent_compact") and not compact.participants
        assert len(raw[2]) < len(raw[0])
        # the front ends' shares are the bytes the owner makes from the members (the full answer's)
        q = full.quorum
        assert raw[2] == RoundShares(q.quorum_id, [QuorumMember.from_proto(m) for m in q.participants],
                                     q.regent_committed, q.created).answer("r2:1", 2, True)
        quorum = Quorum.from_proto(full.quorum)
        share = CompactQuorum("r2:1", compact.quorum_id, compact.regent_committed.step, True, compact.regent_compact)
        for g in range(2):
            want = compute_quorum_results("r2:1", g, quorum, True)
            got = share.result("r2:1", g, True)
            assert got == type(want)(**{**want.__dict__, "replica_ids": []})
        assert share.result("r2:1", 1, True).recover_dst_replica_ranks == [0]  # r0 (step 3) heals from r2 at rank 1
    finally:
        server.shutdown()
