"""TorchFT's `torchft.coordination`: the Lighthouse and Manager servers and their clients, for code that
drives the protocol itself (tests, custom launchers, tools).

`LighthouseServer` / `LighthouseClient` are Regent's own (they speak TorchFT's wire protocol, so either side
interoperates with TorchFT's). `ManagerServer` is the per-replica-group server the `Manager` starts on group
rank 0; `ManagerClient` talks to one from any process.
"""

from __future__ import annotations

import datetime
from typing import Any

import grpc

from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient
from regent.ft.manager import ManagerServer, _result_from_proto, _rpc_error
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.recovery import QuorumResult
from regent.ft.rpc_security import Security, TLSFiles
from regent.ft.types import Quorum, QuorumMember, to_seconds

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer", "Quorum", "QuorumMember",
           "QuorumResult"]


class ManagerClient:
    """A client of one replica group's ManagerServer (TorchFT's `ManagerClient(addr, connect_timeout)`)."""

    def __init__(self, addr: str, connect_timeout: datetime.timedelta | float = 60.0, *,
                 secret: bytes | None = None, tls: TLSFiles | None = None) -> None:
        """`secret` / `tls` (Regent): the job secret each call proves and the TLS files; None takes the
        environment (`regent.ft.rpc_security`), `b""` / `TLSFiles()` turn them off."""
        https = addr.strip().startswith("https://")
        self._addr = addr.removeprefix("http://").removeprefix("https://")
        self._connect_timeout = to_seconds(connect_timeout)
        self._channel = Security.resolve(secret, tls).channel(self._addr, force_tls=https)
        self._stub = torchft_pb2_grpc.ManagerServiceStub(self._channel)

    def _call(self, what: str, method: Any, request: Any, timeout: datetime.timedelta | float) -> Any:
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=self._connect_timeout)
            return method(request, timeout=to_seconds(timeout))
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"{what}: ManagerServer {self._addr} not reachable within "
                               f"{self._connect_timeout:.3g} s") from None
        except grpc.RpcError as err:
            raise _rpc_error(what, self._addr, err) from None
        finally:
            # a future that timed out stays subscribed: grpc's polling thread would then raise "Channel closed!"
            # once this client is closed (an unhandled exception in a thread); cancelling unsubscribes it
            ready.cancel()

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
