"""Lighthouse front ends: N processes that share the Lighthouse's gRPC port and feed its one quorum owner.

Why: one Python process saturates at ~12k requests/s (`docs/scaling.md`), and heartbeats queue behind quorum
rounds on its one loop. With `LighthouseServer(frontends=N)` / `regent lighthouse --frontends N`, N front-end
processes bind the same port with `SO_REUSEPORT` (the kernel spreads connections over them; Linux only), so the
HTTP/2 framing, HPACK, the job-secret check, protobuf decoding and the heartbeat answers run on N cores. The
owner (the `LighthouseServer` process) keeps every piece of state and the decision (`regent.ft.quorum`,
unchanged); a front end holds none.

The link between the owner and each front end is a Unix socket pair made by the owner (so the peer is known
without a handshake; nothing on it is unpickled). Each front end sends, at most `batch_ms` after the first
item of a batch, one write holding:
- the heartbeats it answered since the last batch (one entry per replica: the newest, with when it arrived and
  its committed report), applied by the owner with `apply_heartbeats`;
- the Quorum calls it received, pre-decoded (`regent.ft.joins`: one `K_JOINS` frame of short records a batch,
  applied by the owner in one pass), the RegentHolders calls (a call id), and withdrawals of Quorum calls that
  ended on the client's side (deadline, cancel, disconnect).
The owner answers each call by id (the bytes the single-process Lighthouse would send: byte-identical, since
the same code makes them); a full answer shared by many members (TorchFT's, one encoding per round) crosses the
link once per round and front end, then by reference. A compact answer (`regent.ft.compact`) is not made by the
owner: it sends the round's plan (`compact.encode_plan`) once per front end, then the ids of the calls it answers (one K_SHARES
frame per loop turn), and the front end builds the round's plan once (`compact.RoundShares.from_plan`) and encodes
each caller's share itself. The owner's work per join is then the membership update (`quorum.apply_joins` over a
pre-decoded batch; no future, no task per call), which is what a 12,800-group round in under 200 ms
needs (issue 37, item 2).

Liveness lag: a heartbeat counts from when its front end received it (front ends and owner share the host's
monotonic clock), and reaches the owner's table `batch_ms` plus one owner loop turn later; the owner measures
that delay for every heartbeat (`LighthouseServer.frontend_stats()`). Without a job secret a front end answers a
heartbeat at once (before the owner applied it).

Job secret: a front end checks each call's proof (HMAC, clock window) and refuses bad ones itself; the owner spends
every nonce (one replay table for all front ends: a recorded call replayed on a connection that lands on another
front end is refused too). Heartbeats then go up one by one with their nonces and are answered after the owner's
verdict (`K_VERDICT`, one per batch).

Failures: a front end that dies is restarted by the owner (its clients reconnect, and the kernel sends new
connections to the front ends still listening meanwhile; its callers' Quorum calls are withdrawn); a crash loop
is slowed down, never given up on. The owner dying closes the links, and each front end exits when its link
ends: no orphans.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from regent.ft.compact import RoundShares
from regent.ft.grpc_lite import Reply
from regent.ft.joins import decode_joins, encode_joins, join_record
from regent.ft.quorum import LighthouseState, note_heartbeat
from regent.ft.rpc_security import CallVerifier, proof_nonce

logger = logging.getLogger(__name__)

# ---- the link's framing (pure) ----------------------------------------------------------------------------------

_HEAD = struct.Struct(">IB")  # payload length, kind
_CALL = struct.Struct(">Q")
_NONCE = struct.Struct(">QQ")  # a job-secret proof's timestamp (ms) and nonce key; zeros without a secret
_ANSWER = struct.Struct(">QB")
# Kinds, front end -> owner
K_CONFIG_ACK = ord("k")  # ready: JSON {"pid": ..., "port": ...}
K_ERROR = ord("e")  # could not start: utf-8 message
K_BEATS = ord("h")  # JSON [[rid, t], [rid, t, step, lineage, accepted_loss, accepted_lineage], ...]
K_CHECKED_BEATS = ord("s")  # with a job secret: JSON [[ms, key, rid, t, (committed)], ...], each awaits a verdict
K_JOINS = ord("j")  # Quorum calls, pre-decoded: `joins.encode_joins`
K_HOLDERS = ord("r")  # call id, nonce
K_WITHDRAW = ord("w")  # call id
K_REFUSED = ord("x")  # calls this front end refused (bad or missing proof) since its last report: JSON count
# Kinds, owner -> front end
K_CONFIG = ord("c")  # JSON config (first frame)
K_ANSWER = ord("a")  # call id, status code (0 OK; REF: the last blob), payload (response, or a status message)
K_SHARES = ord("m")  # call ids (>Q each) answered with their compact share of the last plan, one frame a turn
K_PLAN = ord("p")  # a round's plan (`compact.encode_plan`): the next K_SHARES are shares of it
K_BLOB = ord("b")  # a response many calls share (a full quorum answer): the next K_ANSWERs with REF use it
K_VERDICT = ord("v")  # per K_CHECKED_BEATS batch, in order: JSON [[index, refusal message], ...] (refused only)
REF = 255
BLOB_MIN_BYTES = 1024
MAX_LINK_FRAME = 1 << 30
QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
HEARTBEAT_METHOD = "/torchft.LighthouseService/Heartbeat"
HOLDERS_METHOD = "/torchft.LighthouseService/RegentHolders"


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One link frame."""
    return _HEAD.pack(len(payload), kind) + payload


def split_frames(buffer: bytearray) -> list[tuple[int, bytes]]:
    """Take every complete frame off the front of `buffer` (the rest stays for the next read)."""
    out = []
    pos = 0
    end = len(buffer)
    while end - pos >= _HEAD.size:
        length, kind = _HEAD.unpack_from(buffer, pos)
        if length > MAX_LINK_FRAME:
            raise ValueError(f"link frame of {length} bytes")
        if end - pos - _HEAD.size < length:
            break
        start = pos + _HEAD.size
        out.append((kind, bytes(buffer[start:start + length])))
        pos = start + length
    del buffer[:pos]
    return out


# ---- heartbeats: batching and merging (pure) ---------------------------------------------------------------------

Beat = list  # [rid, t] or [rid, t, step, lineage, accepted_loss, accepted_lineage]


def batch_beat(pending: dict[str, Beat], rid: str, t: float, committed: tuple[int, int, int, int] | None) -> None:
    """A front end's pending batch keeps one entry per replica: the newest heartbeat, with the newest committed
    report any of its heartbeats in the batch carried (a report must not be lost to a later bare heartbeat)."""
    if committed is not None:
        pending[rid] = [rid, t, *committed]
        return
    old = pending.get(rid)
    pending[rid] = [rid, t, *old[2:]] if old is not None and len(old) > 2 else [rid, t]


def apply_heartbeats(state: LighthouseState, beats: Iterable[Beat], now: float) -> dict[str, list[str]]:
    """Batched heartbeats into the liveness table. Each counts from when its front end received it, but never
    from later than `now` (clock skew cannot make a replica live in the future) and never moves a replica's
    last heartbeat backwards (two front ends' batches can arrive out of order after a reconnect). Retires
    older incarnations as `note_heartbeat` does. Returns {replica id: ids it retired} for those that retired any."""
    retired: dict[str, list[str]] = {}
    table = state.heartbeats
    for beat in beats:
        rid, t = beat[0], min(float(beat[1]), now)
        last = table.get(rid)
        gone = note_heartbeat(state, rid, t if last is None or t > last else last)
        if gone:
            retired[rid] = gone
    return retired


@dataclass
class LagStats:
    """How late heartbeats reached the owner's table (receipt at a front end to applied), in ms buckets."""

    bounds_ms: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
    counts: list[int] = field(default_factory=lambda: [0] * 13)
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_ms, seconds * 1e3)] += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def percentile_ms(self, q: float) -> float:
        """The upper bound of the bucket holding the q-th quantile (the max for the last bucket)."""
        n = self.count
        if not n:
            return 0.0
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= q * n:
                return self.bounds_ms[i] if i < len(self.bounds_ms) else self.max_s * 1e3
        return self.max_s * 1e3

    def summary(self) -> dict[str, float]:
        n = self.count
        return {"count": n, "mean_ms": 1e3 * self.total_s / n if n else 0.0, "p50_ms_le": self.percentile_ms(0.5),
                "p99_ms_le": self.percentile_ms(0.99), "max_ms": 1e3 * self.max_s}


def reuse_port_available() -> str | None:
    """None where front ends can share a port, else why not: they need Linux's SO_REUSEPORT, which spreads
    connections over the sockets (macOS and the BSDs have the option, but give every connection to one)."""
    if not sys.platform.startswith("linux"):
        return f"Lighthouse front ends need Linux's SO_REUSEPORT load balancing; this is {sys.platform}"
    if not hasattr(socket, "SO_REUSEPORT"):
        return "Lighthouse front ends need SO_REUSEPORT, which this Python's socket module lacks"
    return None


# ---- the owner's side --------------------------------------------------------------------------------------------


class Owner:
    """What the pool needs from the quorum owner (`LighthouseServer` implements it)."""

    def _frontend_beats(self, beats: list[Beat]) -> None: ...
    def _frontend_joins(self, link: _OwnerLink, joins: list) -> None: ...
    def _withdraw(self, rid: str, participant: Any) -> None: ...
    def _holders(self) -> bytes: ...
    def _frontend_spend(self, method: str, ms: int, key: int) -> str | None: ...
    def _frontend_spend_many(self, method: str, nonces: Iterable[tuple[int, int]]) -> list[str | None] | None: ...


class _OwnerLink(asyncio.Protocol):
    """The owner's end of one front end's link: runs requests, batches answers into one write per loop turn."""

    def __init__(self, pool: FrontendPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.out: list[bytes] = []
        self.flush_pending = False
        self.calls: dict[int, asyncio.Future] = {}  # what K_WITHDRAW or a lost link cancels
        # Quorum calls waiting for the next quorum (`LighthouseServer._frontend_joins`): call id -> its current
        # quorum.Participant (whose member is the `joins.Join`); K_WITHDRAW or a lost link withdraws them.
        self.joins: dict[int, Any] = {}
        self.blob: bytes | None = None
        self.share_ids: list[int] = []  # calls answered with their share since the last flush (K_SHARES)
        self.plan_sent: bytes | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        try:
            frames = split_frames(self.buffer)
        except ValueError as err:
            logger.error("front end %d sent a bad link frame (%s); restarting it", self.slot, err)
            if self.transport is not None:
                self.transport.close()
            return
        owner = self.pool.owner
        for kind, payload in frames:
            try:
                if kind == K_BEATS:
                    owner._frontend_beats(json.loads(payload))
                elif kind == K_CHECKED_BEATS:
                    self._checked_beats(json.loads(payload))
                elif kind == K_JOINS:
                    self._joins(payload)
                elif kind == K_WITHDRAW:
                    call_id = _CALL.unpack(payload)[0]
                    task = self.calls.pop(call_id, None)
                    if task is not None:
                        task.cancel()
                    participant = self.joins.pop(call_id, None)
                    if participant is not None:
                        owner._withdraw(participant.member.replica_id, participant)
                elif kind == K_HOLDERS:
                    self._run(_CALL.unpack_from(payload)[0], owner._holders, HOLDERS_METHOD,
                              _NONCE.unpack_from(payload, _CALL.size))
                elif kind == K_REFUSED:
                    self.pool.refused += int(json.loads(payload))
                elif kind == K_CONFIG_ACK:
                    if not self.ready.done():
                        self.ready.set_result(json.loads(payload))
                elif kind == K_ERROR:
                    if not self.ready.done():
                        self.ready.set_exception(OSError(payload.decode(errors="replace")))
                else:
                    logger.warning("front end %d sent an unknown link frame kind %d", self.slot, kind)
            except Exception:
                logger.exception("front end %d: handling a link frame failed", self.slot)

    def _checked_beats(self, entries: list[list]) -> None:
        """Heartbeats whose proofs the front end checked: spend each nonce here (one table for every front end,
        so a replay is refused whichever front end it reaches), apply the fresh ones, answer with the refusals."""
        owner = self.pool.owner
        refusals = owner._frontend_spend_many(HEARTBEAT_METHOD, [(int(e[0]), int(e[1])) for e in entries]) \
            or [None] * len(entries)
        beats = [entry[2:] for entry, refusal in zip(entries, refusals) if refusal is None]
        refused = [[i, refusal] for i, refusal in enumerate(refusals) if refusal is not None]
        if beats:
            owner._frontend_beats(beats)
        self._send(frame(K_VERDICT, json.dumps(refused).encode()))

    def _joins(self, payload: bytes) -> None:
        """A batch of pre-decoded Quorum calls (`regent.ft.joins`): with a job secret every call's nonce is spent
        first (a refused one is answered UNAUTHENTICATED and never touches the state), then the owner applies the
        rest in one pass. A frame that does not decode is a broken front end: it is restarted."""
        try:
            joins = decode_joins(payload)
        except (ValueError, TypeError, struct.error) as err:
            logger.error("front end %d sent a bad joins frame (%s); restarting it", self.slot, err)
            if self.transport is not None:
                self.transport.close()
            return
        owner = self.pool.owner
        refusals = owner._frontend_spend_many(QUORUM_METHOD, (j.nonce for j in joins))
        if refusals is not None and any(refusals):
            from regent.ft.grpc_lite import StatusCode

            code = int(StatusCode.UNAUTHENTICATED)
            for join, refusal in zip(joins, refusals):
                if refusal is not None:
                    self._send(frame(K_ANSWER, _ANSWER.pack(join.call_id, code) + refusal.encode()))
            joins = [join for join, refusal in zip(joins, refusals) if refusal is None]
        try:
            owner._frontend_joins(self, joins)
        except Exception as err:  # a defect: answered to every caller of the batch (UNKNOWN), none left waiting
            from regent.ft.grpc_lite import StatusCode

            logger.exception("Lighthouse: applying front end %d's batch of %d joins failed", self.slot, len(joins))
            message = f"{type(err).__name__}: {err}".encode()
            for join in joins:
                participant = self.joins.pop(join.call_id, None)
                if participant is not None:
                    owner._withdraw(join.replica_id, participant)
                self._send(frame(K_ANSWER, _ANSWER.pack(join.call_id, int(StatusCode.UNKNOWN)) + message))

    def _spent(self, call_id: int, method: str, nonce: tuple[int, int]) -> bool:
        """Spend the call's nonce in the owner (with a job secret); False: refused, and answered so."""
        refusal = self.pool.owner._frontend_spend(method, *nonce)
        if refusal is None:
            return True
        from regent.ft.grpc_lite import StatusCode

        self._send(frame(K_ANSWER, _ANSWER.pack(call_id, int(StatusCode.UNAUTHENTICATED)) + refusal.encode()))
        return False

    def _run(self, call_id: int, call: Callable[[], bytes | asyncio.Future], method: str = "",
             nonce: tuple[int, int] = (0, 0)) -> None:
        if method and not self._spent(call_id, method, nonce):
            return
        try:
            result = call()
        except Exception as err:  # noqa: BLE001 - answered to the caller as the single-process server would
            self._answer_error(call_id, err)
            return
        if isinstance(result, bytes):
            self.answer(call_id, result)
            return
        self.calls[call_id] = result
        result.add_done_callback(lambda task, c=call_id: self._done(c, task))

    def _done(self, call_id: int, task: asyncio.Future) -> None:
        self.calls.pop(call_id, None)
        if task.cancelled():
            return  # withdrawn by the front end, or the link is gone
        err = task.exception()
        if err is None:
            self.answer(call_id, task.result())
        else:
            self._answer_error(call_id, err)

    def _answer_error(self, call_id: int, err: BaseException) -> None:
        from regent.ft.grpc_lite import RpcStatusError, StatusCode

        if isinstance(err, RpcStatusError):
            code, message = int(err.code), err.message
        else:
            logger.error("Lighthouse call from front end %d failed", self.slot, exc_info=err)
            code, message = int(StatusCode.UNKNOWN), f"{type(err).__name__}: {err}"
        self._send(frame(K_ANSWER, _ANSWER.pack(call_id, code) + message.encode()))

    def answer(self, call_id: int, response: bytes) -> None:
        if len(response) >= BLOB_MIN_BYTES:
            if response is not self.blob:
                self.blob = response
                self._send(frame(K_BLOB, response))
            self._send(frame(K_ANSWER, _ANSWER.pack(call_id, REF)))
        else:
            self._send(frame(K_ANSWER, _ANSWER.pack(call_id, 0) + response))

    def answer_round(self, issued: Any, compact_ids: list[int], full_ids: list[int]) -> None:
        """Answer this link's joins in an issued quorum (`lighthouse._Issued`): the compact ones with their share
        of the round's plan (the plan crosses the link once per round, then one K_SHARES frame of call ids a loop
        turn), the others with TorchFT's full answer (one encoding per round, sent once as a blob)."""
        if compact_ids:
            plan = issued.plan()
            if plan is not self.plan_sent:
                self._shares_out()  # shares of the previous plan go before the new one
                self.plan_sent = plan
                self._send(frame(K_PLAN, plan))
            self.share_ids += compact_ids
            self._send(b"")
        if full_ids:
            full = issued.full()
            for call_id in full_ids:
                self.answer(call_id, full)

    def _send(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_pending:
            self.flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _shares_out(self) -> None:
        if self.share_ids:
            ids, self.share_ids = self.share_ids, []
            self.out.append(frame(K_SHARES, struct.pack(f">{len(ids)}Q", *ids)))

    def _flush(self) -> None:
        self.flush_pending = False
        self._shares_out()
        out, self.out = self.out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for task in list(self.calls.values()):
            task.cancel()  # the front end's clients lost their connections with it: withdraw them
        self.calls.clear()
        joins, self.joins = self.joins, {}
        for participant in joins.values():
            self.pool.owner._withdraw(participant.member.replica_id, participant)
        if not self.ready.done():
            self.ready.set_exception(OSError("the front end exited before it was ready"))
        if not self.lost.done():
            self.lost.set_result(None)


@dataclass
class _Slot:
    proc: subprocess.Popen | None = None
    link: _OwnerLink | None = None
    restarts: list[float] = field(default_factory=list)


class FrontendPool:
    """N front-end processes on the owner's port, started, watched and restarted from the owner's loop."""

    START_TIMEOUT_S = 60.0

    def __init__(self, owner: Owner, count: int, host: str, port: int, config: dict[str, Any]) -> None:
        if count < 1:
            raise ValueError(f"a front-end pool needs at least one front end, got {count}")
        self.owner = owner
        self.count = count
        self.host = host
        self.port = port
        self.config = config
        self.slots = [_Slot() for _ in range(count)]
        self.lag = LagStats()
        self.restarted = 0
        self.refused = 0  # calls the front ends refused for their proofs (the owner counts replays itself)
        self._closing = False
        self._watchers: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start every front end and wait until each listens (raises, naming the cause, if one cannot)."""
        await asyncio.gather(*(self._spawn(i) for i in range(self.count)))
        self._watchers = [asyncio.get_running_loop().create_task(self._watch(i)) for i in range(self.count)]

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc is not None and s.proc.poll() is None]

    async def _spawn(self, i: int) -> None:
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "regent.ft.frontends", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        slot = self.slots[i]
        slot.proc = proc
        _, link = await loop.create_unix_connection(lambda: _OwnerLink(self, i), sock=mine)
        slot.link = link
        link._send(frame(K_CONFIG, json.dumps({**self.config, "host": self.host, "port": self.port,
                                               "slot": i}).encode()))
        try:
            info = await asyncio.wait_for(link.ready, self.START_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._kill(slot)
            raise OSError(f"Lighthouse front end {i} did not start within {self.START_TIMEOUT_S:.0f} s") from None
        except OSError as err:
            self._kill(slot)
            raise OSError(f"Lighthouse front end {i} could not serve port {self.port}: {err}") from None
        except BaseException:
            self._kill(slot)
            raise
        logger.info("Lighthouse front end %d (pid %d) serving port %s", i, info.get("pid"), info.get("port"))

    async def _watch(self, i: int) -> None:
        """Restart front end `i` whenever it dies; a crash loop waits longer (up to 5 s), never gives up."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            slot = self.slots[i]
            assert slot.link is not None
            await slot.link.lost
            if self._closing:
                return
            code = await loop.run_in_executor(None, self._reap, slot)
            now = time.monotonic()
            slot.restarts = [t for t in slot.restarts if now - t < 30.0] + [now]
            delay = min(5.0, 0.05 * 2 ** (len(slot.restarts) - 1))
            logger.warning("Lighthouse front end %d exited (%s); restarting it in %.2f s (%d restarts in 30 s)",
                           i, code, delay, len(slot.restarts))
            await asyncio.sleep(delay)
            while not self._closing:
                try:
                    await self._spawn(i)
                    self.restarted += 1
                    break
                except OSError as err:
                    logger.error("restarting Lighthouse front end %d failed: %s; retrying in 5 s", i, err)
                    await asyncio.sleep(5.0)

    @staticmethod
    def _reap(slot: _Slot) -> int | None:
        proc = slot.proc
        if proc is None:
            return None
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    @staticmethod
    def _kill(slot: _Slot) -> None:
        if slot.link is not None and slot.link.transport is not None:
            slot.link.transport.close()
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.kill()

    async def stop(self) -> None:
        """Close every link (each front end exits on it) and reap the processes."""
        self._closing = True
        for task in self._watchers:
            task.cancel()
        for slot in self.slots:
            if slot.link is not None and slot.link.transport is not None:
                slot.link.transport.close()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, self._reap, s) for s in self.slots),
                             return_exceptions=True)

    def note_lag(self, beats: list[Beat], now: float) -> None:
        add = self.lag.add
        for beat in beats:
            add(max(0.0, now - beat[1]))


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) a SO_REUSEPORT socket on host:port: it holds the port for the front ends, so that
    a server without SO_REUSEPORT (another Lighthouse, TorchFT's) cannot take it, and picks a free port for 0.
    No SO_REUSEADDR: Linux would let an SO_REUSEADDR socket bind over a socket that is not listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host or ("::" if family == socket.AF_INET6 else "0.0.0.0"), port))
    except BaseException:
        sock.close()
        raise
    return sock


# ---- the front end's side ----------------------------------------------------------------------------------------


class _FrontLink(asyncio.Protocol):
    """A front end's end of its link: batches heartbeats and requests up, resolves calls from the answers."""

    def __init__(self, front: FrontEnd) -> None:
        self.front = front
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        for kind, payload in split_frames(self.buffer):
            self.front.on_frame(kind, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.front.owner_gone.set()


class FrontEnd:
    """One front end: gRPC on the shared port; heartbeats answered here, everything else asked of the owner."""

    def __init__(self, batch_s: float) -> None:
        self.batch_s = batch_s
        self.server: Any = None  # the grpc_lite server: its `current_volatile` is the call's proof
        self.secret = False  # with a job secret, the owner spends every call's nonce before it is answered
        self.checked: list[Beat] = []
        self.checked_futures: list[asyncio.Future] = []
        self.verdicts: collections.deque[list[asyncio.Future]] = collections.deque()
        self.verifier: CallVerifier | None = None
        self.reported_refused = 0
        self.loop = asyncio.get_running_loop()
        self.link = _FrontLink(self)
        self.config: asyncio.Future = self.loop.create_future()
        self.owner_gone = asyncio.Event()
        self.beats: dict[str, Beat] = {}
        self.out: list[bytes] = []
        self.flush_handle: asyncio.Handle | None = None
        self.calls: dict[int, Reply] = {}  # calls to the owner not answered yet
        self.joins: list[tuple[list, bytes, bytes]] = []  # Quorum calls since the last frame (`joins.join_record`)
        self.next_call = 0
        self.blob = b""
        self.asks: dict[int, tuple[str, int, bool]] = {}  # compact Quorum calls: (replica id, group size, init_sync)
        self.shares: RoundShares | None = None  # the last K_PLAN's
        # What a call needs of `regent.ft.lighthouse` (which imports this module), bound once: a function-level
        # import per call cost ~1 us of a heartbeat's ~10 us of Python (issue 37).
        from regent.ft import lighthouse

        self._decode_heartbeat = lighthouse.decode_heartbeat_request
        self._decode_quorum = lighthouse.decode_quorum_request
        self._compact_ask = lighthouse._compact_ask
        self._empty_heartbeat = lighthouse.EMPTY_HEARTBEAT_RESPONSE

    # gRPC handlers -----------------------------------------------------------------------------------------------
    def heartbeat(self, request: bytes, deadline: float | None) -> bytes:
        message = self._decode_heartbeat(request)
        committed = None
        if message.HasField("regent_committed"):
            c = message.regent_committed
            committed = (c.step, c.lineage, c.accepted_loss, c.accepted_lineage)
        if self.secret:
            # Answered once the owner spent its nonce (K_VERDICT): a replay is refused on every front end.
            ms, key = self._nonce()
            self.checked.append([ms, key, message.replica_id, time.monotonic(), *(committed or ())])
            future = self.loop.create_future()
            self.checked_futures.append(future)
            self._soon()
            return future
        batch_beat(self.beats, message.replica_id, time.monotonic(), committed)
        if self.flush_handle is None:
            self._soon()
        return self._empty_heartbeat

    def _nonce(self) -> tuple[int, int]:
        token = self.server.current_volatile if self.server is not None else None
        return (proof_nonce(token) or (0, 0)) if token is not None else (0, 0)

    def quorum(self, request: bytes, deadline: float | None) -> Reply:
        message = self._decode_quorum(request)  # refuse what the owner would refuse, here
        # Decoded here, on this core (`regent.ft.joins`); the heartbeats received so far go first in the batch:
        # the owner sees them before this join.
        future = self._new_call()
        call_id = self.next_call
        self.joins.append(join_record(call_id, self._nonce(), message, request))
        ask = self._compact_ask(message)
        if ask is not None:
            self.asks[call_id] = (message.requester.replica_id, *ask)
        if self.flush_handle is None:
            self._soon()
        return future

    def holders(self, request: bytes, deadline: float | None) -> Reply:
        from regent.ft.lighthouse import decode_holders_request

        decode_holders_request(request)
        nonce = _NONCE.pack(*self._nonce())
        return self._call(K_HOLDERS, lambda c: _CALL.pack(c) + nonce)

    def _new_call(self) -> Reply:
        """A call to the owner under the next id: a `grpc_lite.Reply`, answered when the owner's answer comes (no
        future, no loop turn per call); its cancel (the client gave up) withdraws the call."""
        self.next_call += 1
        call_id = self.next_call
        reply = Reply(functools.partial(self._ended, call_id))
        self.calls[call_id] = reply
        return reply

    def _call(self, kind: int, payload: Callable[[int], bytes]) -> Reply:
        """Forward one call to the owner as its own frame."""
        future = self._new_call()
        self._out(frame(kind, payload(self.next_call)))
        return future

    def _out(self, data: bytes) -> None:
        """A frame for the owner, after the joins received before it (their order is kept)."""
        self._seal_joins()
        self.out.append(data)
        self._soon()

    def _seal_joins(self) -> None:
        if self.joins:
            self.out.append(frame(K_JOINS, encode_joins(self.joins)))
            self.joins = []

    def _ended(self, call_id: int, reply: Reply) -> None:
        """A call the client stopped waiting for (reset, deadline, disconnect): withdrawn from the owner."""
        self.asks.pop(call_id, None)
        if self.calls.pop(call_id, None) is not None:
            self._out(frame(K_WITHDRAW, _CALL.pack(call_id)))

    # batching ----------------------------------------------------------------------------------------------------
    def _soon(self) -> None:
        """Flush `batch_s` after the first item of a batch; with 0, at the end of this loop turn (everything
        this wake-up read goes in one write, and no timer wakes the process again)."""
        if self.flush_handle is None:
            self.flush_handle = (self.loop.call_later(self.batch_s, self.flush) if self.batch_s > 0
                                 else self.loop.call_soon(self.flush))

    def flush(self) -> None:
        self.flush_handle = None
        parts = []
        if self.beats:
            parts.append(frame(K_BEATS, json.dumps(list(self.beats.values()), separators=(",", ":")).encode()))
            self.beats = {}
        if self.checked:
            parts.append(frame(K_CHECKED_BEATS, json.dumps(self.checked, separators=(",", ":")).encode()))
            self.verdicts.append(self.checked_futures)
            self.checked, self.checked_futures = [], []
        if self.verifier is not None and self.verifier.refused > self.reported_refused:
            parts.append(frame(K_REFUSED, str(self.verifier.refused - self.reported_refused).encode()))
            self.reported_refused = self.verifier.refused
        self._seal_joins()
        parts += self.out
        self.out = []
        if parts and self.link.transport is not None:
            self.link.transport.write(b"".join(parts))

    def _share(self, call_id: int, future: Reply) -> None:
        """Answer a compact call with its share of the round (the last K_PLAN's)."""
        try:
            if self.shares is None:
                raise RuntimeError("the owner answered a compact call before sending the round's plan")
            rid, world_size, init_sync = self.asks.pop(call_id)
            future.set_result(self.shares.answer(rid, world_size, init_sync))
        except Exception as err:  # answered to the caller (INTERNAL), as a failed owner call would be
            from regent.ft.grpc_lite import RpcStatusError, StatusCode

            logger.exception("front end: computing a compact quorum share failed")
            if not future.done():
                future.set_exception(RpcStatusError(StatusCode.INTERNAL, f"{type(err).__name__}: {err}"))

    def on_frame(self, kind: int, payload: bytes) -> None:
        if kind == K_ANSWER:
            call_id, code = _ANSWER.unpack_from(payload)
            future = self.calls.pop(call_id, None)
            self.asks.pop(call_id, None)
            if future is None or future.done():
                return
            body = payload[_ANSWER.size:]
            if code == 0:
                future.set_result(body)
            elif code == REF:
                future.set_result(self.blob)
            else:
                from regent.ft.grpc_lite import RpcStatusError

                future.set_exception(RpcStatusError(code, body.decode(errors="replace")))
        elif kind == K_SHARES:
            for (call_id,) in struct.iter_unpack(">Q", payload):
                future = self.calls.pop(call_id, None)
                if future is not None and not future.done():
                    self._share(call_id, future)
        elif kind == K_VERDICT:
            from regent.ft.grpc_lite import RpcStatusError, StatusCode

            futures = self.verdicts.popleft()
            refused = {int(i): str(message) for i, message in json.loads(payload)}
            for i, future in enumerate(futures):
                if future.done():
                    continue  # the call ended meanwhile (deadline, reset)
                if i in refused:
                    future.set_exception(RpcStatusError(StatusCode.UNAUTHENTICATED, refused[i]))
                else:
                    future.set_result(self._empty_heartbeat)
        elif kind == K_BLOB:
            self.blob = payload
        elif kind == K_PLAN:
            try:
                self.shares = RoundShares.from_plan(payload)
            except Exception:  # the round's K_SHARES then fail with INTERNAL (`_share`), the front end lives on
                logger.exception("front end: a round's plan could not be decoded")
                self.shares = None
        elif kind == K_CONFIG and not self.config.done():
            self.config.set_result(json.loads(payload))


def _security_from(config: dict[str, Any]) -> Any:
    from regent.ft import rpc_security

    tls = rpc_security.TLSFiles(*config.get("tls", [None, None, None, None]))
    secret = bytes.fromhex(config["secret"]) if config.get("secret") else None
    return rpc_security.Security(secret, tls)


async def _serve(fd: int) -> None:
    from regent.ft import grpc_lite
    from regent.ft.lighthouse import lite_server

    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=fd)
    front = FrontEnd(0.002)
    await loop.create_unix_connection(lambda: front.link, sock=sock)
    config = await front.config
    front.batch_s = float(config.get("batch_ms", 2.0)) / 1000.0
    assert front.link.transport is not None
    try:
        security = _security_from(config)
        front.secret = bool(security.secret)
        # A front end checks each call's proof (HMAC, clock window) but leaves its nonce to the owner; its
        # refusals are reported to the owner (`LighthouseServer.refused_calls`) with the next batch.
        verifier = (CallVerifier(security.secret, "Lighthouse", spend_nonces=False, on_refuse=front._soon)
                    if security.secret else None)
        front.verifier = verifier
        server = lite_server(grpc_lite.method_table("torchft.LighthouseService", {
            "Quorum": front.quorum, "Heartbeat": front.heartbeat, "RegentHolders": front.holders}), security,
            verifier)
        front.server = server
        port = await server.start(config["host"], int(config["port"]), reuse_port=True)
    except Exception as err:  # noqa: BLE001 - reported to the owner, which raises it
        front.link.transport.write(frame(K_ERROR, f"{type(err).__name__}: {err}".encode()))
        await asyncio.sleep(0.1)
        return
    front.link.transport.write(frame(K_CONFIG_ACK, json.dumps({"pid": os.getpid(), "port": port}).encode()))
    await front.owner_gone.wait()  # the owner closed the link, or died: no orphans
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m regent.ft.frontends FD`: one front end, started by `FrontendPool` with its link on FD."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [lighthouse front end] %(message)s")
    from regent.ft.lighthouse import new_event_loop, tune_gc

    tune_gc()  # a front end decodes and encodes a share per join: the same allocation pattern as the owner
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(int(args[0])))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
