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

Where the rest lives: the group-local server of group rank 0 in `regent.ft.manager_server` (`ManagerServer`),
the committed-state recovery (`recovery_plan`, `recover_committed`, `serve_committed`) in
`regent.ft.committed`; their public names are re-exported here, so `from regent.ft.manager import ...` keeps
working.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import enum
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

from regent import settings
from regent.ft.committed import (  # noqa: F401 (HOLDER_GRACE_S, RECOVER_ATTEMPTS: re-exported)
    HOLDER_GRACE_S,
    RECOVER_ATTEMPTS,
    CommittedStateRecovery,
    StateLostError,
    recovery_plan,
    state_nbytes,
)
from regent.ft.config import env_timeout
from regent.ft.manager_server import (  # noqa: F401 (the server's names: re-exported)
    COMMIT_REPORT_TIMEOUT_S,
    COMPACT_AUTO_MEMBERS,
    LocalRpcError,
    ManagerServer,
    _LocalCall,
    _one_of,
    _result_from_proto,
    _result_to_proto,
    _rpc_error,
)
from regent.ft.process_group import ReplicatedGroup
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.recovery import QuorumResult
from regent.ft.rpc_security import Security
from regent.ft.transfer import (
    CheckpointTransport,
    GroupTransport,
    RWLock,
    StreamTransport,
    local_view,
)
from regent.ft.types import to_seconds

__all__ = ["Manager", "ManagerServer", "StateLostError", "WorldSizeMode", "local_hostname", "recovery_plan"]

logger = logging.getLogger(__name__)

EventCallback = Callable[[str, dict], None]

_MANAGER_ADDR_KEY = "regent/manager_addr"
_REPLICA_ID_KEY = "regent/replica_id"


class WorldSizeMode(enum.Enum):
    """How many replicas train (TorchFT's names): DYNAMIC, every healthy replica; FIXED_WITH_SPARES, at most
    `min_replica_size`, the others kept in sync as spares."""

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


# ---- the per-rank Manager -------------------------------------------------------------------------------


def _completed(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class Manager(CommittedStateRecovery):
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
        quorum_reuse: (Regent) while the Lighthouse is unreachable, the members of the last quorum may agree to
            keep it for the next step instead of waiting for the Lighthouse (`regent.ft.quorum_reuse`); each
            such step is a "quorum_reused" event. Off by default, as TorchFT has no such thing; `regent train`
            turns it on (`--ft.quorum-reuse`).
        on_event: called as on_event(kind, details) for "quorum", "quorum_reused", "heal_started", "heal_done", "commit",
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
        quorum_reuse: bool = False,
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
        hostname = hostname or settings.REGENT_FT_HOSTNAME.get()
        lighthouse_addr = lighthouse_addr or settings.REGENT_FT_LIGHTHOUSE.get()  # or TORCHFT_LIGHTHOUSE
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
        self._voted = False  # this step's commit vote is cast (a later error cannot change its outcome)
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
        self._reused_seen = 0  # the server's `quorums_reused` already told as events
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
        self._behind_calls = 0
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
            name = replica_id or settings.REGENT_FT_REPLICA_ID.get()
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
                quorum_reuse=quorum_reuse,
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
            if not self._voted:
                # From here on this replica skips the step's collectives (`allreduce`): its peers, who have not
                # failed, would wait for it until their timeout. The group tells them (`build_notice`). Before
                # the vote only: this vote is then no, so every member rebuilds the group at the next quorum
                # and the notice cannot reach a later step.
                announce = getattr(self._pg, "announce_abandoned", None)
                if announce is not None:
                    announce(self.replica_id)
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
        self._voted = False
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
        if self._server is not None and self._server.quorums_reused > self._reused_seen:
            self._reused_seen = self._server.quorums_reused
            self._emit("quorum_reused", quorum_id=result.quorum_id, step=self._step, members=result.replica_world_size)
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
        nbytes = state_nbytes(state)
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
        self._voted = True
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

    @property
    def group_store(self) -> dist.TCPStore:
        """The replica's group-local TCPStore (hosted by group rank 0): where the group's ranks agree on a
        decision that group rank 0 makes (e.g. whether this step's backstop copy is due), so all act alike."""
        return self._group_store

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


def local_hostname() -> str:
    """This host's name, for `hostname=` when replicas run on several machines."""
    return socket.gethostname()
