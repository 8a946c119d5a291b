"""Hosting one actor: its mailbox, running handlers one at a time, failure, stop and supervision.

Async actors run on the process's event loop, one task per actor. Sync actors get a thread of their own,
so a handler may block (for example on `Future.get()`) without stalling the loop that carries replies.
Failure rules (Monarch's):
- an `Exception` from an endpoint with a reply port goes back to the caller as `ActorError`; the actor lives;
- an exception with no reply port (broadcast, explicit port), a `BaseException`, or a failing `__init__`
  kills the actor: queued calls get `SupervisionError`, and its owner is sent the failure.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import queue
import threading
from typing import Any

from regent.actor._actor import EndpointProperty, endpoints_of
from regent.actor._config import config
from regent.actor._context import Instance, set_current
from regent.actor._errors import format_remote_traceback
from regent.actor._messages import RankFailed
from regent.actor._pickle import loads_call
from regent.actor._port import DroppingPort, Port
from regent.actor._process import ActorRuntime
from regent.actor._runtime import DEAD, ERROR, OK

logger = logging.getLogger("regent.actor")

_STOP_WORKER = ("exit",)


class Mailbox:
    """FIFO of work items; supervision items jump the queue (in their own order: one failure per rank of a lost
    host reaches `__supervise__` rank by rank). Put on the loop thread, get on the worker.

    A sync actor's thread sleeps on a `queue.SimpleQueue` of wake tokens (one per item put) rather than a
    Condition: the hand-off is the cost of a call to many sync actors (~50 us each on a 2-core VM), and the C
    queue wakes a thread for about a quarter less. deque appends and pops are atomic, so the items need no lock.
    """

    def __init__(self, is_async: bool, shared: SharedSyncThread | None = None, owner: Any = None) -> None:
        self.items: collections.deque = collections.deque()
        self.front: collections.deque = collections.deque()  # items put with front=True, taken first
        self.is_async = is_async
        # a thread of its own sleeps on its own tokens; actors on the shared thread post their cell to its queue
        self.tokens: queue.SimpleQueue | None = None
        self.token: Any = None
        if shared is not None:
            self.tokens, self.token = shared.tokens, owner
        elif not is_async:
            self.tokens = queue.SimpleQueue()
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any, front: bool = False) -> None:
        (self.front if front else self.items).append(item)
        if self.tokens is not None:
            self.tokens.put(self.token)
            return
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get_async(self) -> Any:
        while not self.items and not self.front:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        return self.pop()

    def pop(self) -> Any:
        """The next item, front items first; IndexError when there is none."""
        try:
            return self.front.popleft()
        except IndexError:
            return self.items.popleft()

    def get_sync(self) -> Any:
        assert self.tokens is not None
        while True:
            self.tokens.get()
            try:
                return self.pop()
            except IndexError:  # its item was taken by drain(); wait for the next
                continue

    def drain(self) -> list:
        items = []
        while True:
            try:
                items.append(self.pop())
            except IndexError:
                return items


class SharedSyncThread:
    """One thread that runs every sync actor of this process (`config.shared_asyncio_runtime`, Monarch's knob).

    Its queue holds one token per message put: the cell whose mailbox has it (the message itself stays in the
    cell's mailbox, where supervision can jump ahead of it), or ("init", cell) to construct a new actor here,
    so that thread-local state set in `__init__` is seen by every endpoint, as with a thread per actor."""

    def __init__(self) -> None:
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="actors-shared", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            token = self.tokens.get()
            if type(token) is tuple:
                self._serve(token[1], None)
                continue
            cell = token
            try:
                item = cell.mailbox.pop()
            except IndexError:  # its item was taken by drain()
                continue
            if cell.finished:  # failed or stopped: what is still addressed to it gets its death
                cell._answer_dead(item)
                continue
            self._serve(cell, item)

    @staticmethod
    def _serve(cell: Cell, item: tuple | None) -> None:
        """Construct `cell` (item None) or handle one of its items; mark it finished once it has ended."""
        try:
            alive = cell._init_sync() if item is None else cell._step_sync(item)
        except BaseException as exc:  # reported, and the actor fails (supervision)
            # Endpoint errors are handled inside; this is one escaping `__cleanup__` or the runtime itself. A
            # thread of its own would end with its actor; this one serves the others, so: report, end the actor.
            logger.exception("the shared actor thread stops %s after an error", cell.display)
            if cell.alive:
                cell.fail(exc)
            alive = False
        if not alive:
            cell.finished = True


def shared_sync_thread(rt: ActorRuntime) -> SharedSyncThread:
    """This process's shared thread for sync actors, started on first use."""
    if rt.shared_sync_thread is None:
        rt.shared_sync_thread = SharedSyncThread()
    return rt.shared_sync_thread


class Cell:
    def __init__(self, rt: ActorRuntime, key: str, mesh_id: str, rank: int, point: tuple, name: str,
                 owner: tuple[str, str], cls: type, args: tuple, kwargs: dict, is_async: bool,
                 init_reply: tuple | None, proc: Any, creator: Any) -> None:
        self.rt = rt
        self.key = key
        self.mesh_id = mesh_id
        self.rank = rank
        self.point = point
        self.name = name
        self.owner = owner
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.is_async = is_async
        self.init_reply = init_reply
        self.status = "init"
        self.endpoints = endpoints_of(cls)
        self.shared = None if is_async or not config.shared_asyncio_runtime else shared_sync_thread(rt)
        self.finished = False  # (shared thread) this actor has ended: its later messages get its death
        self.mailbox = Mailbox(is_async, self.shared, self)
        self.instance: Any = None
        self.owned: list[Any] = []
        self.tasks: set[asyncio.Task] = set()
        self.failure_exc: BaseException | None = None
        self.ctx = Instance(key, name, f"{cls.__module__}.{cls.__qualname__}", point, proc, cell=self,
                            creator=creator)
        self.display = f"{cls.__module__}.{cls.__qualname__} {name}{self.ctx.rank}"
        self.current_reply: tuple | None = None
        self.supervise_lock: asyncio.Lock | None = None  # one __supervise__ at a time
        # (async actors) __supervise__ runs not finished yet: messages taken from the mailbox wait for them
        self.supervising: set[asyncio.Task] = set()
        # async actors: failures of owned meshes that arrive while __init__ still runs (handled after it)
        self.early_failures: list | None = []

    @property
    def alive(self) -> bool:
        return self.status in ("init", "running", "stopping")

    # ---------------------------------------------------------------- starting
    def start(self) -> None:
        if self.is_async:
            task = self.rt.loop.create_task(self._run_async())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif self.shared is not None:
            self.shared.tokens.put(("init", self))
        else:
            threading.Thread(target=self._run_sync, name=f"actor-{self.name}-{self.rank}", daemon=True).start()

    def post(self, item: tuple) -> None:
        """Loop thread: a message for this actor."""
        if not self.alive:
            self._answer_dead(item)
            return
        if item[0] == "stop" and self.status == "init":
            self._stop_during_init(item[1], item[2])
            return
        self.mailbox.put(item)

    def _stop_during_init(self, reply: tuple | None, reason: str) -> None:
        """Loop thread: stop an actor whose `__init__` has not returned (it may never: Monarch's
        `test_run_forever_on_init`). As in Monarch the stop completes now; whatever waits on the actor is
        answered, and `__cleanup__` runs if `__init__` ever returns (its thread sees the actor stopped)."""
        why = f"actor {self.display} has status: stopped ({reason}) before its __init__ returned"
        self.status = "stopped"
        self.rt.actors.mark_dead(self.key, why)
        if self.init_reply is not None:
            self.rt.send_reply(self.init_reply, DEAD, why)
        for queued in self.mailbox.drain():
            self._answer_dead(queued)
        self.rt.actors.remove(self.key)
        if reply is not None:
            self.rt.send_reply(reply, OK, None)

    def _answer_dead(self, item: tuple) -> None:
        kind = item[0]
        if kind == "m" and item[4] is not None:
            self.rt.send_reply(item[4], DEAD, self.dead_text())
        elif kind == "stop" and item[1] is not None:
            self.rt.send_reply(item[1], OK, None)

    def dead_text(self) -> str:
        return self.rt.actors.why_dead(self.key) or f"actor {self.display} is not running"

    def _construct(self) -> None:
        self.instance = self.cls.__new__(self.cls)
        self.instance.__init__(*self.args, **self.kwargs)
        self.args = self.kwargs = None

    # ---------------------------------------------------------------- sync actors
    def _run_sync(self) -> None:
        """A thread of its own: construct, then handle messages until the actor ends."""
        if not self._init_sync():
            return
        while self._step_sync(self.mailbox.get_sync()):
            pass

    def _init_sync(self) -> bool:
        """Run `__init__` on this (the actor's) thread; False if it failed (reported, cleaned up)."""
        set_current(self.ctx, self.point)
        try:
            self._construct()
        except BaseException as exc:  # noqa: BLE001 - __init__ failure is a supervision event
            self.fail(exc, during_init=True)
            self._cleanup_sync(exc)
            return False
        if self.status != "init":  # stopped while __init__ ran (`_stop_during_init`)
            self._cleanup_sync(None)
            return False
        self.status = "running"
        if self.init_reply is not None:
            self.rt.send_reply(self.init_reply, OK, None)
        return True

    def _step_sync(self, item: tuple) -> bool:
        """Handle one mailbox item on the actor's thread; False once the actor has ended."""
        kind = item[0]
        if kind == "m":
            self._handle_sync(item)
        elif kind == "sup":
            self._supervise_sync(item[1])
        elif kind == "stop":
            self._stop_sync(item[1], item[2])
            return False
        elif kind == "exit":
            self._cleanup_sync(self.failure_exc)
            return False
        if not self.alive:
            self._cleanup_sync(self.failure_exc)
            return False
        return True

    def _decode(self, item: tuple) -> tuple | None:
        """A message's endpoint and arguments, or None once a missing endpoint or undecodable arguments went
        back to the caller as its error."""
        _, method, body, buffers, reply, _ = item
        ep = self.endpoints.get(method) or self._plain_endpoint(method)
        try:
            if ep is None:
                raise AttributeError(f"{self.cls.__qualname__} has no endpoint {method!r}")
            args, kwargs = loads_call(body, buffers)
        except Exception as exc:  # noqa: BLE001 - reported: an argument error goes back to the caller
            self._endpoint_raised(exc, reply, method)
            return None
        return ep, args, kwargs

    def _handle_sync(self, item: tuple) -> None:
        _, method, _, _, reply, msg_rank = item
        set_current(self.ctx, msg_rank)
        self.current_reply = reply
        call = self._decode(item)
        if call is None:
            return
        ep, args, kwargs = call
        if ep.explicit_response_port:
            port = self._port_for(reply)
            try:
                ep.fn(self.instance, port, *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - explicit-port endpoints die on any exception
                self.fail(exc, current_reply=reply)
            return
        try:
            result = ep.fn(self.instance, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported: an endpoint's error goes back to its caller
            self._endpoint_raised(exc, reply, method)
        except BaseException as exc:  # noqa: BLE001 - reported: anything else fails the actor (supervision)
            self.fail(exc, current_reply=reply)
        else:
            if reply is not None:
                self.rt.send_reply(reply, OK, result)
        finally:
            self.current_reply = None

    def _supervise_sync(self, failure: Any) -> None:
        if self.rt.supervision.failure_is_stale(failure):
            return
        set_current(self.ctx, self.point)
        try:
            result = self.instance.__supervise__(failure)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except BaseException as exc:  # noqa: BLE001 - reported: a failing __supervise__ is a supervision event
            self._supervise_raised(failure, exc)
            return
        if not result:
            self.escalate(failure)

    def _stop_sync(self, reply: tuple | None, reason: str) -> None:
        self.status = "stopping"
        self._stop_owned_sync()
        self._cleanup_sync(None)
        self._finish_stop(reply, reason)

    def _stop_owned_sync(self) -> None:
        for mesh in reversed(self.owned):
            try:
                mesh.stop().get(timeout=self.rt_stop_timeout())
            except Exception as exc:  # noqa: BLE001 - reported; one mesh that will not stop must not keep the others
                logger.warning("stopping %s owned by %s: %s", mesh, self.display, exc)
        self.owned.clear()

    def rt_stop_timeout(self) -> float:
        return config.stop_timeout + 5

    def _cleanup_sync(self, exc: BaseException | None) -> None:
        cleanup = getattr(self.instance, "__cleanup__", None) if self.instance is not None else None
        if cleanup is None:
            return
        set_current(self.ctx, self.point)
        try:
            result = cleanup(exc)
            if inspect.isawaitable(result):
                asyncio.run(_await(result))
        except Exception as err:  # noqa: BLE001 - reported; a failing __cleanup__ must not stop the shutdown
            logger.error("__cleanup__ of %s raised: %s", self.display, err)

    # ---------------------------------------------------------------- async actors
    def _construct_off_loop(self) -> asyncio.Future:
        """Run `__init__` on a thread of its own and resolve (on the loop) with its exception or None.

        The loop carries every actor's messages, replies and supervision for this process, so an
        `__init__` that blocks (waits on an event, a lock, a slow import) must not run on it. Messages
        for this actor wait in its mailbox until `__init__` returns, so no call races construction.
        """
        loop = self.rt.loop
        done = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if not done.done():
                done.set_result(exc)

        def run() -> None:
            set_current(self.ctx, self.point)
            try:
                self._construct()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop: __init__ failure is a supervision event
                outcome: BaseException | None = exc
            else:
                outcome = None
                seen = _thread_locals_seen(self.instance)
                if seen:
                    loop.call_soon_threadsafe(_thread_locals_carry, seen)
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:
                pass  # the loop is closed: the process is exiting, nobody waits for this actor

        threading.Thread(target=run, name=f"actor-init-{self.name}-{self.rank}", daemon=True).start()
        return done

    async def _run_async(self) -> None:
        set_current(self.ctx, self.point)
        exc = await self._construct_off_loop()
        if exc is not None:
            self.fail(exc, during_init=True)
            await self._cleanup_async(exc)
            return
        if not self.alive:  # failed (aborted, or its proc is stopping) while __init__ ran
            await self._cleanup_async(self.failure_exc)
            return
        self.status = "running"
        if self.init_reply is not None:
            self.rt.send_reply(self.init_reply, OK, None)
        early, self.early_failures = self.early_failures, None
        for failure in early or ():
            self.supervise(failure)
        while True:
            item = await self.mailbox.get_async()
            kind = item[0]
            if kind == "m":
                if self.supervising:
                    # as in Monarch, a failure delivered before a message is supervised before that message is
                    # handled (an owner asked for its failures right after a failed call must have seen them);
                    # a running endpoint does not hold __supervise__ up, only the next messages wait
                    await asyncio.wait(set(self.supervising))
                await self._handle_async(item)
            elif kind == "stop":
                await self._stop_async(item[1], item[2])
                return
            elif kind == "exit":
                await self._cleanup_async(self.failure_exc)
                return
            if not self.alive:
                await self._cleanup_async(self.failure_exc)
                return

    async def _handle_async(self, item: tuple) -> None:
        _, method, _, _, reply, msg_rank = item
        set_current(self.ctx, msg_rank)
        call = self._decode(item)
        if call is None:
            return
        ep, args, kwargs = call
        if ep.concurrent:
            task = self.rt.loop.create_task(self._invoke_async(ep, args, kwargs, reply, method))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        await self._invoke_async(ep, args, kwargs, reply, method)

    async def _invoke_async(self, ep: Any, args: tuple, kwargs: dict, reply: tuple | None, method: str) -> None:
        if ep.explicit_response_port:
            port = self._port_for(reply)
            try:
                await ep.fn(self.instance, port, *args, **kwargs)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - explicit-port endpoints die on any exception
                self.fail(exc, current_reply=reply)
            return
        try:
            result = await ep.fn(self.instance, *args, **kwargs)
        except asyncio.CancelledError:
            if self.status == "stopping":
                raise
            self.fail(asyncio.CancelledError("endpoint was cancelled"), current_reply=reply)
        except Exception as exc:  # noqa: BLE001 - reported: an endpoint's error goes back to its caller
            self._endpoint_raised(exc, reply, method)
        except BaseException as exc:  # noqa: BLE001 - reported: anything else fails the actor (supervision)
            self.fail(exc, current_reply=reply)
        else:
            if reply is not None:
                self.rt.send_reply(reply, OK, result)

    async def _supervise_async(self, failure: Any) -> None:
        if self.supervise_lock is None:
            self.supervise_lock = asyncio.Lock()
        async with self.supervise_lock:
            await self._supervise_async_locked(failure)

    async def _supervise_async_locked(self, failure: Any) -> None:
        if self.rt.supervision.failure_is_stale(failure) or not self.alive:
            return
        set_current(self.ctx, self.point)
        try:
            handler = self.instance.__supervise__
            if inspect.iscoroutinefunction(handler):
                result = await handler(failure)
            else:
                result = await self.rt.loop.run_in_executor(None, handler, failure)
        except BaseException as exc:  # noqa: BLE001 - reported: a failing __supervise__ is a supervision event
            self._supervise_raised(failure, exc)
            return
        if not result:
            self.escalate(failure)

    async def _stop_async(self, reply: tuple | None, reason: str) -> None:
        self.status = "stopping"
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()
        for mesh in reversed(self.owned):
            try:
                await asyncio.wait_for(mesh.stop(), self.rt_stop_timeout())
            except Exception as exc:  # noqa: BLE001 - reported; one mesh that will not stop must not keep the others
                logger.warning("stopping %s owned by %s: %s", mesh, self.display, exc)
        self.owned.clear()
        await self._cleanup_async(None)
        self._finish_stop(reply, reason)

    async def _cleanup_async(self, exc: BaseException | None) -> None:
        cleanup = getattr(self.instance, "__cleanup__", None) if self.instance is not None else None
        if cleanup is None:
            return
        try:
            result = cleanup(exc)
            if inspect.isawaitable(result):
                await asyncio.wait_for(_await(result), config.cleanup_timeout)
        except Exception as err:  # noqa: BLE001 - reported; a failing __cleanup__ must not stop the shutdown
            logger.error("__cleanup__ of %s raised: %r", self.display, err)

    # ---------------------------------------------------------------- common
    def _plain_endpoint(self, method: str) -> Any:
        """A plain method called through `as_endpoint(mesh.method)`."""
        fn = getattr(self.cls, method, None)
        if fn is None or not callable(fn) or method.startswith("__"):
            return None
        ep = EndpointProperty(fn)
        self.endpoints[method] = ep
        return ep

    def _port_for(self, reply: tuple | None) -> Any:
        if reply is None:
            return DroppingPort()
        return Port(reply[0], reply[1], reply[2])

    def _endpoint_raised(self, exc: Exception, reply: tuple | None, method: str) -> None:
        if reply is None:
            self.fail(exc)
            return
        # Monarch's wording: the actor's (mesh) name, not its class and rank (the traceback names the code)
        message = f"Actor call {self.name}.{method} failed."
        self.rt.send_reply(reply, ERROR, (exc, message, format_remote_traceback(exc)))

    def fail(self, exc: BaseException | None, current_reply: tuple | None = None, text: str | None = None,
             during_init: bool = False) -> None:
        """Any thread: this actor is dead. Reply to what waits on it and tell the owner."""
        if text is None:
            detail = format_remote_traceback(exc) if exc is not None else "no reason provided"
            what = "failed during __init__" if during_init else "failed"
            text = f"Supervision event: actor {self.display} {what}: {detail}"
        self.failure_exc = exc
        self.rt.run_on_loop(self._fail_on_loop, text, current_reply)

    def _fail_on_loop(self, text: str, current_reply: tuple | None) -> None:
        if self.status in ("failed", "stopped"):
            return
        was_running_stop = self.status == "stopping"
        self.status = "failed"
        why = f"The actor {self.display} and all its descendants have failed: {text}"
        self.rt.actors.mark_dead(self.key, why)
        if current_reply is not None:
            self.rt.send_reply(current_reply, DEAD, why)
        if self.init_reply is not None and self.instance is None:
            self.rt.send_reply(self.init_reply, DEAD, why)
        for item in self.mailbox.drain():
            self._answer_dead(item)
        self.mailbox.put(_STOP_WORKER)
        for task in list(self.tasks):
            if task is not asyncio.current_task():
                task.cancel()
        for mesh in self.owned:
            try:
                mesh.stop()
            except Exception as exc:  # noqa: BLE001 - reported; the other owned meshes are still stopped
                logger.warning("stopping %s owned by %s after its failure: %s", mesh, self.display, exc)
        self.owned.clear()
        self.rt.actors.remove(self.key)
        if not was_running_stop:
            self.rt.send(self.owner[0], RankFailed(self.mesh_id, self.rank, text))

    def _supervise_raised(self, failure: Any, exc: BaseException) -> None:
        text = (
            f"Supervision event: actor {self.display} failed: ErrorDuringHandlingSupervision: "
            f"{format_remote_traceback(exc)}This error occurred while handling another failure:\n{failure.report()}"
        )
        self.fail(exc, text=text)

    def escalate(self, failure: Any) -> None:
        self.fail(None, text=(
            f"Supervision event: actor {self.display} failed: UnhandledSupervisionEvent:\n"
            f"{failure.report()}"
        ))

    def supervise(self, failure: Any) -> None:
        """Loop thread: a mesh this actor owns failed."""
        if self.is_async and self.early_failures is not None:
            self.early_failures.append(failure)  # __init__ is still running on its thread
            return
        handler = getattr(type(self.instance), "__supervise__", None) if self.instance is not None else None
        if handler is None:
            self.escalate(failure)
            return
        if self.is_async:
            task = self.rt.loop.create_task(self._supervise_async(failure))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.supervising.add(task)
            task.add_done_callback(self.supervising.discard)
        else:
            self.mailbox.put(("sup", failure), front=True)

    def request_stop(self, reason: str, reply: tuple | None = None) -> None:
        self.rt.run_on_loop(self.post, ("stop", reply, reason))

    def _finish_stop(self, reply: tuple | None, reason: str) -> None:
        def on_loop() -> None:
            self.status = "stopped"
            self.rt.actors.mark_dead(self.key, f"actor {self.display} has status: stopped ({reason})")
            for item in self.mailbox.drain():
                self._answer_dead(item)
            self.rt.actors.remove(self.key)
            if reply is not None:
                self.rt.send_reply(reply, OK, None)

        self.rt.run_on_loop(on_loop)


def _thread_locals_seen(instance: Any) -> list[tuple[threading.local, dict]]:
    """(init thread) The `threading.local` attributes of a new async actor with what `__init__` put in them.

    Monarch runs an async actor's `__init__` on the thread its endpoints run on, so `self.local.value` set
    there is seen by them; Regent runs it on a thread of its own (a blocking `__init__` must not freeze the
    process's loop), so what it stored is carried to the loop thread before the first message."""
    found = []
    for value in list(vars(instance).values()) if hasattr(instance, "__dict__") else ():
        if isinstance(value, threading.local):
            found.append((value, dict(vars(value))))
    return found


def _thread_locals_carry(seen: list[tuple[threading.local, dict]]) -> None:
    """(loop thread) Give the loop thread's view of each `threading.local` what `__init__` stored."""
    for local, values in seen:
        vars(local).update(values)


async def _await(awaitable: Any) -> Any:
    return await awaitable
