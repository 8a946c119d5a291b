"""Client for a Lighthouse (Regent's or TorchFT's: both speak the same gRPC protocol).

Why a retry loop of our own: the Lighthouse may restart on the same address. While it is down every call
fails fast with UNAVAILABLE; we retry with exponential backoff (100 ms x1.5 up to 1 s, plus jitter; TorchFT's
client goes up to 10 s, we stay at 1 s so a restarted Lighthouse is found within about a second) until the
call's own deadline or `connect_timeout`, whichever comes first. A Quorum request that was in flight when the
server died is simply sent again to the new server, which is how a fresh quorum forms after a restart. The
channel itself redials with the same short backoff, so one channel serves across restarts.

Unlike TorchFT's client, the constructor does not dial: an unreachable Lighthouse is reported by the first
call, after `connect_timeout` (or the call's own timeout, if shorter).

Security (`regent.ft.rpc_security`): with a job secret (`secret=`, else `$REGENT_JOB_SECRET`) every call,
and every retry, carries a fresh proof of it; a Lighthouse without a secret ignores it, so this client works
against TorchFT's. With TLS files (`tls=`, else `$REGENT_FT_TLS_*`), or an https:// address, the channel is TLS.

`unavailable_since` (monotonic seconds, or None) says since when every call has found the Lighthouse unreachable:
set by the first UNAVAILABLE of any call, cleared by any answer. A Quorum call with `give_up` stops retrying once
that says so (`LighthouseUnavailable`): a ManagerServer that may reuse its last quorum through an outage
(`regent.ft.quorum_reuse`) asks its peers instead of waiting here.

Errors: DEADLINE_EXCEEDED / CANCELLED -> TimeoutError; unreachable -> ConnectionError naming the address and
the fix; UNAUTHENTICATED (wrong or missing secret) -> `regent.auth.AuthenticationError`, at once, not retried; anything else ->
RuntimeError.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from regent.auth import AuthenticationError
from regent.ft.compact import CompactQuorum
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.rpc_security import Security, TLSFiles
from regent.ft.types import Quorum, QuorumMember, to_seconds

logger = logging.getLogger(__name__)

T = TypeVar("T")

# HTTP/2 keepalive like TorchFT's client; fast reconnects so a restarted Lighthouse is found within ~1 s.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 0),
]

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 1.0
BACKOFF_FACTOR = 1.5
BACKOFF_JITTER_S = 0.1


class LighthouseUnavailable(ConnectionError):
    """A call's `give_up` stopped its retries while the Lighthouse was unreachable."""


def normalize_address(addr: str) -> str:
    """'http://host:port' or 'host:port' -> 'host:port' (the form grpc wants)."""
    addr = addr.strip()
    for prefix in ("http://", "https://", "grpc://"):
        if addr.startswith(prefix):
            addr = addr[len(prefix) :]
    addr = addr.rstrip("/")
    if not addr:
        raise ValueError("empty Lighthouse address; pass host:port, e.g. --lighthouse http://127.0.0.1:29510")
    return addr


def next_backoff(current: float) -> float:
    """Exponential backoff step: x1.5 up to BACKOFF_MAX_S."""
    return min(current * BACKOFF_FACTOR, BACKOFF_MAX_S)


class LighthouseClient:
    """Blocking, thread-safe client. One channel, reused across calls and across Lighthouse restarts.

    Args:
        addr: the Lighthouse's address ("host:port", optionally "http://" or "https://" in front).
        connect_timeout: how long a call keeps retrying while the Lighthouse is unreachable.
        secret: (Regent) the job secret; None takes the environment, b"" turns it off.
        tls: (Regent) the TLS files; None takes the environment, TLSFiles() turns TLS off.
    """

    def __init__(self, addr: str, connect_timeout: timedelta | float = 60, *, secret: bytes | None = None,
                 tls: TLSFiles | None = None) -> None:
        """`secret` / `tls`: None takes the environment; `b""` / `TLSFiles()` turn them off."""
        self._https = addr.strip().startswith("https://")
        self._security = Security.resolve(secret, tls)
        self._target = normalize_address(addr)
        self._connect_timeout = to_seconds(connect_timeout)
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: torchft_pb2_grpc.LighthouseServiceStub | None = None
        self.unavailable_since: float | None = None
        self._connect()

    @property
    def target(self) -> str:
        return self._target

    def _connect(self) -> torchft_pb2_grpc.LighthouseServiceStub:
        with self._lock:
            if self._stub is None:
                self._channel = self._security.channel(self._target, CHANNEL_OPTIONS, force_tls=self._https)
                self._stub = torchft_pb2_grpc.LighthouseServiceStub(self._channel)
            return self._stub

    def close(self) -> None:
        """Close the channel; calls in flight on it end with TimeoutError (gRPC CANCELLED)."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta | float,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: dict | None = None,
        commit_failures: int = 0,
        *,
        compact: bool | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> Quorum:
        """Join the next quorum and block until one that includes this replica is issued, or `timeout`.

        `compact` (Regent extension): None asks for TorchFT's full answer; True / False ask a Regent Lighthouse
        for this member's share only (`regent.ft.compact`), computed with init_sync = `compact`. The answer is
        then a `Quorum` whose `compact` holds the share and whose `participants` is empty; a Lighthouse that does
        not know the extension (TorchFT's) answers in full, and `compact` stays None.

        `give_up` (Regent extension): asked each time the Lighthouse is found unreachable; True ends the call
        with `LighthouseUnavailable` instead of retrying until it answers."""
        member = QuorumMember(
            replica_id=replica_id,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=dict(data or {}),
            commit_failures=commit_failures,
        )
        request = torchft_pb2.LighthouseQuorumRequest(requester=member.to_proto())
        if compact is not None:
            request.regent_compact.init_sync = compact
            request.regent_compact.SetInParent()
        response = self._call("Quorum", lambda stub, t: stub.Quorum(request, timeout=t), timeout, give_up)
        quorum = Quorum.from_proto(response.quorum)
        if compact is not None and response.quorum.HasField("regent_compact"):
            quorum = dataclasses.replace(quorum, compact=CompactQuorum(
                replica_id, quorum.quorum_id, quorum.committed_step, compact, response.quorum.regent_compact))
        return quorum

    def heartbeat(self, replica_id: str, timeout: timedelta | float = 5.0,
                  committed: tuple[int, int, int, int] | None = None) -> None:
        """Tell the Lighthouse this replica is alive; only heartbeating replicas count toward a quorum.

        `committed` (Regent extension, skipped by a TorchFT Lighthouse): (step, lineage, accepted_loss,
        accepted_lineage) of the state this replica holds; it feeds the Lighthouse's committed watermark. The last
        two name the watermark this replica accepts losing after restoring older state (0, 0: none)."""
        request = torchft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id)
        if committed is not None:
            step, lineage, accepted, accepted_lineage = committed
            request.regent_committed.CopyFrom(torchft_pb2.RegentCommitted(
                step=step, lineage=lineage, accepted_loss=accepted, accepted_lineage=accepted_lineage))
        self._call("Heartbeat", lambda stub, t: stub.Heartbeat(request, timeout=t), timeout)

    def holders(self, replica_id: str = "", timeout: timedelta | float = 10.0) -> tuple[int, int, list[QuorumMember]]:
        """(watermark step, watermark lineage, live replicas holding it) — a Regent Lighthouse only.

        A restarted replica asks this before its first quorum, to pull the committed state from a holder at
        once (`Manager.recover_committed`) instead of waiting for the holders' next sync."""
        request = torchft_pb2.RegentHoldersRequest(replica_id=replica_id)
        reply = self._call("RegentHolders", lambda stub, t: stub.RegentHolders(request, timeout=t), timeout)
        return (reply.watermark.step, reply.watermark.lineage,
                [QuorumMember.from_proto(m) for m in reply.holders])

    def _call(
        self,
        name: str,
        invoke: Callable[[torchft_pb2_grpc.LighthouseServiceStub, float], T],
        timeout: timedelta | float,
        give_up: Callable[[], bool] | None = None,
    ) -> T:
        timeout_s = to_seconds(timeout)
        start = time.monotonic()
        deadline = start + timeout_s
        first_unavailable: float | None = None
        backoff = BACKOFF_START_S
        last_detail = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if first_unavailable is not None:
                    raise self._unreachable(time.monotonic() - first_unavailable, last_detail)
                raise TimeoutError(f"Lighthouse {name} at {self._target} timed out after {timeout_s:.3g} s")
            stub = self._connect()
            try:
                answer = invoke(stub, remaining)
                self.unavailable_since = None
                return answer
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                detail = err.details() if hasattr(err, "details") else str(err)
                if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    raise TimeoutError(
                        f"Lighthouse {name} at {self._target} timed out after {timeout_s:.3g} s: {detail}"
                    ) from None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthenticationError(
                        f"Lighthouse {name} at {self._target} refused this process: {detail}") from None
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise RuntimeError(f"Lighthouse {name} at {self._target} failed: {code}: {detail}") from None
                now = time.monotonic()
                if self.unavailable_since is None:
                    self.unavailable_since = now
                if give_up is not None and give_up():
                    raise LighthouseUnavailable(f"Lighthouse {name} at {self._target}: unavailable ({detail}); "
                                                "the caller stopped waiting for it") from None
                if first_unavailable is None:
                    first_unavailable = now
                    logger.info("Lighthouse at %s unavailable (%s); retrying", self._target, detail)
                last_detail = detail or ""
                waited = now - first_unavailable
                if waited >= self._connect_timeout:
                    raise self._unreachable(waited, last_detail) from None
                pause = min(
                    backoff + random.uniform(0, BACKOFF_JITTER_S),
                    max(0.0, deadline - now),
                    max(0.0, first_unavailable + self._connect_timeout - now),
                )
                backoff = next_backoff(backoff)
                if pause > 0:
                    time.sleep(pause)

    def _unreachable(self, waited: float, detail: str) -> ConnectionError:
        return ConnectionError(
            f"Lighthouse at {self._target} unreachable after {waited:.1f} s ({detail}); "
            "is it running? set --lighthouse (or TORCHFT_LIGHTHOUSE) to its address"
        )
