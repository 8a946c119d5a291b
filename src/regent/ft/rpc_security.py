"""Who may call the control plane: the job secret on every gRPC call, and TLS when certificates are given.

Why: the Lighthouse and every replica's ManagerServer take calls that change training (join a quorum, vote a
commit, kill a replica). On a shared network anyone who can reach the port could do that. Two independent
defences, each optional, applied by one server stack and one authenticator: every control-plane server is
`regent.ft.grpc_lite` built by `Security.server`, which checks calls with `CallVerifier`. grpcio remains the
client library (`Security.channel`): Regent's clients and TorchFT's stubs call through it.

**The job secret** (`regent.auth`: `$REGENT_JOB_SECRET` or `$REGENT_JOB_SECRET_FILE`; `regent train` gives one
to every process, so it is on there by default). Every call carries the metadata entry

    regent-auth: v1:<unix ms>:<nonce, 32 hex>:<HMAC-SHA256(secret, label + method + ms, nonce), hex>

The server refuses, with UNAUTHENTICATED and before the handler runs (so nothing changes), a call whose entry
is missing or malformed, whose MAC is wrong (another secret, or made for another method), whose time is more
than `CLOCK_WINDOW_S` from its own clock, or whose nonce it already accepted (a replay; nonces are remembered
for as long as their time is inside the window, and only after the MAC checked out, so only holders of the
secret can fill that memory). Each refused peer host is logged once (a warning), later refusals from it at
DEBUG. Without a secret nothing is required, and a client with a secret still talks to a server without one
(the extra metadata entry is ignored): plain TorchFT clients and servers work as before.

The secret proves who calls; it does not hide or protect the traffic. Without TLS an on-path attacker can read
the calls and, racing the real caller, use a proof it saw once. Use TLS on networks you do not trust.

**TLS** (`TLSFiles`; env `REGENT_FT_TLS_CERT`, `REGENT_FT_TLS_KEY`, `REGENT_FT_TLS_CA`,
`REGENT_FT_TLS_SERVER_NAME`; `regent train`: `--ft.tls-cert` etc.). Servers present `cert`/`key`; a server
given a `ca` also requires client certificates signed by it (mutual TLS). Clients verify the server against
`ca` (or the system's roots), present `cert`/`key` when they have them, and check the server's certificate
against `server_name` when set (one certificate for every host of a job), else against the host they dial.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from regent import auth, settings
from regent.ft import grpc_lite

logger = logging.getLogger(__name__)

AUTH_KEY = "regent-auth"
AUTH_KEY_BYTES = AUTH_KEY.encode()
VERSION = "v1"
# How far a call's time may be from the server's clock (seconds). Clusters keep clocks within milliseconds
# (NTP); a recorded call is useless once it is older than this.
CLOCK_WINDOW_S = 30.0
# Refused peers whose first refusal was logged as a warning; beyond this many, refusals go to DEBUG only.
MAX_LOGGED_PEERS = 4096
_LABEL = b"regent-grpc-call-v1 "

TLS_CERT_ENV = settings.REGENT_FT_TLS_CERT.name
TLS_KEY_ENV = settings.REGENT_FT_TLS_KEY.name
TLS_CA_ENV = settings.REGENT_FT_TLS_CA.name
TLS_SERVER_NAME_ENV = settings.REGENT_FT_TLS_SERVER_NAME.name
# "0" turns the secret off for the control plane even when the process has a job secret.
RPC_AUTH_ENV = settings.REGENT_FT_RPC_AUTH.name


def call_mac(secret: bytes, method: str, ms: int, nonce: str) -> str:
    """The MAC of one call: bound to the method, the time and the nonce (`regent.auth.proof`)."""
    return auth.proof(secret, _LABEL + method.encode() + b" " + str(ms).encode(), nonce.encode()).hex()


def make_token(secret: bytes, method: str, now: float | None = None) -> str:
    """A fresh `regent-auth` value for one call of `method` ('/package.Service/Method')."""
    ms = int((time.time() if now is None else now) * 1000)
    nonce = secrets.token_hex(16)
    return f"{VERSION}:{ms}:{nonce}:{call_mac(secret, method, ms, nonce)}"


class CallVerifier:
    """The one authenticator of every control-plane server (the Lighthouse, its front ends, each ManagerServer,
    the dashboard's kill): checks `regent-auth` values (thread-safe) and remembers accepted nonces (no replays).
    Called as `verifier(path, headers, peer)` it is `grpc_lite.Server`'s `authenticate` hook."""

    def __init__(self, secret: bytes, what: str = "server", window_s: float = CLOCK_WINDOW_S,
                 spend_nonces: bool = True, on_refuse: Callable[[], None] | None = None) -> None:
        """`spend_nonces=False`: `check` and the hook check proofs only, for a Lighthouse front end whose owner
        spends the nonces (`spend`), so replays are caught across all front ends. `on_refuse`: called after each
        refusal (a front end reports its count to the owner)."""
        self._secret = secret
        self._what = what
        self.window_s = window_s
        self._spend_nonces = spend_nonces
        self._on_refuse = on_refuse
        self._lock = threading.Lock()
        # Accepted nonces (their first 64 bits, as ints: about 100 bytes each with the queue entry; a false
        # "replay" needs two of the calls inside one window to share 64 random bits) in arrival order.
        self._seen: set[int] = set()
        self._order: collections.deque[tuple[int, int]] = collections.deque()
        self._logged: set[str] = set()
        self.accepted = 0
        self.refused = 0

    def verify(self, method: str, token: str | bytes | None, now: float | None = None, spend: bool = True) -> str | None:
        """None when the call may run (its nonce is then spent), else why it is refused. `spend=False` checks the
        proof only, for a Lighthouse front end whose owner spends the nonce (`spend`): replays are then caught
        across all front ends, not per process."""
        if token is None:
            return "no regent-auth metadata (the caller has no job secret)"
        if isinstance(token, bytes):
            try:
                token = token.decode("ascii")
            except UnicodeDecodeError:
                return "malformed regent-auth metadata"
        parts = token.split(":")
        if not token.isascii() or len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit() or len(parts[2]) != 32 \
                or len(parts[3]) != 64:
            return "malformed regent-auth metadata"
        _, ms_text, nonce, mac = parts
        try:
            key = int(nonce[:16], 16)
        except ValueError:
            return "malformed regent-auth metadata"
        ms = int(ms_text)
        now = time.time() if now is None else now
        if abs(now - ms / 1000.0) > self.window_s:
            return (f"call time {ms / 1000.0:.3f} is {now - ms / 1000.0:+.1f} s from this server's clock "
                    f"(window {self.window_s:g} s): a replay or a skewed clock")
        if not hmac.compare_digest(mac, call_mac(self._secret, method, ms, nonce)):
            return "wrong proof (another job secret, or made for another method)"
        return self.spend(ms, key, now) if spend else None

    def spend(self, ms: int, key: int, now: float | None = None) -> str | None:
        """Spend a checked proof's nonce (`proof_nonce`): None the first time, a refusal for a replay."""
        return self.spend_many([(ms, key)], now)[0]

    def spend_many(self, nonces: list[tuple[int, int]], now: float | None = None) -> list[str | None]:
        """`spend` for a batch of checked proofs (a front end's batch of calls), in order: every nonce is checked
        and spent as `spend` would, under one clock read and one lock."""
        now = time.time() if now is None else now
        cutoff = int((now - self.window_s) * 1000)
        out: list[str | None] = []
        with self._lock:
            order, seen = self._order, self._seen
            while order and order[0][0] < cutoff:
                seen.discard(order.popleft()[1])
            for ms, key in nonces:
                if key in seen:
                    out.append("replayed proof (nonce already used)")
                    continue
                seen.add(key)
                order.append((ms, key))
                self.accepted += 1
                out.append(None)
        return out

    def refuse(self, peer: str, method: str, reason: str) -> str:
        """Count and log a refusal (a warning once per peer host, then DEBUG); returns the client's message."""
        host = peer_host(peer)
        with self._lock:
            self.refused += 1
            first = host not in self._logged and len(self._logged) < MAX_LOGGED_PEERS
            if first:
                self._logged.add(host)
        log = logger.warning if first else logger.debug
        log("%s refused %s from %s: %s%s", self._what, method, host, reason,
            "; further refusals from this host are logged at DEBUG" if first else "")
        if self._on_refuse is not None:
            self._on_refuse()
        return (f"{self._what} requires the job secret: {reason}; set {auth.SECRET_ENV} or {auth.SECRET_FILE_ENV} "
                "to the job's secret")

    def check(self, method: str, token: str | bytes | None, peer: str) -> str | None:
        """`verify`, and `refuse` on failure: None or the UNAUTHENTICATED message."""
        reason = self.verify(method, token, spend=self._spend_nonces)
        return None if reason is None else self.refuse(peer, method, reason)

    def __call__(self, path: bytes, headers: list[tuple[bytes, bytes]], peer: str) -> str | None:
        """`grpc_lite.Server`'s `authenticate` hook: None to serve the call, else the UNAUTHENTICATED message."""
        token = None
        for name, value in headers:
            if name == AUTH_KEY_BYTES:
                token = value
                break
        return self.check(path.decode("ascii", "replace"), token, peer)

    @staticmethod
    def call_age(headers: list[tuple[bytes, bytes]], now: float | None = None) -> float | None:
        """`grpc_lite.Server`'s `call_age` hook: seconds since the caller signed this call (its proof's
        timestamp; the proof was checked before this is asked), or None without a well-formed proof."""
        for name, value in headers:
            if name == AUTH_KEY_BYTES:
                parts = value.split(b":")
                if len(parts) == 4 and parts[1].isdigit():
                    return (time.time() if now is None else now) - int(parts[1]) / 1000.0
                return None
        return None

    @property
    def remembered(self) -> int:
        """Nonces held now (memory use: accepted calls within the window)."""
        return len(self._seen)


def proof_nonce(token: bytes | None) -> tuple[int, int] | None:
    """(timestamp ms, nonce key) of a well-formed `regent-auth` value, as `CallVerifier.spend` takes them."""
    if token is None:
        return None
    parts = token.split(b":")
    try:
        return int(parts[1]), int(parts[2][:16], 16)
    except (IndexError, ValueError):
        return None


def peer_host(peer: str) -> str:
    """'ipv4:1.2.3.4:5678' / 'ipv6:[::1]:5678' / '1.2.3.4:5678' -> the host part (refusals are logged per host:
    each connection has a new port)."""
    for prefix in ("ipv4:", "ipv6:"):
        peer = peer.removeprefix(prefix)
    host, sep, port = peer.rpartition(":")
    host = host if sep and port.isdigit() else peer
    return host.strip("[]").replace("%5B", "").replace("%5D", "")


# ---- TLS --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths for TLS (see the module docstring); all None: no TLS."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TLSFiles:
        return cls(settings.REGENT_FT_TLS_CERT.get(environ), settings.REGENT_FT_TLS_KEY.get(environ),
                   settings.REGENT_FT_TLS_CA.get(environ), settings.REGENT_FT_TLS_SERVER_NAME.get(environ))

    def validate(self) -> None:
        """Fail early with the fix: cert and key go together, and every named file must be readable."""
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"TLS needs both a certificate and its key ({TLS_CERT_ENV} / {TLS_KEY_ENV}, "
                             "--ft.tls-cert / --ft.tls-key); only one was given")
        for name, path in (("certificate", self.cert), ("key", self.key), ("CA bundle", self.ca)):
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"TLS {name} {path} is missing or unreadable")

    def _read(self, path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))

    def server_context(self, alpn: Sequence[str] = ("h2",), require_client_cert: bool | None = None) -> ssl.SSLContext:
        """A server-side `ssl.SSLContext` (the lean gRPC server and the dashboard). gRPC needs ALPN "h2"."""
        self._need_server_pair()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)  # type: ignore[arg-type]
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        require = self.ca is not None if require_client_cert is None else require_client_cert
        if self.ca:
            ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if require else ssl.CERT_NONE
        return ctx

    def _need_server_pair(self) -> None:
        if not (self.cert and self.key):
            raise ValueError(f"a TLS server needs a certificate and its key ({TLS_CERT_ENV} / {TLS_KEY_ENV}); "
                             f"got cert={self.cert!r} key={self.key!r}")

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


# ---- what a process uses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Security:
    """The secret (None: calls are not authenticated) and TLS files of one server or client."""

    secret: bytes | None = None
    tls: TLSFiles = field(default_factory=TLSFiles)

    @classmethod
    def resolve(cls, secret: bytes | None = None, tls: TLSFiles | None = None) -> Security:
        """Arguments win; None takes the environment (the job secret unless `REGENT_FT_RPC_AUTH=0`; the
        `REGENT_FT_TLS_*` files). `secret=b""` / `tls=TLSFiles()` turn either off explicitly."""
        if secret is None and settings.REGENT_FT_RPC_AUTH.get():
            secret = auth.job_secret_from_env()
        tls = TLSFiles.from_env() if tls is None else tls
        tls.validate()
        return cls(secret or None, tls)

    @property
    def scheme(self) -> str:
        return "https" if self.tls.enabled else "http"

    def describe(self) -> str:
        """For logs: what protects this endpoint (never the secret itself)."""
        parts = ["job secret" if self.secret else "no secret", "TLS" if self.tls.enabled else "no TLS"]
        if self.tls.enabled and self.tls.ca and self.tls.cert:
            parts[-1] = "mutual TLS"
        return ", ".join(parts)

    # -- clients --
    def channel(self, target: str, options: Sequence[tuple[str, Any]] | None = None,
                force_tls: bool = False) -> grpc.Channel:
        """A channel to `target` ('host:port'): TLS when configured (or `force_tls`, e.g. an https:// address:
        then the system's roots verify the server), every call signed when a secret is set."""
        opts = list(options or [])
        if self.tls.enabled or force_tls:
            channel = grpc.secure_channel(target, self.tls.channel_credentials(), options=opts + self.tls.channel_options())
        else:
            channel = grpc.insecure_channel(target, options=opts)
        if self.secret:
            channel = SigningChannel(channel, self.secret)
        return channel

    def sign(self, method: str) -> list[tuple[str, str]]:
        """Metadata for one call (for code that calls without `channel`); empty without a secret."""
        return [(AUTH_KEY, make_token(self.secret, method))] if self.secret else []

    # -- servers --
    def server(self, handlers: dict[str, grpc_lite.Handler], what: str,
               verifier: CallVerifier | None = None) -> grpc_lite.Server:
        """The one way a control-plane gRPC server is built (`what`: 'Lighthouse', 'ManagerServer', for logs):
        `grpc_lite` with the secret's check (`verifier`, else a new `CallVerifier` when a secret is set) and TLS
        when configured."""
        if verifier is None and self.secret:
            verifier = CallVerifier(self.secret, what)
        return grpc_lite.Server(
            handlers, authenticate=verifier, ssl=self.tls.server_context() if self.tls.enabled else None,
            volatile_header=AUTH_KEY_BYTES if verifier is not None else b"",
            call_age=verifier.call_age if verifier is not None else None)


class _SignedUnaryUnary:
    """A unary method whose every call (and every retry: each is a new call) carries a fresh proof."""

    __slots__ = ("_inner", "_method", "_secret")

    def __init__(self, inner: Any, method: str, secret: bytes) -> None:
        self._inner, self._method, self._secret = inner, method, secret

    def _metadata(self, metadata: Any) -> list[tuple[str, str]]:
        out = list(metadata or ())
        out.append((AUTH_KEY, make_token(self._secret, self._method)))
        return out

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any) -> Any:
        return self._inner(request, timeout=timeout, metadata=self._metadata(metadata), **kw)

    def with_call(self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any) -> Any:
        return self._inner.with_call(request, timeout=timeout, metadata=self._metadata(metadata), **kw)

    def future(self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any) -> Any:
        return self._inner.future(request, timeout=timeout, metadata=self._metadata(metadata), **kw)


class SigningChannel(grpc.Channel):
    """A channel whose unary calls carry the secret's proof. Why not `grpc.intercept_channel`: grpcio's
    interceptor machinery cost ~200 us per call here, this wrapper about the price of the HMAC. Stubs
    generated for TorchFT's services use it unchanged; streaming methods (none in the control plane) are
    passed through unsigned."""

    def __init__(self, channel: grpc.Channel, secret: bytes) -> None:
        self._channel = channel
        self._secret = secret

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    **kw: Any) -> Any:
        inner = self._channel.unary_unary(method, request_serializer=request_serializer,
                                          response_deserializer=response_deserializer, **kw)
        name = method.decode() if isinstance(method, bytes) else method
        return _SignedUnaryUnary(inner, name, self._secret)

    def unary_stream(self, *args: Any, **kw: Any) -> Any:
        return self._channel.unary_stream(*args, **kw)

    def stream_unary(self, *args: Any, **kw: Any) -> Any:
        return self._channel.stream_unary(*args, **kw)

    def stream_stream(self, *args: Any, **kw: Any) -> Any:
        return self._channel.stream_stream(*args, **kw)

    def subscribe(self, callback: Callable, try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Callable) -> None:
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SigningChannel:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


# ---- the dashboard's one action ----------------------------------------------------------------------------

DASHBOARD_AUTH_HEADER = "X-Regent-Auth"


def dashboard_kill_method(replica_id: str) -> str:
    """What a dashboard kill's proof is bound to (so it kills only the replica it names)."""
    return f"dashboard:kill:{replica_id}"


def dashboard_kill_headers(secret: bytes | None, replica_id: str) -> dict[str, str]:
    """Headers for `POST /replica/<id>/kill` on a Lighthouse that has a job secret."""
    return {DASHBOARD_AUTH_HEADER: make_token(secret, dashboard_kill_method(replica_id))} if secret else {}
