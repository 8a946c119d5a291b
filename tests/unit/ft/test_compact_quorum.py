"""The compact quorum answer (regent.ft.compact): the same recovery plan as the full member list gives, for every
member and group rank; negotiated, so that a client that does not ask (TorchFT's) gets the full answer, and a
Lighthouse that does not know it (TorchFT's) answers in full to a Regent client that asks."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from types import SimpleNamespace

import grpc
import pytest

from regent.ft.compact import CompactQuorum, RoundShares, compact_share, encode_plan
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.recovery import LINEAGE_KEY, QuorumPlan, compute_quorum_results, state_version
from regent.ft.types import Quorum, QuorumMember


def reference_results(replica_id: str, group_rank: int, participants: list, init_sync: bool) -> dict:
    """TorchFT's rules written out the plain O(N) way per member (the oracle for `QuorumPlan`)."""
    members = sorted(participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in members]
    rank = ids.index(replica_id)
    top = max(state_version(m) for m in members)
    at_max = [m for m in members if state_version(m) == top]
    primary = at_max[group_rank % len(at_max)]
    force = init_sync and top[0] == 0
    dst = [i for i, m in enumerate(members)
           if state_version(m) != top or (force and m.replica_id != primary.replica_id)]
    up = [i for i in range(len(members)) if i not in dst]
    src_of = {d: up[(i + group_rank) % len(up)] for i, d in enumerate(dst)}
    src = src_of.get(rank)
    return {"replica_rank": rank, "replica_world_size": len(members), "recover_src_replica_rank": src,
            "recover_src_manager_address": members[src].address if src is not None else "",
            "recover_dst_replica_ranks": sorted(d for d, s in src_of.items() if s == rank),
            "store_address": primary.store_address, "max_step": top[0],
            "max_replica_rank": [m.replica_id for m in at_max].index(replica_id)
            if replica_id in [m.replica_id for m in at_max] else None,
            "max_world_size": len(at_max), "heal": src is not None,
            "commit_failures": max(m.commit_failures for m in members)}


def random_members(rng: random.Random, n: int) -> list[QuorumMember]:
    steps = rng.choice([[0], [0, 1], [5], [4, 5], [3, 4, 5]])
    return [QuorumMember(replica_id=f"g{i:03d}:{rng.randrange(1000)}", address=f"mgr{i}", store_address=f"st{i}",
                         step=rng.choice(steps), world_size=rng.choice([1, 2, 4]),
                         data={LINEAGE_KEY: rng.choice([0, 0, 1])}, commit_failures=rng.choice([0, 0, 0, 1]))
            for i in range(n)]


def test_plan_and_compact_share_match_the_rules_for_every_member_and_group_rank() -> None:
    rng = random.Random(0)
    for trial in range(60):
        members = random_members(rng, rng.randint(1, 13))
        quorum = Quorum(quorum_id=trial + 1, participants=members, created=datetime.now(timezone.utc))
        plan = QuorumPlan(quorum.quorum_id, members)
        for init_sync in (True, False):
            for m in members:
                share = torchft_pb2.RegentCompactQuorum.FromString(
                    compact_share(plan, m.replica_id, 4, init_sync).SerializeToString())
                decoded = CompactQuorum(m.replica_id, quorum.quorum_id, 0, init_sync, share)
                for g in range(4):
                    want = reference_results(m.replica_id, g, members, init_sync)
                    full = compute_quorum_results(m.replica_id, g, quorum, init_sync)
                    small = decoded.result(m.replica_id, g, init_sync)
                    for r in (full, small):
                        assert {k: getattr(r, k) for k in want} == want, (trial, m.replica_id, g, init_sync)
                    assert small.members_digest == full.members_digest == plan.digest
                    assert small.recover_src_replica_id == full.recover_src_replica_id
                    assert small.replica_ids == [] and full.replica_ids == sorted(x.replica_id for x in members)
                    assert small.recover_src_replica_id == (
                        full.replica_ids[full.recover_src_replica_rank] if full.heal else "")


def test_round_shares_from_the_plan_match_the_owners_for_every_member() -> None:
    """A front end builds its shares from the round's plan (`encode_plan`); the owner from its own members: the
    same bytes for every member, group size and init_sync (incl. lineage, odd `data`, healers and step 0)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    rng = random.Random(1)
    for trial in range(30):
        members = random_members(rng, rng.randint(1, 13))
        if trial % 5 == 0:  # user data beside the lineage, and a lineage that is not an int (counts as 0)
            members[0] = QuorumMember(**{**members[0].__dict__, "data": {LINEAGE_KEY: "x", "user": [1, 2]}})
        committed = torchft_pb2.RegentCommitted(step=rng.choice([0, 4, 5]), lineage=rng.randrange(3), resets=1)
        created = Timestamp(seconds=1_700_000_000 + trial, nanos=rng.randrange(10**9))
        owner = RoundShares(trial + 1, members, committed, created)
        front = RoundShares.from_plan(encode_plan(trial + 1, members, committed, created))
        for m in members:
            for world_size, init_sync in ((1, False), (4, True), (m.world_size, rng.random() < 0.5)):
                assert front.answer(m.replica_id, world_size, init_sync) == owner.answer(
                    m.replica_id, world_size, init_sync)
        with pytest.raises(KeyError):
            front.answer("not-a-member", 1, False)


def test_round_shares_answer_is_compact_share_byte_for_byte() -> None:
    """`RoundShares.answer` writes a round without healers from pieces encoded once per group size; the bytes
    must be `compact_share`'s encoding for every member, group size and init_sync (rounds with healers, step 0,
    rank 0, up-to-date and behind members, odd store addresses)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from regent.ft.compact import encode_compact_response

    rng = random.Random(7)
    quiet = 0
    for trial in range(200):
        members = random_members(rng, rng.randint(1, 13))
        if trial % 3 == 0:  # everyone at one version: the pieces' path
            members = [QuorumMember(**{**m.__dict__, "step": 6, "data": {LINEAGE_KEY: 1}}) for m in members]
        if trial % 7 == 0:
            members[0] = QuorumMember(**{**members[0].__dict__, "store_address": "é\"x\u0001"})
        committed = torchft_pb2.RegentCommitted(step=rng.choice([0, 5]), lineage=rng.randrange(3), resets=0)
        shares = RoundShares(trial + 1, members, committed, Timestamp(seconds=trial, nanos=5))
        quiet += not shares.plan.recover_dst
        for m in members:
            for world_size in (0, 1, 3, 8, 20):
                for init_sync in (False, True):
                    want = encode_compact_response(shares.common,
                                                   compact_share(shares.plan, m.replica_id, world_size, init_sync))
                    assert shares.answer(m.replica_id, world_size, init_sync) == want, (trial, m.replica_id)
    assert quiet > 60  # the pieces' path was taken


def test_digest_follows_membership_only() -> None:
    a = QuorumPlan(1, [SimpleNamespace(replica_id=r, step=1, data={}, commit_failures=0) for r in ("x:1", "y:1")])
    b = QuorumPlan(2, [SimpleNamespace(replica_id=r, step=9, data={}, commit_failures=0) for r in ("y:1", "x:1")])
    c = QuorumPlan(1, [SimpleNamespace(replica_id=r, step=1, data={}, commit_failures=0) for r in ("x:1", "y:2")])
    assert a.digest == b.digest != c.digest


def test_regent_client_asks_compact_and_falls_back_against_torchft() -> None:
    torchft_rs = pytest.importorskip("torchft._torchft")
    regent = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60000, quorum_tick_ms=20,
                              secret=b"")
    theirs = torchft_rs.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60000,
                                         quorum_tick_ms=20, heartbeat_timeout_ms=5000)
    try:
        for address, compact_expected in ((regent.address(), True),
                                          ("http://127.0.0.1:" + theirs.address().rsplit(":", 1)[1], False)):
            client = LighthouseClient(address, connect_timeout=10, secret=b"")
            with ThreadPoolExecutor(2) as pool:
                fa = pool.submit(client.quorum, "a:1", 20.0, address="mgr-a", store_address="sa", step=4,
                                 world_size=2, compact=False)
                fb = pool.submit(client.quorum, "b:1", 20.0, address="mgr-b", store_address="sb", step=2,
                                 world_size=2)
                qa, qb = fa.result(), fb.result()
            assert (qa.compact is not None) == compact_expected
            assert qb.compact is None and qb.replica_ids() == ["a:1", "b:1"]
            for g in range(2):
                got = compute_quorum_results("a:1", g, qa, False)
                want = compute_quorum_results("a:1", g, qb, False)
                assert got.recover_dst_replica_ranks == want.recover_dst_replica_ranks == [1]
                assert (got.store_address, got.replica_rank, got.members_digest) == (
                    want.store_address, want.replica_rank, want.members_digest)
            client.close()
    finally:
        regent.shutdown()
        theirs.shutdown()


def test_lighthouse_service_stub_still_decodes_compact_answers() -> None:
    """grpc's generated stub (what Regent's client uses) parses a compact answer as a normal response."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20, secret=b"")
    try:
        with grpc.insecure_channel(server.address().replace("http://", "")) as channel:
            stub = torchft_pb2_grpc.LighthouseServiceStub(channel)
            request = torchft_pb2.LighthouseQuorumRequest(
                requester=torchft_pb2.QuorumMember(replica_id="solo:1", store_address="s", world_size=3))
            request.regent_compact.SetInParent()
            reply = stub.Quorum(request, timeout=20)
        share = reply.quorum.regent_compact
        assert (share.replica_rank, share.replica_world_size, list(share.store_addresses)) == (0, 1, ["s"])
        assert not share.recovery  # step 0 but alone: nobody to heal
    finally:
        server.shutdown()
