"""Pre-decoded Quorum joins (`regent.ft.joins`, `quorum.apply_joins`): a front end's records read back as the
members the owner would have parsed, the batched bookkeeping equals one join at a time, and the plan made from
the front ends' entries is the plan made from the members. Pure: no process, no socket."""

from __future__ import annotations

import json
import random
from datetime import datetime, timezone

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from regent.ft.compact import RoundShares, encode_plan
from regent.ft.joins import Join, decode_joins, encode_joins, join_record
from regent.ft.lighthouse import decode_quorum_request
from regent.ft.proto import torchft_pb2
from regent.ft.quorum import (
    LighthouseState,
    Participant,
    Watermark,
    apply_joins,
    note_committed,
    note_heartbeat,
)
from regent.ft.recovery import ACCEPTED_LOSS_KEY, LINEAGE_KEY, accepted_loss, state_version
from regent.ft.rpc_security import CallVerifier
from regent.ft.types import QuorumMember, decode_member_data

ODD_DATA = ["", "not json", "[1, 2]", json.dumps({LINEAGE_KEY: "7"}), json.dumps({LINEAGE_KEY: True}),
            json.dumps({ACCEPTED_LOSS_KEY: [5, 1], LINEAGE_KEY: 2}), json.dumps({ACCEPTED_LOSS_KEY: [5, "x"]}),
            json.dumps({"user": {"nested": ["é", 1.5]}, LINEAGE_KEY: 3})]


def random_request(rng: random.Random, i: int) -> tuple[torchft_pb2.LighthouseQuorumRequest, bytes]:
    member = torchft_pb2.QuorumMember(
        replica_id=rng.choice([f"g{i}:{rng.randrange(99)}", f"plain{i}"]), address=f"http://h{i}:1",
        store_address=f"h{i}:2", step=rng.choice([0, 3, 5]), world_size=rng.choice([1, 8]),
        shrink_only=rng.random() < 0.2, data=rng.choice(ODD_DATA), commit_failures=rng.choice([0, 0, 2]))
    request = torchft_pb2.LighthouseQuorumRequest(requester=member)
    if rng.random() < 0.5:
        request.regent_compact.init_sync = rng.random() < 0.5
    return request, request.SerializeToString()


def random_joins(rng: random.Random, n: int, first_call: int = 1) -> tuple[list[Join], list[bytes]]:
    raws, records = [], []
    for i in range(n):
        request, raw = random_request(rng, i)
        raws.append(raw)
        records.append(join_record(first_call + i, (rng.randrange(1 << 40), rng.randrange(1 << 63)),
                                   decode_quorum_request(raw), raw))
    return decode_joins(encode_joins(records)), raws


def test_a_join_reads_as_the_member_the_owner_would_parse() -> None:
    rng = random.Random(0)
    for _ in range(20):
        joins, raws = random_joins(rng, rng.randint(1, 9), first_call=100)
        for i, (join, raw) in enumerate(zip(joins, raws)):
            request = torchft_pb2.LighthouseQuorumRequest.FromString(raw)
            member = QuorumMember.from_proto(request.requester)
            assert join.call_id == 100 + i and join.raw == raw
            assert join.to_proto() == request.requester
            for name in ("replica_id", "address", "store_address", "step", "world_size", "shrink_only", "data",
                         "commit_failures"):
                assert getattr(join, name) == getattr(member, name), name
            assert (join.step, join.lineage) == state_version(member)
            assert join.accepted == (list(accepted_loss(member)) if accepted_loss(member) else None)
            assert join.compact == request.HasField("regent_compact")
            assert join.to_json() == member.to_json()


def test_a_plan_entry_is_what_json_dumps_writes() -> None:
    """`compact.plan_entry` writes the JSON itself for the usual types; the bytes must be json.dumps's (odd
    strings: quotes, backslashes, control and non-ASCII characters; big and negative ints; odd lineages)."""
    from regent.ft.compact import plan_entry

    rng = random.Random(9)
    odd = ["", "a\"b", "back\\slash", "\u0000\n\t", "é", "日本", "\ud83d\ude00", "x" * 300]
    for i in range(500):
        member = QuorumMember(replica_id=rng.choice(odd) + str(i), address=rng.choice(odd),
                              store_address=rng.choice(odd), step=rng.choice([0, 5, 2**62, -3]),
                              data=decode_member_data(rng.choice(ODD_DATA)) if rng.random() < 0.5 else {LINEAGE_KEY: i},
                              commit_failures=rng.choice([0, 7]))
        lineage = state_version(member)[1]
        assert plan_entry(member) == json.dumps([member.replica_id, member.address, member.store_address,
                                                 member.step, lineage, member.commit_failures],
                                                separators=(",", ":")).encode(), i


def test_a_malformed_joins_frame_is_refused() -> None:
    rng = random.Random(1)
    records = [join_record(i, (0, 0), *(lambda r: (decode_quorum_request(r[1]), r[1]))(random_request(rng, i)))
               for i in range(3)]
    payload = encode_joins(records)
    with pytest.raises(ValueError):
        decode_joins(payload + b"x")  # the blob longer than the records say
    with pytest.raises(ValueError):
        decode_joins(payload[:-1])
    head = json.dumps([[1, 2]]).encode()
    with pytest.raises(ValueError):
        decode_joins(len(head).to_bytes(4, "big") + head)  # records of the wrong shape


def one_at_a_time(state: LighthouseState, joins: list[Join], now: float) -> list[Participant]:
    """What the owner did per call before batches: heartbeat, committed report, join (`_enter`)."""
    out = []
    for join in joins:
        note_heartbeat(state, join.replica_id, now)
        note_committed(state, join.replica_id, join.step, join.lineage,
                       tuple(join.accepted) if join.accepted else None)
        state.participants[join.replica_id] = Participant(now, join)
        out.append(state.participants[join.replica_id])
    return out


def test_a_batch_of_joins_leaves_the_state_one_join_at_a_time_leaves() -> None:
    rng = random.Random(2)
    for trial in range(200):
        joins, _ = random_joins(rng, rng.randint(1, 12))
        a, b = LighthouseState(), LighthouseState()
        watermark = Watermark(rng.choice([0, 3, 5]), rng.randrange(3), 0)
        for s in (a, b):  # a table already holding other incarnations, reports and a watermark
            s.watermark = watermark
            for g in range(4):
                note_heartbeat(s, f"g{g}:old", 1.0)
                s.committed[f"g{g}:old"] = (3, 0)
        applied = apply_joins(a, joins, 2.0)
        expected = one_at_a_time(b, joins, 2.0)
        assert (a.heartbeats, a.incarnations, a.committed, a.watermark) == \
            (b.heartbeats, b.incarnations, b.committed, b.watermark), trial
        assert [p.member for p in applied.participants] == [p.member for p in expected] == joins
        assert {r: (p.joined, p.member) for r, p in a.participants.items()} == \
            {r: (p.joined, p.member) for r, p in b.participants.items()}
        retired = {j.replica_id for j in joins if j.replica_id.rpartition(":")[0] in {f"g{g}" for g in range(4)}}
        assert set(applied.retired) <= retired
        assert all(old not in a.heartbeats for olds in applied.retired.values() for old in olds)


def test_a_batch_reports_each_watermark_move_with_the_watermark_before() -> None:
    state = LighthouseState(watermark=Watermark(5, 2, 0))
    rng = random.Random(3)
    joins, _ = random_joins(rng, 1)
    raw = torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(
        replica_id="r:1", step=3, data=json.dumps({ACCEPTED_LOSS_KEY: [5, 2], LINEAGE_KEY: 1}))).SerializeToString()
    higher = torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(
        replica_id="q:1", step=9)).SerializeToString()
    batch = decode_joins(encode_joins([join_record(1, (0, 0), decode_quorum_request(raw), raw),
                                       join_record(2, (0, 0), decode_quorum_request(higher), higher)]))
    applied = apply_joins(state, batch, 1.0)
    # the reset (to step 3, counted), then the rise to step 9
    assert applied.watermark_moves == [("r:1", Watermark(5, 2, 0)), ("q:1", Watermark(3, 1, 1, 2))]
    assert state.watermark == Watermark(9, 0, 1, 2)


def test_the_plan_from_front_end_entries_is_the_plan_from_the_members() -> None:
    rng = random.Random(4)
    for trial in range(30):
        joins, raws = random_joins(rng, rng.randint(1, 10))
        joins = list({j.replica_id: j for j in joins}.values())  # one join per member
        members = [QuorumMember.from_proto(j.to_proto()) for j in joins]
        committed = torchft_pb2.RegentCommitted(step=5, lineage=1, resets=0)
        created = Timestamp()
        created.FromDatetime(datetime(2026, 12, 5, tzinfo=timezone.utc))
        assert encode_plan(trial, joins, committed, created) == encode_plan(trial, members, committed, created)
        front = RoundShares.from_plan(encode_plan(trial, joins, committed, created))
        owner = RoundShares(trial, members, committed, created)
        for m in members:
            assert front.answer(m.replica_id, 2, True) == owner.answer(m.replica_id, 2, True)


def test_a_batch_of_nonces_is_spent_as_one_at_a_time() -> None:
    batch, single = CallVerifier(b"k" * 32, "test"), CallVerifier(b"k" * 32, "test")
    now = 1_800_000_000.0
    nonces = [(int(now * 1000), key) for key in (1, 2, 1, 3, 2)]
    assert batch.spend_many(nonces, now) == [single.spend(ms, key, now) for ms, key in nonces]
    assert batch.spend_many(nonces, now) == [single.spend(ms, key, now) for ms, key in nonces]  # all replays now
    assert batch.accepted == single.accepted == 3


def test_an_owner_fed_pre_decoded_joins_shows_and_names_members_as_one_parsing_requests() -> None:
    """The same Quorum requests into a Lighthouse's own path (`_quorum`: parsed in the owner) and as a front end's
    K_JOINS frames (through a real owner link handler): the same waiting members on the dashboard (`to_json` of a
    `Join` parses its raw request) and byte-identical RegentHolders answers (wire forms from the raw requests)."""

    from regent.ft.frontends import K_JOINS, FrontendPool, _OwnerLink, frame
    from regent.ft.lighthouse import LighthouseServer

    rng = random.Random(5)
    requests = []
    for i in range(6):
        request, raw = random_request(rng, i)
        request.requester.replica_id = f"w{i}:1"
        request.requester.step = 5
        request.requester.data = json.dumps({LINEAGE_KEY: 2, "user": i})
        requests.append((request, request.SerializeToString()))
    direct = LighthouseServer(min_replicas=99, secret=b"", frontends=0)
    fed = LighthouseServer(min_replicas=99, secret=b"", frontends=0)
    try:
        async def ask_directly() -> None:
            for request, _ in requests:
                direct._quorum(request.requester, None)

        async def feed() -> None:
            link = _OwnerLink(FrontendPool(fed, 1, "127.0.0.1", 0, {}), 0)
            records = [join_record(i + 1, (0, 0), decode_quorum_request(raw), raw)
                       for i, (_, raw) in enumerate(requests)]
            link.data_received(frame(K_JOINS, encode_joins(records[:4])) + frame(K_JOINS, encode_joins(records[4:])))
            assert len(link.joins) == len(requests)

        direct._call_in_loop(ask_directly()).result(timeout=10)
        fed._call_in_loop(feed()).result(timeout=10)

        def waiting(server: LighthouseServer) -> list[dict]:
            return [{k: v for k, v in w.items() if k != "waiting_s"} for w in server.status()["waiting"]]

        assert waiting(fed) == waiting(direct) and len(waiting(fed)) == len(requests)
        assert fed.status()["committed"] == direct.status()["committed"] == {"step": 5, "lineage": 2, "resets": 0}

        async def holders(server: LighthouseServer) -> bytes:
            return server._holders()

        assert fed._call_in_loop(holders(fed)).result(timeout=10) == \
            direct._call_in_loop(holders(direct)).result(timeout=10)
        names = torchft_pb2.RegentHoldersResponse.FromString(fed._call_in_loop(holders(fed)).result(timeout=10))
        assert [h.replica_id for h in names.holders] == [f"w{i}:1" for i in range(6)]
        assert all(h.address for h in names.holders)
    finally:
        direct.shutdown()
        fed.shutdown()


def test_a_batch_the_owner_cannot_apply_is_answered_with_the_error_and_leaves_no_one_waiting(caplog) -> None:
    """A defect's path: a record that decodes but cannot be applied (a step that is not a number). Every caller of
    the batch is answered (UNKNOWN) and none is left as a participant of the next quorum."""
    from regent.ft.frontends import _ANSWER, K_ANSWER, K_JOINS, FrontendPool, _OwnerLink, frame, split_frames
    from regent.ft.grpc_lite import StatusCode
    from regent.ft.lighthouse import LighthouseServer

    rng = random.Random(6)
    records = []
    for i in range(3):
        request, raw = random_request(rng, i)
        records.append(join_record(i + 1, (0, 0), decode_quorum_request(raw), raw))
    records[2][0][1] = "not a step"
    server = LighthouseServer(min_replicas=99, secret=b"", frontends=0)
    try:
        async def feed() -> list[tuple[int, bytes]]:
            link = _OwnerLink(FrontendPool(server, 1, "127.0.0.1", 0, {}), 0)
            link.data_received(frame(K_JOINS, encode_joins(records)))
            assert not link.joins
            return split_frames(bytearray(b"".join(link.out)))

        sent = server._call_in_loop(feed()).result(timeout=10)
        answers = [_ANSWER.unpack_from(payload) for kind, payload in sent if kind == K_ANSWER]
        assert answers == [(i, int(StatusCode.UNKNOWN)) for i in (1, 2, 3)]
        assert server.status()["waiting"] == []
    finally:
        server.shutdown()
