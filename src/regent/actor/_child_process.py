"""Starting a proc's process without running any Python in the child before it execs.

uvloop's `subprocess_exec` starts children with libuv's `fork()` and then runs the interpreter's after-fork
hooks in the child (`os.register_at_fork(after_in_child=...)`: torch's, gRPC's, logging's, any library's)
before `exec`. In a process with other threads that is the classic fork deadlock: a hook waits for a lock
that a thread of the parent held at the moment of the fork, the child never execs, and uv_spawn's parent
side blocks reading the exec-status pipe, on the runtime's loop thread, freezing the whole runtime. It was
seen once: a test process with torch and gRPC loaded hung 12+ minutes in a proc spawn. Forking a process of
several GiB also copies its page tables, on the loop thread.

CPython's `subprocess.Popen` (3.10+) uses `vfork` when no `preexec_fn` is given, runs no Python code in the
child; the pipes are then read by the loop, and a thread per child reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import subprocess
import threading
from collections.abc import Mapping, Sequence

logger = logging.getLogger("regent.actor")

# the StreamReader's line limit: a longer line is read in pieces (the pumps handle LimitOverrunError)
_LINE_LIMIT = 2**16


class _PipeReader(asyncio.StreamReaderProtocol):
    """Lets the pipe's transport close at EOF. StreamReaderProtocol asks to keep a transport open after EOF (a
    socket may still write); uvloop honours that, so each exited child's two pipe fds stayed open until the
    garbage collector found them (22 fds after 80 procs had come and gone)."""

    def eof_received(self) -> bool:
        super().eof_received()
        return False


class ChildProcess:
    """A started child: its pid, stdout/stderr as `asyncio.StreamReader`s, `wait()`, `send_signal()`."""

    def __init__(self, popen: subprocess.Popen, loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self._loop = loop
        self.pid = popen.pid
        self.stdout = asyncio.StreamReader(limit=_LINE_LIMIT, loop=loop)
        self.stderr = asyncio.StreamReader(limit=_LINE_LIMIT, loop=loop)
        self._exited: asyncio.Future[int] = loop.create_future()

    @property
    def returncode(self) -> int | None:
        """None until the child was reaped; then its exit code (negative: the signal that ended it)."""
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """Signal the child if it has not been reaped yet (its pid cannot have been reused before that)."""
        if self._popen.returncode is not None:  # set by `wait()` in the reaper thread, before `_exited`
            return
        os.kill(self.pid, sig)

    # ---------------------------------------------------------------- set-up, on the loop thread
    async def _attach_pipes(self) -> None:
        for reader, pipe in ((self.stdout, self._popen.stdout), (self.stderr, self._popen.stderr)):
            await self._loop.connect_read_pipe(functools.partial(_PipeReader, reader, loop=self._loop), pipe)

    def _watch_exit(self) -> None:
        """Reap the child from a thread blocked in `wait()`, one per child, as asyncio's ThreadedChildWatcher does.

        Not the loop's executor: the thread is held for the child's whole life, and a host's 128 procs would
        starve the executor that starts them. Not a pidfd polled by the loop either: with uvloop, a pidfd closed
        once the child was reaped made a concurrent spawn's child fail with EBADF (a spawn/stop loop of 4-proc
        meshes lost about one mesh in ten that way; with these threads, none in hundreds).
        """
        threading.Thread(target=self._reap_blocking, name=f"regent-reap-{self.pid}", daemon=True).start()

    def _reap_blocking(self) -> None:
        rc = self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody is waiting for this exit
            self._loop.call_soon_threadsafe(self._set_exit, rc)

    def _set_exit(self, rc: int) -> None:
        if not self._exited.done():
            self._exited.set_result(rc)


async def start_child(program: str, argv: Sequence[str], env: Mapping[str, str]) -> ChildProcess:
    """Start `program` (seen as `argv[0]`) with stdin from /dev/null and stdout/stderr piped to the loop."""
    loop = asyncio.get_running_loop()
    # On the loop thread, not a helper: vfork holds it only until the child execs (no Python runs in between),
    # and a child's "parent" for PR_SET_PDEATHSIG is the thread that started it, so that thread must live as
    # long as the runtime (a pool thread that retires would signal a child that asked for it).
    popen = subprocess.Popen(list(argv), executable=program, env=dict(env), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True)
    child = ChildProcess(popen, loop)
    child._watch_exit()
    try:
        await child._attach_pipes()
    except BaseException:
        popen.kill()  # reaped by the watcher
        raise
    return child
