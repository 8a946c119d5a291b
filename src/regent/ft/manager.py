"""The Manager: one per trainer rank; runs the fault-tolerant step lifecycle.

Step lifecycle (what each call does, and what happens on every error path):

1. `start_quorum()` — ask for the next quorum (in the background when `use_async_quorum`). The group's
   ranks send their request to the `ManagerServer` of group rank 0, which makes one Lighthouse call for
   the whole replica. On the answer each rank computes its recovery plan (`compute_quorum_results`):
   if the quorum id changed it rebuilds the replicated group; a donor sends its state to its healers; a
   healer receives the donor's state (applied before the forward pass in sync mode, at `should_commit`
   in async mode). Any error here is *reported* (`errored()`), never raised. A quorum that does not form
   within `quorum_timeout` raises `TimeoutError` from `start_quorum()` in sync mode and from an explicit
   `wait_quorum()`; inside `allreduce`/`should_commit` it is reported like any other error, so the step
   does not commit and the next `start_quorum()` simply asks again.
2. `allreduce(tensor)` — average across participating replicas; healing or spare replicas contribute
   zeros. Errors are swallowed and reported; the returned future always resolves (to the input on error).
3. `should_commit()` — a group-wide AND of "no error and at least `min_replica_size` participants". On
   True the step counter advances (the step is the version: replicas at the same step hold bit-identical
   state); on False the caller must discard the step, `commit_failures` is carried into the next quorum
   (which makes the Lighthouse issue a new quorum id, so every replica rebuilds its group), and after
   `max_retries` consecutive failures it raises.

Replica ids are `name:uuid4` per process start, so a restarted replica is a membership change.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import enum
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import torch
import torch.distributed as dist

from regent.ft.config import env_timeout
from regent.ft.process_group import ReplicatedGroup
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.quorum import group_name
from regent.ft.recovery import (
    ACCEPTED_LOSS_KEY,
    LINEAGE_KEY,
    QuorumResult,
    compute_quorum_results,
    state_version,
)
from regent.ft.rpc_security import Security, TLSFiles
from regent.ft.transfer import (
    ANY_STEP,
    CheckpointTransport,
    GroupTransport,
    RWLock,
    StreamTransport,
    local_view,
)
from regent.ft.types import to_seconds

logger = logging.getLogger(__name__)

EventCallback = Callable[[str, dict], None]

_MANAGER_ADDR_KEY = "regent/manager_addr"
_REPLICA_ID_KEY = "regent/replica_id"
# A commit is reported to the Lighthouse before the ranks apply it; this bounds the wait on a slow Lighthouse.
COMMIT_REPORT_TIMEOUT_S = 1.0
# Above this many members a ManagerServer asks the Lighthouse for the compact quorum answer (REGENT_COMPACT_QUORUM)
COMPACT_AUTO_MEMBERS = 64


class WorldSizeMode(enum.Enum):
    """How many replicas train (TorchFT's names): DYNAMIC, every healthy replica; FIXED_WITH_SPARES, at most
    `min_replica_size`, the others kept in sync as spares."""

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


# ---- the group-local server (hosted by group rank 0) ---------------------------------------------------


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
    """The stand-in for a gRPC servicer context when group rank 0 calls its own ManagerServer directly.

    Why: rank 0 hosts the ManagerServer, and a gRPC round trip to itself (serialize, loopback, grpcio's thread
    pool, deserialize) cost about 1 ms of every `start_quorum`; the direct call runs the same handler code."""

    def __init__(self, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise LocalRpcError(code, details)


class ManagerServer(torchft_pb2_grpc.ManagerServiceServicer):
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
    ) -> None:
        from regent.ft.lighthouse_client import LighthouseClient

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
        self.compact_quorum = os.environ.get("REGENT_COMPACT_QUORUM", "auto")
        self._last_members = 0
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
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=2 * world_size + 8, thread_name_prefix="regent-mgr"),
            interceptors=self.security.server_interceptors("ManagerServer"),
        )
        torchft_pb2_grpc.add_ManagerServiceServicer_to_server(self, self._server)
        port = self.security.add_port(self._server, bind or f"{hostname}:0")
        if port == 0:
            raise OSError(f"ManagerServer could not bind {bind or hostname + ':0'}; set hostname/port")
        self._address = f"{hostname}:{port}"
        self._server.start()
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="regent-heartbeat", daemon=True)
        self._heartbeat_thread.start()
        logger.info("ManagerServer %s for %s at %s (%s)", replica_id, lighthouse_addr, self._address,
                    self.security.describe())

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        """Stop serving; calls waiting for group ranks or the Lighthouse end with CANCELLED now."""
        self._stopped.set()
        self._beat_now.set()
        with self._cond:
            self._cond.notify_all()
        self._client.close()
        self._server.stop(grace=0.5)

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
        last = requests[-1]
        # The compact answer (regent.ft.compact) is computed for one init_sync: ask for it when the group's ranks
        # agree (they always do with one Manager config), else for the full member list.
        init_syncs = {bool(r.init_sync) for r in requests}
        wanted = self.compact_quorum == "1" or (self.compact_quorum == "auto"
                                                  and self._last_members > COMPACT_AUTO_MEMBERS)
        compact = init_syncs.pop() if wanted and len(init_syncs) == 1 else None
        deadline = time.monotonic() + timeout
        attempt = 0
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
                )
                rnd.result = quorum
                self._round_quorum_id = int(quorum.quorum_id)
                # the lineage of the up-to-date members: what this replica's state becomes if it heals now
                self.heal_lineage = (quorum.compact.max_lineage if quorum.compact is not None
                                     else max(state_version(m) for m in quorum.participants)[1])
                self._last_members = (quorum.compact.msg.replica_world_size if quorum.compact is not None
                                      else len(quorum.participants))
                break
            except Exception as err:  # noqa: BLE001 - retried; the last error is kept in rnd.error and sent back to the caller
                attempt += 1
                if attempt > self.quorum_retries or time.monotonic() >= deadline:
                    rnd.error = err
                    break
                time.sleep(max(0.1, timeout / (self.quorum_retries + 1)))
        del last
        with self._cond:
            rnd.done = True
            self._cond.notify_all()

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
        if self._lighthouse_unreachable:
            self._beat_now.set()  # no per-step stall while the Lighthouse is down; the heartbeat loop reports it
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


def _rpc_error(what: str, addr: str, err: grpc.RpcError) -> Exception:
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        # TorchFT's client words a deadline as a cancelled call ("status: Cancelled, message: ..."); code that
        # matches on that text keeps working.
        return TimeoutError(f'{what} via manager {addr} timed out (status: Cancelled, message: "Timeout expired"): '
                            f"{detail}")
    return RuntimeError(f"{what} via manager {addr} failed ({code}): {detail}")


# ---- the per-rank Manager -------------------------------------------------------------------------------


def _completed(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class Manager:
    """Fault-tolerance manager for one trainer rank (see the module docstring for the lifecycle).

    Args:
        pg: the replicated group (default: a new `ReplicatedGroup` on the platform's backend).
        load_state_dict / state_dict: the user's state (registered under key "default"); more with
            `register_state_dict_fn`.
        min_replica_size: fewest participating replicas for a step to commit.
        use_async_quorum: overlap the quorum (and healing) with the forward pass. DiLoCo needs False.
        timeout / quorum_timeout / connect_timeout: seconds (or timedelta); env REGENT_FT_TIMEOUT_SEC,
            REGENT_FT_QUORUM_TIMEOUT_SEC, REGENT_FT_CONNECT_TIMEOUT_SEC (or TORCHFT_*) win.
        group_rank / group_world_size: this rank inside its replica (env RANK / WORLD_SIZE).
        store_addr / store_port: the replica's group-local TCPStore (hosted by group rank 0; it is also the
            rendezvous store advertised to other replicas). Env MASTER_ADDR / MASTER_PORT. With one rank per
            replica it may be omitted (a free port is picked).
        lighthouse_addr: env REGENT_FT_LIGHTHOUSE or TORCHFT_LIGHTHOUSE.
        replica_id: the replica's name; a uuid is appended per process start.
        hostname: address advertised to others (default 127.0.0.1, env REGENT_FT_HOSTNAME).
        transport: how healers receive state (default: `GroupTransport` over the replicated group).
        init_sync: at step 0 every replica pulls the primary's weights.
        max_retries: raise after this many consecutive failed commits (None = never).
        backstop: a `regent.ft.backstop.Backstop` to restore from when every holder of the committed state is
            gone (Regent; see `recover_committed`).
        lost_state: when every holder of the committed state is gone and no backstop has it: "accept" (default,
            TorchFT's behaviour: go on from what is held, counted as a lineage reset, logged as an error) or
            "raise" (`StateLostError`).
        world_size_mode / rank / world_size / checkpoint_transport: TorchFT's spellings (`WorldSizeMode`;
            group_rank, group_world_size and transport).
        on_event: called as on_event(kind, details) for "quorum", "heal_started", "heal_done", "commit",
            "error", "peer_abort" and "group_failed" (this build `group` of this replica's replicated group
            failed: no collective in it can complete any more; pass it on to the other replicas'
            `peer_failed(prefix, group=...)` so that they stop waiting for one now).
    """

    def __init__(
        self,
        pg: ReplicatedGroup | None = None,
        load_state_dict: Callable[[Any], None] | None = None,
        state_dict: Callable[[], Any] | None = None,
        min_replica_size: int = 1,
        use_async_quorum: bool = True,
        timeout: float | datetime.timedelta = 60.0,
        quorum_timeout: float | datetime.timedelta = 60.0,
        connect_timeout: float | datetime.timedelta = 60.0,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        hostname: str | None = None,
        port: int = 0,
        heartbeat_interval: float = 0.1,
        transport: CheckpointTransport | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        on_event: EventCallback | None = None,
        backstop: Any = None,
        lost_state: str = "accept",
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        checkpoint_transport: CheckpointTransport | None = None,
    ) -> None:
        # TorchFT's spellings of three arguments (its code runs unchanged); both at once is an error.
        group_rank = _one_of("group_rank", group_rank, "rank", rank)
        group_world_size = _one_of("group_world_size", group_world_size, "world_size", world_size)
        transport = _one_of("transport", transport, "checkpoint_transport", checkpoint_transport)
        self.world_size_mode = WorldSizeMode(world_size_mode)
        self.timeout = env_timeout("timeout", to_seconds(timeout))
        self.quorum_timeout = env_timeout("quorum_timeout", to_seconds(quorum_timeout))
        self.connect_timeout = env_timeout("connect_timeout", to_seconds(connect_timeout))
        self.min_replica_size = min_replica_size
        self.use_async_quorum = use_async_quorum
        self.init_sync = init_sync
        self.max_retries = max_retries
        self._on_event = on_event
        self.group_rank = int(group_rank if group_rank is not None else os.environ.get("RANK", 0))
        self.group_world_size = int(
            group_world_size if group_world_size is not None else os.environ.get("WORLD_SIZE", 1)
        )
        hostname = hostname or os.environ.get("REGENT_FT_HOSTNAME", "127.0.0.1")
        lighthouse_addr = (
            lighthouse_addr or os.environ.get("REGENT_FT_LIGHTHOUSE") or os.environ.get("TORCHFT_LIGHTHOUSE")
        )
        self._pg = pg if pg is not None else ReplicatedGroup(timeout=self.timeout, connect_timeout=self.connect_timeout)
        self._transport: CheckpointTransport = transport if transport is not None else GroupTransport(self._pg)

        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        self._state_lock = RWLock()

        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._quorum_key: tuple[int, tuple[str, ...] | bytes] | None = None
        self._configuring_key: tuple[int, tuple[str, ...] | bytes] | None = None
        # Which build of the replicated group ("<quorum id>/s<max step>f<commit failures>"): the same for every
        # member, new at each rebuild, even under one quorum id (a rebuild after failed commits keeps the id).
        self._group: str | None = None
        self._configuring_group: str | None = None
        # the build whose failure was announced ("group_failed"), or that a peer's report aborted
        self._announced_group: str | None = None
        self._errored: Exception | None = None
        self._healing = False
        self._pending_state: Any = None
        self._participating_rank: int | None = None
        self._participating_world_size = 0
        # How many replicas hold the primary's state once an init-sync step (step 0) commits: only the primary's
        # gradient counts there, but every member ends the step with its state, so all count toward
        # min_replica_size (as in TorchFT, where every replica at the max step participates). 0 otherwise.
        self._init_sync_replicas = 0
        self._replica_rank = 0
        self._replica_world_size = 0
        self._quorum_future: concurrent.futures.Future | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="regent-quorum")

        self._server: ManagerServer | None = None
        # Committed state (Regent): served to restarted replicas between syncs (`serve_committed`), restored
        # from the durable backstop when no live replica holds it (`recover_committed`).
        self.backstop = backstop
        if lost_state not in ("accept", "raise"):
            raise ValueError(f"lost_state={lost_state!r}: use 'accept' or 'raise'")
        self.lost_state = lost_state
        self._hostname = hostname
        self._committed_fns: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
        self._committed_transport: StreamTransport | None = None
        self._committed_live = False
        self._recover_needed = False
        self._recover_calls = 0
        self._before_withdraw: list[Callable[[], Any]] = []
        self._group_store = self._make_group_store(store_addr, store_port)
        # Who may call the control plane (the job secret, TLS): from the environment, like TorchFT's settings.
        self._security = Security.resolve()
        if self.group_rank == 0:
            if not lighthouse_addr:
                raise ValueError(
                    "no Lighthouse address: pass lighthouse_addr= or set REGENT_FT_LIGHTHOUSE "
                    "(start one with `regent lighthouse --bind 127.0.0.1:29510 --min-replicas 1`)"
                )
            name = replica_id or os.environ.get("REGENT_FT_REPLICA_ID") or "replica"
            full_id = f"{name}:{uuid.uuid4()}"
            store_host = self._store_host
            if store_host.startswith("127.") and hostname and not hostname.startswith("127."):
                # MASTER_ADDR is this host's loopback (the group's ranks share it), but peers on other hosts
                # dial the store address to rebuild the replicated group: advertise the host's address (the
                # store listens on every interface)
                store_host = hostname
            self._server = ManagerServer(
                replica_id=full_id,
                lighthouse_addr=lighthouse_addr,
                hostname=hostname,
                store_address=f"{store_host}:{self._group_store.port}",
                world_size=self.group_world_size,
                bind=f"{hostname}:{port}",
                heartbeat_interval=heartbeat_interval,
                connect_timeout=self.connect_timeout,
                quorum_retries=quorum_retries,
                secret=self._security.secret or b"",
                tls=self._security.tls,
            )
            self._group_store.set(_MANAGER_ADDR_KEY, self._server.address())
            self._group_store.set(_REPLICA_ID_KEY, full_id)
        self._manager_addr = self._group_store.get(_MANAGER_ADDR_KEY).decode()
        self.replica_id = self._group_store.get(_REPLICA_ID_KEY).decode()
        self._channel = self._security.channel(self._manager_addr)
        self._stub = torchft_pb2_grpc.ManagerServiceStub(self._channel)
        logger.info("Manager %s group rank %d/%d ready", self.replica_id, self.group_rank, self.group_world_size)

    def _make_group_store(self, store_addr: str | None, store_port: int | None) -> dist.TCPStore:
        addr = store_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        port = store_port if store_port is not None else os.environ.get("MASTER_PORT")
        if port is None:
            if self.group_world_size > 1:
                raise ValueError(
                    f"group of {self.group_world_size} ranks needs a shared store: pass store_addr/store_port "
                    "(or set MASTER_ADDR/MASTER_PORT) to a port group rank 0 can listen on"
                )
            port = 0
        self._store_host = addr
        timeout = datetime.timedelta(seconds=self.connect_timeout)
        if self.group_rank == 0:
            try:
                return dist.TCPStore(addr, int(port), is_master=True, timeout=timeout, wait_for_workers=False)
            except (RuntimeError, OSError) as err:
                if int(port) == 0 or "in use" not in str(err).lower():
                    raise
                # Someone (e.g. the trainer's own default process group at MASTER_PORT) already serves a
                # store there: share it as a client, like TorchFT does with torchrun's store.
                logger.info("store %s:%s already served; joining it as a client", addr, port)
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)

    # ---- state ------------------------------------------------------------------------------------------
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Add user state under `key`; it is sent to healers and loaded on them."""
        self._state_fns[key] = (load_state_dict, state_dict)

    def state_dict(self) -> dict[str, int]:
        """The Manager's own state; save it in disk checkpoints too (the step is the version)."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._step = int(state["step"])
        self._batches_committed = int(state["batches_committed"])
        if self._server is not None:
            self._server.committed_step = self._step

    def full_state_dict(self) -> dict[str, Any]:
        """Everything a healer receives: every registered user state and the Manager's own. Also what a disk
        checkpoint of a fault-tolerant replica should hold."""
        return {"user": {k: save() for k, (_, save) in self._state_fns.items()}, "regent": self.state_dict()}

    def _manager_state_dict(self) -> dict[str, Any]:
        """TorchFT's layout of `full_state_dict()` (the Manager's own state under "torchft"), which TorchFT's
        tooling and tests read."""
        return {"user": {k: save() for k, (_, save) in self._state_fns.items()}, "torchft": self.state_dict()}

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `full_state_dict()` (e.g. from a disk checkpoint) through the registered load functions; TorchFT's
        layout (`_manager_state_dict()`) loads too."""
        for key, (load, _) in self._state_fns.items():
            if key not in state["user"]:
                raise RuntimeError(f"state has no key {key!r}; register the same state fns on every replica")
            load(state["user"][key])
        self.load_state_dict(state["regent"] if "regent" in state else state["torchft"])

    def disallow_state_dict_read(self) -> None:
        """Take the write side of the state lock (wrap `optimizer.step()`): donors never serve torn weights."""
        self._state_lock.acquire_write()

    def allow_state_dict_read(self) -> None:
        self._state_lock.release_write()

    # ---- committed state: early heal and the durable backstop (Regent) ------------------------------------
    def serve_committed(self, save: Callable[[], Any], load: Callable[[Any], None], live: bool = False) -> None:
        """Serve this replica's committed state to restarted replicas while it keeps computing.

        `save()` returns the committed state (tensors that do not change between two commits, e.g. DiLoCo's
        last global parameters and outer optimizer); `load(state)` applies a peer's on a restarted replica.
        Call `publish_committed()` after each commit and `withdraw_committed()` before the tensors change.

        `live=True` (per-step training): the committed state is the live training state between two optimizer
        steps, published after every step; a healer takes whatever step the holder serves when it asks (at
        least the committed step it was told of), and a heal applied by a quorum is withdrawn and republished
        here."""
        self._committed_fns = (save, load)
        self._committed_live = live
        if self._committed_transport is None:
            self._committed_transport = StreamTransport(host=self._hostname or "127.0.0.1", timeout=self.timeout)

    def _committed_tree(self) -> dict[str, Any]:
        assert self._committed_fns is not None
        lineage = self._server.lineage if self._server is not None else 0
        return {"user": self._committed_fns[0](), "regent": {**self.state_dict(), "lineage": lineage}}

    def publish_committed(self) -> None:
        if self._committed_transport is not None:
            # served in place: no device-to-host copy of the committed state at every sync (see StreamTransport);
            # live state (published at every step) is also described only when a healer asks
            self._committed_transport.send_checkpoint([], self._step, self._committed_tree(), self.timeout,
                                                      copy_to_host=False, lazy=self._committed_live)

    def before_committed_change(self, fn: Callable[[], Any]) -> None:
        """Call `fn` before the committed state changes (e.g. wait for a backstop copy of it to finish)."""
        self._before_withdraw.append(fn)

    def withdraw_committed(self) -> None:
        for fn in self._before_withdraw:
            fn()
        if self._committed_transport is not None:
            self._committed_transport.disallow_checkpoint(cut_readers=self._committed_live)

    def recover_committed(self) -> str:
        """Make sure this replica will not train on from less than the run has committed.

        Called by a restarted replica before its first quorum, and after a quorum reported that no member holds
        the committed watermark. Every group rank calls it at the same point; group rank 0 decides and the
        others follow through the group store. Returns what happened:
        - "none": nothing to do (nothing committed yet, this replica holds it, or the next quorum heals it);
        - "early": pulled the committed state from a live holder now (`serve_committed` on both sides), without
          waiting for the holders' next sync: the window in which only the holders have it closes here;
        - "restored": no live replica holds it: restored the newest durable backstop, counted as a lineage
          reset (`state_lost` event with what was lost); the Lighthouse is told, so the quorum goes on from it;
        - "accepted" also when no live replica holds it but this replica's own committed state is at least as
          new as the newest backstop: it goes on from that (`state_lost`, cause "own_state");
        - when no backstop exists either: with `lost_state="raise"` raises `StateLostError` (`state_lost` with
          fatal=True); with "accept" (the default, TorchFT's behaviour) goes on from what this replica holds,
          counted as a lineage reset (`state_lost`, cause "no_holder") and logged as an error: "accepted".
        """
        self._recover_calls += 1
        for attempt in range(RECOVER_ATTEMPTS * 2 if self._committed_live else RECOVER_ATTEMPTS):
            key = f"regent/recover/{self._recover_calls}/{attempt}"
            plan = self._share(f"{key}/plan", self._recover_plan if self.group_rank == 0 else None)
            kind = plan["kind"]
            if kind == "none":
                return "none"
            if kind == "keep":
                if self._server is not None:
                    self._server.accepted = (int(plan["watermark"]), int(plan["lineage"]))
                    self._server.heartbeat_now()  # the Lighthouse counts the reset and lowers its watermark
                self._emit("state_lost", lost_step=plan["watermark"], restored_step=self._step, source="own",
                           fatal=False, cause="own_state", reason=plan["reason"])
                return "accepted"
            if kind == "fatal" and self.lost_state == "accept":
                logger.error("%s; going on from step %d (lost_state='accept'; pass lost_state='raise' to stop "
                             "instead)", plan["reason"], self._step)
                if self._server is not None:
                    self._server.accepted = (int(plan["watermark"]), int(plan["lineage"]))
                    self._server.heartbeat_now()  # the Lighthouse counts the reset and lowers its watermark
                self._emit("state_lost", lost_step=plan["watermark"], restored_step=self._step, source=None,
                           fatal=False, cause="no_holder", reason=plan["reason"])
                return "accepted"
            if kind == "fatal":
                self._emit("state_lost", lost_step=plan["watermark"], restored_step=None, source=None,
                           fatal=True, reason=plan["reason"])
                raise StateLostError(plan["reason"])
            start = time.monotonic()
            try:
                state = self._fetch_early(plan) if kind == "early" else self.backstop.load(plan["path"],
                                                                                            self.group_rank)
                error = ""
            except Exception as err:  # noqa: BLE001 - reported below; every rank agrees before anything is applied
                state, error = None, f"{type(err).__name__}: {err}"
            errors = self._gather(f"{key}/ok", error)
            if any(errors):
                logger.warning("recovering the committed state (%s, attempt %d) failed: %s", kind, attempt + 1,
                               [e for e in errors if e])
                self._emit("recover_failed", how=kind, attempt=attempt + 1, errors=[e for e in errors if e])
                # a live holder refuses or cuts a read while it takes its optimizer step (tens of ms): ask again soon
                time.sleep(min(1.0, 0.05 * 2 ** attempt) if self._committed_live else min(2.0, 0.25 * 2 ** attempt))
                continue
            if kind == "early":
                self._committed_fns[1](state["user"])
                self.load_state_dict(state["regent"])
                if self._server is not None:
                    self._server.lineage = int(state["regent"].get("lineage", 0))
                self._emit("early_heal_done", donor=plan["donor"], manager_step=self._step,
                           seconds=round(time.monotonic() - start, 4), bytes=_state_nbytes(state))
                return "early"
            if state.get("committed"):  # a backstop of the committed state alone (DiLoCo: see the session)
                self._committed_fns[1](state["user"])
                self.load_state_dict(state["regent"])
                if self._server is not None:
                    self._server.lineage = int(state["regent"].get("lineage", 0))
            else:
                self.load_full_state_dict(state)
            if self._server is not None:
                self._server.accepted = (int(plan["watermark"]), int(plan["lineage"]))
                self._server.heartbeat_now()  # the Lighthouse lowers its watermark before our next quorum
            self._emit("state_lost", lost_step=plan["watermark"], restored_step=self._step, source=plan["path"],
                       fatal=False, cause="backstop_restore", seconds=round(time.monotonic() - start, 4), reason=plan["reason"])
            return "restored"
        logger.warning("could not recover the committed state early; the next quorum heals this replica")
        return "none"

    def accept_loss(self, source: str) -> None:
        """This replica went back to older state on purpose (a checkpoint restart): if that is less than the
        run has committed, count it (`state_lost`) and tell the Lighthouse, so the quorum goes on from here."""
        if self._server is None:
            return
        watermark, lineage, _ = self._server._client.holders(self.replica_id, timeout=self.connect_timeout)
        if watermark <= self._step:
            return
        self._server.accepted = (watermark, lineage)
        self._server.heartbeat_now()
        self._emit("state_lost", lost_step=watermark, restored_step=self._step, source=source, fatal=False,
                   cause="checkpoint_restart", reason=f"restarted from {source}")

    def _recover_plan(self) -> dict[str, Any]:
        """Group rank 0: where the committed state comes from (see `recover_committed` and `recovery_plan`)."""
        assert self._server is not None
        client = self._server._client
        deadline = time.monotonic() + HOLDER_GRACE_S
        while True:
            watermark, lineage, holders = client.holders(self.replica_id, timeout=self.connect_timeout)
            give_up = time.monotonic() >= deadline
            latest = self.backstop.latest() if self.backstop is not None and give_up else None
            plan = recovery_plan(
                watermark=watermark, lineage=lineage, holders=[(h.replica_id, h.address) for h in holders],
                replica_id=self.replica_id, own_step=self._step, can_fetch=self._committed_transport is not None,
                give_up=give_up, backstop=latest,
                backstop_root=str(self.backstop.root) if self.backstop is not None else None)
            if plan is not None:
                return plan
            time.sleep(0.5)

    def _fetch_early(self, plan: dict[str, Any]) -> Any:
        assert self._committed_transport is not None
        with self._security.channel(plan["address"]) as channel:
            stub = torchft_pb2_grpc.ManagerServiceStub(channel)
            try:
                reply = stub.CheckpointMetadata(
                    torchft_pb2.CheckpointMetadataRequest(rank=self.group_rank), timeout=self.connect_timeout)
            except grpc.RpcError as err:
                raise _rpc_error("committed-state address", plan["address"], err) from None
        if not reply.regent_committed_metadata:
            raise RuntimeError(f"holder {plan['donor']} serves no committed state for group rank {self.group_rank}")
        if not self._committed_live:
            return self._committed_transport.recv_checkpoint(
                0, reply.regent_committed_metadata, int(plan["watermark"]), self.timeout, into=self._committed_tree())
        # live (per-step) state: the holder has moved on since the Lighthouse named it; take what it serves now,
        # provided it is at least the committed step we were told of (a holder between its commit vote and its
        # optimizer step still serves the step before: the next attempt gets the newer one)
        state = self._committed_transport.recv_checkpoint(
            0, reply.regent_committed_metadata, ANY_STEP, self.timeout, into=self._committed_tree())
        served = int(state["regent"].get("step", -1))
        if served < int(plan["watermark"]):
            raise RuntimeError(f"holder {plan['donor']} serves step {served}, behind committed step {plan['watermark']}")
        return state

    def _share(self, key: str, decide: Callable[[], Any] | None) -> Any:
        """Group rank 0's decision, seen by every group rank (through the group store)."""
        if self.group_world_size == 1:
            assert decide is not None
            return decide()
        if decide is not None:
            try:
                value = decide()
            except Exception as err:  # the others must not wait for a decision that will never come
                self._group_store.set(key, json.dumps({"kind": "error", "error": repr(err)}))
                raise
            self._group_store.set(key, json.dumps(value))
            return value
        value = json.loads(self._group_store.get(key).decode())
        if value.get("kind") == "error":
            raise RuntimeError(f"group rank 0 could not plan the recovery: {value['error']}")
        return value

    def _gather(self, key: str, error: str) -> list[str]:
        """Every group rank's outcome (empty string: ok)."""
        if self.group_world_size == 1:
            return [error]
        self._group_store.set(f"{key}/{self.group_rank}", error or "ok")
        out = [self._group_store.get(f"{key}/{r}").decode() for r in range(self.group_world_size)]
        return ["" if e == "ok" else e for e in out]

    # ---- events and errors ------------------------------------------------------------------------------
    def _emit(self, kind: str, **details: Any) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(kind, {"replica_id": self.replica_id, "group_rank": self.group_rank, **details})
        except Exception:
            logger.exception("on_event callback failed for %s", kind)

    def peer_failed(self, replica_prefix: str, reason: str = "reported failed by its supervisor",
                    group: str | None = None) -> bool:
        """A replica died, or its group failed: if it is a member of our current group, abort the group now.

        A dead peer never answers, and NCCL cannot tell a dead peer from a slow one: a collective in flight
        would wait out the full timeout. Aborting fails it at once (the step does not commit), and the next
        quorum rebuilds the group. `replica_prefix` matches replica ids such as `replica_1:` (the restarted
        process gets a new uuid). `group`: only that build of the group is affected (the `group` of a peer's
        "group_failed" event: reported late, it must not abort the next build). Returns whether it aborted.
        """
        generation_of = getattr(self._pg, "generation", None)
        for _ in range(3):
            # Read the build's generation, then which build it is, then the generation again: the training
            # thread may start the next build meanwhile (it sets `_configuring_key`, then configures).
            generation = generation_of() if generation_of is not None else None
            configuring = self._configuring_key
            key = configuring or self._quorum_key
            build = self._configuring_group if configuring else self._group
            if generation_of is None or generation_of() == generation:
                break
        if key is None or (group is not None and build != group):
            return False
        if isinstance(key[1], bytes):  # a compact answer: only the digest is known; take the peer for a member
            # (at the sizes that use it nearly every live group is one; a wrong guess costs one uncommitted step)
            peers = [] if self.replica_id.startswith(replica_prefix) else [replica_prefix]
        else:
            peers = [rid for rid in key[1] if rid.startswith(replica_prefix) and rid != self.replica_id]
        if not peers:
            return False
        # Our collectives in flight fail now, on Gloo too (see `ReplicatedGroup.abort`: a process that uses
        # this should leave with os._exit, as Regent's actor processes do). A decision about an established
        # build aborts that build only: the next one may have begun its rendezvous since, without the dead peer
        # (a soak saw a notice about quorum 36 give up the rendezvous of quorum 37, whose other member then
        # waited 20 s in its first allreduce). A rendezvous under way is aborted whatever its generation.
        only = None if configuring else generation
        if only is not None and generation_of() != only:
            logger.info("peer %s %s: quorum %d's group was already replaced; nothing to abort", peers[0], reason,
                        key[0])
            return False
        logger.warning("peer %s %s; aborting the replicated group of quorum %d", peers[0], reason, key[0])
        self._emit("peer_abort", peer=peers[0], quorum_id=key[0])  # before the abort, whose effects report
        this_build = {} if only is None else {"only_generation": only}  # a group without generations: no kwarg
        self._pg.abort(RuntimeError(f"peer replica {peers[0]} {reason}"), wait=False, fail_pending=True,
                       **this_build)
        return True

    def report_error(self, err: Exception) -> None:
        """Mark this step as failed: it will not commit; the error is sticky until the next quorum."""
        if self._errored is None:
            logger.warning("step %d: error reported: %s", self._step, err)
            self._errored = err
            self._emit("error", step=self._step, error=f"{type(err).__name__}: {err}")
        self._announce_group_failure()

    def _announce_group_failure(self) -> None:
        """Once our group has failed (a communication error, an abort, a peer's report), no collective in
        that build of it can complete: the peers waiting in one would wait out the timeout, since no process
        died. Say so once per build ("group_failed"), for whoever can reach them (the orchestrator calls
        their `peer_failed`). A member aborted on a peer's report announces too: the other group ranks of
        the replica that failed first may be waiting for it."""
        key, build = self._quorum_key, self._group
        error = self._pg.errored()
        if key is None or build is None or error is None or build == self._announced_group:
            return
        self._announced_group = build
        self._emit("group_failed", quorum_id=key[0], group=build, error=f"{type(error).__name__}: {error}")

    def errored(self) -> Exception | None:
        return self._errored

    # ---- quorum -----------------------------------------------------------------------------------------
    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False,
                     timeout: float | datetime.timedelta | None = None) -> None:
        """Begin the next step's quorum (see module docstring). Blocks only in sync mode. `timeout` (seconds or,
        as TorchFT takes it, a timedelta) defaults to the Manager's `quorum_timeout`."""
        timeout = None if timeout is None else to_seconds(timeout)
        if self._quorum_future is not None:
            try:
                self._quorum_future.result()
            except Exception as err:  # noqa: BLE001 - already reported or raised in wait_quorum
                logger.debug("previous quorum failed: %s", err)
        if self._recover_needed:
            self._recover_needed = False
            if self._committed_live:
                self.withdraw_committed()
            self.recover_committed()
            if self._committed_live:
                self.publish_committed()
        self._errored = None
        self._healing = False
        self._pending_state = None
        if self.use_async_quorum:
            self._quorum_future = self._executor.submit(
                self._async_quorum, allow_heal, shrink_only, timeout or self.quorum_timeout
            )
        else:
            # Sync mode waits anyway: run it on this thread (a hand-off to the quorum thread cost ~0.4 ms).
            self._quorum_future = concurrent.futures.Future()
            try:
                self._async_quorum(allow_heal, shrink_only, timeout or self.quorum_timeout)
            except Exception as err:  # noqa: BLE001 - reported: wait_quorum() raises it
                self._quorum_future.set_exception(err)
            else:
                self._quorum_future.set_result(None)
            self.wait_quorum()
            if self._healing:
                self._apply_pending_state()

    def wait_quorum(self) -> None:
        """Wait for the quorum started by `start_quorum`; raises TimeoutError if no quorum formed in time."""
        if self._quorum_future is None:
            raise RuntimeError("wait_quorum() before start_quorum(); call start_quorum() at the start of each step")
        self._quorum_future.result()

    def _quorum_rpc(self, shrink_only: bool, timeout: float) -> QuorumResult:
        request = torchft_pb2.ManagerQuorumRequest(
            group_rank=self.group_rank,
            step=self._step,
            checkpoint_metadata=self._transport.metadata(),
            regent_committed_metadata=(self._committed_transport.metadata()
                                       if self._committed_transport is not None else ""),
            shrink_only=shrink_only,
            init_sync=self.init_sync,
            commit_failures=self._commit_failures,
        )
        try:
            if self._server is not None:  # rank 0 hosts the server: call it directly, no loopback round trip
                return _result_from_proto(self._server.Quorum(request, _LocalCall(timeout)))
            return _result_from_proto(self._stub.Quorum(request, timeout=timeout))
        except grpc.RpcError as err:
            raise _rpc_error("quorum", self._manager_addr, err) from None

    def _async_quorum(self, allow_heal: bool, shrink_only: bool, timeout: float) -> None:
        result = self._quorum_rpc(shrink_only, timeout)
        if result.state_lost:
            # Every member holds less than the run has committed: training on would silently reset the
            # lineage. Do not commit; the next start_quorum() recovers the committed state first.
            self._recover_needed = True
            self.report_error(StateLostError(
                f"quorum {result.quorum_id}: no member holds committed step {result.committed_step} "
                f"(members at most at step {result.max_step}); recovering it before training on"))
            return
        self._replica_rank = result.replica_rank
        self._replica_world_size = result.replica_world_size
        self._init_sync_replicas = 0
        if self.use_async_quorum and allow_heal:
            # Healing replicas do not participate this step: they train on stale weights and contribute zeros.
            # At step 0 with init_sync every replica but the primary heals, so only the primary participates.
            if self.init_sync and result.max_step == 0 and result.replica_world_size > 1:
                self._participating_rank = None if result.heal else 0
                self._participating_world_size = 1
                self._init_sync_replicas = result.replica_world_size
            else:
                self._participating_rank = result.max_replica_rank
                self._participating_world_size = result.max_world_size
        else:
            self._participating_rank = result.replica_rank
            self._participating_world_size = result.replica_world_size
        if self.world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
            # At most min_replica_size replicas train; the rest are spares that stay in sync (they receive
            # every update, contribute zeros) and take over when a trainer fails.
            self._participating_world_size = min(self._participating_world_size, self.min_replica_size)
            if self._participating_rank is not None and self._participating_rank >= self.min_replica_size:
                self._participating_rank = None

        # Rebuild the group when the membership decision changed. The quorum id alone is not enough: a
        # restarted Lighthouse counts from 1 again, so the members are part of the key, and a quorum that
        # reports commit failures always rebuilds (every member sees the same max, so all agree).
        # keyed on the member ids when known (`peer_failed` checks them), else on their digest (a compact answer)
        quorum_key = (result.quorum_id, tuple(result.replica_ids) if result.replica_ids else result.members_digest)
        if quorum_key != self._quorum_key or result.commit_failures > 0:
            self._emit(
                "quorum",
                quorum_id=result.quorum_id,
                participants=result.replica_ids,  # empty with a compact answer: `members` counts them
                members=result.replica_world_size,
                replica_rank=result.replica_rank,
                step=self._step,
                max_step=result.max_step,
            )
            # Unique per rebuild: the suffix separates two rebuilds under one quorum id (Lighthouse restart).
            rebuild = f"s{result.max_step}f{result.commit_failures}"
            build = f"{result.quorum_id}/{rebuild}"
            store = f"{result.store_address}/regent/{result.quorum_id}/{self.group_rank}/{rebuild}"
            self._configuring_key = quorum_key  # a member reported dead now aborts the rendezvous
            self._configuring_group = build
            try:
                self._pg.configure(store, self.replica_id, result.replica_rank, result.replica_world_size)
                self._quorum_id = result.quorum_id
                self._quorum_key = quorum_key
                self._group = build
            except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
                self.report_error(RuntimeError(f"rebuilding the replicated group at {store} failed: {err}"))
                return
            finally:
                self._configuring_key = self._configuring_group = None

        if not allow_heal:
            return
        try:
            if result.recover_dst_replica_ranks:
                with self._state_lock.read(timeout=self.timeout):
                    self._transport.send_checkpoint(
                        result.recover_dst_replica_ranks, result.max_step, self.full_state_dict(), self.timeout
                    )
            if result.heal:
                self._heal_from(result)
        except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
            self.report_error(err)

    def _heal_from(self, result: QuorumResult) -> None:
        src = result.recover_src_replica_rank
        donor = result.replica_ids[src] if src is not None and result.replica_ids else str(src)
        self._healing = True
        self._emit("heal_started", donor=donor, step=self._step, max_step=result.max_step)
        start = time.monotonic()
        metadata = self._transport.metadata()
        if not metadata.startswith("<"):
            metadata = self._donor_metadata(result.recover_src_manager_address)
        with self._state_lock.read(timeout=self.timeout):
            into = self.full_state_dict()
        state = self._transport.recv_checkpoint(src, metadata, result.max_step, self.timeout, into=into)
        self._pending_state = state
        nbytes = _state_nbytes(state)
        self._emit(
            "heal_done", donor=donor, bytes=nbytes, seconds=round(time.monotonic() - start, 4), step=result.max_step
        )

    def _donor_metadata(self, donor_manager_addr: str) -> str:
        with self._security.channel(donor_manager_addr) as channel:
            stub = torchft_pb2_grpc.ManagerServiceStub(channel)
            try:
                reply = stub.CheckpointMetadata(
                    torchft_pb2.CheckpointMetadataRequest(rank=self.group_rank), timeout=self.connect_timeout
                )
            except grpc.RpcError as err:
                raise _rpc_error("checkpoint metadata", donor_manager_addr, err) from None
        return reply.checkpoint_metadata

    def _apply_pending_state(self) -> None:
        state, self._pending_state = self._pending_state, None
        if state is None:
            return
        if self._committed_live:
            self.withdraw_committed()  # the served tensors are overwritten next
        self.load_full_state_dict(state)
        self._healing = False
        if self._server is not None:
            # The replica now holds its donor's state, lineage included. Without this it would look behind its
            # donor at the next quorum until it committed a step, and heal again and again where no step can
            # commit (min_replica_size 2 with one up-to-date peer; found by the partition tests).
            self._server.lineage = self._server.heal_lineage
        if self._committed_live:
            self.publish_committed()

    # ---- collectives ------------------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG) -> torch.futures.Future:
        """Average (`reduce_op` AVG, the default) or sum (SUM) `tensor` in place across participating replicas;
        never raises.

        The returned future resolves to `tensor` (reduced, or untouched after an error, which is reported so the
        step will not commit). `should_quantize` (TorchFT's FP8 allreduce, which needs triton and NCCL) is not
        implemented: True raises rather than silently sending full precision.
        """
        if should_quantize:
            raise NotImplementedError("Manager.allreduce(should_quantize=True): quantized allreduce is not "
                                      "implemented in Regent; pass should_quantize=False")
        if reduce_op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"Manager.allreduce: reduce_op {reduce_op} unsupported; use ReduceOp.AVG or SUM")
        average = reduce_op == dist.ReduceOp.AVG
        if self._errored is not None:
            return _completed(tensor)
        result = tensor
        tensor = local_view(tensor)  # a DTensor (FSDP shard) is reduced shard by shard, in place
        try:
            self.wait_quorum()
            num = self.num_participants()
            if not self.is_participating():
                tensor.zero_()
            fut = self._pg.allreduce([tensor], dist.ReduceOp.SUM)
        except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
            self.report_error(err)
            return _completed(result)

        def finish(f: torch.futures.Future) -> torch.Tensor:
            try:
                f.value()
                if average:
                    tensor.div_(max(1, num))
            except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
                self.report_error(err)
            return result

        return fut.then(finish)

    def wrap_future(self, fut: torch.futures.Future, default: Any,
                    timeout: float | datetime.timedelta | None = None) -> torch.futures.Future:
        """TorchFT's error rule for a user's own future: an error (or no result within `timeout`, default the
        Manager's) is reported, so the step will not commit, and the future resolves to `default` instead."""
        out: torch.futures.Future = torch.futures.Future()
        settled = threading.Lock()
        done = [False]

        def settle(value: Any, err: Exception | None) -> None:
            with settled:
                if done[0]:
                    return
                done[0] = True
            if err is not None:
                self.report_error(err)
            out.set_result(value)

        limit = self.timeout if timeout is None else to_seconds(timeout)
        timer = threading.Timer(limit, lambda: settle(default, TimeoutError(
            f"future not done within {limit:.3g} s (Manager.wrap_future)")))
        timer.daemon = True
        timer.start()

        def on_done(f: torch.futures.Future) -> None:
            timer.cancel()
            try:
                settle(f.value(), None)
            except Exception as err:  # noqa: BLE001 - reported (the step will not commit), as TorchFT does
                settle(default, err)

        fut.add_done_callback(on_done)
        return out

    def num_participants(self) -> int:
        self.wait_quorum()
        return self._participating_world_size

    def participating_rank(self) -> int | None:
        self.wait_quorum()
        return self._participating_rank

    def is_participating(self) -> bool:
        """False while healing in async mode: this replica contributes zeros this step."""
        self.wait_quorum()
        return self._participating_rank is not None and not (self._healing and self.use_async_quorum)

    # ---- commit -----------------------------------------------------------------------------------------
    def should_commit(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Group-wide vote: commit this step only if no rank errored and enough replicas participated."""
        timeout = None if timeout is None else to_seconds(timeout)
        try:
            self.wait_quorum()
        except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
            self.report_error(err)
        # The group's error fails this step only if it reached one of the step's operations (each failure
        # of one is reported on its own too). A peer reported dead once every operation had completed (its
        # replica committed this very step and then died) leaves this replica's results valid: voting no
        # here left the run's newest committed step with the dead replica alone (seen in a full test run:
        # that step was lost and counted as a lineage reset).
        group_error = self._pg.errored()
        if group_error is not None and getattr(self._pg, "error_hit_operations", lambda: True)():
            self.report_error(group_error)
        elif group_error is not None:
            logger.info("step %d: the replicated group was aborted after every operation of the step had "
                        "completed (%s); the step may still commit", self._step, group_error)
        if self._healing and self._errored is None:
            try:
                self._apply_pending_state()
            except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
                self.report_error(err)
        # Stop serving our state before the vote: once it passes, the optimizer changes the weights.
        # In-flight reads by healers finish first; if they cannot within the timeout, we vote no
        # (the weights then stay as they are, so nobody reads torn state).
        try:
            self._transport.disallow_checkpoint()
        except Exception as err:  # noqa: BLE001 - reported: report_error() logs it and this step will not commit
            self.report_error(err)
        enough = max(self._participating_world_size, self._init_sync_replicas) >= self.min_replica_size
        local = enough and self._errored is None
        request = torchft_pb2.ShouldCommitRequest(should_commit=local, group_rank=self.group_rank, step=self._step)
        try:
            if self._server is not None:
                decision = self._server.ShouldCommit(request, _LocalCall(timeout or self.timeout)).should_commit
            else:
                decision = self._stub.ShouldCommit(request, timeout=timeout or self.timeout).should_commit
        except grpc.RpcError as err:
            self.report_error(_rpc_error("should_commit", self._manager_addr, err))
            decision = False
        if decision:
            self._step += 1
            self._batches_committed += self._participating_world_size
            self._commit_failures = 0
        else:
            self._commit_failures += 1
        self._emit(
            "commit",
            step=self._step,
            committed=decision,
            participants=self._participating_world_size,
            enough_replicas=enough,
            error=None if self._errored is None else str(self._errored),
        )
        if not decision and self.max_retries is not None and self._commit_failures > self.max_retries:
            raise RuntimeError(
                f"{self._commit_failures} consecutive failed commits (max_retries={self.max_retries}); "
                f"last error: {self._errored}. Check the replicas' logs; raise max_retries to keep trying"
            )
        return decision

    # ---- accessors --------------------------------------------------------------------------------------
    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def lineage(self) -> int | None:
        """The quorum id this replica's state was committed in (`regent.ft.recovery.state_version`); None
        for a group rank without the Manager server (ranks other than 0)."""
        return self._server.lineage if self._server is not None else None

    def quorum_id(self) -> int:
        return self._quorum_id

    def replica_rank(self) -> int:
        return self._replica_rank

    @property
    def pg(self) -> ReplicatedGroup:
        return self._pg

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server, the heartbeats, the transport and the group."""
        self._channel.close()  # cancels an in-flight quorum call, so the quorum thread ends now
        if self._server is not None:
            self._server.shutdown()  # ends rank 0's own in-process quorum call the same way
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._transport.shutdown()
        if self._committed_transport is not None:
            self._committed_transport.shutdown()
        self._pg.shutdown()


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise TypeError(f"Manager: pass {name}= or {alias}=, not both")
    return value if value is not None else alias_value


class StateLostError(RuntimeError):
    """No live replica and no durable backstop holds the committed state: training cannot go on without
    silently losing it."""


def recovery_plan(*, watermark: int, lineage: int, holders: list[tuple[str, str]], replica_id: str,
                  own_step: int, can_fetch: bool, give_up: bool, backstop: tuple[int, str] | None,
                  backstop_root: str | None) -> dict[str, Any] | None:
    """Where a replica's committed state comes from (pure; `Manager.recover_committed` carries it out).

    `holders`: (replica id, address) of the live replicas at the run's committed `watermark`, as the
    Lighthouse names them (address "" when a restarted Lighthouse has not learned it yet). None: no holder is
    known yet, ask again (until `give_up`). Otherwise a plan whose "kind" is:
    - "none": nothing to do (this replica holds the watermark), or a live holder heals it at the next quorum
      (no early copy here, or no address to copy from yet): the state is alive, nothing is lost;
    - "early": copy it now from "donor" at "address";
    - "keep": every holder is gone and this replica's own committed state is at least as new as the newest
      `backstop` (step, path): go on from it, a counted loss;
    - "restore": every holder is gone: restore the backstop, a counted loss;
    - "fatal": every holder is gone and there is no backstop.
    """
    if watermark <= own_step:
        return {"kind": "none"}
    mine = group_name(replica_id)
    others = [(rid, address) for rid, address in holders if group_name(rid) != mine and rid != replica_id]
    reachable = [(rid, address) for rid, address in others if address]
    if others and (not can_fetch or not reachable):
        return {"kind": "none"}
    if others:
        donor, address = reachable[0]
        return {"kind": "early", "watermark": watermark, "donor": donor, "address": address}
    if not give_up:
        return None
    reason = f"no live replica holds committed step {watermark} (lineage {lineage}): every holder is gone"
    if backstop is None:
        where = f" and the backstop at {backstop_root} has none" if backstop_root is not None else ""
        return {"kind": "fatal", "watermark": watermark, "lineage": lineage,
                "reason": f"{reason}{where}; committed training would be lost. Restart from a checkpoint "
                          "(regent train --recovery restart) or enable the durable backstop "
                          "(regent train: ft.backstop_every_s; library: Manager(backstop=Backstop(...)))"}
    step, path = backstop
    if own_step >= step:
        # going back to the backstop would lose more than the dead holders took with them
        return {"kind": "keep", "watermark": watermark, "lineage": lineage,
                "reason": f"{reason}; going on from this replica's own committed step {own_step} (the newest "
                          f"backstop is step {step})"}
    return {"kind": "restore", "watermark": watermark, "lineage": lineage, "path": path, "step": step,
            "reason": f"{reason}; restoring the durable backstop of step {step}"}


# How long a restarted replica looks for a live holder of the committed state before it concludes that none
# is left (a restarted Lighthouse learns who holds what from the next heartbeats, 0.1 s apart by default).
HOLDER_GRACE_S = 6.0
RECOVER_ATTEMPTS = 4


def _state_nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_nbytes(v) for v in state)
    return 0



def local_hostname() -> str:
    """This host's name, for `hostname=` when replicas run on several machines."""
    return socket.gethostname()
