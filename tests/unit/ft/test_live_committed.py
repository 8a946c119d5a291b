"""Per-step early heal on the wire: state published lazily at every step, fetched at whatever step the donor
serves, and withdrawn at once even while a healer is reading (StreamTransport, real sockets)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from regent.ft.transfer import (
    _GREETING,
    _MAX_REQUEST_BYTES,
    ANY_STEP,
    StreamTransport,
    _recv_frame,
    _send_frame,
)
from regent.sockio import recv_exact


def _state(step: int, scale: float = 1.0) -> dict:
    return {"user": {"w": torch.full((256,), scale), "sched": {"step_count": step}},
            "regent": {"step": step, "batches_committed": step}}


@pytest.fixture
def donor():
    t = StreamTransport(secret=b"", timeout=30)
    yield t
    t.shutdown()


def test_lazy_publish_serves_the_step_it_was_given_and_any_step_fetch_takes_it(donor):
    healer = StreamTransport(secret=b"", timeout=30)
    try:
        live = _state(7, 3.0)
        donor.send_checkpoint([], 7, live, 10, copy_to_host=False, lazy=True)
        got = healer.recv_checkpoint(0, donor.metadata(), ANY_STEP, 10, into=_state(0))
        assert got["regent"]["step"] == 7 and got["user"]["sched"]["step_count"] == 7
        assert torch.equal(got["user"]["w"], live["user"]["w"])
        # the donor moves on: withdraw, then publish the next step; an exact request for the old one is refused
        donor.disallow_checkpoint(cut_readers=True)
        donor.send_checkpoint([], 8, _state(8, 4.0), 10, copy_to_host=False, lazy=True)
        with pytest.raises(RuntimeError, match="stale step"):
            healer.recv_checkpoint(0, donor.metadata(), 7, 10, into=_state(0))
        got = healer.recv_checkpoint(0, donor.metadata(), ANY_STEP, 10, into=_state(0))
        assert got["regent"]["step"] == 8 and float(got["user"]["w"][0]) == 4.0
    finally:
        healer.shutdown()


def test_a_lazily_published_state_that_cannot_be_described_is_refused_to_the_healer(donor):
    healer = StreamTransport(secret=b"", timeout=30)
    try:
        donor.send_checkpoint([], 3, {"user": {"bad": object()}, "regent": {"step": 3}}, 10,
                              copy_to_host=False, lazy=True)  # no error here: described on request
        with pytest.raises(RuntimeError, match="cannot describe"):
            healer.recv_checkpoint(0, donor.metadata(), ANY_STEP, 10, into=None)
    finally:
        healer.shutdown()


def test_withdraw_cuts_a_reader_that_stopped_reading(donor):
    """A healer that asked for 64 MB and stopped reading (a frozen process) must not hold the donor's next
    optimizer step for the 30 s transfer timeout."""
    big = {"user": {"w": torch.ones(16 * 1024 * 1024)}, "regent": {"step": 5}}
    donor.send_checkpoint([], 5, big, 10, copy_to_host=False, lazy=True)
    host, port = donor.metadata().removeprefix("tcp://").rsplit(":", 1)
    frozen = socket.create_connection((host, int(port)))
    frozen.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        assert recv_exact(frozen, len(_GREETING) + 1) == _GREETING + b"N"
        _send_frame(frozen, json.dumps({"what": "chunk", "step": 5, "chunk": 0, "of": 1}).encode())
        assert json.loads(_recv_frame(frozen, _MAX_REQUEST_BYTES, "answer")) == {"ok": True}
        time.sleep(0.5)  # the donor is now blocked sending into a full socket
        done = threading.Event()
        start = time.monotonic()
        threading.Thread(target=lambda: (donor.disallow_checkpoint(cut_readers=True), done.set()),
                         daemon=True).start()
        assert done.wait(15), "the withdraw waited for the frozen reader"
        assert time.monotonic() - start < 15
    finally:
        frozen.close()
