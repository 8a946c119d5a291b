"""The ManagerServer: TorchFT's ManagerService for one replica group, hosted by group rank 0.

It gathers the group's ranks into one Lighthouse quorum call per step and answers each rank its own share of
the result (`regent.ft.recovery.compute_quorum_results`), holds the group-wide commit barrier
(`ShouldCommit`), serves the checkpoint metadata healers dial (`CheckpointMetadata`), heartbeats the
Lighthouse with the replica's committed (step, lineage), and reports each commit to it before any rank applies
it. The per-rank `regent.ft.manager.Manager` is its only client in Regent; TorchFT's `ManagerClient`
(`regent.ft.coordination`) speaks to it too.

Serving: `regent.ft.grpc_lite` (the control plane's one gRPC server, built by `Security.server`) on an asyncio
loop in its own thread. The handlers block (each waits, on a condition, for the group's other ranks), so each
call runs in a worker thread of a pool sized for the group: two calls per rank can wait at once (a Quorum and a
ShouldCommit) plus the CheckpointMetadata calls of healing peers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import threading
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from regent import settings
from regent.eventloop import new_event_loop
from regent.ft import grpc_lite
from regent.ft.lighthouse_client import LighthouseClient, LighthouseUnavailable
from regent.ft.proto import torchft_pb2
from regent.ft.quorum_reuse import agree_to_reuse, agree_to_reuse_counted, reissue, reused_step
from regent.ft.recovery import (
    ACCEPTED_LOSS_KEY,
    LINEAGE_KEY,
    QuorumResult,
    compute_quorum_results,
    state_version,
)
from regent.ft.rpc_security import Security, TLSFiles
from regent.ft.types import Quorum, to_seconds

logger = logging.getLogger(__name__)

# A commit is reported to the Lighthouse before the ranks apply it; this bounds the wait on a slow Lighthouse.
COMMIT_REPORT_TIMEOUT_S = 1.0
# Above this many members a ManagerServer asks the Lighthouse for the compact quorum answer (REGENT_COMPACT_QUORUM)
COMPACT_AUTO_MEMBERS = 64
# How long connecting to (and each call of) the TCPStore a quorum reuse is agreed in may take.
REUSE_STORE_TIMEOUT_S = 5.0
# At shutdown, calls in flight get this long to end (their waits are woken with CANCELLED) before the server
# answers the rest with UNAVAILABLE.
SHUTDOWN_GRACE_S = 0.5


class _Round:
    """One barrier round: every group rank contributes, the last one triggers the result."""

    def __init__(self) -> None:
        self.arrived: dict[int, Any] = {}
        self.done = False
        self.result: Any = None
        self.error: Exception | None = None


class LocalRpcError(grpc.RpcError):
    """What a `ManagerServer` handler raises when group rank 0 calls it in-process (see `_LocalCall`): the same
    code()/details() as a gRPC error, so callers handle both paths alike."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _LocalCall:
    """A handler's view of its call: the deadline, and `abort`. The same object serves calls that came over
    gRPC (`ManagerServer._serve`) and group rank 0's direct calls to its own ManagerServer.

    Why the direct call: rank 0 hosts the ManagerServer, and a gRPC round trip to itself (serialize, loopback,
    a worker thread, deserialize) cost about 1 ms of every `start_quorum`; it runs the same handler code."""

    def __init__(self, timeout: float | None) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout

    @classmethod
    def until(cls, deadline: float | None) -> _LocalCall:
        """A call that ends at `deadline` (`time.monotonic()` seconds; None: no deadline)."""
        call = cls(None)
        call._deadline = deadline
        return call

    def time_remaining(self) -> float | None:
        """Seconds left (None without a deadline, as grpcio says it)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise LocalRpcError(code, details)


class ManagerServer:
    """TorchFT's ManagerService for one replica group: quorum aggregation, commit barrier, kill, heartbeats.

    With a job secret (`secret=`, else `$REGENT_JOB_SECRET`) every call must carry a fresh proof of it
    (`regent.ft.rpc_security`), checked before any handler runs; with TLS files (`tls=`, else
    `$REGENT_FT_TLS_*`) it serves TLS. Its own Lighthouse client uses the same.

    Args:
        replica_id: this replica group's id, as the Lighthouse knows it.
        lighthouse_addr: the Lighthouse's address.
        hostname: the name peers reach this server by.
        store_address: the group's TCPStore ("host:port"); TorchFT spells it `store_addr`.
        world_size: the number of ranks in the group; a quorum request waits for all of them.
        bind: the address to listen on ("[::]:0" picks a free port).
        heartbeat_interval: how often the Lighthouse is told this group is alive.
        connect_timeout: how long to keep trying to reach the Lighthouse.
        quorum_retries: how many times a failed Lighthouse quorum call is retried.
        secret: (Regent) the job secret; None takes the environment.
        tls: (Regent) the TLS files; None takes the environment.
        quorum_reuse: (Regent) while the Lighthouse is unreachable, the last quorum's members may agree to keep
            it for the next step (`regent.ft.quorum_reuse`) instead of waiting for the Lighthouse.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        store_address: str | None = None,
        world_size: int = 1,
        bind: str | None = None,
        heartbeat_interval: float | datetime.timedelta = 0.1,
        connect_timeout: float | datetime.timedelta = 60.0,
        quorum_retries: int = 0,
        *,
        store_addr: str | None = None,
        secret: bytes | None = None,
        tls: TLSFiles | None = None,
        quorum_reuse: bool = False,
    ) -> None:
        store_address = _one_of("store_address", store_address, "store_addr", store_addr)  # TorchFT: store_addr
        if store_address is None:
            raise TypeError("ManagerServer: store_address (TorchFT: store_addr) is required")
        heartbeat_interval, connect_timeout = to_seconds(heartbeat_interval), to_seconds(connect_timeout)
        self.replica_id = replica_id
        self.store_address = store_address
        self.world_size = world_size
        self.quorum_retries = quorum_retries
        # Ask the Lighthouse for the compact quorum answer (regent.ft.compact; a TorchFT Lighthouse answers in
        # full anyway): "auto" once a quorum had more than COMPACT_AUTO_MEMBERS members (small runs keep the
        # member list: events name the members and `peer_failed` checks membership exactly), "1" always, "0" never.
        self.compact_quorum = settings.REGENT_COMPACT_QUORUM.get()
        self._last_members = 0
        self.quorum_reuse = quorum_reuse
        self._last_quorum: Quorum | None = None  # the last quorum this group trained in (from the Lighthouse or reused)
        self.quorums_reused = 0  # steps that went on without the Lighthouse (read by the Manager for its events)
        self._lighthouse_addr = lighthouse_addr
        self._connect_timeout = connect_timeout
        self.security = Security.resolve(secret, tls)
        self._client = LighthouseClient(lighthouse_addr, connect_timeout=connect_timeout,
                                        secret=self.security.secret or b"", tls=self.security.tls)
        self._cond = threading.Condition()
        self._quorum_round = _Round()
        self._commit_round = _Round()
        self._metadata: dict[int, str] = {}
        # quorum id of the last committed step (see `recovery.state_version`) and of the latest quorum
        self._lineage = 0
        self.heal_lineage = 0  # lineage of the up-to-date members of the latest quorum (see Manager._apply_pending_state)
        self._round_quorum_id: int | None = None
        # What the heartbeats report (Regent extension): the committed step (set at each commit, and by the
        # Manager of group rank 0 when it loads state).
        self.committed_step = 0
        # The watermark (step, lineage) this replica accepts losing after restoring older state; None: none.
        self.accepted: tuple[int, int] | None = None
        self._committed_meta: dict[int, str] = {}
        self._stopped = threading.Event()
        self._lighthouse_unreachable = False  # set when a commit report failed, cleared by the next heartbeat
        self._beat_now = threading.Event()  # set at a commit: tell the Lighthouse now, not at the next beat
        self._calls: set[asyncio.Future] = set()  # calls being served over gRPC (loop thread): shutdown lets them end
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * world_size + 8,
                                                           thread_name_prefix="regent-mgr")
        self._loop = new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="regent-mgr-rpc", daemon=True)
        self._loop_thread.start()
        self._server = self.security.server(grpc_lite.method_table("torchft.ManagerService", {
            "Quorum": self._method(self.Quorum, torchft_pb2.ManagerQuorumRequest),
            "CheckpointMetadata": self._method(self.CheckpointMetadata, torchft_pb2.CheckpointMetadataRequest),
            "ShouldCommit": self._method(self.ShouldCommit, torchft_pb2.ShouldCommitRequest),
            "Kill": self._method(self.Kill, torchft_pb2.KillRequest),
        }), "ManagerServer")
        from regent.ft.lighthouse import parse_bind

        host, port = parse_bind(bind or f"{hostname}:0")
        try:
            port = asyncio.run_coroutine_threadsafe(self._server.start(host, port), self._loop).result()
        except OSError as err:
            self._stop_loop()
            raise OSError(f"ManagerServer could not bind {bind or hostname + ':0'} ({err}); set hostname/port") \
                from err
        except BaseException:
            self._stop_loop()
            raise
        self._address = f"{hostname}:{port}"
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="regent-heartbeat", daemon=True)
        self._heartbeat_thread.start()
        logger.info("ManagerServer %s for %s at %s (%s)", replica_id, lighthouse_addr, self._address,
                    self.security.describe())

    def address(self) -> str:
        return self._address

    @property
    def lighthouse_client(self) -> LighthouseClient:
        """This group's client of the Lighthouse (the Manager asks it who holds the committed state)."""
        return self._client

    def shutdown(self) -> None:
        """Stop serving; calls waiting for group ranks or the Lighthouse end with CANCELLED now."""
        self._stopped.set()
        self._beat_now.set()
        with self._cond:
            self._cond.notify_all()
        self._client.close()
        if self._loop.is_running():
            stopped = asyncio.run_coroutine_threadsafe(self._stop_serving(), self._loop)
            try:
                stopped.result(timeout=5)
            except (concurrent.futures.TimeoutError, RuntimeError) as err:  # a wedged loop: the process is ending it anyway
                logger.warning("ManagerServer %s: gRPC server did not stop cleanly: %s", self.replica_id, err)
        self._stop_loop()

    async def _stop_serving(self) -> None:
        """Let the calls woken by the shutdown send their answers (CANCELLED), then stop the server."""
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=SHUTDOWN_GRACE_S)
        await asyncio.sleep(0)  # the server's own done-callbacks (which write the answers) run first
        await self._server.stop()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()
        self._pool.shutdown(wait=False)

    def _method(self, handler: Any, request_type: Any) -> grpc_lite.Handler:
        """A `grpc_lite` handler that runs the blocking `handler(message, context)` in a worker thread."""

        def serve(request: bytes, deadline: float | None) -> asyncio.Future:
            call = self._loop.run_in_executor(self._pool, self._serve, handler, request_type, request, deadline)
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
            return call

        return serve

    def _serve(self, handler: Any, request_type: Any, request: bytes, deadline: float | None) -> bytes:
        """One call over gRPC, in a worker thread: decode, run the handler, encode; an abort becomes the status."""
        try:
            message = request_type.FromString(request)
        except DecodeError as err:
            raise grpc_lite.RpcStatusError(grpc_lite.StatusCode.INVALID_ARGUMENT, f"bad request: {err}") from None
        try:
            return handler(message, _LocalCall.until(deadline)).SerializeToString()
        except LocalRpcError as err:
            raise grpc_lite.RpcStatusError(err.code().value[0], err.details()) from None

    def _wait_round(self, rnd: _Round, context: Any, what: str) -> None:
        """Wait (holding `_cond`) until `rnd` is done; abort on the call's deadline or a shutdown."""
        if not self._cond.wait_for(lambda: rnd.done or self._stopped.is_set(), timeout=context.time_remaining()):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, what)
        if not rnd.done:
            context.abort(grpc.StatusCode.CANCELLED, "ManagerServer shut down")

    def _heartbeat_loop(self) -> None:
        failing_since: float | None = None
        while not self._stopped.is_set():
            self._beat_now.wait(self._heartbeat_interval)
            self._beat_now.clear()
            if self._stopped.is_set():
                break
            try:
                self.heartbeat_now(timeout=max(1.0, 10 * self._heartbeat_interval))
                self._lighthouse_unreachable = False
                if failing_since is not None:
                    logger.info("heartbeats to the Lighthouse resumed")
                failing_since = None
            except Exception as err:  # noqa: BLE001 - reported once per outage; the heartbeat thread must keep beating
                if failing_since is None:
                    failing_since = time.monotonic()
                    logger.warning("heartbeat to Lighthouse %s failed: %s", self._lighthouse_addr, err)

    def heartbeat_now(self, timeout: float = 5.0) -> None:
        """One heartbeat with this replica's committed state (also sent before a quorum after a restore)."""
        self._client.heartbeat(self.replica_id, timeout=timeout,
                               committed=(self.committed_step, self._lineage, *(self.accepted or (0, 0))))

    @property
    def lineage(self) -> int:
        return self._lineage

    @lineage.setter
    def lineage(self, value: int) -> None:
        self._lineage = int(value)

    # gRPC handlers
    def Quorum(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        timeout = context.time_remaining()
        if timeout is None or timeout > 1e8:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing timeout")
        with self._cond:
            self._metadata[request.group_rank] = request.checkpoint_metadata
            if request.regent_committed_metadata:
                self._committed_meta[request.group_rank] = request.regent_committed_metadata
            rnd = self._quorum_round
            rnd.arrived[request.group_rank] = request
            leader = len(rnd.arrived) >= self.world_size
            if leader:
                self._quorum_round = _Round()
        if leader:
            self._run_lighthouse_quorum(rnd, timeout)
        with self._cond:
            self._wait_round(rnd, context, "quorum: not all group ranks arrived in time")
        if rnd.error is not None:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(rnd.error, TimeoutError) else grpc.StatusCode.INTERNAL
            context.abort(code, f"Lighthouse quorum failed: {rnd.error}")
        result = compute_quorum_results(self.replica_id, request.group_rank, rnd.result, request.init_sync)
        return _result_to_proto(result)

    def _run_lighthouse_quorum(self, rnd: _Round, timeout: float) -> None:
        requests = list(rnd.arrived.values())
        # The compact answer (regent.ft.compact) is computed for one init_sync: ask for it when the group's ranks
        # agree (they always do with one Manager config), else for the full member list.
        init_syncs = {bool(r.init_sync) for r in requests}
        wanted = self.compact_quorum == "1" or (self.compact_quorum == "auto"
                                                  and self._last_members > COMPACT_AUTO_MEMBERS)
        compact = init_syncs.pop() if wanted and len(init_syncs) == 1 else None
        deadline = time.monotonic() + timeout
        attempt = 0
        reusable = self._reusable(requests)
        while True:
            try:
                quorum = self._client.quorum(
                    self.replica_id,
                    timeout=max(0.01, deadline - time.monotonic()),
                    address=self._address,
                    store_address=self.store_address,
                    step=max(r.step for r in requests),
                    world_size=self.world_size,
                    shrink_only=any(r.shrink_only for r in requests),
                    commit_failures=max(r.commit_failures for r in requests),
                    data={LINEAGE_KEY: self._lineage, **({ACCEPTED_LOSS_KEY: list(self.accepted)}
                                                           if self.accepted else {})},
                    compact=compact,
                    # a reusable last quorum: at the first sign of an outage, ask the peers instead (once)
                    give_up=(lambda: True) if reusable is not None else None,
                )
                self._took(rnd, quorum, reused=False)
                return
            except LighthouseUnavailable:
                assert reusable is not None
                if self._agree(reusable, deadline):
                    self._took(rnd, reusable, reused=True)
                    return
                reusable = None  # the members decided to ask the Lighthouse: wait for it
            except Exception as err:  # noqa: BLE001 - retried; the last error is kept in rnd.error and sent back to the caller
                attempt += 1
                if attempt > self.quorum_retries or time.monotonic() >= deadline:
                    rnd.error = err
                    break
                time.sleep(max(0.1, timeout / (self.quorum_retries + 1)))
        self._finish(rnd)

    def _finish(self, rnd: _Round) -> None:
        with self._cond:
            rnd.done = True
            self._cond.notify_all()

    def _took(self, rnd: _Round, quorum: Quorum, reused: bool) -> None:
        """`quorum` is this round's answer: remember what the group needs from it and wake the group's ranks."""
        rnd.result = quorum
        self._round_quorum_id = int(quorum.quorum_id)
        # the lineage of the up-to-date members: what this replica's state becomes if it heals now
        self.heal_lineage = (quorum.compact.max_lineage if quorum.compact is not None
                             else max(state_version(m) for m in quorum.participants)[1])
        self._last_members = (quorum.compact.msg.replica_world_size if quorum.compact is not None
                              else len(quorum.participants))
        self._last_quorum = quorum
        if reused:
            self.quorums_reused += 1
            logger.info("quorum %d reused for step %d without the Lighthouse (unreachable)", quorum.quorum_id,
                        reused_step(quorum))
        self._finish(rnd)

    def _reusable(self, requests: list[Any]) -> Quorum | None:
        """The last quorum as this round's answer, if the rules of `quorum_reuse.reissue` allow it (and it is on)."""
        if not self.quorum_reuse:
            return None
        return reissue(self._last_quorum, max(r.step for r in requests), self._lineage,
                       max(r.commit_failures for r in requests), any(r.shrink_only for r in requests))

    def _agree(self, quorum: Quorum, deadline: float) -> bool:
        """Whether every member of `quorum` agreed to reuse it (`quorum_reuse.agree_to_reuse`), through the TCPStore
        of its first member by replica id (one store every member names alike)."""
        compact = quorum.compact.msg if quorum.compact is not None else None
        # a compact share names the store primaries of group ranks 0.. of the up-to-date members, sorted by id:
        # the first is the first member's (nobody healed, or it is not reissued)
        address = (compact.store_addresses[0] if compact is not None
                   else min(quorum.participants, key=lambda m: m.replica_id).store_address)

        def back() -> bool:
            return self._client.unavailable_since is None or self._stopped.is_set()

        try:
            store = _store_client(address, max(0.1, min(REUSE_STORE_TIMEOUT_S, deadline - time.monotonic())))
            if compact is not None:
                return agree_to_reuse_counted(store, quorum.quorum_id, reused_step(quorum),
                                              int(compact.replica_world_size), deadline, back)
            return agree_to_reuse(store, quorum.quorum_id, reused_step(quorum), self.replica_id,
                                  [m.replica_id for m in quorum.participants], deadline, back)
        except Exception as err:  # noqa: BLE001 - reported; without the agreement this group asks the Lighthouse
            logger.warning("could not agree on reusing quorum %d (%s); waiting for the Lighthouse",
                           quorum.quorum_id, err)
            return False

    def CheckpointMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._cond:
            meta = self._metadata.get(request.rank)
        if meta is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"group rank {request.rank} has not registered metadata")
        return torchft_pb2.CheckpointMetadataResponse(
            checkpoint_metadata=meta, regent_committed_metadata=self._committed_meta.get(request.rank, ""))

    def ShouldCommit(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._cond:
            rnd = self._commit_round
            rnd.arrived[request.group_rank] = request.should_commit
            last = len(rnd.arrived) >= self.world_size
            if last:
                rnd.result = all(rnd.arrived.values())
                if rnd.result:
                    if self._round_quorum_id is not None:
                        self._lineage = self._round_quorum_id  # this replica's state is now that quorum's
                    self.committed_step = request.step + 1
                    self.accepted = None
                self._commit_round = _Round()
        if last:
            if rnd.result:
                # The Lighthouse learns of the commit before any rank applies it, so its watermark never lags
                # the state the replicas hold: if every replica then died, the loss is counted in full.
                self._report_commit()
            with self._cond:
                rnd.done = True
                self._cond.notify_all()
        with self._cond:
            self._wait_round(rnd, context, "should_commit: not all group ranks voted in time")
        return torchft_pb2.ShouldCommitResponse(should_commit=bool(rnd.result))

    def _report_commit(self) -> None:
        """Tell the Lighthouse of a commit at once (bounded); while it is unreachable, the heartbeats retry."""
        if self._lighthouse_unreachable or self._client.unavailable_since is not None:
            # known to be down (a failed report, or any call since the last answer): no per-step stall of
            # COMMIT_REPORT_TIMEOUT_S; the heartbeat loop reports the commit once it answers
            self._beat_now.set()
            return
        try:
            self.heartbeat_now(timeout=COMMIT_REPORT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - reported; the heartbeats retry the report
            self._lighthouse_unreachable = True
            self._beat_now.set()
            logger.warning("could not report commit of step %d to the Lighthouse (%s); the heartbeats retry",
                           self.committed_step, err)

    def Kill(self, request: Any, context: Any) -> Any:  # noqa: N802
        logger.error("replica %s killed by request: %s; exiting with status 1", self.replica_id, request.msg)

        def die() -> None:
            time.sleep(0.05)  # let the response go out
            logging.shutdown()
            os._exit(1)

        threading.Thread(target=die, daemon=True).start()
        return torchft_pb2.KillResponse()


def _result_to_proto(r: QuorumResult) -> Any:
    msg = torchft_pb2.ManagerQuorumResponse(
        quorum_id=r.quorum_id,
        recover_src_manager_address=r.recover_src_manager_address,
        recover_dst_replica_ranks=r.recover_dst_replica_ranks,
        store_address=r.store_address,
        max_step=r.max_step,
        max_world_size=r.max_world_size,
        replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size,
        heal=r.heal,
        commit_failures=r.commit_failures,
        replica_ids=r.replica_ids,
        regent_committed_step=r.committed_step,
        regent_members_digest=r.members_digest,
        regent_recover_src_replica_id=r.recover_src_replica_id,
    )
    if r.recover_src_replica_rank is not None:
        msg.recover_src_replica_rank = r.recover_src_replica_rank
    if r.max_replica_rank is not None:
        msg.max_replica_rank = r.max_replica_rank
    return msg


def _result_from_proto(m: Any) -> QuorumResult:
    return QuorumResult(
        quorum_id=m.quorum_id,
        replica_rank=m.replica_rank,
        replica_world_size=m.replica_world_size,
        recover_src_manager_address=m.recover_src_manager_address,
        recover_src_replica_rank=m.recover_src_replica_rank if m.HasField("recover_src_replica_rank") else None,
        recover_dst_replica_ranks=list(m.recover_dst_replica_ranks),
        store_address=m.store_address,
        max_step=m.max_step,
        max_replica_rank=m.max_replica_rank if m.HasField("max_replica_rank") else None,
        max_world_size=m.max_world_size,
        heal=m.heal,
        commit_failures=m.commit_failures,
        replica_ids=list(m.replica_ids),
        committed_step=m.regent_committed_step,
        members_digest=bytes(m.regent_members_digest),
        recover_src_replica_id=m.regent_recover_src_replica_id,
    )


def _store_client(address: str, timeout_s: float) -> Any:
    """A client of the TCPStore at "host:port" (a bracketed IPv6 host too)."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _rpc_error(what: str, addr: str, err: grpc.RpcError) -> Exception:
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        # TorchFT's client words a deadline as a cancelled call ("status: Cancelled, message: ..."); code that
        # matches on that text keeps working.
        return TimeoutError(f'{what} via manager {addr} timed out (status: Cancelled, message: "Timeout expired"): '
                            f"{detail}")
    return RuntimeError(f"{what} via manager {addr} failed ({code}): {detail}")


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise TypeError(f"Manager: pass {name}= or {alias}=, not both")
    return value if value is not None else alias_value
