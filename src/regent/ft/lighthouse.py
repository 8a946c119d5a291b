"""The Lighthouse: one process that decides which replica groups train together (the "quorum").

It serves TorchFT's gRPC `LighthouseService` (so TorchFT managers and clients work against it unchanged) and an
HTTP dashboard. The decision itself is `regent.ft.quorum.quorum_compute`; this module only feeds it and
broadcasts its results.

Threading: all Lighthouse state lives on one asyncio loop in a background thread, so no lock is needed and a
Quorum call costs no thread. gRPC is served by `regent.ft.grpc_lite` (a lean HTTP/2 server on that loop; a
heartbeat costs a seventh of the CPU grpcio's asyncio server spent, which also failed calls at 1,024 groups:
benchmarks/RESULTS.md), the one server stack of the control plane. The HTTP dashboard runs in its own
threads and reads the state through the loop. With `frontends=N` (`regent lighthouse --frontends N`, Linux), N
front-end processes serve the gRPC port instead and batch heartbeats and requests into this loop, which keeps every
piece of state and the decision (`regent.ft.frontends`).

Ports: gRPC listens on the bound port P; the dashboard listens on **P + 1** (so plain HTTP/1.1 never shares the
gRPC port). With port 0 a free pair (P, P + 1) is chosen.

Differences from TorchFT, on purpose:
- a Quorum call that ends (client deadline, cancel, disconnect) withdraws its participant, so a replica that
  stopped waiting is never put into a quorum it will not hear about;
- heartbeat entries older than `max(60 s, 10 x heartbeat_timeout)` are forgotten (TorchFT keeps them forever);
- `POST /replica/<id>/kill` also finds replicas that are waiting for the next quorum, not only past members;
- `GET /status.json` (machine-readable) next to the live page; `GET /status` is an alias; with `?limit=N`
  (`&offset=K&q=substring`) one page of each list plus totals and counts (`regent.ft.dashboard`: the live page
  stays usable at 1,024+ members);
- `state_file` keeps quorum ids increasing across a Lighthouse restart (clients reconnect by themselves), and
  the committed watermark with them;
- the committed watermark (`regent.ft.quorum.note_committed`): the highest committed step any replica reported,
  sent with every issued quorum (a Regent extension field that TorchFT clients skip), and the `RegentHolders`
  call that tells a restarted Regent replica which live replicas hold it (its early heal);
- a new incarnation of a replica group ("<group>:<new uuid>") retires the group's older ids at its first
  heartbeat or request, and `forget_replicas` (used by Regent's orchestrator when it sees a process die)
  retires ids at once: survivors do not wait `heartbeat_timeout_ms` for a dead incarnation (`regent.ft.quorum`).

Who may call (`regent.ft.rpc_security`): with a job secret (`secret=`, else `$REGENT_JOB_SECRET` /
`$REGENT_JOB_SECRET_FILE`; `regent train` gives every process one) every gRPC call must carry a fresh proof of
it, or is refused with UNAUTHENTICATED before it touches any state; both server implementations check it. With
TLS files (`tls=`, else `$REGENT_FT_TLS_*`) gRPC and the dashboard are served over TLS (the dashboard as
HTTPS, without client certificates) and `address()` says https://. The dashboard never shows the secret. Its
kill action, unauthenticated in TorchFT, needs an `X-Regent-Auth` header made with the secret
(`rpc_security.dashboard_kill_headers`) when the Lighthouse has one; without a secret it is open, as in
TorchFT: then keep the Lighthouse on loopback or a trusted network (the default bind is 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from regent import settings
from regent.eventloop import new_event_loop
from regent.ft import grpc_lite, rpc_security
from regent.ft.compact import RoundShares, encode_plan
from regent.ft.joins import Join
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.quorum import (
    LighthouseState,
    Participant,
    QuorumOptions,
    Watermark,
    apply_joins,
    expect_first_groups,
    expire_heartbeats,
    forget_replicas,
    group_name,
    healthy_replicas,
    holders,
    issue_quorum,
    note_committed,
    note_heartbeat,
    quorum_compute,
    quorum_possible,
    restart_grace,
    restore_last_quorum,
    seed_watermark,
)
from regent.ft.recovery import accepted_loss, state_version
from regent.ft.types import Quorum, QuorumMember

logger = logging.getLogger(__name__)

FRONTENDS_ENV = settings.REGENT_LIGHTHOUSE_FRONTENDS.name
KILL_TIMEOUT_S = 10.0
PORT_PAIR_ATTEMPTS = 50


def parse_bind(bind: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port). An empty host means all interfaces."""
    match = re.fullmatch(r"\[(?P<v6>[^\]]*)\]:(?P<port>\d+)|(?P<host>[^:\[\]]*):(?P<port4>\d+)", bind.strip())
    if not match:
        raise ValueError(f"bad Lighthouse bind address {bind!r}; use HOST:PORT, e.g. 127.0.0.1:29510 or [::]:29510")
    if match.group("v6") is not None:
        return match.group("v6"), int(match.group("port"))
    return match.group("host"), int(match.group("port4"))


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(host: str) -> str:
    """The name clients should dial: the bound IP, or this machine's hostname for a wildcard bind."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return host


def load_state(path: Path) -> tuple[int, Watermark]:
    """The last quorum id and committed watermark a previous Lighthouse saved at `path` (zeros if none yet)."""
    saved = load_saved(path)
    return saved.quorum_id, saved.watermark


class SavedState(NamedTuple):
    """What a Lighthouse keeps in its state file for the one restarted after it."""

    quorum_id: int
    watermark: Watermark
    groups: list[str]  # the replica groups of the last quorum (empty if none)
    members: list[str]  # its replica ids, sorted (empty if none, or a file of an older Regent)


def load_saved(path: Path) -> SavedState:
    """The state a previous Lighthouse saved at `path` (zeros and empty lists if none yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return SavedState(0, Watermark(), [], [])
    try:
        data = json.loads(text)
        quorum_id = int(data["quorum_id"])
        w = data.get("committed", {})
        resets = int(w.get("resets", 0))
        # A file of an older Regent after a reset does not say which lineage was lost: take every lineage issued
        # so far as lost, so that no commit from before the restart can raise the watermark (`seed_watermark`).
        lost_lineage = int(w["lost_lineage"]) if "lost_lineage" in w else quorum_id if resets else 0
        watermark = Watermark(int(w.get("step", 0)), int(w.get("lineage", 0)), resets, lost_lineage)
        groups = [str(g) for g in data.get("groups", [])]
        members = sorted(str(m) for m in data.get("members", []))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"Lighthouse state file {path} is not valid ({err}); delete it to start quorum ids from 1 "
            "(and forget the committed watermark)"
        ) from None
    logger.info("resuming quorum ids after %d, committed watermark step %d (from %s)", quorum_id,
                watermark.step, path)
    return SavedState(quorum_id, watermark, groups, members)


def load_quorum_id(path: Path) -> int:
    """The last quorum id a previous Lighthouse saved at `path` (0 if there is none yet)."""
    return load_state(path)[0]


def save_quorum_id(path: Path, quorum_id: int, watermark: Watermark | None = None,
                   groups: list[str] | None = None, members: list[str] | None = None) -> None:
    """Atomically record the latest quorum id, watermark and the last quorum's replica groups and replica ids
    (write a sibling file, then rename over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = watermark or Watermark()
    tmp.write_text(json.dumps({"quorum_id": quorum_id, "saved": datetime.now(timezone.utc).isoformat(),
                               "committed": {"step": w.step, "lineage": w.lineage, "resets": w.resets,
                                             "lost_lineage": w.lost_lineage},
                               "groups": sorted(groups or []), "members": sorted(members or [])}))
    os.replace(tmp, path)


class _DashboardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _DashboardHTTPServer6(_DashboardHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # Dual-stack like the gRPC port: `[::]:P` answers IPv4 clients too, whatever the OS default.
        with contextlib.suppress(OSError, AttributeError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


EMPTY_HEARTBEAT_RESPONSE = torchft_pb2.LighthouseHeartbeatResponse().SerializeToString()


GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> None:
    """For a process that serves the Lighthouse and little else (`regent lighthouse`, its front ends): freeze what
    start-up allocated (modules, protobuf descriptors) out of the collector's reach, and collect the youngest
    generation every 50,000 allocations instead of 700. A round of 12,800 joins allocates a few objects per join;
    with the defaults the collector ran ~30% of the owner's round (`control_plane_sim.py --only owner`, 2-core box,
    2026-12-05: 205-275 ms with the defaults, 150-173 ms with these). Not done by `LighthouseServer` itself: a
    process that embeds one keeps its own collector settings."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _compact_ask(request: torchft_pb2.LighthouseQuorumRequest) -> tuple[int, bool] | None:
    """(group size, init_sync) when the requester asked for the compact answer (`regent.ft.compact`), else None."""
    if not request.HasField("regent_compact"):
        return None
    return int(request.requester.world_size), bool(request.regent_compact.init_sync)


_REPLICA_ID = attrgetter("replica_id")


class _Issued:
    """One issued quorum and its answers: TorchFT's full answer (one encoding for every member that wants it,
    made on first need) or a member's compact share (`regent.ft.compact`, from one plan per round)."""

    def __init__(self, quorum: Quorum, wires: Callable[[], list[torchft_pb2.QuorumMember]],
                 watermark: Watermark) -> None:
        self.quorum = quorum
        self.quorum_id = quorum.quorum_id
        self.ids = frozenset(map(_REPLICA_ID, quorum.participants))
        self._wires = wires
        self._committed = torchft_pb2.RegentCommitted(step=watermark.step, lineage=watermark.lineage,
                                                      resets=watermark.resets)
        self._full: bytes | None = None
        self._shares: RoundShares | None = None
        self._plan: bytes | None = None

    def answer(self, replica_id: str, ask: tuple[int, bool] | None) -> bytes:
        if ask is None:
            return self.full()
        if self._shares is None:
            self._shares = RoundShares(self.quorum_id, self.quorum.participants, self._committed, self._created())
        return self._shares.answer(replica_id, *ask)

    def plan(self) -> bytes:
        """The round's plan for the front ends (`compact.encode_plan`, once per round): each computes its callers'
        compact shares from it."""
        if self._plan is None:
            self._plan = encode_plan(self.quorum_id, self.quorum.participants, self._committed, self._created())
        return self._plan

    def _created(self) -> Timestamp:
        created = Timestamp()
        created.FromDatetime(self.quorum.created)
        return created

    def full(self) -> bytes:
        if self._full is None:
            response = torchft_pb2.LighthouseQuorumResponse(
                quorum=torchft_pb2.Quorum(quorum_id=self.quorum_id, participants=self._wires(),
                                          regent_committed=self._committed))
            response.quorum.created.FromDatetime(self.quorum.created)
            self._full = response.SerializeToString()
        return self._full


def _decode(cls: Any, what: str, request: bytes) -> Any:
    """`cls` parsed from `request`, or INVALID_ARGUMENT: one definition for this process's server and the front
    ends'."""
    try:
        return cls.FromString(request)
    except DecodeError as err:
        raise grpc_lite.RpcStatusError(grpc_lite.StatusCode.INVALID_ARGUMENT, f"bad {what} request: {err}") from None


def decode_quorum_request(request: bytes) -> torchft_pb2.LighthouseQuorumRequest:
    """A Quorum request with its requester, or INVALID_ARGUMENT."""
    message = _decode(torchft_pb2.LighthouseQuorumRequest, "Quorum", request)
    if not message.HasField("requester"):
        raise grpc_lite.RpcStatusError(grpc_lite.StatusCode.INVALID_ARGUMENT, "missing requester")
    return message


def decode_heartbeat_request(request: bytes) -> torchft_pb2.LighthouseHeartbeatRequest:
    return _decode(torchft_pb2.LighthouseHeartbeatRequest, "Heartbeat", request)


def decode_holders_request(request: bytes) -> torchft_pb2.RegentHoldersRequest:
    return _decode(torchft_pb2.RegentHoldersRequest, "RegentHolders", request)


def lite_server(handlers: dict[str, grpc_lite.Handler], security: rpc_security.Security,
                verifier: rpc_security.CallVerifier | None = None) -> grpc_lite.Server:
    """The Lighthouse's gRPC server, with its secret check and TLS: the same in this process and in a front end
    (`regent.ft.frontends`)."""
    return security.server(handlers, "Lighthouse", verifier)


def _lite_handlers(lighthouse: LighthouseServer) -> dict[str, grpc_lite.Handler]:
    """`torchft.LighthouseService` for `grpc_lite`: bytes in, bytes out."""

    def quorum(request: bytes, deadline: float | None) -> bytes | asyncio.Future:
        message = decode_quorum_request(request)
        return lighthouse._quorum(message.requester, _compact_ask(message))

    def heartbeat(request: bytes, deadline: float | None) -> bytes:
        message = decode_heartbeat_request(request)
        lighthouse._heartbeat(message.replica_id, message)
        return EMPTY_HEARTBEAT_RESPONSE

    def regent_holders(request: bytes, deadline: float | None) -> bytes:
        decode_holders_request(request)
        return lighthouse._holders()

    return grpc_lite.method_table("torchft.LighthouseService", {
        "Quorum": quorum, "Heartbeat": heartbeat, "RegentHolders": regent_holders})


class LighthouseServer:
    """A Lighthouse in this process, served from a background thread until `shutdown()`.

    Args:
        bind: the address to listen on ("[::]:0" picks a free port).
        min_replicas: the fewest replica groups a quorum may have.
        join_timeout_ms: how long a quorum waits for groups that were in the last one.
        quorum_tick_ms: how often the quorum rules are evaluated.
        heartbeat_timeout_ms: how long without a heartbeat before a group counts as gone.
        holder_grace_ms: Regent's: how long a fast quorum waits for a replica that holds the committed step but
            was not in the last quorum (`quorum.holders_on_their_way`); 0: TorchFT's rule exactly.
        late_member_ms: Regent's: once a strict majority of the last quorum has joined, how long its other
            members are waited for before the quorum is issued without them (`quorum.late_members`); 0 (the
            default): TorchFT's rules.
        state_file, secret, tls, expect_groups, expect_within_s, frontends: Regent's additions (see __init__).
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        min_replicas: int = 1,
        join_timeout_ms: int = 60000,
        quorum_tick_ms: int = 100,
        heartbeat_timeout_ms: int = 5000,
        state_file: str | os.PathLike[str] | None = None,
        secret: bytes | None = None,
        tls: rpc_security.TLSFiles | None = None,
        expect_groups: list[str] | None = None,
        expect_within_s: float = 60.0,
        frontends: int | None = None,
        frontend_batch_ms: float = 2.0,
        seed_committed: tuple[int, int] | None = None,
        holder_grace_ms: int = 2000,
        late_member_ms: int = 0,
    ) -> None:
        """`state_file` (optional, beyond TorchFT) keeps quorum ids increasing across Lighthouse restarts: the last
        id is saved there and a restarted Lighthouse continues after it. Without it a restarted Lighthouse starts
        again at 1, and managers could meet an id they already used (a stale rendezvous prefix).

        `secret` / `tls`: who may call and over what (see the module docstring); None takes the environment,
        `b""` / `TLSFiles()` turn them off.

        `expect_groups` (Regent, for launchers that know what they started, like `regent train`): the replica
        groups ("<group>" of "<group>:<uuid>" ids) the first quorum waits for, at most `expect_within_s` (see
        `quorum.expect_first_groups`). Ignored by a Lighthouse restarted from its state file.

        `frontends` (Regent, Linux): serve gRPC from this many front-end processes sharing the port
        (`regent.ft.frontends`: heartbeats answered there, batched into this process every `frontend_batch_ms`;
        the decision stays here). 0 serves gRPC from this process, as before; None takes
        `$REGENT_LIGHTHOUSE_FRONTENDS` (default 0).

        `seed_committed` (Regent, for the launcher that restarts this Lighthouse): the highest (manager step,
        lineage) the launcher saw committed. The watermark rises to it if the state file stops short of it
        (`quorum.seed_watermark`: steps committed while the Lighthouse was down, whose holders all died before
        telling the new one)."""
        if frontends is None:
            frontends = settings.REGENT_LIGHTHOUSE_FRONTENDS.get()
        if frontends < 0:
            raise ValueError(f"frontends must be 0 (serve from this process) or more, got {frontends}")
        if frontends:
            from regent.ft.frontends import reuse_port_available

            why = reuse_port_available()
            if why is not None:
                raise ValueError(f"{why}; run with --frontends 0 (one process) on this machine")

        self._frontends = frontends
        self._frontend_batch_ms = frontend_batch_ms
        self._pool: Any = None
        self._reserved: socket.socket | None = None
        self._security = rpc_security.Security.resolve(secret, tls)
        self._verifier = (rpc_security.CallVerifier(self._security.secret, "Lighthouse")
                          if self._security.secret else None)
        self._opts = QuorumOptions(
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            holder_grace_ms=holder_grace_ms,
            late_member_ms=late_member_ms,
        )
        self._host, requested_port = parse_bind(bind)
        self._state = LighthouseState()
        self._state_file = Path(state_file) if state_file is not None else None
        if self._state_file is not None:
            saved = load_saved(self._state_file)
            self._state.quorum_id, self._state.watermark = saved.quorum_id, saved.watermark
            restart_grace(self._state, saved.groups, time.monotonic(), self._opts)
            restore_last_quorum(self._state, saved.members, datetime.now(timezone.utc))
        if seed_committed is not None:
            before = self._state.watermark.step
            if seed_watermark(self._state, int(seed_committed[0]), int(seed_committed[1])):
                logger.warning("committed watermark %d -> %d: step %d (lineage %d) was committed while the "
                               "Lighthouse was down and no replica has reported it here yet", before,
                               self._state.watermark.step, seed_committed[0], seed_committed[1])
                self._save_state()
        if expect_groups:
            expect_first_groups(self._state, list(expect_groups), time.monotonic(), expect_within_s)
        self._member_wire: dict[str, torchft_pb2.QuorumMember] = {}  # each replica's last quorum request
        # The wire form of each waiting participant, so unknown fields and the exact `data` string round-trip.
        self._wire: dict[str, torchft_pb2.QuorumMember] = {}
        # One future per Quorum call waiting for the next issued quorum; all are resolved when one is issued.
        self._waiters: list[asyncio.Future] = []
        # The front ends' Quorum calls waiting for the next issued quorum, per batch: (link, participants)
        # (`_frontend_joins`).
        self._front_joins: list[tuple[Any, list[Participant]]] = []
        self._last_reason = ""
        self._quorums_issued = 0
        self._grace_stats: dict[str, float] = {"waits": 0, "came": 0, "timed_out": 0, "waited_s": 0.0}
        self._late_stats: dict[str, int] = {"quorums": 0, "left_out": 0}  # rule 4b's quorums (`_note_late`)
        self._tick_pending = False
        self._stopped = threading.Event()

        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="regent-lighthouse", daemon=True)
        self._thread.start()
        try:
            self._grpc_port, self._http = self._bind_ports(requested_port)
            self._call_in_loop(self._start_serving()).result()
        except BaseException:
            self._stop_loop()
            raise
        self._http_thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.2}, name="regent-lighthouse-http",
            daemon=True,
        )
        self._http_thread.start()
        logger.info(
            "Lighthouse serving gRPC at %s, dashboard at %s (%s; %s)", self.address(), self.dashboard_url(),
            self._opts, self._security.describe()
        )

    # ---- public API ---------------------------------------------------------------------------------------

    def address(self) -> str:
        """The gRPC address for clients and managers: 'http://host:port'."""
        return f"{self._security.scheme}://{format_hostport(advertised_host(self._host), self._grpc_port)}"

    def dashboard_url(self) -> str:
        """The HTTP dashboard: gRPC port + 1."""
        return f"{self._security.scheme}://{format_hostport(advertised_host(self._host), self._http_port())}/"

    @property
    def port(self) -> int:
        return self._grpc_port

    @property
    def options(self) -> QuorumOptions:
        return self._opts

    @property
    def refused_calls(self) -> int:
        """gRPC calls refused for a missing or wrong proof of the job secret (0 without a secret)."""
        front_ends = self._pool.refused if self._pool is not None else 0
        return (self._verifier.refused if self._verifier is not None else 0) + front_ends

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot: current quorum, waiting participants, heartbeats, and the next-quorum reason."""
        if self._stopped.is_set():
            raise RuntimeError("Lighthouse is shut down")
        return self._call_in_loop(self._snapshot()).result(timeout=10)

    def committed_watermark(self) -> tuple[int, int]:
        """The committed watermark (step, lineage) as this Lighthouse knows it, without building `status()`."""
        if self._stopped.is_set():
            raise RuntimeError("Lighthouse is shut down")

        async def read() -> tuple[int, int]:
            return self._state.watermark.step, self._state.watermark.lineage

        return self._call_in_loop(read()).result(timeout=10)

    def counted_live(self) -> set[str]:
        """The replica ids this Lighthouse counts live now (fresh heartbeat): for monitors and the control-plane
        simulator (`regent.ft.simulate`), without building the whole `status()`. Thread-safe."""
        if self._stopped.is_set():
            raise RuntimeError("Lighthouse is shut down")

        async def read() -> set[str]:
            return healthy_replicas(time.monotonic(), self._state, self._opts)

        return self._call_in_loop(read()).result(timeout=10)

    def frontend_pids(self) -> list[int]:
        """The front-end processes serving now (empty with `frontends=0`): for CPU accounting and tests."""
        return self._pool.pids() if self._pool is not None else []

    def frontend_stats(self) -> dict[str, Any]:
        """Front ends: how many, restarts, and how late their batched heartbeats reached the liveness table
        (`frontends.LagStats`: receipt at a front end to applied here). Empty with `frontends=0`. Thread-safe."""
        if self._pool is None:
            return {}

        async def read() -> dict[str, Any]:
            return {"frontends": self._pool.count, "pids": self._pool.pids(), "restarted": self._pool.restarted,
                    "batch_ms": self._frontend_batch_ms, "heartbeat_apply_lag": self._pool.lag.summary()}

        return self._call_in_loop(read()).result(timeout=10)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `shutdown()` (or `timeout` seconds). Returns True once shut down."""
        return self._stopped.wait(timeout)

    def shutdown(self) -> None:
        """Stop serving: in-flight Quorum calls end with UNAVAILABLE/CANCELLED on the client side."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(Exception):
            self._call_in_loop(self._stop_serving()).result(timeout=10)
        self._http.shutdown()
        self._http.server_close()
        self._stop_loop()
        logger.info("Lighthouse at %s shut down", self.address())

    def __enter__(self) -> LighthouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- startup / teardown -------------------------------------------------------------------------------

    def _call_in_loop(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def _http_port(self) -> int:
        return self._http.server_address[1]

    def _bind_ports(self, port: int) -> tuple[int, ThreadingHTTPServer]:
        """Bind gRPC on `port` and the dashboard on `port + 1`; with port 0 find a free pair."""
        attempts = PORT_PAIR_ATTEMPTS if port == 0 else 1
        last_error: Exception | None = None
        for _ in range(attempts):
            grpc_port = port or self._free_port()
            try:
                http = self._make_http_server(grpc_port + 1)
            except OSError as err:
                last_error = err
                continue
            try:
                self._call_in_loop(self._create_grpc_server(grpc_port)).result()
            except OSError as err:  # the port is taken: try another pair, and the last error is raised below
                http.server_close()
                last_error = err
                continue
            return grpc_port, http
        where = format_hostport(self._host, port)
        raise OSError(
            f"could not bind the Lighthouse to {where} (gRPC) and port+1 (dashboard): {last_error}; "
            "is another Lighthouse running? pick a free port with --bind HOST:PORT"
        )

    def _free_port(self) -> int:
        """P with P and P+1 free now, from outside the ephemeral range (`regent.ports.free_port_pair` says why)."""
        from regent.ports import free_port_pair

        return free_port_pair(self._host)

    def _make_http_server(self, port: int) -> ThreadingHTTPServer:
        cls = _DashboardHTTPServer6 if ":" in self._host else _DashboardHTTPServer
        handler = type("_BoundDashboardHandler", (_DashboardHandler,), {"lighthouse": self})
        http = cls((self._host, port), handler)
        if self._security.tls.enabled:
            try:
                # HTTPS without client certificates (a browser has none); the handshake runs in each
                # connection's own thread (do_handshake_on_connect=False), so a silent client blocks no one.
                ctx = self._security.tls.server_context(alpn=("http/1.1",), require_client_cert=False)
                http.socket = ctx.wrap_socket(http.socket, server_side=True, do_handshake_on_connect=False)
            except BaseException:
                http.server_close()
                raise
        return http

    async def _create_grpc_server(self, port: int) -> None:
        security = self._security
        if self._frontends:
            from regent.ft.frontends import reserve_port

            self._reserved = reserve_port(self._host, port)
            return
        server = lite_server(_lite_handlers(self), security, self._verifier)
        await server.start(self._host, port)
        self._server = server

    async def _start_serving(self) -> None:
        if self._frontends:
            from regent.ft.frontends import FrontendPool

            tls = self._security.tls
            self._pool = FrontendPool(self, self._frontends, self._host, self._grpc_port, {
                "batch_ms": self._frontend_batch_ms,
                "secret": self._security.secret.hex() if self._security.secret else "",
                "tls": [tls.cert, tls.key, tls.ca, tls.server_name]})
            try:
                await self._pool.start()
            except BaseException:
                await self._pool.stop()
                self._close_reserved()
                raise
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_forever())

    def _close_reserved(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    async def _stop_serving(self) -> None:
        self._tick_task.cancel()
        if self._pool is not None:
            await self._pool.stop()
            self._close_reserved()
        else:
            await self._server.stop()

    # ---- quorum -------------------------------------------------------------------------------------------

    def _join(self, wire: torchft_pb2.QuorumMember, member: QuorumMember) -> Participant:
        now = time.monotonic()
        participant = Participant(joined=now, member=member)
        self._state.participants[member.replica_id] = participant
        self._wire[member.replica_id] = wire
        self._member_wire[member.replica_id] = wire
        return participant

    def _quorum(self, wire: torchft_pb2.QuorumMember, ask: tuple[int, bool] | None = None) -> bytes | asyncio.Future:
        """Serve one Quorum call: join, then wait for a quorum that includes us. Returns the encoded response at
        once when this call completes a quorum, else a task that resolves to it. `ask`: the compact answer's
        (group size, init_sync) when the requester asked for it (`_compact_ask`)."""
        member, participant = self._enter(wire)
        rid = member.replica_id
        mine = [participant]
        while True:
            issued = self._wait_for_next()
            if not issued.done():
                break
            answered: _Issued = issued.result()
            if rid in answered.ids:
                return answered.answer(rid, ask)
            logger.info("replica %s not in quorum %d; waiting for the next", rid, answered.quorum_id)
            mine[0] = self._join(wire, member)
        task = self._loop.create_task(self._quorum_wait(wire, member, mine, issued, ask))
        # A done callback, not a `finally`: it runs even if the call is cancelled before the task starts.
        task.add_done_callback(lambda _: self._withdraw(rid, mine[0]))
        return task

    def _enter(self, wire: torchft_pb2.QuorumMember) -> tuple[QuorumMember, Participant]:
        """A Quorum call's effects before it waits: an implicit heartbeat, its committed report, its join."""
        member = QuorumMember.from_proto(wire)
        rid = member.replica_id
        self._heartbeat(rid)  # a Quorum request is an implicit heartbeat
        step, lineage = state_version(member)
        self._note_committed(rid, step, lineage, accepted_loss(member))
        return member, self._join(wire, member)

    def _note_committed(self, rid: str, step: int, lineage: int, accepted: tuple[int, int] | None = None) -> None:
        before = self._state.watermark
        if not note_committed(self._state, rid, step, lineage, accepted):
            return
        w = self._state.watermark
        if w.resets != before.resets:
            logger.warning("lineage reset accepted by %s: committed watermark %d -> %d (restored older state)",
                           rid, before.step, w.step)
        self._save_state()

    def _save_state(self) -> None:
        if self._state_file is None:
            return
        try:
            prev = self._state.prev_quorum
            members = prev.replica_ids() if prev is not None else None
            groups = sorted({group_name(rid) or rid for rid in members}) if members is not None else None
            if groups is None and self._state.expected_groups:
                groups = sorted(self._state.expected_groups)  # no quorum yet since the restart: keep the last one's
            save_quorum_id(self._state_file, self._state.quorum_id, self._state.watermark, groups, members)
        except OSError:
            logger.exception("could not save Lighthouse state to %s; ids may repeat after a restart",
                             self._state_file)

    def _holders(self) -> bytes:
        """The `RegentHolders` answer: the watermark and the healthy replicas holding it."""
        w = self._state.watermark
        found = holders(time.monotonic(), self._state, self._opts)
        return torchft_pb2.RegentHoldersResponse(
            watermark=torchft_pb2.RegentCommitted(step=w.step, lineage=w.lineage, resets=w.resets),
            # A holder whose address this Lighthouse has not learned yet (it was restarted, and the holder has not
            # asked for a quorum since) is named without one: the asker then knows the state is alive and heals
            # at its next quorum, instead of concluding from an empty list that every holder is gone.
            holders=[self._wire_of(rid) for rid in found],
        ).SerializeToString()

    def _heartbeat(self, rid: str, message: torchft_pb2.LighthouseHeartbeatRequest | None = None) -> None:
        if message is not None and message.HasField("regent_committed"):
            c = message.regent_committed
            self._note_committed(rid, c.step, c.lineage, (c.accepted_loss, c.accepted_lineage) if c.accepted_loss else None)
        retired = note_heartbeat(self._state, rid, time.monotonic())
        if retired:
            logger.info("replica %s is a new incarnation; retired %s", rid, retired)
            for old in retired:
                self._member_wire.pop(old, None)
            self._tick_soon()  # survivors waiting on the old incarnation may form a quorum now

    def _frontend_beats(self, beats: list[list]) -> None:
        """A front end's batch of heartbeats (`frontends.batch_beat` entries): committed reports first, as
        `_heartbeat` does, then the liveness table (`frontends.apply_heartbeats`)."""
        from regent.ft.frontends import apply_heartbeats

        for beat in beats:
            if len(beat) > 2:
                step, lineage, loss, loss_lineage = (int(x) for x in beat[2:6])
                self._note_committed(beat[0], step, lineage, (loss, loss_lineage) if loss else None)
        now = time.monotonic()
        retired = apply_heartbeats(self._state, beats, now)
        self._pool.note_lag(beats, now)
        if retired:
            for rid, old_ids in retired.items():
                logger.info("replica %s is a new incarnation; retired %s", rid, old_ids)
                for old in old_ids:
                    self._member_wire.pop(old, None)
            self._tick_soon()

    def _frontend_spend(self, method: str, ms: int, key: int) -> str | None:
        """With a job secret: spend the nonce of a call a front end checked the proof of (one table for all
        front ends, so a replay is refused whichever front end it reaches). None: run it; else the refusal."""
        if self._verifier is None:
            return None
        reason = self._verifier.spend(ms, key)
        return None if reason is None else self._verifier.refuse("a front end", method, reason)

    def _frontend_spend_many(self, method: str, nonces: Iterable[tuple[int, int]]) -> list[str | None] | None:
        """`_frontend_spend` for a batch of calls (one clock read and one lock; every nonce still checked): each
        call's refusal or None; None for all when this Lighthouse has no secret (`nonces` is then not read)."""
        if self._verifier is None:
            return None
        verifier = self._verifier
        return [None if reason is None else verifier.refuse("a front end", method, reason)
                for reason in verifier.spend_many(list(nonces))]

    def _frontend_joins(self, link: Any, joins: list[Join]) -> None:
        """A front end's batch of Quorum calls, pre-decoded there (`regent.ft.joins`). The same effects as
        `_quorum` per call (`quorum.apply_joins`: the implicit heartbeat, the committed report, the join), in one
        pass; each waits as its participant in the link's `joins` (no future, no task), and `_tick` answers every
        front-end join of a round in one pass. With a job secret the link has spent every call's nonce first."""
        if not joins:
            return
        try:
            applied = apply_joins(self._state, joins, time.monotonic())
        except Exception:
            # A defect (a record apply_joins cannot read): none of the batch may wait, since its callers are answered
            # with the error (`_OwnerLink._joins`); the reports applied before it stand (they are what was sent).
            participants = self._state.participants
            for join in joins:
                waiting = participants.get(join.replica_id)
                if waiting is not None and waiting.member is join:
                    del participants[join.replica_id]
            raise
        link.joins.update(zip([j.call_id for j in joins], applied.participants))
        self._member_wire.update(zip([j.replica_id for j in joins], joins))
        self._front_joins.append((link, applied.participants))
        self._after_reports(applied.retired, applied.watermark_moves)
        if quorum_possible(self._state, self._opts):
            self._tick_soon()

    def _after_reports(self, retired: dict[str, list[str]], moves: list[tuple[str, Watermark]]) -> None:
        """What `_heartbeat` and `_note_committed` do after a batch changed the table: log and forget retired
        incarnations (a quorum may form without them), log a lineage reset, save a moved watermark once."""
        for rid, old_ids in retired.items():
            logger.info("replica %s is a new incarnation; retired %s", rid, old_ids)
            for old in old_ids:
                self._member_wire.pop(old, None)
        if retired:
            self._tick_soon()
        for rid, before in moves:
            after = self._state.watermark
            if after.resets != before.resets:
                logger.warning("lineage reset accepted by %s: committed watermark %d -> %d (restored older state)",
                               rid, before.step, after.step)
        if moves:
            self._save_state()

    def _wire_of(self, rid: str) -> torchft_pb2.QuorumMember:
        """A replica's last Quorum request's member (parsed now if a front end pre-decoded it), or its id alone."""
        wire = self._member_wire.get(rid)
        if wire is None:
            return torchft_pb2.QuorumMember(replica_id=rid)
        return wire if isinstance(wire, torchft_pb2.QuorumMember) else wire.to_proto()

    def _answer_front_joins(self, answers: _Issued) -> None:
        """Answer the front ends' waiting joins that `answers` includes, per link in one go (`_OwnerLink.
        answer_round`: the round's plan and one frame of call ids); the others join the next round (as
        `_quorum_wait` does for this process's own callers)."""
        batches, self._front_joins = self._front_joins, []
        ids = answers.ids
        answered: dict[Any, tuple[list[int], list[int]]] = {}
        for link, participants in batches:
            waiting = link.joins
            compact, full = answered.setdefault(link, ([], []))
            left_out = []
            for participant in participants:
                join = participant.member
                call_id = join.call_id
                if waiting.get(call_id) is not participant:
                    continue  # withdrawn, or its link is gone
                if join.replica_id in ids:
                    del waiting[call_id]
                    (compact if join.compact else full).append(call_id)
                else:
                    logger.info("replica %s not in quorum %d; waiting for the next", join.replica_id,
                                answers.quorum_id)
                    again = Participant(joined=time.monotonic(), member=join)
                    self._state.participants[join.replica_id] = again
                    self._member_wire[join.replica_id] = join
                    waiting[call_id] = again
                    left_out.append(again)
            if left_out:
                self._front_joins.append((link, left_out))
        for link, (compact, full) in answered.items():
            link.answer_round(answers, compact, full)

    def forget_replicas(self, replica_ids: list[str]) -> list[str]:
        """Count `replica_ids` as failed now (their processes are known dead), not after their heartbeats time
        out; a quorum that waited for them forms at once. Thread-safe. Returns the ids that still counted."""
        return self._call_in_loop(self._forget(list(replica_ids))).result(timeout=10)

    async def _forget(self, replica_ids: list[str]) -> list[str]:
        forgotten = forget_replicas(self._state, replica_ids)
        for rid in replica_ids:
            self._member_wire.pop(rid, None)
        if forgotten:
            logger.info("replicas %s reported failed; no longer waited for", forgotten)
            self._tick()
        return forgotten

    def _wait_for_next(self) -> asyncio.Future:
        """A future for the next issued quorum; issues one now if it is already possible."""
        issued = self._loop.create_future()
        self._waiters.append(issued)
        if quorum_possible(self._state, self._opts):
            # One computation per loop turn, not per request: with a small min_replicas every request of a round
            # passes `quorum_possible`, and an O(N) compute per request made a round of N joins O(N^2) (found by
            # the control-plane simulator: seconds at 4,000 groups).
            self._tick_soon()
        return issued

    async def _quorum_wait(
        self, wire: torchft_pb2.QuorumMember, member: QuorumMember, mine: list[Participant], issued: asyncio.Future,
        ask: tuple[int, bool] | None,
    ) -> bytes:
        rid = member.replica_id
        while True:
            answered: _Issued = await issued
            if rid in answered.ids:
                return answered.answer(rid, ask)
            # Issued without us (e.g. shrink_only): re-insert ourselves and wait for the next one.
            logger.info("replica %s not in quorum %d; waiting for the next", rid, answered.quorum_id)
            mine[0] = self._join(wire, member)
            issued = self._wait_for_next()

    def _withdraw(self, rid: str, participant: Participant) -> None:
        """The caller stopped waiting (deadline, cancel, disconnect): take it out of the next quorum."""
        if self._state.participants.get(rid) is participant:
            del self._state.participants[rid]
            self._wire.pop(rid, None)

    def _tick(self) -> None:
        now = time.monotonic()
        members, reason = quorum_compute(now, self._state, self._opts)
        if reason != self._last_reason:
            logger.debug("Quorum status: %s", reason)
            self._last_reason = reason
        if members is None:
            return
        wire = self._wire  # the waiting callers' wire forms, for the full answer if anyone asks for it
        self._wire = {}
        previous_id = self._state.quorum_id if self._state.prev_quorum is not None else None
        quorum = issue_quorum(self._state, members, datetime.now(timezone.utc))
        self._quorums_issued += 1
        self._note_grace(now, members)
        self._note_late(quorum.quorum_id)
        # A front end's member parses its wire form from its raw request (`joins.Join.to_proto`), only if a
        # caller wants TorchFT's full answer.
        answers = _Issued(quorum, lambda: [wire.get(m.replica_id) or m.to_proto() for m in members],
                          self._state.watermark)
        if quorum.quorum_id != previous_id:
            self._save_state()
            if len(members) <= 64:
                logger.info("Quorum %d: %s (%s)", quorum.quorum_id, [m.replica_id for m in members], reason)
            else:
                logger.info("Quorum %d: %d members (%s)", quorum.quorum_id, len(members), reason)
        waiters, self._waiters = self._waiters, []
        for issued in waiters:
            if not issued.done():  # a cancelled call's future is done already
                issued.set_result(answers)
        self._answer_front_joins(answers)

    def _note_grace(self, now: float, members: list[Any]) -> None:
        """A quorum issued after the holder grace held it back: count the wait, and whether a replica it waited
        for came in time (`status()["holder_grace"]`, and one log line each)."""
        state = self._state
        if not state.grace_awaited:
            return
        ids = {m.replica_id for m in members}
        came = sorted(state.grace_awaited & ids)
        waited = now - (state.grace_since if state.grace_since is not None else now)
        stats = self._grace_stats
        stats["waits"] += 1
        stats["came" if came else "timed_out"] += 1
        stats["waited_s"] = round(stats["waited_s"] + waited, 6)
        logger.info("holder grace: quorum %d waited %.2f s for %s; %s", state.quorum_id, waited,
                    sorted(state.grace_awaited)[:3], f"came: {came[:3]}" if came else "none came in time")
        state.grace_awaited = set()
        state.grace_since = None

    def _note_late(self, quorum_id: int) -> None:
        """A quorum issued without late members of the last one (`quorum.late_members`): count it and them
        (`status()["late_members"]`, and one log line each), so an operator sees how often the rule acts, and whom
        it leaves out (a replica left out again and again is slower than the others, not paused)."""
        state = self._state
        if not state.late_left_out:
            return
        left = state.late_left_out
        self._late_stats["quorums"] += 1
        self._late_stats["left_out"] += len(left)
        logger.info("late members: quorum %d issued without %s, %.0f ms after a majority of the last one joined",
                    quorum_id, left[:3], self._opts.late_member_ms)
        state.late_left_out = []

    def _tick_soon(self) -> None:
        """One tick at the loop's next turn, however many events ask for it meanwhile: a burst of restarts
        costs one quorum computation, not one per new incarnation."""
        if not self._tick_pending:
            self._tick_pending = True
            self._loop.call_soon(self._deferred_tick)

    def _deferred_tick(self) -> None:
        self._tick_pending = False
        if quorum_possible(self._state, self._opts):
            self._tick()

    async def _tick_forever(self) -> None:
        """The periodic tick. It computes a quorum only while one could form (`quorum_possible`: someone is
        waiting), so heartbeats alone cost O(1) each however many replicas there are; old heartbeats are swept
        every `forget_after / 10` seconds, an O(table) pass that is cheap at that rate."""
        period = self._opts.quorum_tick_ms / 1000.0
        forget_after = max(60.0, 10 * self._opts.heartbeat_timeout_ms / 1000.0)
        next_sweep = time.monotonic() + forget_after / 10
        while True:
            await asyncio.sleep(period)
            try:
                if quorum_possible(self._state, self._opts):
                    self._tick()
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + forget_after / 10
                    self._forget_old_heartbeats(now - forget_after)
            except Exception:
                logger.exception("Lighthouse quorum tick failed; will retry next tick")

    def _forget_old_heartbeats(self, cutoff: float) -> None:
        for rid in expire_heartbeats(self._state, cutoff, keep=self._state.participants):
            self._member_wire.pop(rid, None)

    # ---- dashboard ----------------------------------------------------------------------------------------

    async def _snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        state = self._state
        members, reason = quorum_compute(now, state, self._opts)
        healthy = healthy_replicas(now, state, self._opts)
        prev: Quorum | None = state.prev_quorum
        max_step = max((m.step for m in prev.participants), default=-1) if prev else -1
        prev_json = None
        if prev is not None:
            prev_json = prev.to_json()
            prev_json["age_s"] = (datetime.now(timezone.utc) - prev.created).total_seconds()
            for m in prev_json["participants"]:
                m["recovering"] = m["step"] != max_step
                m["healthy"] = m["replica_id"] in healthy
        return {
            "quorum_id": state.quorum_id,
            "address": self.address(),
            "dashboard": self.dashboard_url(),
            "options": {
                "min_replicas": self._opts.min_replicas,
                "join_timeout_ms": self._opts.join_timeout_ms,
                "quorum_tick_ms": self._opts.quorum_tick_ms,
                "heartbeat_timeout_ms": self._opts.heartbeat_timeout_ms,
                "holder_grace_ms": self._opts.holder_grace_ms,
                "late_member_ms": self._opts.late_member_ms,
            },
            "next_quorum": {"ready": members is not None, "reason": reason},
            "quorums_issued": self._quorums_issued,
            "holder_grace": dict(self._grace_stats),
            "late_members": dict(self._late_stats),
            "state_file": str(self._state_file) if self._state_file is not None else None,
            "max_step": max_step,
            "committed": {"step": state.watermark.step, "lineage": state.watermark.lineage,
                          "resets": state.watermark.resets},
            "prev_quorum": prev_json,
            "waiting": [
                {**p.member.to_json(), "waiting_s": now - p.joined, "healthy": rid in healthy}
                for rid, p in sorted(state.participants.items())
            ],
            "heartbeats": [
                {"replica_id": rid, "age_s": now - last, "healthy": rid in healthy}
                for rid, last in sorted(state.heartbeats.items())
            ],
        }

    async def _member_address(self, replica_id: str) -> str | None:
        prev = self._state.prev_quorum
        if prev is not None:
            for m in prev.participants:
                if m.replica_id == replica_id:
                    return m.address
        waiting = self._state.participants.get(replica_id)
        return waiting.member.address if waiting else None

    def kill_replica(self, replica_id: str, msg: str = "killed from the Lighthouse dashboard") -> str:
        """Ask a replica's manager to exit via `ManagerService.Kill`. Returns a note on what happened.

        Raises KeyError for an unknown replica and ConnectionError if its manager cannot be reached."""
        address = self._call_in_loop(self._member_address(replica_id)).result(timeout=10)
        if address is None:
            raise KeyError(f"no replica {replica_id!r} in the current quorum or waiting for the next")
        if not address:
            raise ConnectionError(f"replica {replica_id!r} did not report a manager address; cannot kill it")
        target = address
        for prefix in ("http://", "https://"):
            if target.startswith(prefix):
                target = target[len(prefix) :]
        with self._security.channel(target) as channel:
            stub = torchft_pb2_grpc.ManagerServiceStub(channel)
            try:
                stub.Kill(torchft_pb2.KillRequest(msg=msg), timeout=KILL_TIMEOUT_S)
            except grpc.RpcError as err:
                detail = err.details() or ""
                never_reached = any(
                    marker in detail.lower() for marker in ("failed to connect", "connection refused", "dns")
                )
                if err.code() == grpc.StatusCode.UNAVAILABLE and not never_reached:
                    # The manager exits inside the call, so the connection usually drops before a reply.
                    logger.info("kill sent to %s at %s (connection closed: %s)", replica_id, address, detail)
                    return f"kill sent to {replica_id} at {address}; connection closed as the manager exited"
                raise ConnectionError(
                    f"could not kill {replica_id}: manager at {address} answered {err.code().name}: {detail}"
                ) from None
        logger.info("kill sent to %s at %s", replica_id, address)
        return f"kill sent to {replica_id} at {address}"


def _dashboard_page() -> bytes:
    return resources.files("regent.ft").joinpath("templates/lighthouse.html").read_bytes()


class _DashboardHandler(BaseHTTPRequestHandler):
    lighthouse: LighthouseServer  # set on a per-server subclass
    server_version = "RegentLighthouse"
    # A client that stays silent (or never finishes its TLS handshake) holds its thread this long at most.
    timeout = 30.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("dashboard %s: " + format, self.address_string(), *args)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, status: HTTPStatus, payload: Any) -> None:
        self._send(status, json.dumps(payload, indent=1).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, _dashboard_page(), "text/html; charset=utf-8")
        elif path in ("/status.json", "/status"):
            from urllib.parse import parse_qs

            from regent.ft.dashboard import paged_status, parse_page

            try:
                page = parse_page(parse_qs(self.path.partition("?")[2]))
            except ValueError as err:
                self._send_json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
                return
            status = self.lighthouse.status()
            self._send_json(HTTPStatus.OK, status if page is None else paged_status(status, *page))
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no page {path}; try / or /status.json"})

    def do_POST(self) -> None:  # noqa: N802
        from urllib.parse import unquote

        match = re.fullmatch(r"/replica/(?P<rid>[^/]+)/kill", self.path.split("?", 1)[0])
        if not match:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": "POST /replica/<replica_id>/kill is the only action"})
            return
        replica_id = unquote(match.group("rid"))
        verifier = self.lighthouse._verifier
        if verifier is not None:
            method = rpc_security.dashboard_kill_method(replica_id)
            refusal = verifier.check(method, self.headers.get(rpc_security.DASHBOARD_AUTH_HEADER),
                                     self.address_string())
            if refusal is not None:
                self._send_json(HTTPStatus.UNAUTHORIZED, {
                    "error": f"{refusal}; this Lighthouse has a job secret, so a kill needs the "
                             f"{rpc_security.DASHBOARD_AUTH_HEADER} header "
                             "(regent.ft.rpc_security.dashboard_kill_headers)"})
                return
        try:
            note = self.lighthouse.kill_replica(replica_id)
        except KeyError as err:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": str(err.args[0])})
        except ConnectionError as err:
            self._send_json(HTTPStatus.BAD_GATEWAY, {"error": str(err)})
        else:
            self._send_json(HTTPStatus.OK, {"killed": replica_id, "note": note})
