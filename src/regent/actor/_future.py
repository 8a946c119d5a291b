"""`Future`: a result that can be waited for from any thread (`get`) or awaited on any asyncio loop.

Results are cached: `get()` and `await` may be repeated, and a `get(timeout)` that times out does not
consume the future. It is resolved from the runtime's event loop thread.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

R = TypeVar("R")
_TOKEN = object()
_loop_thread_checker: list[Callable[[], bool]] = []  # set by the runtime: "am I on the runtime loop thread?"


class Future(Generic[R]):
    """The result of an actor call or runtime operation. Cannot be constructed directly."""

    __slots__ = ("_lock", "_event", "_state", "_value", "_callbacks", "_no_block_thread")

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _TOKEN:
            raise TypeError("Future cannot be constructed directly; it is returned by endpoint adverbs")
        self._lock = threading.Lock()
        self._event: threading.Event | None = None  # created only if someone blocks in get()
        self._state = 0  # 0 pending, 1 result, 2 exception
        self._value: Any = None
        self._callbacks: list[Callable[[Future], None]] = []
        self._no_block_thread: int | None = None  # a thread that would deadlock blocking on this (see _mesh)

    @classmethod
    def _new(cls) -> Future:
        return cls(_token=_TOKEN)

    @classmethod
    def _resolved(cls, value: Any) -> Future:
        fut = cls._new()
        fut._set_result(value)
        return fut

    @classmethod
    def _failed(cls, exc: BaseException) -> Future:
        fut = cls._new()
        fut._set_exception(exc)
        return fut

    # ---- resolution (any thread) ----
    def _set_result(self, value: Any) -> bool:
        return self._resolve(1, value)

    def _set_exception(self, exc: BaseException) -> bool:
        return self._resolve(2, exc)

    def _resolve(self, state: int, value: Any) -> bool:
        with self._lock:
            if self._state:
                return False
            self._state = state
            self._value = value
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for cb in callbacks:
            cb(self)
        return True

    def done(self) -> bool:
        return self._state != 0

    def add_done_callback(self, cb: Callable[[Future], None]) -> None:
        with self._lock:
            if not self._state:
                self._callbacks.append(cb)
                return
        cb(self)

    def _outcome(self) -> Any:
        if self._state == 1:
            return self._value
        raise self._value

    # ---- waiting ----
    def get(self, timeout: float | None = None) -> R:
        if not self._state:
            if self._no_block_thread == threading.get_ident():
                raise RuntimeError(
                    "Future.get() here would never return: this sync actor runs on its process's shared actor "
                    "thread (shared_asyncio_runtime), and so does an actor it waits for, which cannot run until "
                    "this endpoint returns; make one of them async, or turn shared_asyncio_runtime off"
                )
            if _loop_thread_checker and _loop_thread_checker[0]():
                raise RuntimeError(
                    "Future.get() was called on the actor runtime's event loop, where it would deadlock; "
                    "use `await fut` inside async endpoints"
                )
            try:
                asyncio.get_running_loop()
                warnings.warn(
                    "Future.get() blocks a running asyncio event loop; prefer `await fut`",
                    UserWarning,
                    stacklevel=2,
                )
            except RuntimeError:
                pass
            with self._lock:
                if self._event is None:
                    self._event = threading.Event()
                    if self._state:
                        self._event.set()
                event = self._event
            if not event.wait(timeout):
                raise TimeoutError(f"Future not ready after {timeout} s")
        return self._outcome()

    def result(self, timeout: float | None = None) -> R:
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - returning it is the point
            return exc
        return None

    def __await__(self) -> Generator[Any, None, R]:
        if not self._state:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ValueError("__await__ with no active event loop; use .get() outside async code") from None
            waiter = loop.create_future()

            def wake(_: Future) -> None:
                def settle() -> None:
                    if not waiter.done():
                        waiter.set_result(None)

                if _loop_thread_checker and _loop_thread_checker[0]() and _running_loop_is(loop):
                    settle()
                else:
                    loop.call_soon_threadsafe(settle)

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self._outcome()

    async def as_asyncio(self) -> R:
        return await self

    def __repr__(self) -> str:
        state = {0: "pending", 1: "done", 2: "failed"}[self._state]
        return f"<Future {state}>"


def _running_loop_is(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
