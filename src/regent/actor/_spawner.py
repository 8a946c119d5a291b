"""Starting procs on this machine: cold (a new Python process) or claimed from warm spares.

A `LocalSpawner` lives in every process that starts procs (the controller, an actor that calls
`this_host().spawn_procs`, a `regent worker`). It is the procs' parent: it reaps them and reports their exit
status ("Killed(sig=9)", "Exited(3)"), pumps their stdout/stderr (prefixed with the proc's rank), and hands
each new proc its identity, env and bootstrap ("configure") before anyone else may talk to it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from regent import settings
from regent.actor._child_process import ChildProcess, start_child
from regent.actor._config import config
from regent.actor._errors import ActorError
from regent.actor._messages import Configure, encode
from regent.actor._pickle import loads
from regent.actor._process import ActorRuntime
from regent.actor._runtime import ERROR, OK, OneShot, new_id, new_sock_dir, remove_sock_dir

logger = logging.getLogger("regent.actor")


PROC_MAIN = "regent.actor._proc_main"
# After a warm spare fails to start, the next try comes this long later, doubling while starts keep failing.
SPARE_RETRY_MIN_S = 2.0
SPARE_RETRY_MAX_S = 300.0
# A proc writes this line (plus a token) to its stdout and stderr when told to change its logging options;
# the owner's log router swallows it and so knows every line before it was printed under the old options.
LOG_SYNC_MARK = "\x1eregent-log-sync "
# The end of a mark's token that says whether the proc's lines after it go to its owner (a worker forwards them)
# or stay where the proc runs (a worker prints them on its own stdout/stderr).
LOG_TO_OWNER, LOG_TO_HOST = "+owner", "+host"


def log_destination_after(text: str) -> tuple[str, bool | None]:
    """(the text before a sync mark, whether lines after it go to the owner: True, False, or None when `text`
    holds no mark with a destination)."""
    if LOG_SYNC_MARK not in text:
        return text, None
    before, _, token = text.partition(LOG_SYNC_MARK)
    token = token.strip()
    return before, True if token.endswith(LOG_TO_OWNER) else False if token.endswith(LOG_TO_HOST) else None


@dataclass(frozen=True)
class BootstrapCommand:
    """The argv (and extra environment) that starts a proc process: `program` is executed with `args`;
    `arg0`, when given, is what the process sees as `argv[0]`. The command must end up running
    `python -m regent.actor._proc_main` in an interpreter that can import regent (a wrapper script may
    set things up first and then `exec "$@"`). The runtime passes everything else through the environment."""

    program: str
    arg0: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def with_env(self, env: dict[str, str]) -> BootstrapCommand:
        """A copy whose environment also holds `env` (it wins over this command's own entries)."""
        return replace(self, env={**self.env, **env})

    def to_spec(self) -> dict:
        """The plain-data form that travels to a remote worker (inside a routing envelope)."""
        return {"program": str(self.program), "arg0": self.arg0, "args": [str(a) for a in self.args],
                "env": {str(k): str(v) for k, v in self.env.items()}}


def default_bootstrap_cmd(python: str | None = None) -> BootstrapCommand:
    """Regent's own proc command: `<python> -m regent.actor._proc_main` (this interpreter by default)."""
    return BootstrapCommand(program=python or sys.executable, arg0=None, args=["-m", PROC_MAIN], env={})


class Child:
    """A process this runtime started (a proc or a warm spare)."""

    def __init__(self, pid: str, process: ChildProcess, label: str, spare: bool) -> None:
        self.pid = pid
        self.process = process
        self.label = label
        self.spare = spare
        self.conn: Any = None
        self.on_exit: Callable[[str, str | None], None] | None = None
        self.on_output: Callable[[str, str, str], None] | None = None
        self.exit_reason: str | None = None
        self.graceful = False
        self.sock_dir: str | None = None  # made here, removed by `_watch` once the process is gone


class LocalSpawner:
    """Starts procs on this machine as children of this process, and keeps warm spares."""

    def __init__(self, rt: ActorRuntime) -> None:
        self.rt = rt
        self.children: dict[str, Child] = {}
        self.spares: collections.deque[Child] = collections.deque()
        self.starting_spares = 0
        self.warm_target = 0
        self.preload: list[str] = []
        self.refill_delay_s = 0.0
        self.spare_retry_s = 0.0  # the wait before the next try after a spare failed to start (0: none failed)

    def is_child(self, pid: str) -> bool:
        return pid in self.children

    def forget_spare(self, pid: str) -> None:
        for child in list(self.spares):
            if child.pid == pid:
                self.spares.remove(child)
                self._replenish()

    async def _start(self, pid: str, env: dict[str, str], label: str, spare: bool, preload: list[str],
                     on_exit: Callable | None, on_output: Callable | None,
                     sys_path: list[str] | None = None, command: dict | None = None) -> Child:
        rt = self.rt
        sock_dir = new_sock_dir()
        boot = {
            "id": pid,
            "sock_dir": sock_dir,
            "parent": rt.info,
            "sys_path": list(dict.fromkeys(list(sys_path or []) + [p for p in sys.path if p])),
            "cwd": os.getcwd(),
            "preload": list(preload),
            "tcp_host": rt.tcp_host,
            "advertise_host": rt.advertise_host,
        }
        full_env = dict(os.environ)
        full_env.update(config.child_env())
        full_env.update(env)
        full_env[settings.REGENT_BOOT.name] = json.dumps(boot)
        full_env[settings.REGENT_JOB_SECRET.name] = rt.secret.hex()
        full_env.pop(settings.REGENT_JOB_SECRET_FILE.name, None)
        full_env["PYTHONUNBUFFERED"] = "1"
        cmd = command or default_bootstrap_cmd().to_spec()
        full_env.update(cmd.get("env") or {})
        waiter = rt.loop.create_future()
        rt.hello_waiters[pid] = waiter
        rt.held.add(pid)
        try:
            process = await start_child(cmd["program"], [cmd.get("arg0") or cmd["program"], *cmd.get("args", [])],
                                        full_env)
        except OSError as exc:
            rt.hello_waiters.pop(pid, None)
            rt.held.discard(pid)
            remove_sock_dir(sock_dir)
            raise RuntimeError(f"cannot start proc {pid} with bootstrap command {cmd['program']!r} "
                               f"{cmd.get('args', [])}: {exc}") from exc
        child = Child(pid, process, label, spare)
        child.sock_dir = sock_dir
        child.on_exit = on_exit
        child.on_output = on_output
        self.children[pid] = child
        rt.loop.create_task(self._pump(child, process.stdout, "stdout"))
        rt.loop.create_task(self._pump(child, process.stderr, "stderr"))
        exit_task = rt.loop.create_task(self._watch(child))
        done, _ = await asyncio.wait([waiter, exit_task], timeout=config.spawn_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            rt.hello_waiters.pop(pid, None)
            if exit_task in done:
                raise RuntimeError(f"proc {pid} exited during startup: {child.exit_reason}")
            self.kill(pid)
            raise TimeoutError(f"proc {pid} did not start within {config.spawn_timeout} s (REGENT_SPAWN_TIMEOUT)")
        child.conn = waiter.result()
        return child

    async def _pump(self, child: Child, stream: asyncio.StreamReader, name: str) -> None:
        while True:
            try:
                line = await stream.readline()
            except (ValueError, asyncio.LimitOverrunError):
                line = await stream.read(65536)
            if not line:
                return
            text = line.decode(errors="replace")
            if child.on_output is not None:
                child.on_output(child.pid, name, f"[{child.label}] {text}" if config.prefix_output else text)

    async def _watch(self, child: Child) -> str:
        rc = await child.process.wait()
        reason = f"Killed(sig={-rc})" if rc < 0 else f"Exited({rc})"
        child.exit_reason = reason
        if child.sock_dir is not None:
            remove_sock_dir(child.sock_dir)
        self.children.pop(child.pid, None)
        if child in self.spares:
            self.spares.remove(child)
            self._replenish()
        graceful = child.graceful or (rc == 0 and child.pid in self.rt.supervision.graceful)
        if child.on_exit is not None:
            child.on_exit(child.pid, None if graceful else reason)
        return reason

    async def configure(self, child: Child, new_pid: str, cfg: dict, bootstrap: bytes) -> None:
        """Give a started (or spare) process its identity, env and bootstrap; wait until it is ready."""
        rt = self.rt
        old_pid = child.pid
        if child.pid != new_pid:
            old = child.pid
            self.children.pop(old, None)
            rt.hello_waiters.pop(old, None)
            rt.held.discard(old)
            child.pid = new_pid
            self.children[new_pid] = child
            rt.held.add(new_pid)
            child.conn.peer = new_pid
        cfg = dict(cfg, id=new_pid)
        fut = rt.loop.create_future()
        port = rt.new_port(OneShot(fut))
        child.conn.send(encode(Configure(cfg, (rt.proc_id, port, 0))), bootstrap)
        try:
            status, body, buffers = await asyncio.wait_for(fut, config.spawn_timeout)
        finally:
            rt.drop_port(port)
        if status != OK:
            value = loads(body, buffers)
            if status == ERROR:
                exc, message, tb = value
                raise ActorError(exc, message, tb)
            raise RuntimeError(str(value))
        info = dict(rt.directory.get(old_pid) or rt.directory.get(new_pid) or {})
        info["id"] = new_pid
        rt.learn(new_pid, info)

    async def spawn(self, specs: list[dict], bootstrap: bytes, on_exit: Callable, on_output: Callable,
                    release: bool) -> list[dict]:
        """Start (or claim) one process per spec, configure them, and return their address infos, each with
        `from_spare`: whether that process was a claimed warm spare (so a restart can say it was warm)."""

        async def one(spec: dict) -> dict:
            env = dict(spec.get("env") or {})
            if spec.get("gpu_index") is not None:
                env.update(visibility_env(spec["gpu_index"]))
            command = spec.get("command")
            claimed = bool(self.spares) and command is None
            if claimed:  # spares run Regent's default command: only it may claim them
                child = self.spares.popleft()
                child.label = spec["label"]
                if self.refill_delay_s > 0:
                    # the next spare's imports (seconds of CPU) would compete with the claimed proc's start
                    self.rt.loop.call_later(self.refill_delay_s, self._replenish)
                else:
                    self._replenish()
            else:
                child = await self._start(spec["pid"], env, spec["label"], False, [], on_exit, on_output,
                                          spec.get("sys_path"), command)
            child.on_exit = on_exit
            child.on_output = on_output
            child.spare = False
            cfg = dict(spec["cfg"], env=env)
            try:
                await self.configure(child, spec["pid"], cfg, bootstrap)
            except BaseException:
                self.kill(child.pid)
                raise
            info = self.rt.directory.get(child.pid)
            if release:
                self.rt.release(child.pid, child.conn)
            else:
                self.rt.held.discard(child.pid)
            # a copy: the directory's entry stays an address; whether a spare was claimed goes to the owner
            return dict(info or {}, from_spare=claimed)

        return list(await asyncio.gather(*(one(s) for s in specs)))

    def keep_warm(self, n: int, preload: list[str], refill_delay_s: float = 0.0) -> None:
        if n < 0:
            raise ValueError(f"keep_warm needs n >= 0, got {n}")
        if refill_delay_s < 0:
            raise ValueError(f"keep_warm needs refill_delay_s >= 0, got {refill_delay_s}")
        self.refill_delay_s = float(refill_delay_s)
        if list(preload) != self.preload:
            while self.spares:  # spares that preloaded other modules are replaced
                self.kill(self.spares.popleft().pid)
        self.warm_target = n
        self.preload = list(preload)
        while len(self.spares) > n:
            self.kill(self.spares.pop().pid)
        self._replenish()

    def _replenish(self) -> None:
        missing = self.warm_target - len(self.spares) - self.starting_spares
        for _ in range(max(0, missing)):
            self.starting_spares += 1
            self.rt.loop.create_task(self._start_spare())

    async def _start_spare(self) -> None:
        pid = new_id("spare")
        try:
            child = await self._start(pid, {}, f"spare {pid}", True, self.preload, None, _write_output)
        except Exception as exc:  # noqa: BLE001 - reported; a spare is an optimisation, spawning goes on without it
            # Try again later, backing off while starts keep failing (a broken preload fails every time). Before
            # this, one spare that died while starting left the pool one short for the rest of the run: seen in
            # a soak, where every later restart of that replica was a cold start (5-12 s instead of 0.5 s).
            retry = min(SPARE_RETRY_MAX_S, max(SPARE_RETRY_MIN_S, 2 * self.spare_retry_s))
            self.spare_retry_s = retry
            logger.warning("could not start a warm spare: %s; trying again in %.0f s", exc, retry)
            self.rt.loop.call_later(retry, self._replenish)
            return
        finally:
            self.starting_spares -= 1
        self.spare_retry_s = 0.0
        self.rt.held.discard(pid)
        if len(self.spares) >= self.warm_target:  # keep_warm lowered the target while this one started
            self.kill(child.pid)
            return
        self.spares.append(child)

    def kill(self, pid: str) -> None:
        child = self.children.get(pid)
        if child is not None and child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGKILL)

    def kill_all(self) -> None:
        """SIGKILL every child, and remove their socket directories now: this process may leave (`os._exit`)
        before `_watch` sees them go."""
        self.warm_target = 0
        for pid, child in list(self.children.items()):
            self.kill(pid)
            if child.sock_dir is not None:
                remove_sock_dir(child.sock_dir)

    def os_pid(self, pid: str) -> int | None:
        child = self.children.get(pid)
        return child.process.pid if child else None


# ------------------------------------------------------------------------------------ CPU pinning
_BIND_KEYS = ("cpus", "physcpubind", "cpunodebind", "membind")


def parse_cpu_list(value: Any, what: str) -> list[int]:
    """`"0-3,6"`, `5`, or `[0, 1]` -> sorted ids; ValueError naming `what` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"proc_bind {what}: expected a CPU list like '0-3,6', got {value!r}")
    if isinstance(value, int):
        items: list[Any] = [value]
    elif isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        raise ValueError(f"proc_bind {what}: expected a CPU list like '0-3,6', got {value!r}")
    ids: set[int] = set()
    for item in items:
        try:
            if isinstance(item, str) and "-" in item:
                lo, hi = (int(x) for x in item.split("-", 1))
                if lo > hi:
                    raise ValueError
                ids.update(range(lo, hi + 1))
            else:
                ids.add(int(item))
        except ValueError:
            raise ValueError(f"proc_bind {what}: bad entry {item!r} in {value!r} (expected e.g. '0-3,6')") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"proc_bind {what}: needs at least one id >= 0, got {value!r}")
    return sorted(ids)


def check_proc_bind(entry: Any) -> dict[str, list[int]]:
    """Validate one `proc_bind` entry (Monarch's keys); returns it normalized to id lists. `membind` (NUMA
    memory policy) is refused: Regent pins CPUs only, and a binding that is accepted must be applied."""
    if not isinstance(entry, dict):
        raise ValueError(f"proc_bind entries must be dicts like {{'cpus': '0-3'}}, got {entry!r}")
    unknown = set(entry) - set(_BIND_KEYS)
    if unknown:
        raise ValueError(f"proc_bind: unknown keys {sorted(unknown)}; allowed: {list(_BIND_KEYS)}")
    if "membind" in entry:
        raise ValueError("proc_bind: 'membind' (NUMA memory binding) is not supported; pin CPUs with 'cpus', "
                         "'physcpubind' or 'cpunodebind', or set the memory policy in spawn_procs(bootstrap=...)")
    return {key: parse_cpu_list(value, key) for key, value in entry.items()}


def node_cpus(node: int) -> set[int]:
    path = f"/sys/devices/system/node/node{node}/cpulist"
    try:
        with open(path) as f:
            return set(parse_cpu_list(f.read().strip(), f"cpunodebind node {node}"))
    except OSError:
        raise ValueError(f"proc_bind cpunodebind: NUMA node {node} does not exist on this host ({path})") from None


def apply_proc_bind(bind: dict[str, list[int]]) -> None:
    """In a new proc: restrict every thread of this process (and so all it starts later) to the CPUs asked
    for: `cpus`/`physcpubind` name CPUs, `cpunodebind` NUMA nodes; given together, both must hold."""
    cpus: set[int] | None = None
    for key in ("cpus", "physcpubind"):
        if key in bind:
            cpus = (cpus or set()) | set(bind[key])
    if "cpunodebind" in bind:
        on_nodes = set().union(*(node_cpus(n) for n in bind["cpunodebind"]))
        cpus = on_nodes if cpus is None else cpus & on_nodes
    if cpus is None:
        return
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"proc_bind asks for CPUs {sorted(cpus)}, but this process may only use "
                         f"{sorted(allowed)} (check the host's CPU count and any cgroup/taskset limit)")
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def visibility_env(index: int) -> dict[str, str]:
    """Accelerator pinning for the index-th proc of a host, from regent.platform."""
    from regent.platform import child_visibility_env

    try:
        return dict(child_visibility_env(index))
    except Exception as exc:  # noqa: BLE001 - pinning is best effort; say why it was skipped
        logger.warning("accelerator pinning for proc %d skipped: %s", index, exc)
        return {}


def _write_output(pid: str, stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    try:
        out.write(text)
        out.flush()
    except Exception:  # noqa: BLE001 - our own stdout/stderr is closed or broken: nowhere to report; the child keeps running
        pass


def spawner_of(rt: ActorRuntime) -> LocalSpawner:
    """This process's spawner (`ActorRuntime.spawner`), made on first use."""
    if rt.spawner is None:
        rt.spawner = LocalSpawner(rt)
    return rt.spawner  # type: ignore[return-value] - only a LocalSpawner is ever set
