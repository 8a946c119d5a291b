"""State carries its integrity: a backstop snapshot is checked against its record (checksum, size, step,
lineage) before it is loaded, and a restore falls back to the next older one when the newest is damaged; a
state transfer whose tensor bytes are altered on the wire is refused. Real files, real sockets."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
import torch

from regent.ft import committed as committed_mod
from regent.ft import wire
from regent.ft.backstop import Backstop, BackstopCorruptError, complete_steps, read_record
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient
from regent.ft.manager import Manager
from regent.ft.rpc_security import TLSFiles
from regent.ft.transfer import StreamTransport, TransferIntegrityError


def _full_state(step: int, lineage: int = 3) -> dict:
    w = torch.arange(1000, dtype=torch.float32) + step
    return {"user": {"default": {"w": w}}, "regent": {"step": step, "batches_committed": step, "lineage": lineage}}


def _save(b: Backstop, step: int, **kw) -> None:
    state = kw.pop("state", None) or _full_state(step)
    assert b.maybe_save(step, lambda: state, force=True, **kw)
    b.wait()
    assert b.last_error is None, b.last_error


def _flip(path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_backstop_records_step_lineage_checksum_and_refuses_damage(tmp_path, caplog):
    events = []
    b = Backstop(tmp_path, rank=0, world_size=1, every_s=3600, keep=5, on_event=lambda k, d: events.append((k, d)))
    for step in (1, 2, 3, 4):
        _save(b, step)
    record = read_record(tmp_path / "step-00000004" / "rank0.done")
    assert record["step"] == 4 and record["lineage"] == 3 and len(record["sha256"]) == 64
    assert torch.equal(b.load(str(tmp_path / "step-00000004"), 0)["user"]["default"]["w"], _full_state(4)["user"]["default"]["w"])

    _flip(tmp_path / "step-00000004" / "rank0.pt")  # one bit, same size
    with pytest.raises(BackstopCorruptError, match="sha256"):
        b.load(str(tmp_path / "step-00000004"), 0)
    pt3 = tmp_path / "step-00000003" / "rank0.pt"
    pt3.write_bytes(pt3.read_bytes()[:-10])  # truncated
    with pytest.raises(BackstopCorruptError, match="truncated"):
        b.load(str(tmp_path / "step-00000003"), 0)
    done2 = tmp_path / "step-00000002" / "rank0.done"
    edited = json.loads(done2.read_text())
    edited["lineage"] = 99
    done2.write_text(json.dumps(edited))  # someone edits the record: its own digest no longer matches
    with pytest.raises(BackstopCorruptError, match="own digest"):
        b.load(str(tmp_path / "step-00000002"), 0)

    caplog.set_level(logging.ERROR, logger="regent.ft.backstop")
    # the newest intact one is step 1: the damaged ones are passed over, each reported
    assert b.latest() == (1, str(tmp_path / "step-00000001"))
    corrupt = [d["manager_step"] for k, d in events if k == "backstop_corrupt"]
    assert corrupt == [4, 3, 2]
    assert caplog.text.count("falling back to an older backstop") == 3

    # a directory renamed to another step is mislabelled, not loaded
    (tmp_path / "step-00000001").rename(tmp_path / "step-00000009")
    with pytest.raises(BackstopCorruptError, match="mislabelled"):
        b.load(str(tmp_path / "step-00000009"), 0)
    assert b.latest() is None


def test_backstop_refuses_contents_that_contradict_the_record(tmp_path, caplog):
    b = Backstop(tmp_path, rank=0, world_size=1, every_s=3600, keep=5)
    _save(b, 5, state=_full_state(6))  # written as step 5, but the state says step 6
    with pytest.raises(BackstopCorruptError, match="holds step 6"):
        b.load(str(tmp_path / "step-00000005"), 0)
    _save(b, 7, lineage=11)  # recorded lineage 11, the state says 3
    with pytest.raises(BackstopCorruptError, match="lineage"):
        b.load(str(tmp_path / "step-00000007"), 0)
    # a record of an older Regent (a bare step) is still read, with a warning that it cannot be checked
    _save(b, 8)
    (tmp_path / "step-00000008" / "rank0.done").write_text("8")
    caplog.set_level(logging.WARNING, logger="regent.ft.backstop")
    assert b.load(str(tmp_path / "step-00000008"), 0)["regent"]["step"] == 8
    assert "without a checksum" in caplog.text


def test_a_two_rank_backstop_with_one_damaged_rank_is_passed_over(tmp_path):
    ranks = [Backstop(tmp_path, rank=r, world_size=2, every_s=3600, keep=5) for r in range(2)]
    for step in (1, 2):
        for b in ranks:
            _save(b, step)
    assert complete_steps(tmp_path, 2) == [1, 2]
    _flip(tmp_path / "step-00000002" / "rank1.pt")
    assert ranks[0].latest()[0] == 1  # rank 0 plans the restore for both: rank 1's damage counts too


def test_restore_falls_back_to_the_older_backstop_and_reports_it(tmp_path, monkeypatch):
    """The whole path: every holder is gone, the newest backstop is damaged, the Manager restores the older."""
    monkeypatch.setattr(committed_mod, "HOLDER_GRACE_S", 0.3)
    events = []
    b = Backstop(tmp_path, rank=0, world_size=1, every_s=3600, keep=5, on_event=lambda k, d: events.append((k, d)))
    _save(b, 8)
    _save(b, 9)
    _flip(tmp_path / "step-00000009" / "rank0.pt")
    lh = LighthouseServer(min_replicas=1, heartbeat_timeout_ms=200, secret=b"", tls=TLSFiles())
    w = torch.zeros(1000)
    manager = None
    try:
        with LighthouseClient(lh.address(), connect_timeout=5, secret=b"", tls=TLSFiles()) as ghost:
            ghost.heartbeat("ghost:1", committed=(10, 3, 0, 0))  # committed step 10, then gone
        time.sleep(0.8)  # past HOLDER_ALIVE_TIMEOUTS (3) x the 200 ms heartbeat timeout: no longer a holder
        manager = Manager(load_state_dict=lambda sd: w.copy_(sd["w"]), state_dict=lambda: {"w": w},
                          use_async_quorum=False, connect_timeout=5, timeout=5, lighthouse_addr=lh.address(),
                          replica_id="me", backstop=b, on_event=lambda k, d: events.append((k, d)))
        assert manager.recover_committed() == "restored"
        assert manager.current_step() == 8
        assert torch.equal(w, _full_state(8)["user"]["default"]["w"])
        kinds = [k for k, _ in events]
        assert "backstop_corrupt" in kinds
        lost = [d for k, d in events if k == "state_lost"]
        assert lost and lost[-1]["restored_step"] == 8 and lost[-1]["lost_step"] == 10
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        lh.shutdown()


# ---- transfer ---------------------------------------------------------------------------------------------


class _CorruptingProxy:
    """A TCP relay in front of a donor that flips one bit of every donor->healer stream longer than `at` bytes
    (the chunk connections; the description's connection is shorter)."""

    def __init__(self, target: tuple[str, int], at: int) -> None:
        self.target, self.at = target, at
        self.flipped = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.at), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x10
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass  # either side closed: the relay of this connection ends
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the other pump

    def close(self) -> None:
        self._sock.close()


def test_tensor_digest_sees_changed_moved_and_swapped_bytes():
    data = bytes(torch.randn(10_000, generator=torch.Generator().manual_seed(0)).numpy().tobytes()) + b"tail!"
    base = wire.tensor_digest(memoryview(data))
    assert len(base) == wire.DIGEST_BYTES and wire.tensor_digest(data) == base

    def changed(edit) -> bool:
        b = bytearray(data)
        edit(b)
        return wire.tensor_digest(b) != base

    def swap(b: bytearray, i: int, j: int, n: int) -> None:
        b[i:i + n], b[j:j + n] = b[j:j + n], b[i:i + n]

    assert changed(lambda b: b.__setitem__(777, b[777] ^ 0x01))  # one bit
    assert changed(lambda b: b.__setitem__(len(b) - 2, b[len(b) - 2] ^ 0x80))  # in the tail
    assert changed(lambda b: swap(b, 0, 8, 8))  # neighbouring words
    assert changed(lambda b: swap(b, 0, 4096 * 3 + 8, 8))  # words of other rows and columns
    assert changed(lambda b: swap(b, 0, 4096, 4096))  # whole rows
    assert changed(lambda b: swap(b, 0, 4, 4))  # halves of a word
    assert wire.tensor_digest(data[:-1]) != base  # length
    assert wire.tensor_digest(b"") != wire.tensor_digest(b"\0")


def test_transfer_refuses_tensor_bytes_altered_on_the_wire():
    state = {"w": torch.randn(256, 1024), "b": torch.randn(1024), "step": 3}
    donor = StreamTransport(num_chunks=2, timeout=10, secret=b"")
    healer = StreamTransport(num_chunks=2, timeout=10, secret=b"")
    proxy = _CorruptingProxy(("127.0.0.1", int(donor.metadata().rsplit(":", 1)[1])), at=200_000)
    try:
        donor.send_checkpoint([1], 3, state, timeout=10)
        # straight from the donor: intact
        got = healer.recv_checkpoint(0, donor.metadata(), 3, timeout=10)
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
        # through the relay that flips a bit: refused, naming the tensor
        with pytest.raises(TransferIntegrityError, match="arrived corrupted"):
            healer.recv_checkpoint(0, f"tcp://127.0.0.1:{proxy.port}", 3, timeout=10)
        assert proxy.flipped >= 1
    finally:
        proxy.close()
        donor.shutdown()
        healer.shutdown()


def test_a_restore_takes_the_newest_backstop_a_vote_vouched_for(tmp_path):
    """The writer may carry a flip its vote has not found yet: with votes, a restore takes the newest snapshot
    whose ranks' recorded vote digests are that step's majority (`verdicts.json`, written by the controller),
    passes over the rest (`backstop_unvouched`), and pruning spares the newest vouched one."""
    from regent.ft.backstop import record_verdict
    from regent.ft.digest import combine_rank_digests

    events = []
    ranks = [Backstop(tmp_path, rank=r, world_size=2, every_s=3600, keep=2, require_vouched=True,
                      on_event=lambda k, d: events.append((k, d))) for r in range(2)]
    for step in (10, 20, 30):
        for r, b in enumerate(ranks):
            _save(b, step, digest=f"d{step}-{r}")
    assert complete_steps(tmp_path, 2) == [10, 20, 30]  # each prune ran before the other rank finished
    # no vote vouched for any: the newest intact one, said plainly
    assert ranks[0].latest() == (30, str(tmp_path / "step-00000030"))
    assert events[-1] == ("backstop_unvouched", {"manager_step": 30, "passed_over": [], "unchecked": True})
    record_verdict(tmp_path, 10, combine_rank_digests(["d10-0", "d10-1"]))
    record_verdict(tmp_path, 30, combine_rank_digests(["flipped", "d30-1"]))  # the majority held another state
    assert ranks[0].latest() == (10, str(tmp_path / "step-00000010"))
    assert events[-1] == ("backstop_unvouched", {"manager_step": 10, "passed_over": [30, 20]})
    for step in (40, 50):
        for r, b in enumerate(ranks):
            _save(b, step, digest=f"d{step}-{r}")
    assert complete_steps(tmp_path, 2) == [10, 30, 40, 50]  # 20 pruned (keep=2); 10, the newest vouched, spared
    record_verdict(tmp_path, 40, combine_rank_digests(["d40-0", "d40-1"]))
    assert ranks[1].latest() == (40, str(tmp_path / "step-00000040"))
    # without votes nothing needs vouching
    assert Backstop(tmp_path, rank=0, world_size=2, every_s=3600).latest()[0] == 50
