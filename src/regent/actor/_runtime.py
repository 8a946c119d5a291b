"""The routing of the per-process runtime: one asyncio loop, a listener, direct connections to peers, reply ports.

Every process of a job (the controller, each proc, each `regent worker`) has exactly one runtime (a
`_process.ActorRuntime`, built on `Runtime`). It owns all sockets; all per-process state is reached from it and
touched only on its event loop thread. Other
threads (the user's main thread, sync actors' threads) hand work over with `run_on_loop`, which batches
wake-ups so a burst of calls costs one loop wake-up, not one per call.

Routing is by process id: `send(proc_id, ...)` uses the connection to that process, dialing it (Unix
socket on the same machine, TCP otherwise) if needed and queueing meanwhile. Messages between two
processes always take one connection, which is what gives per-sender FIFO order.

This module is the routing layer of `regent.actor` (tests/unit/actor/test_layers.py): it imports only the wire
(`_transport`, `_messages`) and plain values below it. What it needs from the layers above is given to it when
built: the handler table of the other message kinds, and `faults` (`PeerFaults`: who is gone, and whom to tell
when a peer is lost; `_supervision.Supervision`). `_process.ActorRuntime` builds on it with the state that lives
on the loop (supervision, the actor directory, tree casts, spawned procs) and a proc's life (orphan, detach).
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import collections
import contextlib
import enum
import faulthandler
import gc
import itertools
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from regent import settings
from regent.actor import _future
from regent.actor._config import config
from regent.actor._errors import ActorError
from regent.actor._future import Future
from regent.actor._messages import Bye, Hello, ReplyBatch, ReplyMsg, WhereIs, decode, encode, reply_to_answer
from regent.actor._pickle import NONE_BODY, dumps, loads
from regent.actor._transport import Connection, connect, listen
from regent.auth import SECRET_ENV, SECRET_FILE_ENV, fingerprint, job_secret_from_env
from regent.eventloop import new_event_loop

logger = logging.getLogger("regent.actor")

# reply status codes carried in "r" envelopes
OK, ERROR, DEAD = 0, 1, 2

# what a message kind is handled by: (connection, or None from this process; the record; body; buffers)
Handler = Callable[[Connection | None, Any, Any, list], None]


class PeerFaults(Protocol):
    """What routing needs from supervision (`_supervision.Supervision`), given to the `Runtime` when built:
    which processes are gone and why, which said goodbye, and whom to tell when a peer is lost."""

    dead: dict[str, str]  # proc id -> why it is gone
    graceful: set[str]  # procs stopping on purpose: their exit is no failure

    def proc_gone(self, proc_id: str, reason: str | None) -> None:
        """`proc_id` exited or became unreachable (`reason=None`: a graceful stop)."""

    def proc_exited(self, proc_id: str, reason: str | None) -> None:
        """A child process exited: reported with the other exits of a short window."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def machine_id() -> str:
    """Identifies this machine (and boot), so peers know when a Unix socket path is reachable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}:{boot}"


class ChannelTransport(enum.Enum):
    """Monarch's transport names. Regent always offers Unix sockets to peers on the same machine and TCP to
    the others; the choice is where the TCP listeners bind and what address peers are told to dial."""

    Unix = "ipc"  # Regent's default: TCP on loopback (peers on this machine use the Unix socket)
    TcpWithLocalhost = "tcp-localhost"  # the same as Unix for Regent
    TcpWithHostname = "tcp"  # TCP on every interface, dialled by this host's name: reachable from other machines
    MetaTlsWithHostname = "metatls-hostname"  # not provided (TLS)
    MetaTlsWithIpV6 = "metatls"  # not provided (TLS)
    Tls = "tls"  # not provided (TLS)


_TLS = (ChannelTransport.MetaTlsWithHostname, ChannelTransport.MetaTlsWithIpV6, ChannelTransport.Tls)


class Runtime:
    """Routing of one process: its loop, listeners, connections and reply ports (see the module docstring)."""

    def __init__(self, proc_id: str, is_controller: bool, secret: bytes | None = None,
                 tcp_host: str | None = None, advertise_host: str | None = None, tcp_port: int = 0,
                 sock_dir: str | None = None, *, handlers: Mapping[str, Handler], faults: PeerFaults) -> None:
        self.proc_id = proc_id
        self.is_controller = is_controller
        self.secret = secret or job_secret_from_env() or secrets.token_bytes(32)
        self.tcp_host = tcp_host or settings.REGENT_LISTEN_HOST.get()
        # the host peers dial when it differs from the one bound (a worker serving `tcp://name:p@tcp://0.0.0.0:p`)
        self.advertise_host = advertise_host
        self.tcp_port = tcp_port  # this process's TCP listener (0: any free port); procs pick their own
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread_id: int | None = None
        self._loop_thread: threading.Thread | None = None  # controller mode: the loop's daemon thread
        # the private directory of this process's unix socket. A proc's is made by its spawner, which removes
        # it when the proc is gone however it ended (a SIGKILL runs no handler); each process also removes its
        # own at exit, and a controller sweeps what killed processes left (`sweep_stale_sock_dirs`).
        self.sock_dir = sock_dir or new_sock_dir()
        atexit.register(remove_sock_dir, self.sock_dir)
        self.info: dict[str, Any] = {"id": proc_id, "machine": machine_id(), "unix": None, "tcp": None,
                                     "job": fingerprint(self.secret)}
        self.servers: list[Any] = []
        self.routes: dict[str, Connection] = {}
        self.directory: dict[str, dict] = {}
        self.queued: dict[str, list[tuple[bytes, Any, list]]] = {}
        self.dialing: set[str] = set()
        self.held: set[str] = set()
        self.where_waiters: dict[str, list[tuple]] = {}  # proc id -> replies waiting for its address
        self.ask_via: dict[str, str] = {}  # proc id -> process to ask for its address
        self.asking: set[str] = set()
        self.hello_waiters: dict[str, asyncio.Future] = {}
        self.connections: set[Connection] = set()
        self.ports: dict[int, Any] = {}
        self._port_ids = itertools.count(1)
        self.remote_procs: dict[str, str] = {}  # proc id -> worker process that started it
        self._inbox: collections.deque = collections.deque()
        self._inbox_lock = threading.Lock()
        self._inbox_scheduled = False
        self.stopping = False
        self.exit_code: int | None = None
        self._sigint_installed = False
        self.stats: collections.Counter = collections.Counter()  # message counts, for tests and benchmarks
        self.faults = faults
        # the runtime's own kinds (hello, whereis, replies, bye), then those of the layers above
        self.handlers: dict[str, Handler] = {
            Hello.KIND: self._h_hello,
            WhereIs.KIND: self._h_whereis,
            ReplyMsg.KIND: self._h_reply,
            ReplyBatch.KIND: self._h_reply_batch,
            Bye.KIND: self._h_bye,
        }
        self.handlers.update(handlers)

    # ------------------------------------------------------------------ loop management
    def start_in_thread(self) -> None:
        """Controller mode: run the loop on a daemon thread."""
        started = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            loop = new_event_loop()
            asyncio.set_event_loop(loop)
            self.bind_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                errors.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=main, name="regent-runtime", daemon=True)
        thread.start()
        self._loop_thread = thread
        started.wait()
        if errors:
            raise errors[0]
        atexit.register(self._atexit)
        self._install_sigint()
        threading.Thread(target=sweep_stale_sock_dirs, name="regent-sweep", daemon=True).start()

    def _install_sigint(self) -> None:
        """On the main thread, wrap SIGINT so an unhandled fault can make the client exit with code 1."""
        self._sigint_installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum: int, frame: Any) -> None:
            if self.exit_code is not None:
                raise SystemExit(self.exit_code)
            if callable(previous):
                previous(signum, frame)
            else:
                raise KeyboardInterrupt

        try:
            signal.signal(signal.SIGINT, on_sigint)
            self._sigint_installed = True
        except ValueError:
            pass

    def exit_main_thread(self, code: int) -> None:
        """Any thread: make the main thread leave with `code` wherever it is (an unhandled fault in the
        client). With our SIGINT handler it raises SystemExit(code), even blocked in sleep or `get()`;
        without it, KeyboardInterrupt."""
        self.exit_code = code
        if self._sigint_installed:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:
            _thread.interrupt_main()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make `loop`, running on the calling thread, this runtime's loop (before `start`, by whoever runs it)."""
        self.loop = loop
        self.loop_thread_id = threading.get_ident()
        _future._loop_thread_checker[:] = [self.on_loop_thread]

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread_id

    async def start(self) -> None:
        if self.loop is None:
            self.bind_loop(asyncio.get_running_loop())
        path = os.path.join(self.sock_dir, "rt.sock")
        server, addr = await listen(f"unix://{path}", self._factory(True), self.loop)
        self.servers.append(server)
        self.info["unix"] = addr
        host = f"[{self.tcp_host}]" if ":" in self.tcp_host else self.tcp_host
        server, addr = await listen(f"tcp://{host}:{self.tcp_port}", self._factory(True), self.loop)
        self.servers.append(server)
        self.info["tcp"] = self.advertised(addr)
        self.directory[self.proc_id] = self.info

    def advertised(self, addr: str) -> str:
        """`addr` (a bound tcp:// address) as peers should dial it: with `advertise_host` when one is set."""
        if self.advertise_host and addr.startswith("tcp://"):
            port = addr.rpartition(":")[2]
            host = self.advertise_host
            return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        return addr

    async def listen_extra(self, address: str, sock: socket.socket | None = None) -> str:
        """Also accept connections on `address` (used by `regent worker --address`), on `sock` if given."""
        server, addr = await listen(address, self._factory(True), self.loop, sock)
        self.servers.append(server)
        return addr

    def run_on_loop(self, fn: Callable, *args: Any) -> None:
        """Run `fn(*args)` on the loop thread: now if already there, else soon (batched wake-ups)."""
        if threading.get_ident() == self.loop_thread_id:
            fn(*args)
            return
        self._inbox.append((fn, args))
        if self._inbox_scheduled:
            return  # a drain is pending and will see this item (it resets the flag before draining)
        with self._inbox_lock:
            if self._inbox_scheduled:
                return
            self._inbox_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain_inbox)
        except RuntimeError:
            pass  # loop closed at interpreter exit

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            self._inbox_scheduled = False
        inbox = self._inbox
        while inbox:
            fn, args = inbox.popleft()
            try:
                fn(*args)
            except Exception:  # one bad item must not stall the rest (logged with its traceback)
                logger.exception("error in runtime task %s", getattr(fn, "__name__", fn))

    def submit(self, coro: Coroutine) -> Future:
        """Run a coroutine on the loop; returns a Future for its outcome."""
        fut = Future._new()

        def start() -> None:
            task = self.loop.create_task(coro)

            def done(t: asyncio.Task) -> None:
                if t.cancelled():
                    fut._set_exception(asyncio.CancelledError())
                elif t.exception() is not None:
                    fut._set_exception(t.exception())
                else:
                    fut._set_result(t.result())

            task.add_done_callback(done)

        self.run_on_loop(start)
        return fut

    def spawn_task(self, coro: Coroutine) -> None:
        self.run_on_loop(lambda: self.loop.create_task(coro))

    # ------------------------------------------------------------------ connections
    def _factory(self, is_server: bool) -> Callable[[], Connection]:
        def make() -> Connection:
            return Connection(self.secret, is_server, self._on_open, self._on_frame, self._on_close,
                              config.max_frame_bytes, self.loop)

        return make

    def _on_open(self, conn: Connection) -> None:
        self.connections.add(conn)
        conn.send(encode(Hello(self.info)), b"")

    def _on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.connections.discard(conn)
        peer = conn.peer
        if peer is None:
            return
        if self.routes.get(peer) is conn:
            del self.routes[peer]
        if self.stopping:
            return
        if self.is_child(peer):
            # a child of ours or of a worker: its parent reports the exit (status, and only once the
            # process is really gone); fall back if that report never comes
            self.loop.call_later(3.0, self._connection_lost_fallback, peer)
        elif peer in self.faults.graceful:
            self.faults.proc_gone(peer, None)
        else:
            self.faults.proc_gone(peer, f"lost connection to process {peer} ({conn.close_reason or 'closed'})")

    def is_child(self, peer: str) -> bool:
        """Whether `peer` is a proc whose parent reports its exit (one a worker started for us; the process
        layer adds its own children)."""
        return peer in self.remote_procs

    def _connection_lost_fallback(self, peer: str) -> None:
        if peer not in self.faults.dead and peer not in self.routes:
            # a host that is gone entirely (its agent too) loses all its procs' connections at once: coalesced
            # like exits, so the owner gets one report per mesh
            self.faults.proc_exited(peer, None if peer in self.faults.graceful else f"lost connection to process {peer}")

    def _on_frame(self, conn: Connection | None, env: bytes, body: Any, buffers: list) -> None:
        try:
            msg = decode(env)
            handler = self.handlers[msg.KIND]
        except Exception as exc:  # noqa: BLE001 - a bad envelope is dropped, the connection survives
            logger.error("dropping malformed message from %s: %s", conn.peername if conn else "self", exc)
            return
        try:
            handler(conn, msg, body, buffers)
        except Exception:  # one bad message must not close the connection (logged with its traceback)
            logger.exception("error handling %r message", msg.KIND)

    def learn(self, proc_id: str, info: dict) -> None:
        """Record a process's address and answer whoever asked for it ("whereis")."""
        self.directory[proc_id] = info
        for reply in self.where_waiters.pop(proc_id, []):
            self.send_reply(reply, OK, info)
        if proc_id in self.queued and proc_id not in self.held and proc_id not in self.routes:
            self.dial(proc_id)

    def _h_whereis(self, conn: Connection | None, msg: WhereIs, body: Any, buffers: list) -> None:
        proc_id, reply = msg
        info = self.directory.get(proc_id)
        if info is not None and proc_id not in self.held:
            self.send_reply(reply, OK, info)
        elif proc_id in self.faults.dead:
            self.send_reply(reply, OK, None)
        else:
            self.where_waiters.setdefault(proc_id, []).append(reply)
            self.loop.call_later(config.spawn_timeout, self._whereis_timeout, proc_id, reply)

    def _whereis_timeout(self, proc_id: str, reply: tuple) -> None:
        waiters = self.where_waiters.get(proc_id, [])
        if reply in waiters:
            waiters.remove(reply)
            self.send_reply(reply, OK, None)

    def _ask_where(self, proc_id: str) -> None:
        """We hold a reference to a proc whose address we do not know: ask the process that gave it to us."""
        via = self.ask_via.get(proc_id)
        if via is None or proc_id in self.asking:
            return
        self.asking.add(proc_id)
        rt = self

        class _Answer:
            def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
                rt.drop_port(port)
                rt.asking.discard(proc_id)
                info = loads(body, buffers) if status == OK else None
                if info is None:
                    rt.faults.proc_gone(proc_id, f"no address known for process {proc_id}")
                else:
                    rt.learn(proc_id, info)

        port = self.new_port(_Answer())
        self.send(via, WhereIs(proc_id, (self.proc_id, port, 0)))

    def _h_hello(self, conn: Connection, msg: Hello, body: Any, buffers: list) -> None:
        info = msg.info
        peer = info["id"]
        conn.peer = peer
        if peer not in self.directory:
            self.learn(peer, info)
        if peer in self.hello_waiters:
            waiter = self.hello_waiters.pop(peer)
            if not waiter.done():
                waiter.set_result(conn)
        if peer in self.held:
            return
        if peer not in self.routes or self.routes[peer].closed:
            self.routes[peer] = conn
            self._flush_queue(peer)

    def _h_bye(self, conn: Connection, msg: Bye, body: Any, buffers: list) -> None:
        if conn is not None and conn.peer is not None:
            self.faults.graceful.add(conn.peer)

    def release(self, proc_id: str, conn: Connection | None) -> None:
        """Make a held (still configuring) proc routable and send what was queued for it."""
        self.held.discard(proc_id)
        info = self.directory.get(proc_id)
        if info is not None:
            for reply in self.where_waiters.pop(proc_id, []):
                self.send_reply(reply, OK, info)
        if conn is not None and not conn.closed:
            self.routes[proc_id] = conn
        self._flush_queue(proc_id)

    def release_remote(self, proc_id: str, info: dict) -> None:
        """A proc that a worker started for us is configured: record its address, make it routable and connect
        to it now (what was queued for it meanwhile is sent once connected)."""
        self.held.discard(proc_id)
        self.learn(proc_id, info)
        self.dial(proc_id)

    def _flush_queue(self, proc_id: str) -> None:
        queued = self.queued.pop(proc_id, None)
        if not queued:
            return
        conn = self.routes.get(proc_id)
        if conn is None:
            self.queued[proc_id] = queued
            self.dial(proc_id)
            return
        for env, body, bufs in queued:
            conn.send(env, body, bufs)

    def send(self, proc_id: str, msg: Any, body: Any = b"", buffers: list = ()) -> None:
        """Send one message (a `_messages` record) to a process (loop thread only). Queues while connecting."""
        self.send_raw(proc_id, encode(msg), body, buffers)

    def send_raw(self, proc_id: str, env_bytes: bytes, body: Any, buffers: list = ()) -> None:
        if proc_id == self.proc_id:
            local_bufs = [memoryview(bytearray(b)) for b in buffers] if buffers else []
            self.loop.call_soon(self._on_frame, None, env_bytes, memoryview(bytes(body)), local_bufs)
            return
        conn = self.routes.get(proc_id)
        if conn is not None and not conn.closed:
            conn.send(env_bytes, body, buffers)
            return
        if proc_id in self.faults.dead:
            self._undeliverable(proc_id, env_bytes)
            return
        self.queued.setdefault(proc_id, []).append((env_bytes, body, buffers))
        if proc_id not in self.held:
            self.dial(proc_id)

    def _undeliverable(self, proc_id: str, env_bytes: bytes) -> None:
        """A message to a dead process: answer its reply port, if any, so nobody waits forever."""
        try:
            msg = decode(env_bytes)
        except Exception as exc:  # noqa: BLE001 - reported; an undecodable message has no reply port to answer
            logger.warning("dropping an undecodable message to dead process %s: %s", proc_id, exc)
            return
        reply = reply_to_answer(msg)
        if reply is not None:
            reason = self.faults.dead.get(proc_id, "unreachable")
            self.send_reply(reply, DEAD, f"the process this actor was running on failed: {reason}")

    def dial(self, proc_id: str) -> None:
        """Connect to `proc_id` now (not waiting for a first message to it), unless already connecting; a
        process whose address is unknown is asked of the process that told us about it."""
        if proc_id in self.dialing:
            return
        info = self.directory.get(proc_id)
        if info is None:
            self._ask_where(proc_id)
            return
        self.dialing.add(proc_id)
        self.loop.create_task(self._dial_task(proc_id, info))

    def address_for(self, info: dict) -> str:
        if info.get("unix") and info.get("machine") == self.info["machine"]:
            return info["unix"]
        if info.get("tcp"):
            return info["tcp"]
        raise ConnectionError(f"process {info.get('id')} has no address reachable from this machine")

    async def _dial_task(self, proc_id: str, info: dict) -> None:
        try:
            conn = await connect(self.address_for(info), self._factory(False), self.loop)
            conn.peer = proc_id
        except Exception as exc:  # noqa: BLE001 - the peer is unreachable: fail what waits on it
            self.dialing.discard(proc_id)
            logger.warning("cannot connect to %s: %s", proc_id, exc)
            self.faults.proc_gone(proc_id, f"cannot connect to process {proc_id}: {exc}")
            return
        self.dialing.discard(proc_id)
        existing = self.routes.get(proc_id)
        if existing is None or existing.closed:
            self.routes[proc_id] = conn
        self._flush_queue(proc_id)

    async def connect_address(self, address: str, timeout: float = 30.0) -> str:
        """Dial an address whose process id is unknown (a worker); returns the peer's process id.

        A refused or missing address is dialled again until `config.attach_timeout`: a worker started
        just before `attach_to_workers` (as Monarch's examples do) may not listen yet."""
        retry_until = self.loop.time() + config.attach_timeout
        while True:
            try:
                conn = await connect(address, self._factory(False), self.loop, timeout)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if self.loop.time() >= retry_until:
                    raise
                await asyncio.sleep(0.05)
        deadline = self.loop.time() + timeout
        while conn.peer is None:
            if conn.closed:
                raise ConnectionError(f"connection to {address} closed before hello")
            if self.loop.time() > deadline:
                raise TimeoutError(f"no hello from {address} within {timeout} s")
            await asyncio.sleep(0.005)
        return conn.peer

    # ------------------------------------------------------------------ ports and replies
    def new_port(self, handler: Any) -> int:
        """Register a reply handler (any thread: the id counter and dict store are atomic)."""
        port_id = next(self._port_ids)
        self.ports[port_id] = handler
        return port_id

    def drop_port(self, port_id: int) -> None:
        self.ports.pop(port_id, None)

    def _h_reply(self, conn: Connection | None, msg: ReplyMsg, body: Any, buffers: list) -> None:
        port_id, index, status = msg
        handler = self.ports.get(port_id)
        if handler is None:
            return  # late reply to a finished or failed call
        handler.deliver(index, status, body, buffers)

    def _h_reply_batch(self, conn: Connection | None, msg: ReplyBatch, body: Any, buffers: list) -> None:
        """Several OK replies to one port, gathered by a host or process (`_tree.Batch`)."""
        port_id, indices, lengths = msg
        self.stats["reply_batches"] += 1
        handler = self.ports.get(port_id)
        if handler is None:
            return
        view = memoryview(body)
        offset = 0
        for index, n in zip(indices, lengths):
            handler.deliver(index, OK, view[offset:offset + n], [])
            offset += n
            if self.ports.get(port_id) is not handler:
                return  # finished (or failed) part-way

    def send_reply(self, reply: tuple, status: int, value: Any) -> None:
        """Send a value (or error) to a reply port `(proc_id, port_id, index)`; any thread.

        The hot path of every call, once per actor: the imports it needs are at module level (an import
        statement here was ~10% of a process's time in a call to 64 async actors)."""
        try:
            body, bufs = (NONE_BODY, []) if value is None else dumps(value)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result becomes an error for the caller
            err = ActorError(RuntimeError(f"result could not be pickled: {exc!r}"), "Actor call failed.")
            body, bufs = dumps((err.exception, str(exc), ""))
            status = ERROR
        if reply[0] == self.proc_id and not bufs:
            # a port in this process (a tree cast's reply batch, or a local caller): no envelope, no frame
            handler = self.ports.get(reply[1])
            if getattr(handler, "deliver_any_thread", False):
                # a reply batch only gathers (no user code runs in it): delivered now, from an actor's thread
                # without a loop wake-up, and on the loop without a callback per reply
                handler.deliver(reply[2], status, body, [])
                return
            if threading.get_ident() == self.loop_thread_id:  # after the current callback, as a frame would be
                self.loop.call_soon(self._local_reply, reply[1], reply[2], status, body)
            else:
                self.run_on_loop(self._local_reply, reply[1], reply[2], status, body)
            return
        env = encode(ReplyMsg(reply[1], reply[2], status))
        self.run_on_loop(self.send_raw, reply[0], env, body, bufs)

    def _local_reply(self, port_id: int, index: int, status: int, body: Any) -> None:
        handler = self.ports.get(port_id)
        if handler is not None:
            handler.deliver(index, status, memoryview(body), [])

    def forget_proc(self, proc_id: str) -> None:
        """`proc_id` is gone (supervision decided): drop its route and what was queued for it."""
        self.held.discard(proc_id)
        self.routes.pop(proc_id, None)
        for env, _body, _bufs in self.queued.pop(proc_id, []):
            self._undeliverable(proc_id, env)

    # ------------------------------------------------------------------ shutdown
    def _atexit(self) -> None:
        try:
            self.shutdown(timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - reported; an atexit hook must not raise
            logger.warning("runtime shutdown at exit failed (owned processes may outlive this one): %s", exc)
        # Stop the loop thread before the interpreter finalizes: a daemon thread still running the event loop
        # (uvloop's C callbacks) while modules are torn down can crash the process at exit (a SIGSEGV after
        # actor_bench had written its results, seen in the test suite).
        thread, loop = self._loop_thread, self.loop
        if thread is not None and loop is not None and not loop.is_closed() and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing left to stop
                loop.call_soon_threadsafe(loop.stop)
            thread.join(2.0)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop every proc mesh this process owns (`stop_owned`, bounded by `timeout`), then close sockets."""
        if self.loop is None or self.loop.is_closed() or self.stopping:
            return

        async def stop_all() -> None:
            await self.stop_owned(timeout)
            self.stopping = True
            for conn in list(self.connections):
                conn.close()

        fut = self.submit(stop_all())
        try:
            fut.get(timeout + 3)
        except Exception as exc:  # noqa: BLE001 - reported; shutdown is best effort and must not raise
            logger.warning("runtime shutdown did not complete (owned processes may outlive this one): %r", exc)

    async def stop_owned(self, timeout: float) -> None:
        """Before the connections close at shutdown: end what this process owns (the process layer's meshes
        and children; routing owns none)."""


def new_sock_dir() -> str:
    """A fresh private (0700) directory for one process's unix socket."""
    return tempfile.mkdtemp(prefix="regent-")


def remove_sock_dir(path: str) -> None:
    """Remove a process's socket directory; best effort (already gone, or not ours to remove: nothing to do)."""
    shutil.rmtree(path, ignore_errors=True)


STALE_SOCK_DIR_AGE_S = 60.0


def sweep_stale_sock_dirs(parent: str | None = None, limit: int = 10_000) -> int:
    """Remove socket directories that processes killed outright (SIGKILL, OOM) left behind; returns how many.

    A directory goes only if all of this holds: named `regent-*`, owned by this user, older than a minute, and
    holding an `rt.sock` that refuses connections (nobody listens on it: its process is gone), or holding
    nothing at all. A live process always listens on its socket, so this never takes one in use. Run by a
    controller at start, off its path."""
    parent = parent or tempfile.gettempdir()
    removed = 0
    try:
        entries = os.scandir(parent)
    except OSError:
        return 0
    with entries:
        for n, entry in enumerate(entries):
            if n >= limit:
                break
            if entry.name.startswith("regent-") and not entry.name.startswith("regent-secret-") \
                    and _is_stale_sock_dir(entry):
                remove_sock_dir(entry.path)
                removed += 1
    return removed


def _is_stale_sock_dir(entry: os.DirEntry) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
            return False
        if time.time() - st.st_mtime < STALE_SOCK_DIR_AGE_S:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(os.path.join(entry.path, "rt.sock"))
    except ConnectionRefusedError:
        return True
    except FileNotFoundError:  # no socket: stale only if empty (else something else named regent-*)
        try:
            return not os.listdir(entry.path)
        except OSError:  # removed meanwhile
            return False
    except OSError:  # a directory we cannot judge (timeout, permissions) is left alone
        return False
    return False  # someone listens: in use


class ForeignJobError(RuntimeError):
    """A mesh or port reference from a job whose secret this process does not hold: its processes would
    refuse every connection, so using it could never work."""


_SAME_SECRET_FIX = (
    f"Give both programs the same secret before either starts: set {SECRET_ENV} to the same hex string (e.g. "
    f"from `python -c 'import secrets; print(secrets.token_hex(32))'`) in both environments, or point "
    f"{SECRET_FILE_ENV} at one file holding it."
)


def check_same_job(rt: Runtime, referrer: dict | None, what: str) -> None:
    """Raise `ForeignJobError` at once (naming the fix) if `referrer`, the process that pickled a reference,
    holds another job secret than this process."""
    theirs = referrer.get("job") if referrer else None
    if theirs is None or theirs == rt.info["job"]:
        return
    raise ForeignJobError(
        f"this {what} belongs to another job: process {referrer.get('id')} that pickled it holds a different "
        f"job secret than this process ({rt.proc_id}), so its processes would refuse this process's "
        f"connections. {_SAME_SECRET_FIX}"
    )


def check_reference_job(rt: Runtime, job: str | None, what: str) -> None:
    """Raise `ForeignJobError` if a JSON reference (`ProcMesh.reference()`) was written in a job with another
    secret (fingerprint `job`): its processes would refuse every connection from this one."""
    if job == rt.info["job"]:
        return
    raise ForeignJobError(
        f"{what} belongs to another job: it was written by a process whose job secret has fingerprint {job}, "
        f"this process's ({rt.proc_id}) has {rt.info['job']}, so its processes would refuse this process's "
        f"connections. {_SAME_SECRET_FIX}"
    )


def learn_addresses(rt: Runtime, infos: dict, referrer: dict | None, what: str = "reference") -> None:
    """Addresses that came with a mesh reference; unknown ones (procs still starting) are asked of
    `referrer`, the process that pickled the reference, when first needed. A reference from another job
    (another secret) raises `ForeignJobError` here, at unpickling, instead of failing at first use."""
    check_same_job(rt, referrer, what)

    def on_loop() -> None:
        if referrer is not None and referrer["id"] != rt.proc_id:
            rt.directory.setdefault(referrer["id"], referrer)
        for pid, info in infos.items():
            if info is not None:
                if pid not in rt.directory:
                    rt.learn(pid, info)
            elif referrer is not None and pid not in rt.directory:
                rt.ask_via.setdefault(pid, referrer["id"])

    rt.run_on_loop(on_loop)


class OneShot:
    """A reply port that resolves an asyncio future with the first reply `(status, body, buffers)`."""

    def __init__(self, fut: asyncio.Future) -> None:
        self.fut = fut

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        if not self.fut.done():
            self.fut.set_result((status, body, buffers))


def exit_gracefully(code: int = 0, teardown: bool = False) -> None:
    """End this process after a graceful stop: run its `atexit` handlers (which include `logging.shutdown`,
    `weakref.finalize` callbacks and multiprocessing's cleanup), collect garbage so `__del__` of unreachable
    objects runs, flush stdio, then leave with `os._exit`, or, with `teardown` where it is safe
    (`teardown_is_safe`), through the interpreter's own exit, which also tears module globals down (their
    `__del__` runs, as when a Monarch proc stops): the event loop is stopped, and the proc's main exits.

    Why not always a normal interpreter exit: it joins every non-daemon thread (an executor thread stuck in a
    call) and finalizes every module and native object, and native communicators are not safe to destroy then
    (a Gloo communicator leaked by an abort may still run a timed-out collective; see
    `regent.ft.process_group.ReplicatedGroup.abort`, which relies on actor processes leaving with `os._exit`).
    A teardown that still hangs ends after TEARDOWN_LIMIT_S (a watchdog outside the interpreter); a handler
    that hangs is bounded by the owner, which kills a proc that has not exited within REGENT_STOP_TIMEOUT.
    Crashes, kills and orphan exits skip all this.
    """
    try:
        atexit._run_exitfuncs()  # prints a failing handler's traceback itself and goes on with the others
    except BaseException as exc:  # noqa: BLE001 - the process is leaving whatever a handler did; say so
        logger.warning("atexit handlers failed during a graceful stop: %r", exc)
    with contextlib.suppress(Exception):  # a finalizer's error must not keep the process from exiting
        gc.collect()
    with contextlib.suppress(Exception):  # a closed stdout/stderr: nowhere to report, the process exits anyway
        sys.stdout.flush()
        sys.stderr.flush()
    if teardown and teardown_is_safe():
        faulthandler.dump_traceback_later(TEARDOWN_LIMIT_S, exit=True)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda *_: None)  # tasks still pending are destroyed at teardown: silently
        _teardown_exit.append(code)
        loop.stop()  # the proc's main returns from run_forever and exits with `teardown_exit_code()`
        return
    os._exit(code)


TEARDOWN_LIMIT_S = 5.0  # how long the interpreter's own exit may take before the process leaves anyway
_teardown_exit: list[int] = []


def teardown_exit_code() -> int | None:
    """The exit code of a graceful stop that ends through the interpreter's teardown (the event loop was stopped
    for it), or None."""
    return _teardown_exit[-1] if _teardown_exit else None


def teardown_is_safe() -> bool:
    """Whether this process can end through the interpreter's teardown without a hang or a crash: it runs on the
    main thread (whose SystemExit ends the process), no other non-daemon thread is alive (the interpreter would
    join it; Regent's own threads are daemons), and no native communicator can exist (torch.distributed was
    never imported)."""
    from regent.platform import native_collectives_loaded

    if threading.current_thread() is not threading.main_thread() or native_collectives_loaded():
        return False
    return not any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())

