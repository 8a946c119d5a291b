"""A control-plane simulator: thousands of replica groups driving a real Lighthouse over real sockets.

Why: the Lighthouse's limits at 100k GPUs (12,800 groups) cannot be found with a dozen real replicas, and the
questions that matter there are about behaviour under load, not about one call: does a heartbeat still count
in time, how long does a quorum round take, is a dead group dropped within the heartbeat timeout, is a live one
ever dropped. So a few worker processes each multiplex thousands of cheap simulated groups (one HTTP/2
connection per group, as a Manager has; pre-encoded gRPC calls) against the Lighthouse, fail them on a seeded
schedule, and restart them under new incarnations, while the coordinator watches the Lighthouse's liveness
table.

What is reported:
- heartbeat lag: from a heartbeat's send to its answer. The Lighthouse records the heartbeat before it answers,
  so this bounds the time to its effect on liveness (and includes any queueing in an overloaded server);
  `late`: heartbeats the simulator itself sent more than one interval after they were due (the simulator, not
  the server, fell behind: a result to distrust);
- quorum round time: from the first Quorum request of a round to the last answer (rounds every
  `quorum_every_s`; every live group joins);
- missed failures: a dead incarnation still counted live `heartbeat_timeout + slack` after its death;
- false failures: a live incarnation, heartbeating, not counted live.

The pure pieces (fault schedule, lives, liveness judgement, lag histogram) are plain functions tested without
processes. Workers are `python -m regent.ft.simulate worker` subprocesses; they share the coordinator's clock
(CLOCK_MONOTONIC is system-wide on Linux), so the simulation is for one host.

    regent simulate --groups 1000 --duration 20 --interval 0.1     # the CLI (see `add_parser`)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from regent.ft.compact import varint
from regent.ft.grpc_lite import (
    DATA,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    GOAWAY,
    HEADERS,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    literal_header,
)

HEARTBEAT_PATH = b"/torchft.LighthouseService/Heartbeat"
QUORUM_PATH = b"/torchft.LighthouseService/Quorum"
BIG_WINDOW = 2**31 - 1


# ---- configuration ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """One simulation. Times in seconds; `faults_per_s` is for the whole fleet (a Poisson process)."""

    groups: int = 200
    workers: int = 2
    duration_s: float = 10.0
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 5.0
    quorum_every_s: float = 2.0  # 0: no quorum rounds, heartbeats only
    join_timeout_ms: int = 60_000
    quorum_tick_ms: int = 100
    faults_per_s: float = 0.5
    down_s: float = 2.0  # how long a failed group stays down before its new incarnation starts
    silent_fraction: float = 0.5  # faults that hang (socket open, nothing sent) rather than crash (socket closed)
    warmup_s: float = 2.0  # no faults and no liveness judgement before this
    poll_s: float = 0.5  # how often the coordinator reads the Lighthouse's liveness table
    slack_s: float = 1.0  # allowance for a heartbeat in flight at a death, and for the poll itself
    compact: bool = False  # ask for the compact quorum answer (Regent extension)
    frontends: int = 0  # Regent's Lighthouse with this many front-end processes (`regent.ft.frontends`)
    frontend_batch_ms: float = 2.0  # their batching interval (0: once per loop turn)
    seed: int = 0


# ---- pure pieces: faults, lives, judgement, lag statistics ------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """Group `group` dies at `at` (hung if `silent`, else crashed) and restarts as a new incarnation at
    `restart_at` (seconds from the simulation's start)."""

    at: float
    group: int
    silent: bool
    restart_at: float


def fault_schedule(cfg: SimConfig) -> list[Fault]:
    """The seeded faults of a run: Poisson arrivals at `faults_per_s` after the warm-up, each on a random group
    that is up at that moment (a dead group cannot fail again). Same config, same schedule: every worker and the
    coordinator compute it themselves."""
    if cfg.faults_per_s <= 0 or cfg.groups <= 0:
        return []
    rng = random.Random(cfg.seed)
    faults: list[Fault] = []
    down_until: dict[int, float] = {}
    t = cfg.warmup_s
    while True:
        t += rng.expovariate(cfg.faults_per_s)
        if t >= cfg.duration_s:
            return faults
        group = rng.randrange(cfg.groups)
        silent = rng.random() < cfg.silent_fraction
        if down_until.get(group, -1.0) > t:
            continue
        faults.append(Fault(t, group, silent, t + cfg.down_s))
        down_until[group] = t + cfg.down_s


def replica_id(group: int, incarnation: int, seed: int = 0) -> str:
    """TorchFT's form "<group>:<uuid>": the Lighthouse retires a group's older id at a new one's first call."""
    return f"sim{group}:s{seed}-i{incarnation}"


@dataclass(frozen=True)
class Life:
    """One incarnation: alive from `start` until `end` (None: to the end of the run)."""

    replica_id: str
    group: int
    start: float
    end: float | None


def lives(cfg: SimConfig, faults: Iterable[Fault]) -> list[Life]:
    """Every incarnation of every group, from the fault schedule."""
    by_group: dict[int, list[Fault]] = {}
    for f in faults:
        by_group.setdefault(f.group, []).append(f)
    out = []
    for g in range(cfg.groups):
        start = 0.0
        for k, f in enumerate(sorted(by_group.get(g, []), key=lambda f: f.at)):
            out.append(Life(replica_id(g, k, cfg.seed), g, start, f.at))
            start = f.restart_at
        if start < cfg.duration_s:
            out.append(Life(replica_id(g, len(by_group.get(g, [])), cfg.seed), g, start, None))
    return out


def judge_liveness(t_before: float, t_after: float, counted_live: set[str], all_lives: Iterable[Life],
                   timeout_s: float, grace_s: float, slack_s: float) -> tuple[set[str], set[str]]:
    """(missed, false) for one read of the Lighthouse's liveness table, taken between `t_before` and `t_after`.

    Missed: an incarnation dead since `end` and still counted live although `end + timeout_s + slack_s` had passed
    before the read began. False: an incarnation alive through the whole read, started more than `grace_s`
    before it (time for its first heartbeat), and not counted live."""
    missed, false = set(), set()
    for life in all_lives:
        if life.end is not None and life.end <= t_after:
            if life.replica_id in counted_live and t_before > life.end + timeout_s + slack_s:
                missed.add(life.replica_id)
        elif life.start + grace_s < t_before and life.replica_id not in counted_live:
            false.add(life.replica_id)
    return missed, false


class LagHistogram:
    """Latencies in log-spaced bins (5% wide, 10 µs to 1000 s): mergeable across processes, fixed size, so a
    worker can count millions of heartbeats and send back a few hundred numbers."""

    RATIO = 1.05
    LOW = 1e-5
    BINS = int(math.log(1e8) / math.log(1.05)) + 2

    def __init__(self, counts: list[int] | None = None, maximum: float = 0.0, total: float = 0.0) -> None:
        self.counts = list(counts) if counts is not None else [0] * self.BINS
        self.maximum = maximum
        self.total = total

    def add(self, seconds: float) -> None:
        i = 0 if seconds <= self.LOW else min(self.BINS - 1, 1 + int(math.log(seconds / self.LOW) / math.log(self.RATIO)))
        self.counts[i] += 1
        self.total += seconds
        if seconds > self.maximum:
            self.maximum = seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def merge(self, other: LagHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.maximum = max(self.maximum, other.maximum)
        self.total += other.total

    def percentile(self, q: float) -> float:
        """The upper edge of the bin holding the q-th percentile (0 < q <= 100), never above the maximum."""
        n = self.count
        if n == 0:
            return 0.0
        rank = max(1, math.ceil(q / 100.0 * n))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(self.maximum, self.LOW * self.RATIO ** i)
        return self.maximum

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "maximum": self.maximum, "total": self.total}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LagHistogram:
        return cls(data["counts"], data["maximum"], data["total"])

    def summary(self) -> dict[str, float]:
        n = self.count
        return {"n": n, "mean_ms": 1e3 * self.total / n if n else 0.0, "p50_ms": 1e3 * self.percentile(50),
                "p99_ms": 1e3 * self.percentile(99), "max_ms": 1e3 * self.maximum}


@dataclass
class RoundStats:
    """One quorum round as one worker saw it; `merge_rounds` combines the workers'."""

    first_send: float = math.inf
    last_answer: float = 0.0
    sent: int = 0
    answered: int = 0
    failed: int = 0
    answer_bytes: int = 0


def merge_rounds(parts: Iterable[dict[int, RoundStats]]) -> dict[int, RoundStats]:
    out: dict[int, RoundStats] = {}
    for part in parts:
        for k, r in part.items():
            m = out.setdefault(k, RoundStats())
            m.first_send = min(m.first_send, r.first_send)
            m.last_answer = max(m.last_answer, r.last_answer)
            m.sent += r.sent
            m.answered += r.answered
            m.failed += r.failed
            m.answer_bytes += r.answer_bytes
    return out


def round_summary(rounds: dict[int, RoundStats]) -> dict[str, Any]:
    """Round times (first request to last answer) of rounds in which every request was answered."""
    times = sorted(r.last_answer - r.first_send for r in rounds.values() if r.sent and r.answered == r.sent)
    incomplete = sum(1 for r in rounds.values() if r.sent and r.answered + r.failed < r.sent)
    if not times:
        return {"rounds": 0, "incomplete": incomplete}
    per_answer = [r.answer_bytes / r.answered for r in rounds.values() if r.answered]
    return {"rounds": len(times), "incomplete": incomplete, "p50_ms": 1e3 * times[len(times) // 2],
            "max_ms": 1e3 * times[-1], "failed": sum(r.failed for r in rounds.values()),
            "answer_bytes": sum(per_answer) / len(per_answer)}


# ---- the worker: many groups, one process -----------------------------------------------------------------------


def _grpc_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


class _GroupConnection(asyncio.Protocol):
    """One simulated group's HTTP/2 connection: sends pre-encoded unary calls, parses only frame headers."""

    def __init__(self, worker: _Worker, group: _Group, authority: bytes) -> None:
        self.worker = worker
        self.group = group
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.next_stream = 1
        self.streams: dict[int, list[Any]] = {}  # sid -> [kind, sent_at, bytes received, round]
        self.received = 0
        self.closed = False
        self._headers = {path: b"".join(literal_header(k, v) for k, v in (
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", authority),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"))) for path in (HEARTBEAT_PATH, QUORUM_PATH)}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = int(SETTINGS_INITIAL_WINDOW_SIZE).to_bytes(2, "big") + BIG_WINDOW.to_bytes(4, "big")
        self.transport.write(PREFACE + frame(SETTINGS, 0, 0, settings)
                             + frame(WINDOW_UPDATE, 0, 0, (BIG_WINDOW - 65_535).to_bytes(4, "big")))

    def call(self, path: bytes, message: bytes, kind: str, now: float, rnd: int = -1) -> None:
        sid = self.next_stream
        self.next_stream += 2
        self.streams[sid] = [kind, now, 0, rnd]
        assert self.transport is not None
        self.transport.write(frame(HEADERS, FLAG_END_HEADERS, sid, self._headers[path])
                             + frame(DATA, FLAG_END_STREAM, sid, message))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        reply = b""
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            if kind == DATA and sid in self.streams:
                s = self.streams[sid]
                s[2] += length
                if s[0] == "quorum" and self.worker.decode:
                    s.append(bytes(buf[pos + 9:pos + 9 + length]))
                self.received += length
            elif kind == HEADERS and flags & FLAG_END_STREAM and sid in self.streams:
                self.worker.answered(self, sid, self.streams.pop(sid))
            elif kind == RST_STREAM and sid in self.streams:
                s = self.streams.pop(sid)
                s[2] = 0
                self.worker.answered(self, sid, s)
            elif kind == SETTINGS and not flags & FLAG_ACK:
                reply += frame(SETTINGS, FLAG_ACK, 0)
            elif kind == GOAWAY:
                self.worker.counters["goaway"] += 1
            pos += 9 + length
        del buf[:pos]
        if self.received > 1 << 30:  # keep the connection window open over many large answers
            reply += frame(WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big"))
            self.received = 0
        if reply and self.transport is not None:
            self.transport.write(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.group.conn is self and self.group.alive:
            self.worker.counters["lost_connections"] += 1
        for sid, s in list(self.streams.items()):
            s[2] = 0
            self.worker.answered(self, sid, s)
        self.streams.clear()


@dataclass
class _Group:
    index: int
    incarnation: int = 0
    alive: bool = False
    conn: _GroupConnection | None = None
    hb_message: bytes = b""
    quorum_in_flight: bool = False
    hb_in_flight: bool = False
    next_due: float = 0.0
    rid: str = ""


class _Worker:
    """The groups `index % workers == worker` of a run, on one asyncio loop."""

    def __init__(self, cfg: SimConfig, worker: int, host: str, port: int) -> None:
        self.cfg = cfg
        self.host, self.port = host, port
        self.authority = f"{host}:{port}".encode()
        self.groups = {g: _Group(g) for g in range(worker, cfg.groups, cfg.workers)}
        self.faults = sorted((f for f in fault_schedule(cfg) if f.group in self.groups), key=lambda f: f.at)
        self.restarts = sorted(self.faults, key=lambda f: f.restart_at)
        self.lag = LagHistogram()
        self.rounds: dict[int, RoundStats] = {}
        self.counters: dict[str, int] = {"heartbeats": 0, "late": 0, "failed_heartbeats": 0, "goaway": 0,
                                         "lost_connections": 0, "skipped_rounds": 0, "bad_answers": 0}
        self.due: list[tuple[float, int, int]] = []  # (due, group, incarnation) heap
        self.t0 = 0.0
        self.decode = cfg.compact or cfg.groups <= 256  # check answers where decoding is cheap

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def connect(self, group: _Group) -> None:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _GroupConnection(self, group, self.authority),
                                               self.host, self.port)
        group.conn = conn
        group.rid = replica_id(group.index, group.incarnation, self.cfg.seed)
        rid = group.rid.encode()
        group.hb_message = _grpc_message(b"\x0a" + varint(len(rid)) + rid)
        group.alive = True
        group.hb_in_flight = group.quorum_in_flight = False

    async def connect_all(self) -> None:
        todo = list(self.groups.values())
        for i in range(0, len(todo), 256):  # in batches: a burst of thousands overflows the listen backlog
            await asyncio.gather(*(self.connect(g) for g in todo[i:i + 256]))

    def schedule(self, group: _Group, due: float) -> None:
        heapq.heappush(self.due, (due, group.index, group.incarnation))

    def answered(self, conn: _GroupConnection, sid: int, stream: list[Any]) -> None:
        kind, sent_at, nbytes, rnd = stream[:4]
        now = self.now()
        group = conn.group
        if kind == "heartbeat":
            if nbytes:
                self.lag.add(now - sent_at)
            else:
                self.counters["failed_heartbeats"] += 1
            if group.conn is conn:
                group.hb_in_flight = False
            return
        r = self.rounds[rnd]
        if group.conn is conn:
            group.quorum_in_flight = False
        if nbytes:
            r.answered += 1
            r.answer_bytes += nbytes
            r.last_answer = max(r.last_answer, now)
            if len(stream) > 4:
                self._check_answer(group, b"".join(stream[4:]))
        else:
            r.failed += 1

    def _check_answer(self, group: _Group, body: bytes) -> None:
        from regent.ft.proto import torchft_pb2

        try:
            q = torchft_pb2.LighthouseQuorumResponse.FromString(body[5:]).quorum
        except Exception:  # noqa: BLE001 - a malformed answer is counted, the simulation goes on
            self.counters["bad_answers"] += 1
            return
        if q.HasField("regent_compact"):
            ok = q.regent_compact.replica_world_size > q.regent_compact.replica_rank >= 0
        else:
            ok = any(m.replica_id == group.rid for m in q.participants)
        if not ok:
            self.counters["bad_answers"] += 1

    def quorum_request(self, group: _Group, step: int) -> bytes:
        from regent.ft.proto import torchft_pb2

        member = torchft_pb2.QuorumMember(replica_id=group.rid, address=f"http://sim{group.index}:29600",
                                          store_address=f"sim{group.index}:29700", step=step, world_size=8)
        request = torchft_pb2.LighthouseQuorumRequest(requester=member)
        if self.cfg.compact:
            request.regent_compact.SetInParent()
        return _grpc_message(request.SerializeToString())

    def kill(self, fault: Fault) -> None:
        group = self.groups[fault.group]
        group.alive = False
        if not fault.silent and group.conn is not None and group.conn.transport is not None:
            group.conn.transport.abort()  # a crash: the kernel closes the socket
        # a hang keeps its socket open and sends nothing (the Lighthouse must time it out)

    async def restart(self, fault: Fault) -> None:
        group = self.groups[fault.group]
        old = group.conn
        group.incarnation += 1
        await self.connect(group)
        if old is not None and old.transport is not None and not old.closed:
            old.transport.abort()  # the hung process is finally gone
        self.schedule(group, self.now())

    async def run(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        interval = cfg.heartbeat_interval_s
        n = max(1, cfg.groups)
        for g in self.groups.values():  # spread the fleet's heartbeats over the interval
            self.schedule(g, interval * g.index / n)
        next_round = cfg.warmup_s / 2 if cfg.quorum_every_s > 0 else math.inf
        round_no = 0
        fi = ri = 0
        pending: set[asyncio.Task] = set()
        while True:
            now = self.now()
            if now >= cfg.duration_s:
                break
            while fi < len(self.faults) and self.faults[fi].at <= now:
                self.kill(self.faults[fi])
                fi += 1
            while ri < len(self.restarts) and self.restarts[ri].restart_at <= now:
                task = loop.create_task(self.restart(self.restarts[ri]))
                pending.add(task)
                task.add_done_callback(pending.discard)
                ri += 1
            while self.due and self.due[0][0] <= now:
                due, index, incarnation = heapq.heappop(self.due)
                group = self.groups[index]
                if not group.alive or incarnation != group.incarnation or group.conn is None:
                    continue
                if group.hb_in_flight:  # one heartbeat at a time, as a Manager's loop sends them
                    self.schedule(group, due + interval)
                    continue
                if now - due > interval:
                    self.counters["late"] += 1
                group.hb_in_flight = True
                group.conn.call(HEARTBEAT_PATH, group.hb_message, "heartbeat", now)
                self.counters["heartbeats"] += 1
                self.schedule(group, max(due + interval, now))
            if now >= next_round:
                r = self.rounds.setdefault(round_no, RoundStats())
                for group in self.groups.values():
                    if not group.alive or group.conn is None:
                        continue
                    if group.quorum_in_flight:
                        self.counters["skipped_rounds"] += 1
                        continue
                    group.quorum_in_flight = True
                    r.first_send = min(r.first_send, now)
                    r.sent += 1
                    group.conn.call(QUORUM_PATH, self.quorum_request(group, round_no), "quorum", now, round_no)
                round_no += 1
                next_round += cfg.quorum_every_s
            wake = min(self.due[0][0] if self.due else now + 0.01, next_round, now + 0.01)
            await asyncio.sleep(max(0.0, wake - self.now()))
        for g in self.groups.values():
            if g.conn is not None and g.conn.transport is not None:
                g.conn.transport.abort()

    def result(self) -> dict[str, Any]:
        return {"lag": self.lag.to_json(), "counters": self.counters,
                "rounds": {k: asdict(r) for k, r in self.rounds.items()}}


def worker_main(cfg: SimConfig, worker: int, host: str, port: int) -> None:
    """Connect this worker's groups, say "ready", read the start time, run, print the result as JSON."""
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass

    async def main() -> None:
        w = _Worker(cfg, worker, host, port)
        await w.connect_all()
        print("ready", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        w.t0 = float(line)
        await asyncio.sleep(max(0.0, w.t0 - time.monotonic()))
        await w.run()
        print(json.dumps(w.result()), flush=True)

    asyncio.run(main())


# ---- the coordinator --------------------------------------------------------------------------------------------


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds of one thread of this process (/proc schedstat, nanoseconds)."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _process_cpu_s(pid: int) -> float:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TorchFTLighthouse:
    """TorchFT's Rust Lighthouse as the server under test (the anchor)."""

    def __init__(self, cfg: SimConfig, exe: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [exe, "--bind", f"127.0.0.1:{self.port}", "--min_replicas", "1", "--join_timeout_ms",
             str(cfg.join_timeout_ms), "--quorum_tick_ms", str(cfg.quorum_tick_ms), "--heartbeat_timeout_ms",
             str(int(cfg.heartbeat_timeout_s * 1000))],
            env=dict(os.environ, RUST_LOG="error"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("torchft_lighthouse did not start") from None
                time.sleep(0.05)

    def cpu_s(self) -> float:
        return _process_cpu_s(self.proc.pid)

    def counted_live(self) -> set[str] | None:
        return None  # TorchFT's Lighthouse does not expose its heartbeat table

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _RegentLighthouse:
    """Regent's Lighthouse in this process; its CPU is its loop thread's, its liveness table read on the loop."""

    def __init__(self, cfg: SimConfig) -> None:
        from regent.ft.lighthouse import LighthouseServer
        from regent.ft.rpc_security import TLSFiles

        self.server = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=cfg.join_timeout_ms,
            quorum_tick_ms=cfg.quorum_tick_ms, heartbeat_timeout_ms=int(cfg.heartbeat_timeout_s * 1000),
            secret=b"", tls=TLSFiles(), frontends=cfg.frontends,
            frontend_batch_ms=cfg.frontend_batch_ms)
        self.port = self.server.port
        self.thread_id = self.server._thread.native_id

    def cpu_s(self) -> float:
        """The owner's loop thread and, with front ends, their processes: the whole Lighthouse."""
        return self.owner_cpu_s() + sum(_process_cpu_s(pid) for pid in self.server.frontend_pids())

    def owner_cpu_s(self) -> float:
        return _thread_cpu_s(self.thread_id)

    def counted_live(self) -> set[str] | None:
        return self.server.counted_live()

    def stop(self) -> None:
        self.server.shutdown()


def torchft_lighthouse_exe() -> str | None:
    """TorchFT's Lighthouse binary, if torchft is installed in this interpreter's environment or on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def run_simulation(cfg: SimConfig, server: str = "regent", log: Any = None) -> dict[str, Any]:
    """Run one simulation against `server` ("regent": in this process; "torchft": TorchFT's binary) and return
    the report (see the module docstring)."""
    say = log or (lambda *_: None)
    if server == "torchft":
        exe = torchft_lighthouse_exe()
        if exe is None:
            raise RuntimeError("torchft_lighthouse not found (pip install torchft-nightly in this environment)")
        lighthouse: Any = _TorchFTLighthouse(cfg, exe)
    else:
        lighthouse = _RegentLighthouse(cfg)
    all_lives = lives(cfg, fault_schedule(cfg))
    procs: list[subprocess.Popen] = []
    try:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        for w in range(cfg.workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "regent.ft.simulate", "worker", json.dumps(asdict(cfg)), str(w),
                 "127.0.0.1", str(lighthouse.port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        t_connect = time.monotonic()
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"simulator worker failed to connect its groups (said {line!r})")
        say(f"{cfg.groups} groups connected in {time.monotonic() - t_connect:.1f} s")
        t0 = time.monotonic() + 0.5
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{t0}\n")
            p.stdin.flush()
        missed: dict[str, float] = {}
        false: dict[str, float] = {}
        polls = 0
        time.sleep(max(0.0, t0 - time.monotonic()))
        cpu0 = lighthouse.cpu_s()
        owner0 = lighthouse.owner_cpu_s() if server != "torchft" else 0.0
        grace = cfg.heartbeat_interval_s + cfg.slack_s
        while time.monotonic() - t0 < cfg.duration_s - 0.1:
            time.sleep(cfg.poll_s)
            t_before = time.monotonic() - t0
            counted = lighthouse.counted_live()
            t_after = time.monotonic() - t0
            if counted is None or t_before < cfg.warmup_s or t_after > cfg.duration_s:
                continue
            polls += 1
            m, f = judge_liveness(t_before, t_after, counted, all_lives, cfg.heartbeat_timeout_s, grace, cfg.slack_s)
            for rid in m:
                missed.setdefault(rid, t_before)
            for rid in f:
                false.setdefault(rid, t_before)
        cpu = lighthouse.cpu_s() - cpu0
        owner_cpu = lighthouse.owner_cpu_s() - owner0 if server != "torchft" else None
        frontend_stats = lighthouse.server.frontend_stats() if server != "torchft" else {}
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=60 + cfg.duration_s)
            if p.returncode != 0:
                raise RuntimeError(f"simulator worker exited with {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.stop()
    lag = LagHistogram()
    counters: dict[str, int] = {}
    for r in results:
        lag.merge(LagHistogram.from_json(r["lag"]))
        for k, v in r["counters"].items():
            counters[k] = counters.get(k, 0) + v
    rounds = merge_rounds({int(k): RoundStats(**v) for k, v in r["rounds"].items()} for r in results)
    faults = fault_schedule(cfg)
    beats = counters.get("heartbeats", 0)
    return {
        "server": server, "config": asdict(cfg), "faults": len(faults),
        "heartbeat_lag": lag.summary(), "heartbeats_per_s": beats / cfg.duration_s,
        "quorum": round_summary(rounds),
        "liveness_polls": polls if server != "torchft" else None,
        "missed_failures": sorted(missed) if server != "torchft" else None,
        "false_failures": sorted(false) if server != "torchft" else None,
        "lighthouse_cpu_s": cpu, "lighthouse_cpu_share": cpu / cfg.duration_s,
        # With front ends: the quorum owner's share of that CPU, and how late batched heartbeats reached its
        # liveness table (the simulator's lag above then ends at the front end's answer).
        "owner_cpu_share": None if owner_cpu is None else owner_cpu / cfg.duration_s,
        "frontends": frontend_stats,
        "counters": counters,
    }


def format_report(r: dict[str, Any]) -> str:
    """One line per run, for terminals and logs."""
    lag, q = r["heartbeat_lag"], r["quorum"]
    live = ("n/a" if r["missed_failures"] is None else
            f"missed {len(r['missed_failures'])} false {len(r['false_failures'])} ({r['liveness_polls']} polls)")
    rounds = (f"rounds {q['rounds']} p50 {q['p50_ms']:.0f} ms max {q['max_ms']:.0f} ms"
              if q.get("rounds") else f"rounds 0 ({q.get('incomplete', 0)} incomplete)")
    return (f"{r['server']:<8} {r['config']['groups']:>6} groups  hb {r['heartbeats_per_s']:.0f}/s  lag p50 "
            f"{lag['p50_ms']:.2f} p99 {lag['p99_ms']:.1f} max {lag['max_ms']:.0f} ms  late {r['counters'].get('late', 0)}"
            f"  {rounds}  faults {r['faults']}  {live}  LH CPU {100 * r['lighthouse_cpu_share']:.0f}%"
            + _frontend_note(r))


def _frontend_note(r: dict[str, Any]) -> str:
    """With front ends: the owner's CPU and the batched heartbeats' delay into its liveness table."""
    fe = r.get("frontends") or {}
    if not fe:
        return ""
    apply = fe["heartbeat_apply_lag"]
    return (f" ({fe['frontends']} front ends; owner {100 * r['owner_cpu_share']:.0f}%; into the table: mean "
            f"{apply['mean_ms']:.1f} p99 <= {apply['p99_ms_le']:.0f} max {apply['max_ms']:.0f} ms)")


# ---- CLI --------------------------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`regent simulate`: the control-plane simulator against a Lighthouse started for the run."""
    d = SimConfig()
    parser = subparsers.add_parser(
        "simulate", help="simulate thousands of replica groups against a real Lighthouse (control-plane scale)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=d.groups)
    parser.add_argument("--workers", type=int, default=d.workers, help="client processes (default 2)")
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds simulated")
    parser.add_argument("--interval", type=float, default=d.heartbeat_interval_s, help="heartbeat interval, s")
    parser.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s)
    parser.add_argument("--quorum-every", type=float, default=d.quorum_every_s, help="s between quorum rounds; 0: none")
    parser.add_argument("--join-timeout-ms", type=int, default=d.join_timeout_ms)
    parser.add_argument("--faults-per-s", type=float, default=d.faults_per_s, help="fleet-wide failure rate")
    parser.add_argument("--down", type=float, default=d.down_s, help="s a failed group stays down")
    parser.add_argument("--silent-fraction", type=float, default=d.silent_fraction)
    parser.add_argument("--compact", action="store_true", help="ask for the compact quorum answer")
    parser.add_argument("--frontends", type=int, default=0,
                        help="Regent's Lighthouse with this many front-end processes (default 0: one process)")
    parser.add_argument("--frontend-batch-ms", type=float, default=d.frontend_batch_ms,
                        help="front ends' batching interval, ms (0: once per loop turn)")
    parser.add_argument("--server", choices=("regent", "torchft"), action="append",
                        help="Lighthouse(s) to drive, one after the other (default regent)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", help="write the reports here")
    parser.set_defaults(func=_cli)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(groups=args.groups, workers=args.workers, duration_s=args.duration,
                     heartbeat_interval_s=args.interval, heartbeat_timeout_s=args.heartbeat_timeout,
                     quorum_every_s=args.quorum_every, join_timeout_ms=args.join_timeout_ms,
                     faults_per_s=args.faults_per_s, down_s=args.down, silent_fraction=args.silent_fraction,
                     compact=args.compact, frontends=args.frontends,
                     frontend_batch_ms=args.frontend_batch_ms, seed=args.seed)


def _cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    reports = []
    for server in args.server or ["regent"]:
        report = run_simulation(cfg, server, log=lambda m: print(m, file=sys.stderr))
        print(format_report(report), flush=True)
        reports.append(report)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1) + "\n")
    return 0 if all(not r["missed_failures"] and not r["false_failures"] for r in reports) else 1


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        worker_main(SimConfig(**json.loads(sys.argv[2])), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        raise SystemExit("usage: python -m regent.ft.simulate worker CONFIG_JSON INDEX HOST PORT (or: regent simulate)")
