"""The job secret and the challenge-response that proves knowledge of it (no torch, no actors: shared by
`regent.actor`'s transport and `regent.ft`'s state transfer).

Where the secret comes from: `$REGENT_JOB_SECRET` (hex), else the file named by `$REGENT_JOB_SECRET_FILE`.
The actor runtime puts it in the environment of every process it spawns, so under `regent train` every
trainer process has it.

Handshake (mutual; fresh nonces on both sides, so a recorded handshake replayed to either side fails):
    server -> client : magic + 32-byte nonce_s
    client -> server : HMAC(secret, client_role + nonce_s) + 32-byte nonce_c
    server -> client : HMAC(secret, server_role + nonce_c)          (only if the client's proof was right)
The actor transport runs it on its event loop with magic b"RGNT" and roles b"client"/b"server"; blocking
sockets use `server_handshake` / `client_handshake` with their own magic and roles, so a proof made for
one protocol is no proof in another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from regent import settings
from regent.sockio import recv_exact

SECRET_ENV = settings.REGENT_JOB_SECRET.name
SECRET_FILE_ENV = settings.REGENT_JOB_SECRET_FILE.name
NONCE = 32
MAC = 32


class AuthenticationError(Exception):
    """A peer could not prove knowledge of the job secret."""


def job_secret_from_env() -> bytes | None:
    """The job secret from `$REGENT_JOB_SECRET` (hex) or the file `$REGENT_JOB_SECRET_FILE`; None if neither."""
    raw = settings.REGENT_JOB_SECRET.get()
    if raw:
        try:
            return bytes.fromhex(raw)
        except ValueError:
            raise ValueError("REGENT_JOB_SECRET must be hex; generate one with `python -c 'import secrets;"
                             " print(secrets.token_hex(32))'`") from None
    path = settings.REGENT_JOB_SECRET_FILE.get()
    if path:
        return read_secret_file(path)
    return None


def read_secret_file(path: str) -> bytes:
    with open(path) as f:
        text = f.read().strip()
    if not text:
        raise ValueError(f"secret file {path} is empty; write a hex secret into it")
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()


def proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of `role + nonce` under the secret: what a side sends to prove it knows the secret."""
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def fingerprint(secret: bytes) -> str:
    """A short public tag of the secret (HMAC of a fixed label, 64 bits): two processes can tell whether
    they hold the same secret without revealing it. References to a job's processes (pickled meshes and
    ports) carry it, so a process with another secret is told at once, not after a refused connection."""
    return hmac.new(secret, b"regent job fingerprint", hashlib.sha256).hexdigest()[:16]


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE)


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    """`n` bytes of the handshake; a peer that closes first fails it (as an `AuthenticationError`)."""
    return recv_exact(sock, n, lambda: AuthenticationError(
        f"{peer} closed the connection during the handshake (wrong job secret?)"))


def server_handshake(sock: socket.socket, secret: bytes, magic: bytes, client_role: bytes, server_role: bytes,
                     peer: str = "peer") -> None:
    """Challenge the client on a connected blocking socket; raises `AuthenticationError` (nothing else is read)
    if its proof is wrong, else proves our own knowledge of the secret to it."""
    nonce = new_nonce()
    sock.sendall(magic + nonce)
    data = _recv_exact(sock, MAC + NONCE, peer)
    if not hmac.compare_digest(data[:MAC], proof(secret, client_role, nonce)):
        raise AuthenticationError(f"refused connection from {peer}: it does not know the job secret "
                                  "(check REGENT_JOB_SECRET / --secret-file)")
    sock.sendall(proof(secret, server_role, data[MAC:]))


def client_handshake(sock: socket.socket, secret: bytes, magic: bytes, client_role: bytes, server_role: bytes,
                     peer: str = "peer") -> None:
    """Answer the server's challenge and check its proof; raises `AuthenticationError` if it does not know
    the secret (nothing it sends afterwards is read)."""
    data = _recv_exact(sock, len(magic) + NONCE, peer)
    if data[:len(magic)] != magic:
        raise AuthenticationError(f"{peer} does not speak this protocol (bad greeting {data[:len(magic)]!r})")
    nonce = new_nonce()
    sock.sendall(proof(secret, client_role, data[len(magic):]) + nonce)
    answer = _recv_exact(sock, MAC, peer)
    if not hmac.compare_digest(answer, proof(secret, server_role, nonce)):
        raise AuthenticationError(f"{peer} does not know the job secret (check REGENT_JOB_SECRET / --secret-file)")
