"""Peer state transfer: in-place receive, several healers, and the three faults (stale step, timeout,
donor stops serving). Real sockets; the group transport runs over a real Gloo group (two threads)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from regent.contiguous import contiguous_empty_like
from regent.ft.transfer import (
    ANY_STEP,
    GroupTransport,
    RWLock,
    StreamTransport,
    flatten_state,
    unflatten_state,
)
from tests.support.ft_harness import gloo_groups


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "empty": torch.empty(0),
        "extra": ("text", 5),
    }


def _assert_same(a, b):
    ma, ta = flatten_state(a, 0)
    mb, tb = flatten_state(b, 0)
    assert [m.path for m in ma.tensors] == [m.path for m in mb.tensors]
    assert all(torch.equal(x, y) for x, y in zip(ta, tb))
    if "extra" in b:
        assert unflatten_state(ma, ta)["extra"] == b["extra"]


def test_flatten_roundtrip_keeps_structure():
    s = _state(0)
    meta, tensors = flatten_state(s, 9)
    assert meta.step == 9 and len(tensors) == 5
    back = unflatten_state(meta, tensors)
    assert back["optim"]["param_groups"] == s["optim"]["param_groups"]
    _assert_same(back, s)


def test_stream_transfer_in_place_to_several_healers():
    donor_state = _state(1)
    donor = StreamTransport(num_chunks=3, timeout=20)
    healers = [StreamTransport(num_chunks=2, timeout=20) for _ in range(3)]
    try:
        donor.send_checkpoint([1, 2, 3], step=7, state_dict=donor_state, timeout=20)
        targets = [_state(10 + i) for i in range(3)]
        ptrs = [t["model"]["w"].data_ptr() for t in targets]
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(
                lambda i: healers[i].recv_checkpoint(0, donor.metadata(), 7, 20, into=targets[i]), range(3)
            ))
        for g, target, ptr in zip(got, targets, ptrs):
            _assert_same(g, donor_state)
            assert g["model"]["w"].data_ptr() == ptr  # received in place
            _assert_same(target, donor_state)
        # Without a template the healer allocates.
        fresh = healers[0].recv_checkpoint(0, donor.metadata(), 7, 20)
        _assert_same(fresh, donor_state)
    finally:
        donor.shutdown()
        for h in healers:
            h.shutdown()


def test_stream_stale_step_is_refused():
    donor = StreamTransport(timeout=10)
    healer = StreamTransport(timeout=10)
    try:
        donor.send_checkpoint([1], step=7, state_dict=_state(1), timeout=10)
        with pytest.raises(RuntimeError, match="stale step"):
            healer.recv_checkpoint(0, donor.metadata(), 6, 10)
    finally:
        donor.shutdown()
        healer.shutdown()


def test_stream_donor_stops_serving_once_weights_change():
    donor = StreamTransport(timeout=10)
    healer = StreamTransport(timeout=10)
    try:
        donor.send_checkpoint([1], step=7, state_dict=_state(1), timeout=10)
        healer.recv_checkpoint(0, donor.metadata(), 7, 10)
        donor.disallow_checkpoint()
        with pytest.raises(RuntimeError, match="not serving"):
            healer.recv_checkpoint(0, donor.metadata(), 7, 10)
    finally:
        donor.shutdown()
        healer.shutdown()


def test_stream_receive_timeout_raises():
    # A "donor" that accepts connections and never answers.
    silent = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    healer = StreamTransport(timeout=10)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            healer.recv_checkpoint(0, f"tcp://127.0.0.1:{silent.getsockname()[1]}", 1, timeout=1.0)
        assert time.monotonic() - start < 10
    finally:
        healer.shutdown()
        silent.close()


def test_rwlock_writer_waits_for_readers():
    lock = RWLock()
    assert lock.acquire_read()
    assert not lock.acquire_write(timeout=0.1)  # a reader (serving) holds it
    lock.release_read()
    assert lock.acquire_write(timeout=1)
    assert not lock.acquire_read(timeout=0.1)  # no reads while the optimizer steps
    lock.release_write()


def test_group_transfer_in_place_and_stale_refused():
    with gloo_groups(timeout=2.0) as groups:
        donor, healer = GroupTransport(groups[0]), GroupTransport(groups[1])
        src = _state(1)
        into = _state(2)
        ptr = into["optim"]["state"][0]["exp_avg"].data_ptr()
        with ThreadPoolExecutor(2) as pool:
            f = pool.submit(donor.send_checkpoint, [1], 4, src, 2)
            got = healer.recv_checkpoint(0, "<group>", 4, 2, into=into)
            f.result()
        _assert_same(got, src)
        assert got["optim"]["state"][0]["exp_avg"].data_ptr() == ptr
        # Stale: the donor offers step 4, the healer wants 5 -> refused before any tensor is received.
        with ThreadPoolExecutor(2) as pool:
            f = pool.submit(donor.send_checkpoint, [1], 4, src, 5)
            with pytest.raises(RuntimeError, match="stale"):
                healer.recv_checkpoint(0, "<group>", 5, 5)
            groups[1].abort(RuntimeError("healer gave up"))
            with pytest.raises(Exception):  # noqa: B017 (the donor's send fails in whatever way gloo reports)
                f.result()


def test_group_receive_timeout_raises():
    with gloo_groups(timeout=1.0) as groups:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            GroupTransport(groups[1]).recv_checkpoint(0, "<group>", 1, 1.0)  # nobody sends
        assert time.monotonic() - start < 10
        assert groups[1].errored() is not None


def _heal(groups, src, into, donor=None, **transport) -> tuple[dict, list[int], GroupTransport]:
    """Donor rank 0 sends `src` (step 4) to healer rank 1, which receives into `into`; returns what the
    healer got, the byte-message sizes (elements) the donor sent in its batch, and the healer's transport."""
    sent: list[int] = []
    real_send_many = groups[0].send_many

    def counting_send_many(tensors, dst, first_tag=0, **kwargs):
        sent.extend(t.numel() for t in tensors)
        real_send_many(tensors, dst, first_tag, **kwargs)

    groups[0].send_many = counting_send_many
    with ThreadPoolExecutor(2) as pool:
        donor = donor or GroupTransport(groups[0], **transport)
        f = pool.submit(donor.send_checkpoint, [1], 4, src, 5)
        healer = GroupTransport(groups[1], **transport)
        got = healer.recv_checkpoint(0, "<group>", 4, 5, into=into)
        f.result()
    groups[0].send_many = real_send_many
    return got, sent, healer


def test_group_transfer_packs_small_tensors_and_sends_large_ones_alone():
    with gloo_groups(timeout=5.0) as groups:
        # b (64 B) and the step counter (4 B) travel in one pack; w and exp_avg (8 KiB each) go alone.
        src, into = _state(1), _state(2)
        own = [into["model"]["w"], into["model"]["b"], into["optim"]["state"][0]["step"],
               into["optim"]["state"][0]["exp_avg"]]
        ptrs = [t.data_ptr() for t in own]
        got, sent, healer = _heal(groups, src, into, packed_below=1024)
        _assert_same(got, src)
        assert healer.last_described_alike
        w = 64 * 32 * 4
        assert sent == [68, w, w, 3 * 4]  # one pack, two tensors alone, then their checksums (int64 [3, 4])
        got_own = [got["model"]["w"], got["model"]["b"], got["optim"]["state"][0]["step"],
                   got["optim"]["state"][0]["exp_avg"]]
        assert [t.data_ptr() for t in got_own] == ptrs  # every tensor landed in place, packed or not


def _flat_state(seed: int, contiguous: bool) -> dict:
    """Three 8 KiB 'parameters' and a moment each; with `contiguous` the parameters share one buffer and
    the moments another (the Trainer's layout)."""
    g = torch.Generator().manual_seed(seed)
    like = [torch.empty(64, 32)] * 3
    params = contiguous_empty_like(like) if contiguous else [torch.empty(64, 32) for _ in like]
    moments = contiguous_empty_like(like) if contiguous else [torch.empty(64, 32) for _ in like]
    for t in params + moments:
        t.copy_(torch.randn(64, 32, generator=g))
    return {"model": {f"p{i}": p for i, p in enumerate(params)},
            "optim": {f"p{i}": {"exp_avg": m, "step": torch.tensor(float(seed))} for i, m in enumerate(moments)}}


@pytest.mark.parametrize("donor_flat,healer_flat,messages", [
    (True, True, 2),     # one message per buffer, received in place
    (True, False, 2),    # same wire format; the healer stages each run and copies it out
    (False, True, 6),    # the donor's tensors are apart: one message each
    (False, False, 6),
])
def test_group_transfer_merges_adjacent_tensors(donor_flat, healer_flat, messages):
    with gloo_groups(timeout=5.0) as groups:
        src, into = _flat_state(1, donor_flat), _flat_state(2, healer_flat)
        _, own = flatten_state(into, 0)
        ptrs = [t.data_ptr() for t in own]
        got, sent, healer = _heal(groups, src, into, packed_below=1024)
        _assert_same(got, src)
        assert healer.last_described_alike  # targets ready before the donor's description came
        assert len(sent) == 1 + messages + 1  # the step counters' pack, the large messages, their checksums
        _, landed = flatten_state(got, 0)
        assert [t.data_ptr() for t in landed] == ptrs  # in place whatever the layouts


def test_group_transfer_with_a_description_larger_than_the_header():
    from regent.ft.transfer import HEADER_BYTES

    with gloo_groups(timeout=5.0) as groups:
        src, into = _state(1), _state(2)
        src["note"] = into["note"] = "x" * (HEADER_BYTES + 1000)  # pickled metadata spills past the header
        got, _, _ = _heal(groups, src, into)
        _assert_same(got, src)
        assert got["note"] == src["note"]


def test_group_donor_reuses_its_layout_until_its_tensors_move():
    with gloo_groups(timeout=5.0) as groups:
        donor = GroupTransport(groups[0], packed_below=1024)
        src = _flat_state(1, True)
        got, _, _ = _heal(groups, src, _flat_state(2, True), donor=donor)
        _assert_same(got, src)
        first = donor._sent.layout
        with torch.no_grad():  # the values change between heals (training goes on), the buffers stay
            for t in flatten_state(src, 0)[1]:
                t.add_(1.0)
        src["optim"]["p0"]["note"] = "a plain value changed"
        got, _, healer = _heal(groups, src, _flat_state(3, True), donor=donor)
        assert donor._sent.layout is first  # described once
        _assert_same(got, src)
        # plain values travel in the structure, not in the layout: the healer still had everything prepared
        assert got["optim"]["p0"]["note"] == "a plain value changed" and healer.last_described_alike
        moved = _flat_state(4, False)  # new buffers, another layout: described again
        got, _, _ = _heal(groups, moved, _flat_state(5, True), donor=donor)
        assert donor._sent.layout is not first
        _assert_same(got, moved)
        # A healer whose state is described otherwise (a tensor it does not have yet) decodes the donor's
        # description and allocates what it lacks.
        partial = _flat_state(6, True)
        kept = partial["model"]["p1"].data_ptr()
        del partial["model"]["p0"]
        got, _, healer = _heal(groups, moved, partial, donor=donor)
        assert not healer.last_described_alike
        _assert_same(got, moved)
        assert got["model"]["p1"].data_ptr() == kept


def test_unflatten_keeps_named_tuples_whole():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    state = {"pair": Pair(1, "x"), "t": torch.ones(2), "seq": [torch.zeros(1), (3, torch.ones(1))]}
    meta, tensors = flatten_state(state, 0)
    back = unflatten_state(meta, tensors)
    assert type(back["pair"]) is Pair and back["pair"] == state["pair"]
    assert back["seq"][1][0] == 3 and torch.equal(back["seq"][1][1], torch.ones(1))
    with pytest.raises(ValueError, match="more tensors than the 2 given"):
        unflatten_state(meta, tensors[:2])


def test_group_transfer_refuses_bytes_corrupted_on_the_way():
    """The donor's checksums travel after the tensors; a message changed on the way fails the heal with
    TransferIntegrityError (here the donor's group flips a byte of its largest message as it sends it)."""
    from regent.ft.transfer import TransferIntegrityError, device_digest

    b = torch.arange(10_000, dtype=torch.int32).view(torch.uint8)
    base = device_digest(b)
    for i in (0, 4095, 5000, 39_999):  # a word of a row, the tail
        c = b.clone()
        c[i] ^= 1
        assert not torch.equal(device_digest(c), base), i
    swapped = b.clone().view(torch.int32)
    swapped[[3, 7]] = swapped[[7, 3]]
    assert not torch.equal(device_digest(swapped.view(torch.uint8)), base)
    assert not torch.equal(device_digest(b[1:]), device_digest(b[:-1]))  # an unaligned view works too

    with gloo_groups(timeout=5.0) as groups:
        torch.manual_seed(0)
        state = {"w": torch.randn(4096), "b": torch.randn(8)}
        send_many = groups[0].send_many

        def corrupting(messages, dst, first_tag=0, **kwargs):
            big = max(messages[:-1], key=lambda m: m.numel())
            bad = big.clone()
            bad[100] ^= 0xFF
            return send_many([bad if m is big else m for m in messages], dst, first_tag=first_tag, **kwargs)

        groups[0].send_many = corrupting
        into = {"w": torch.zeros(4096), "b": torch.zeros(8)}
        with ThreadPoolExecutor(2) as pool:
            sent = pool.submit(GroupTransport(groups[0]).send_checkpoint, [1], 3, state, 10)
            with pytest.raises(TransferIntegrityError, match="does not match the checksums"):
                GroupTransport(groups[1]).recv_checkpoint(0, "<group>", 3, 10, into=into)
            sent.result(timeout=30)


def test_a_healer_whose_group_is_aborted_stops_waiting_for_the_header():
    # Seen in a soak: the donor was told its group failed before it sent anything, and the healer waited the
    # whole timeout for the header while the other replicas waited for it at the Lighthouse (a 15 s stall).
    with gloo_groups(timeout=10.0) as groups:
        into = _state(2)
        threading.Timer(0.3, lambda: groups[1].abort(RuntimeError("peer replica_0 reported failed"), wait=False,
                                                     fail_pending=True)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="reported failed"):
            GroupTransport(groups[1]).recv_checkpoint(0, "<group>", 3, 10, into=into)
        assert time.monotonic() - start < 5
        assert torch.equal(into["model"]["w"], _state(2)["model"]["w"])  # nothing was written into its state


def test_a_donor_aborted_after_the_header_still_posts_the_state_its_healer_waits_for():
    # Caught with stacks in a session-19 soak: a third replica died while a donor sent; the donor's group was
    # aborted after the header went out, so the state never followed it, and the healer, whose receive into its
    # own tensors cannot be given up, waited out the whole timeout (15 s) while the others waited at the
    # Lighthouse. Now the donor posts everything on the build it started with, and fails at once itself.
    with gloo_groups(timeout=20.0) as groups:
        src, into = _state(1), _state(2)
        real_send_many = groups[0].send_many

        def abort_then_send_many(*args, **kwargs):
            groups[0].abort(RuntimeError("peer replica_2 reported failed"), wait=False, fail_pending=True)
            real_send_many(*args, **kwargs)

        groups[0].send_many = abort_then_send_many
        with ThreadPoolExecutor(2) as pool:
            start = time.monotonic()
            sent = pool.submit(GroupTransport(groups[0]).send_checkpoint, [1], 4, src, 20)
            got = GroupTransport(groups[1]).recv_checkpoint(0, "<group>", 4, 20, into=into)
            healed_in = time.monotonic() - start
            with pytest.raises(RuntimeError, match="replica_2 reported failed"):
                sent.result(timeout=30)  # the donor still learns that its group failed
        assert healed_in < 10, f"the healer waited {healed_in:.1f} s for a state that was never sent"
        _assert_same(got, src)


def _live_donor(donor: StreamTransport, tensors: dict, stop: threading.Event, steps: list[int]) -> None:
    """A per-step donor: every few ms it withdraws its state (cutting readers), writes the next step's values
    into its tensors in place, and serves them again, lazily, as the per-step early heal does."""
    step = 0
    while not stop.is_set():
        donor.send_checkpoint([], step, {"model": dict(tensors), "step": step}, 10, copy_to_host=False, lazy=True)
        time.sleep(0.005)
        donor.disallow_checkpoint(cut_readers=True)
        step += 1
        for t in tensors.values():
            t.fill_(step)
        steps.append(step)


def test_a_live_donor_holds_its_state_until_the_healers_transfer_ends():
    # Seen on an H200 (TorchTitan per-step, 33 ms steps, a 74 MB state): all 8 early pulls missed, the donor
    # moved on between the description and the chunks ("stale step") or cut the transfer at its next step. A
    # healer now asks for a hold: the donor's next withdrawal waits until the last chunk is sent.
    tensors = {f"w{i}": torch.zeros(2_000_000) for i in range(4)}  # 32 MB: a transfer spans many donor steps
    donor = StreamTransport(num_chunks=4, timeout=10)
    healer = StreamTransport(num_chunks=4, timeout=10)
    stop, steps = threading.Event(), []
    thread = threading.Thread(target=_live_donor, args=(donor, tensors, stop, steps), daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        for _ in range(3):
            into = {"model": {k: torch.full_like(v, -1.0) for k, v in tensors.items()}, "step": 0}
            for _attempt in range(50):  # the manager's retry: a donor inside its step serves nothing
                try:
                    got = healer.recv_checkpoint(0, donor.metadata(), ANY_STEP, 10, into=into)
                    break
                except RuntimeError as err:
                    assert "not serving" in str(err) or "updating its weights" in str(err), err
                    time.sleep(0.002)
            else:
                raise AssertionError("the donor never served its state")
            values = {float(v.min()) for v in got["model"].values()} | {float(v.max()) for v in got["model"].values()}
            assert values == {float(got["step"])}, "the state arrived torn across donor steps"
        assert len(steps) > 3, "the donor did not keep stepping"
        assert donor.held_s > 0, "the donor never had to hold its state: the case was not set up"
    finally:
        stop.set()
        thread.join(5)
        donor.shutdown()
        healer.shutdown()


def test_a_hold_whose_healer_went_away_expires(monkeypatch):
    import regent.ft.transfer as transfer

    monkeypatch.setattr(transfer, "HOLD_IDLE_S", 0.3)
    donor = StreamTransport(timeout=10)
    try:
        donor.send_checkpoint([], 3, _state(1), 10, copy_to_host=False, lazy=True)
        # a healer that takes the description with a hold and never asks for a chunk
        sock = donor_healer_meta_with_hold(donor)
        sock.close()
        start = time.monotonic()
        donor.disallow_checkpoint(cut_readers=True)
        assert 0.2 < time.monotonic() - start < 3.0
    finally:
        donor.shutdown()


def donor_healer_meta_with_hold(donor: StreamTransport) -> socket.socket:
    import json

    from regent.ft.transfer import _recv_frame, _send_frame

    healer = StreamTransport(timeout=10)
    try:
        host, port = donor.metadata().removeprefix("tcp://").rsplit(":", 1)
        sock = healer._open(host, int(port), donor.metadata(), 10)
        _send_frame(sock, json.dumps({"what": "meta", "step": ANY_STEP, "hold": True}).encode())
        answer = json.loads(_recv_frame(sock, 4096, "answer"))
        assert type(answer.get("hold")) is int, answer
        _recv_frame(sock, 1 << 20, "description")
        return sock
    finally:
        healer.shutdown()
