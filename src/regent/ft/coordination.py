"""TorchFT's `torchft.coordination`: the Lighthouse and Manager servers and their clients, for code that
drives the protocol itself (tests, custom launchers, tools).

`LighthouseServer` / `LighthouseClient` are Regent's own (they speak TorchFT's wire protocol, so either side
interoperates with TorchFT's). `ManagerServer` is the per-replica-group server the `Manager` starts on group
rank 0; `ManagerClient` talks to one from any process.
"""

from __future__ import annotations

import datetime
import random
import time
from typing import Any

import grpc

from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import (
    BACKOFF_JITTER_S,
    BACKOFF_START_S,
    CHANNEL_OPTIONS,
    LighthouseClient,
    next_backoff,
)
from regent.ft.manager_server import ManagerServer, _result_from_proto, _rpc_error
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.recovery import QuorumResult
from regent.ft.rpc_security import Security, TLSFiles
from regent.ft.types import Quorum, QuorumMember, to_seconds

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer", "Quorum", "QuorumMember",
           "QuorumResult"]


class ManagerClient:
    """A client of one replica group's ManagerServer (TorchFT's `ManagerClient(addr, connect_timeout)`).

    Args:
        addr: the ManagerServer's address ("host:port", optionally "http://" or "https://" in front).
        connect_timeout: how long a call keeps retrying while the server is unreachable (timedelta or s).
        secret: (Regent) the job secret each call proves; None takes the environment, b"" turns it off.
        tls: (Regent) the TLS files; None takes the environment, TLSFiles() turns TLS off.
    """

    def __init__(self, addr: str, connect_timeout: datetime.timedelta | float = 60.0, *,
                 secret: bytes | None = None, tls: TLSFiles | None = None) -> None:
        """`secret` / `tls` (Regent): the job secret each call proves and the TLS files; None takes the
        environment (`regent.ft.rpc_security`), `b""` / `TLSFiles()` turn them off."""
        https = addr.strip().startswith("https://")
        self._addr = addr.removeprefix("http://").removeprefix("https://")
        self._connect_timeout = to_seconds(connect_timeout)
        self._channel = Security.resolve(secret, tls).channel(self._addr, options=CHANNEL_OPTIONS, force_tls=https)
        self._stub = torchft_pb2_grpc.ManagerServiceStub(self._channel)

    def _call(self, what: str, method: Any, request: Any, timeout: datetime.timedelta | float) -> Any:
        """One call; while the server is unreachable (not up yet, or restarting) it is retried with a short
        backoff for up to `connect_timeout`. No `channel_ready_future`: its polling thread outlives a cancel by
        up to 0.2 s and raised "Channel closed!" in that thread when the client was closed soon after a call."""
        timeout_s = to_seconds(timeout)
        first_unavailable: float | None = None
        backoff = BACKOFF_START_S
        while True:
            try:
                return method(request, timeout=timeout_s)
            except grpc.RpcError as err:
                if (err.code() if hasattr(err, "code") else None) != grpc.StatusCode.UNAVAILABLE:
                    raise _rpc_error(what, self._addr, err) from None
                now = time.monotonic()
                first_unavailable = now if first_unavailable is None else first_unavailable
                left = first_unavailable + self._connect_timeout - now
                if left <= 0:
                    raise TimeoutError(f"{what}: ManagerServer {self._addr} not reachable within "
                                       f"{self._connect_timeout:.3g} s") from None
                time.sleep(min(left, backoff + random.uniform(0, BACKOFF_JITTER_S)))
                backoff = next_backoff(backoff)

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                timeout: datetime.timedelta | float, init_sync: bool = True, commit_failures: int = 0) -> QuorumResult:
        """Join this step's quorum for `group_rank`; returns when every rank of the group and the Lighthouse
        have answered."""
        request = torchft_pb2.ManagerQuorumRequest(
            group_rank=group_rank, step=step, checkpoint_metadata=checkpoint_metadata, shrink_only=shrink_only,
            init_sync=init_sync, commit_failures=commit_failures)
        return _result_from_proto(self._call("quorum", self._stub.Quorum, request, timeout))

    def _checkpoint_metadata(self, rank: int, timeout: datetime.timedelta | float) -> str:
        """Where group rank `rank` of that replica serves its state to healers."""
        request = torchft_pb2.CheckpointMetadataRequest(rank=rank)
        return self._call("checkpoint_metadata", self._stub.CheckpointMetadata, request, timeout).checkpoint_metadata

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: datetime.timedelta | float) -> bool:
        """This rank's vote; returns the group's decision (True only if every rank voted True)."""
        request = torchft_pb2.ShouldCommitRequest(group_rank=group_rank, step=step, should_commit=should_commit)
        return bool(self._call("should_commit", self._stub.ShouldCommit, request, timeout).should_commit)

    def kill(self, msg: str, timeout: datetime.timedelta | float = 10.0) -> None:
        """Ask the replica to exit (status 1); its supervisor restarts it."""
        self._call("kill", self._stub.Kill, torchft_pb2.KillRequest(msg=msg), timeout)

    def close(self) -> None:
        self._channel.close()
