"""Transport: the secret handshake, malformed and oversized frames, and out-of-band buffers."""

import hashlib
import hmac
import logging
import os
import pickle
import socket
import struct
import time

import numpy as np
import pytest

from regent.actor import Actor, endpoint, this_host
from regent.actor._pickle import dumps, loads
from regent.actor._process import get_runtime
from regent.actor._transport import HEADER, MAGIC, parse_address

TIMEOUT = 60


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x


@pytest.fixture(scope="module")
def echo():
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    yield pm.spawn("echo", Echo)
    pm.stop().get(timeout=TIMEOUT)


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def raw_client(secret: bytes, then: bytes = b""):
    """Connect to this process's runtime, answer its challenge with `secret`, then send `then` at once."""
    path = parse_address(get_runtime().info["unix"])[1]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    greeting = recv_exact(sock, 36)
    assert greeting[:4] == b"RGNT"
    sock.sendall(hmac.new(secret, b"client" + greeting[4:], hashlib.sha256).digest() + os.urandom(32) + then)
    return sock


def frame(env: bytes, body: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, 0, len(env), len(body)) + env + body


def wait_closed(sock, timeout=10.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_wrong_secret_is_refused_before_unpickling(tmp_path, echo):
    marker = tmp_path / "unpickled"
    sock = raw_client(b"not the job secret", then=frame(pickle.dumps(("hello", _Evil(str(marker))))))
    assert wait_closed(sock)
    time.sleep(0.2)
    assert not marker.exists()
    assert echo.echo.call_one("still fine").get(timeout=TIMEOUT) == "still fine"


def test_right_secret_is_accepted():
    sock = raw_client(get_runtime().secret)
    proof = recv_exact(sock, 32)
    assert len(proof) == 32
    assert not wait_closed(sock, timeout=0.3)
    sock.close()


def test_malformed_frame_closes_only_that_connection(caplog, echo):
    sock = raw_client(get_runtime().secret)
    recv_exact(sock, 32)
    with caplog.at_level(logging.ERROR, logger="regent.actor.transport"):
        sock.sendall(b"\x00" * 64)
        assert wait_closed(sock)
    assert "bad magic" in caplog.text
    assert echo.echo.call_one(1).get(timeout=TIMEOUT) == 1


def test_oversized_frame_is_rejected(caplog, echo):
    sock = raw_client(get_runtime().secret)
    recv_exact(sock, 32)
    with caplog.at_level(logging.ERROR, logger="regent.actor.transport"):
        sock.sendall(HEADER.pack(MAGIC, 0, 10, 1 << 50))
        assert wait_closed(sock)
    assert "oversized frame" in caplog.text and "REGENT_MAX_FRAME_BYTES" in caplog.text
    assert echo.echo.call_one(2).get(timeout=TIMEOUT) == 2


def test_garbage_envelope_is_dropped_and_connection_survives(caplog):
    sock = raw_client(get_runtime().secret)
    recv_exact(sock, 32)
    with caplog.at_level(logging.ERROR, logger="regent.actor"):
        sock.sendall(frame(b"this is not a pickle"))
        assert not wait_closed(sock, timeout=0.5)
    assert "malformed message" in caplog.text
    sock.close()


def test_too_many_buffers_is_malformed(caplog):
    sock = raw_client(get_runtime().secret)
    recv_exact(sock, 32)
    with caplog.at_level(logging.ERROR, logger="regent.actor.transport"):
        sock.sendall(struct.pack("<HHIQ", MAGIC, 60000, 0, 0))
        assert wait_closed(sock)
    assert "buffers" in caplog.text


def test_numpy_buffers_travel_out_of_band():
    arr = np.arange(1 << 20, dtype=np.float32)
    body, buffers = dumps({"a": arr, "small": np.arange(3)})
    assert len(buffers) == 1 and buffers[0].nbytes == arr.nbytes
    assert len(body) < 4096
    out = loads(body, [memoryview(bytearray(b)) for b in buffers])
    assert np.array_equal(out["a"], arr) and list(out["small"]) == [0, 1, 2]


def test_plain_results_take_the_fast_path_and_round_trip():
    import enum

    class Colour(enum.IntEnum):  # an int subclass is not a plain int: it goes the general way, by reference
        RED = 1

    big = "x" * (1 << 20)
    for value in (0, -(1 << 80), 1.5, True, None, "", "__main__", big):
        body, buffers = dumps(value)
        assert buffers == [] and loads(body) == value and type(loads(body)) is type(value)
    body, _ = dumps(Colour.RED)
    assert loads(body) is Colour.RED


def test_torch_tensors_travel_out_of_band():
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    view = t[:, :512]  # not contiguous: only the viewed data travels
    bf = torch.ones(1 << 16, dtype=torch.bfloat16)
    param = torch.nn.Parameter(torch.zeros(1 << 15))
    body, buffers = dumps((t, view, bf, param))
    assert [b.nbytes for b in buffers] == [t.nbytes, view.numel() * 4, bf.nbytes, param.nbytes]
    assert len(body) < 4096
    t2, view2, bf2, param2 = loads(body, [memoryview(bytearray(b)) for b in buffers])
    assert torch.equal(t2, t) and torch.equal(view2, view) and bf2.dtype == torch.bfloat16
    assert torch.equal(bf2, bf) and isinstance(param2, torch.nn.Parameter) and param2.requires_grad
    # in band (no buffer callback): still correct
    import cloudpickle

    assert torch.equal(pickle.loads(cloudpickle.dumps(t, protocol=5)), t)


def test_sender_refuses_oversized_message(echo, monkeypatch):
    from regent.actor._config import config

    monkeypatch.setattr(config, "max_frame_bytes", 1 << 20)
    with pytest.raises(ValueError, match="over the frame limit"):
        echo.echo.call_one(np.zeros(1 << 20, dtype=np.uint8))


def test_large_frames_land_in_a_mapping_that_their_tensors_keep_alive():
    import gc
    import mmap

    from regent.actor._transport import MAPPED_MIN, direct_buffer

    assert isinstance(direct_buffer(MAPPED_MIN - 1), bytearray)
    buf = direct_buffer(MAPPED_MIN)
    assert isinstance(buf, mmap.mmap) and len(buf) == MAPPED_MIN
    torch = pytest.importorskip("torch")
    view = memoryview(buf)
    t = torch.frombuffer(view[16:], dtype=torch.uint8)  # a buffer of a frame, as the unpickler makes it
    del buf, view
    gc.collect()
    t.fill_(7)  # still mapped and writable: the tensor holds the mapping
    assert int(t.sum()) == 7 * (MAPPED_MIN - 16)
