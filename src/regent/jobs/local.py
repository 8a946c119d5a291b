"""`ProcessJob`: N local `regent worker` processes that simulate N hosts (tests and local runs use it).

    job = ProcessJob(hosts=2)
    hosts = job.host_mesh()                  # HostMesh {"hosts": 2}, the same on every call
    other = job.state().hosts                # a fresh HostMesh on the same workers (Monarch's state())
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    ...
    job.kill()

Workers share the controller's job secret through a 0600 file, listen on loopback TCP, and exit when the
controller process exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from regent import settings
from regent.actor import HostMesh, attach_to_workers
from regent.actor._host_mesh import release_workers
from regent.actor._process import get_runtime
from regent.jobs.base import JobState


class ProcessJob:
    """Local worker processes standing in for hosts. `ProcessJob(hosts=2)` or `ProcessJob({"trainers": 2})`."""

    def __init__(self, meshes: dict[str, int] | None = None, *, hosts: int | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 60.0) -> None:
        if meshes is None:
            meshes = {"hosts": 1 if hosts is None else int(hosts)}
        elif hosts is not None:
            raise ValueError("give either meshes or hosts=, not both")
        for name, n in meshes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"mesh {name!r} needs a positive number of hosts, got {n!r}")
        self.meshes = dict(meshes)
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self._workers: dict[str, list[subprocess.Popen]] = {}
        self._addresses: dict[str, list[str]] = {}
        self._state: JobState | None = None
        self._secret_file: str | None = None

    def apply(self) -> None:
        """Start the workers (idempotent)."""
        if self._state is not None:
            return
        rt = get_runtime()
        fd, self._secret_file = tempfile.mkstemp(prefix="regent-secret-")
        with os.fdopen(fd, "w") as f:
            f.write(rt.secret.hex())
        os.chmod(self._secret_file, 0o600)
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop(settings.REGENT_JOB_SECRET.name, None)
        meshes: dict[str, HostMesh] = {}
        try:
            for name, n in self.meshes.items():
                procs = []
                for _ in range(n):
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "regent.cli", "worker", "--address", "tcp://127.0.0.1:0",
                         "--secret-file", self._secret_file, "--exit-with-parent"],
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
                    ))
                self._workers[name] = procs
                self._addresses[name] = [self._read_address(p) for p in procs]
                meshes[name] = attach_to_workers(self._addresses[name], name=name)
        except BaseException:
            self.kill()
            raise
        finally:
            # every worker read it before it printed its address: the secret need not stay on disk (and is not
            # left behind in /tmp if this process is killed later)
            if self._secret_file and os.path.exists(self._secret_file):
                os.unlink(self._secret_file)
        self._state = JobState(meshes)

    def _read_address(self, proc: subprocess.Popen) -> str:
        deadline = time.monotonic() + self.start_timeout
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("regent worker serving "):
            proc.kill()
            raise RuntimeError(f"regent worker did not start (exit code {proc.poll()}, said {line!r})")
        if time.monotonic() > deadline:
            raise TimeoutError("regent worker took too long to start")
        threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
        return line.split()[-1]

    def state(self, cached_path: str | None = None) -> JobState:
        """Start if needed and return the host meshes by name. As in Monarch, each call attaches anew:
        the HostMeshes it returns are independent of earlier ones, so `stop()` on one stops only the procs
        spawned from it (the workers, and procs of other meshes, stay up)."""
        self.apply()
        return JobState({name: attach_to_workers(self._addresses[name], name=name) for name in self.meshes})

    def describe(self) -> str:
        """A short human name for logs and events, as the scheduler-backed jobs have."""
        return f"local job ({', '.join(f'{n}: {k} host(s)' for n, k in self.meshes.items())})"

    def host_mesh(self, name: str | None = None) -> HostMesh:
        """The HostMesh of mesh `name` (default: the only/first one); the same object on every call."""
        self.apply()
        assert self._state is not None
        return self._state[name or next(iter(self.meshes))]

    def worker_pids(self, name: str | None = None) -> list[int]:
        return [p.pid for p in self._workers.get(name or next(iter(self.meshes)), [])]

    def kill(self) -> None:
        """Stop the workers (and with them every proc they started). A deliberate end: the procs this client
        spawned on them are not reported to `unhandled_fault_hook` as failures (which would end the client)."""
        procs = [p for ps in self._workers.values() for p in ps]
        if any(p.poll() is None for p in procs):
            release_workers([a for name in self._workers for a in self._addresses.get(name, [])])
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._workers.clear()
        self._state = None

    # -- the `regent.jobs.base.Job` contract, so `--job local` reallocation works like the other backends --
    def start(self) -> None:
        """The Job contract's name for `apply()`."""
        self.apply()

    def worker_addresses(self, timeout: float = 60.0) -> list[str]:
        """`tcp://host:port` of every worker, in order (they are known once `start()` returns)."""
        self.apply()
        return [a for name in self.meshes for a in self._addresses[name]]

    def is_alive(self) -> bool:
        """True while every worker process is running."""
        procs = [p for ps in self._workers.values() for p in ps]
        return bool(procs) and all(p.poll() is None for p in procs)

    def renew(self) -> ProcessJob:
        """Kill these workers and return a fresh, started job of the same shape."""
        self.kill()
        fresh = ProcessJob(dict(self.meshes), env=self.env, start_timeout=self.start_timeout)
        fresh.apply()
        return fresh

    def __enter__(self) -> ProcessJob:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def _drain(stream: Any) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(line.decode(errors="replace"))
