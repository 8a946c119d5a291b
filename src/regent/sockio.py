"""Exact-length reads from a blocking socket, shared by the job-secret handshake (`regent.auth`) and peer state
transfer (`regent.ft.transfer`): `recv` may return fewer bytes than asked, so every fixed-size read loops, and a
peer that closes mid-read is an error, never a short result.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

# At most this much per recv call: one call's copy stays bounded however large the frame.
_CHUNK = 1 << 24


def _peer_closed() -> Exception:
    return ConnectionError("peer closed the connection mid-transfer")


def recv_into(sock: socket.socket, view: memoryview, closed: Callable[[], Exception] = _peer_closed) -> None:
    """Fill `view` from `sock`; raises `closed()` if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, _CHUNK))
        if n == 0:
            raise closed()
        got += n


def recv_exact(sock: socket.socket, n: int, closed: Callable[[], Exception] = _peer_closed) -> bytes:
    """Exactly `n` bytes from `sock`; raises `closed()` if the peer closes first (by default a ConnectionError)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), closed)
    return bytes(buf)
