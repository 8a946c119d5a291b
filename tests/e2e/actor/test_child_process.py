"""Procs' processes: started without running Python in the child before exec (no fork-with-threads
deadlock), reaped without leaking fds, and able to print their stacks on SIGUSR1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from regent.actor._child_process import start_child
from regent.eventloop import new_event_loop

SRC = str(Path(__file__).resolve().parents[3] / "src")


def test_spawning_procs_runs_no_after_fork_hook_in_the_child(tmp_path: Path) -> None:
    """uvloop's subprocess_exec forks and runs `os.register_at_fork(after_in_child=...)` hooks in the child
    before exec; with threads in the parent such a hook can wait forever for a lock (the hang once seen in a
    proc spawn). A hook that records every run must never run while a mesh of procs is started and used."""
    marker = tmp_path / "hook-ran"
    script = textwrap.dedent(f"""
        import os, threading, time
        def hook():
            fd = os.open({str(marker)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.write(fd, b"x")
            os.close(fd)
        os.register_at_fork(after_in_child=hook)
        busy = threading.Thread(target=lambda: [time.sleep(0.001) for _ in range(10**6)], daemon=True)
        busy.start()  # the parent has other threads, as a trainer with torch and gRPC does
        from regent.actor import Actor, endpoint, this_host
        class Pid(Actor):
            @endpoint
            def pid(self) -> int:
                return os.getpid()
        procs = this_host().spawn_procs(per_host={{"procs": 3}})
        pids = list(procs.spawn("p", Pid).pid.call().get().values())
        procs.stop().get()
        assert len(set(pids)) == 3 and os.getpid() not in pids, pids
        print("ok", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert not marker.exists(), "an after-fork hook ran in a proc's child before exec"


async def _run_child(argv: list[str]) -> tuple[int, str, str]:
    child = await start_child(argv[0], argv, dict(os.environ))
    out, err = await asyncio.gather(child.stdout.read(), child.stderr.read())
    rc = await child.wait()
    assert child.returncode == rc
    return rc, out.decode(), err.decode()


def test_a_started_child_reports_output_and_exit_code() -> None:
    loop = new_event_loop()
    try:
        rc, out, err = loop.run_until_complete(_run_child(
            [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"]))
    finally:
        loop.close()
    assert (rc, out, err) == (3, "out\n", "err\n")


def test_a_killed_child_reports_the_signal_and_later_signals_are_ignored() -> None:

    async def main() -> int:
        child = await start_child(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"],
                                  dict(os.environ))
        assert child.returncode is None
        child.send_signal(signal.SIGKILL)
        rc = await asyncio.wait_for(child.wait(), 30)
        child.send_signal(signal.SIGKILL)  # reaped: its pid may belong to someone else now, so nothing is sent
        return rc

    loop = new_event_loop()
    try:
        assert loop.run_until_complete(main()) == -signal.SIGKILL
    finally:
        loop.close()


def test_a_program_that_cannot_start_raises_in_the_caller() -> None:
    loop = new_event_loop()
    try:
        with pytest.raises(FileNotFoundError):
            loop.run_until_complete(start_child("/nonexistent/regent-python", ["x"], dict(os.environ)))
    finally:
        loop.close()


def test_exited_children_leave_no_open_pipes() -> None:
    """Each child's stdout and stderr pipes are closed once read to the end, not when the collector runs."""
    import gc

    async def main() -> tuple[int, int]:
        gc.collect()
        gc.disable()  # the leak this guards against was only ever cleaned up by the collector
        try:
            await _run_child([sys.executable, "-c", "pass"])  # one-time fds (a cached /dev/null) are opened first
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(10):
                rc, _, _ = await _run_child([sys.executable, "-c", "print('x')"])
                assert rc == 0
            await asyncio.sleep(0.1)  # transports close on the loop's next turns
            return before, len(os.listdir("/proc/self/fd"))
        finally:
            gc.enable()

    loop = new_event_loop()
    try:
        before, after = loop.run_until_complete(main())
    finally:
        loop.close()
    assert after <= before, f"{after - before} fds left open by 10 children that exited"


def test_sigusr1_makes_a_proc_print_its_stacks_and_keep_serving() -> None:
    """How a stuck trainer is looked into where py-spy is not installed: its stacks reach the owner's stderr."""
    script = textwrap.dedent("""
        import os, signal, time
        from regent.actor import Actor, endpoint, this_host
        class Sleeper(Actor):
            @endpoint
            def pid(self) -> int:
                return os.getpid()
            @endpoint
            def nap_in_a_named_function(self) -> None:
                time.sleep(3)
        procs = this_host().spawn_procs(per_host={"procs": 1})
        mesh = procs.spawn("s", Sleeper)
        pid = mesh.pid.call_one().get()
        napping = mesh.nap_in_a_named_function.call_one()
        time.sleep(1.0)
        os.kill(pid, signal.SIGUSR1)
        napping.get(timeout=30)
        assert mesh.pid.call_one().get() == pid  # the same process still serves
        procs.stop().get()
        print("ok", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert "in nap_in_a_named_function" in done.stderr, done.stderr[-3000:]
