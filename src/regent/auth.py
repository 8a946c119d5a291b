"""The job secret and the challenge-response that proves knowledge of it (no torch, no actors: shared by
`regent.actor`'s transport and `regent.ft`'s state transfer).

Where the secret comes from: `$REGENT_JOB_SECRET` (hex), else the file named by `$REGENT_JOB_SECRET_FILE`.
The actor runtime puts it in the environment of every process it spawns, so under `regent train` every
trainer process has it. A `regent.actor` client or `regent worker` given neither uses this user's default
secret (`user_secret`: a 0600 file made on first use), so the same user's programs find each other with
nothing set while other users still cannot connect.

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
import os
import secrets
import socket
import tempfile

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


class InsecureSecretFile(ValueError):
    """The default secret file could be read or replaced by another user: using it would let them connect."""


def user_secret_path() -> str | None:
    """Where this user's default job secret lives: $REGENT_USER_SECRET_FILE, else
    $XDG_CONFIG_HOME/regent/job-secret (~/.config/...); None when REGENT_USER_SECRET_FILE turns it off."""
    if settings.REGENT_USER_SECRET_FILE.is_set():
        return settings.REGENT_USER_SECRET_FILE.get()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "regent", "job-secret")


def user_secret() -> bytes | None:
    """This user's default job secret, made (32 random bytes, mode 0600) on first use; None when turned off.

    Why: Monarch's workers need no configuration (`run_worker_loop_forever(address)`), but a worker that proves
    nothing runs code for anyone who reaches its port. A per-user file keeps Monarch's zero configuration for
    the same user on one host (or a shared home) while another user, who cannot read the file, cannot attach.
    Raises `InsecureSecretFile` (one line naming the fix) when the file is another user's or readable by
    others, OSError when it cannot be made (a read-only home)."""
    path = user_secret_path()
    if path is None:
        return None
    if not os.path.exists(path):
        _make_secret_file(path)
    fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd) as f:
        check_private(path, os.fstat(fd))
        text = f.read().strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InsecureSecretFile(f"{path} does not hold a hex secret; delete it to make a new one") from None


def check_private(path: str, st: os.stat_result) -> None:
    """Refuse a secret file another user owns or can read (group/other permission bits set)."""
    if st.st_uid != os.getuid():
        raise InsecureSecretFile(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                                 "delete it, or set REGENT_JOB_SECRET_FILE to a secret of your own")
    if st.st_mode & 0o077:
        raise InsecureSecretFile(f"{path} can be read by other users (mode {st.st_mode & 0o777:o}); "
                                 f"run `chmod 600 {path}`")


def _make_secret_file(path: str) -> None:
    """Write a fresh secret under a temporary name and hard-link it into place: a process that reads the file
    never sees it half written, and of two processes making it at once the first wins and both use its."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".job-secret-", dir=directory)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: its secret is the one
    finally:
        os.unlink(tmp)


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
