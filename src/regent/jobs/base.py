"""The job contract: how Regent gets hosts, whatever the scheduler.

A *job* is one allocation of N hosts, each running one `regent worker` process that serves that host to the
controller. Every backend (local processes, SLURM, Kubernetes, SkyPilot) implements the same small surface,
so the orchestration layer can ask for hosts, wait for them, and replace a bad allocation without knowing
which scheduler is underneath:

    job = SlurmJob(hosts=4, gpus_per_host=8, partition="gpu")
    job.start()                              # submit; returns without waiting for the allocation
    hosts = job.host_mesh(timeout=600)       # waits for every worker, then attaches: extent {"hosts": 4}
    ...
    job = job.renew()                        # after K failed in-place restarts: kill, fresh allocation
    job.kill()                               # idempotent

Lifecycle and failure rules (the contract every backend follows):
- `start()` requests the allocation and launches one worker per host. It does not wait for the scheduler
  to grant the allocation where the scheduler allows that. Calling it twice is a no-op.
- `worker_addresses(timeout)` blocks until every worker has published its `tcp://ip:port` address and is
  listening. It raises `JobFailedError` as soon as the scheduler says the allocation is gone (cancelled,
  failed, pod crashed), and `JobTimeoutError` at the deadline, naming what it was waiting for (for example
  "SLURM job 42 still PENDING: Resources") and where the logs are.
- `kill()` releases everything the job created; calling it again, or on a job that never started, is fine.
- `is_alive()` is False once the scheduler says the allocation ended, or after `kill()`.
- `host_mesh(timeout)` = start if needed + `worker_addresses` + `attach_to_workers`, cached per job.
  `apply()` and `state().hosts` are the same in Monarch's vocabulary.
- `renew()` kills this allocation and returns a new, started job of the same shape and options. The new
  job keeps the same secret, so a controller that already trusts it needs no new configuration.
- When the controller process exits, allocations it started and did not kill are released (atexit), unless
  `job.kill_on_exit = False`. A controller killed with SIGKILL cannot do this; the scheduler's time limit
  (or the worker's own orphan handling) must then end the allocation.

The job secret: every connection to a worker proves knowledge of a per-job secret before anything is
unpickled. The controller owns it: by default it is the secret of this process's actor runtime (which
takes `REGENT_JOB_SECRET` when set, else generates one), so `host_mesh()` can attach without any
configuration; `secret=` (hex text or raw bytes) overrides it and must then match the runtime's. It is
resolved on first use, so constructing a job starts nothing. Backends hand it to workers as a file with
mode 0600 or a mounted Kubernetes Secret, never on a command line (nor in the environment sbatch copies).

Workers that cannot know their address in advance (a SLURM task does not know its node before it runs)
start through `launch_worker`, which picks the host's IP and a port, starts `regent worker`, waits until it
listens, and only then publishes the address (a file in a shared directory and a marker line on stdout).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import logging
import os
import re
import secrets as _secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from regent import settings
from regent.ports import free_port

logger = logging.getLogger(__name__)

SECRET_ENV = settings.REGENT_JOB_SECRET.name
# Printed by launch_worker once the worker listens; backends without a shared filesystem parse it from logs.
ADDRESS_MARKER = "REGENT_WORKER_READY"
_MARKER_RE = re.compile(rf"{ADDRESS_MARKER} rank=(\d+) address=(tcp://\S+)")
_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]*[a-z0-9])?$")


class JobError(RuntimeError):
    """A job could not be started, reached, or cleaned up. The message names the cause and the fix."""


class JobFailedError(JobError):
    """The scheduler reports that the allocation ended (failed, cancelled, timed out, pods crashed)."""


class JobTimeoutError(JobError, TimeoutError):
    """The workers did not all report within the timeout. The message says what the job was waiting on."""


def validate_job_name(name: str) -> str:
    """Job names become SLURM job names, Kubernetes object names and SkyPilot cluster names.

    The strictest of those is a Kubernetes Service name (an RFC 1035 label), so that is the rule everywhere
    (checked before launch, not by the scheduler halfway through)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > 40:
        raise ValueError(
            f"job name {name!r} is not usable: use 1-40 lowercase letters, digits and '-', starting with a "
            f"letter and ending with a letter or digit (e.g. 'regent-replica-0')"
        )
    return name


def normalize_secret(secret: str | bytes) -> str:
    """The secret as the hex text workers read from --secret-file / $REGENT_JOB_SECRET.

    Bytes are the raw secret; a string must already be hex (what `secrets.token_hex(32)` prints)."""
    if isinstance(secret, (bytes, bytearray)):
        if not secret:
            raise ValueError("job secret must not be empty")
        return bytes(secret).hex()
    text = str(secret).strip().lower()
    try:
        if text and bytes.fromhex(text):
            return text
    except ValueError:
        pass
    raise ValueError(
        "job secret must be non-empty hex text (the actor runtime's format); generate one with "
        "`python -c 'import secrets; print(secrets.token_hex(32))'`"
    )


def _runtime_secret() -> bytes | None:
    """The controller runtime's secret: the one attach_to_workers will present to the workers."""
    from regent.actor._process import get_runtime

    return get_runtime().secret


def resolve_secret(secret: str | bytes | None) -> str:
    """Pick the job secret (hex): explicit argument, else this controller's actor runtime secret (which
    itself honours $REGENT_JOB_SECRET), else $REGENT_JOB_SECRET, else a fresh one (exported)."""
    if secret is not None:
        return normalize_secret(secret)
    from_runtime = _runtime_secret()
    if from_runtime is not None:
        return normalize_secret(from_runtime)
    from_env = settings.REGENT_JOB_SECRET.get()
    if from_env:
        return normalize_secret(from_env)
    text = _secrets.token_hex(32)
    os.environ[SECRET_ENV] = text
    logger.debug("generated a job secret and exported it as %s", SECRET_ENV)
    return text


def environ_without_secret() -> dict[str, str]:
    """This process's environment minus the job secret, for schedulers that copy the submitter's
    environment into the job (sbatch does by default): workers get the secret from a file instead."""
    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


def write_secret_file(path: str | os.PathLike[str], secret: str) -> Path:
    """Write the secret to `path` readable by the owner only (0600), created with that mode from the start."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return path


def address_file(address_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where worker `rank` publishes its address inside a job's shared directory."""
    return Path(address_dir) / f"worker-{rank}.addr"


def read_published_addresses(address_dir: str | os.PathLike[str], hosts: int) -> dict[int, str]:
    """The addresses published so far, by rank (files are written atomically, so a present file is whole)."""
    found: dict[int, str] = {}
    for rank in range(hosts):
        try:
            text = address_file(address_dir, rank).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            continue
        if text:
            found[rank] = text
    return found


def parse_address_markers(text: str) -> dict[int, str]:
    """Addresses announced by `launch_worker` marker lines in a log (the last announcement of a rank wins)."""
    return {int(rank): address for rank, address in _MARKER_RE.findall(text)}


def format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class JobState:
    """Host meshes of a job by name (`state.hosts` or `state["hosts"]`), as Monarch's JobState. They are kept
    in `_hosts`, the attribute Monarch's keeps them in (helpers written for Monarch read it)."""

    def __init__(self, meshes: dict[str, Any]) -> None:
        self._hosts = dict(meshes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        meshes = self.__dict__.get("_hosts", {})
        try:
            return meshes[name]
        except KeyError:
            raise AttributeError(f"job has no mesh {name!r}; meshes: {sorted(meshes)}") from None

    def __getitem__(self, name: str) -> Any:
        return self._hosts[name]


class Job(ABC):
    """One allocation of `hosts` hosts, each serving one `regent worker`. See the module docstring."""

    #: the registry name, e.g. "slurm"
    backend: str = ""

    def __init__(
        self,
        hosts: int,
        *,
        name: str = "regent",
        gpus_per_host: int | None = None,
        secret: str | bytes | None = None,
        **backend_opts: Any,
    ) -> None:
        if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
            raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
        if gpus_per_host is not None and (not isinstance(gpus_per_host, int) or gpus_per_host < 0):
            raise ValueError(f"gpus_per_host must be a non-negative integer or None, got {gpus_per_host!r}")
        self.hosts = hosts
        self.name = validate_job_name(name)
        self.gpus_per_host = gpus_per_host
        # Validated now (a bad secret fails before launch), resolved on first use: constructing a job
        # must not start the actor runtime.
        self._secret_arg = normalize_secret(secret) if secret is not None else None
        self._secret: str | None = None
        # A short id keeps concurrent and renewed allocations of the same name apart.
        self.job_uid = uuid.uuid4().hex[:8]
        self._backend_opts = dict(backend_opts)
        self._started = False
        self._killed = False
        #: Kill the allocation when the controller exits (normally or by an exception), so an abandoned
        #: run does not hold nodes until the scheduler's time limit. Set False to keep it running.
        self.kill_on_exit = True
        self._host_mesh: Any = None

    # --- the contract -------------------------------------------------------------------------------
    @abstractmethod
    def start(self) -> None:
        """Request the allocation and launch one `regent worker` per host (non-blocking where possible)."""

    @abstractmethod
    def worker_addresses(self, timeout: float) -> list[str]:
        """Block until every worker is listening; return their `tcp://ip:port` addresses in rank order."""

    @abstractmethod
    def kill(self) -> None:
        """Release the allocation and everything the job created. Idempotent."""

    @abstractmethod
    def is_alive(self) -> bool:
        """True while the allocation is pending or running and `kill()` has not been called."""

    def host_mesh(self, timeout: float = 600.0) -> Any:
        """Wait for the workers and attach to them: a HostMesh with extent {"hosts": self.hosts}.

        Starts the job if needed. The mesh is cached: calling again returns the same HostMesh."""
        if self._killed:
            raise JobError(f"{self.describe()} was killed; call renew() for a fresh allocation")
        if self._host_mesh is not None:
            return self._host_mesh
        if not self._started:
            self.start()
        addresses = self.worker_addresses(timeout)
        from regent.actor import attach_to_workers

        self._host_mesh = _call_attach(attach_to_workers, addresses, self.secret, self.name)
        return self._host_mesh

    # --- release by record (the owner died) --------------------------------------------------------
    def reference(self) -> dict[str, Any] | None:
        """What a later process needs to release this allocation when the process holding this object died
        without `kill()` (a SIGKILLed controller or replica: no atexit ran): JSON, recorded in the run's
        `allocation` events. None when nothing outlives its processes (local workers)."""
        return None

    @classmethod
    def release_reference(cls, ref: dict[str, Any]) -> str:
        """Release the allocation `ref` (from `reference()`) names. Idempotent: one already gone is fine.
        Returns what was done, for the log."""
        raise NotImplementedError(f"{cls.__name__} records nothing to release")

    # Monarch's job vocabulary, so code written against `monarch.job` / `regent.jobs.local` reads the same.
    def apply(self) -> None:
        """Monarch's name for start()."""
        self.start()

    def state(self, cached_path: str | None = None) -> JobState:
        """Monarch-style: start if needed, wait, and return the meshes by name (`state.hosts`)."""
        return JobState({"hosts": self.host_mesh()})

    def renew(self) -> Job:
        """Kill this allocation and return a fresh, started one of the same shape (same options, secret)."""
        self.kill()
        fresh = self._clone()
        logger.info("renewing %s as %s", self.describe(), fresh.describe())
        fresh.start()
        return fresh

    # --- shared helpers ------------------------------------------------------------------------------
    def _mark_started(self) -> None:
        """Backends call this once the scheduler holds something that kill() must release."""
        self._started = True
        _LIVE_JOBS.add(self)

    def describe(self) -> str:
        """A short human name used in logs and errors, e.g. "SLURM job 42 (regent-1a2b3c4d)"."""
        return f"{self.backend or type(self).__name__} job {self.unique_name}"

    @property
    def unique_name(self) -> str:
        """`name-uid`: unique per allocation, still a valid RFC 1123 label."""
        return f"{self.name}-{self.job_uid}"

    @property
    def secret(self) -> str:
        """The job secret as hex text (see the module docstring for where it comes from)."""
        if self._secret is None:
            self._secret = resolve_secret(self._secret_arg)
        return self._secret

    @property
    def started(self) -> bool:
        return self._started

    def _clone(self) -> Job:
        return type(self)(
            self.hosts,
            name=self.name,
            gpus_per_host=self.gpus_per_host,
            secret=self.secret,
            **copy.deepcopy(self._backend_opts),
        )

    def __enter__(self) -> Job:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        state = "killed" if self._killed else ("started" if self._started else "new")
        return f"{type(self).__name__}(hosts={self.hosts}, name={self.name!r}, uid={self.job_uid}, {state})"


_LIVE_JOBS: weakref.WeakSet[Job] = weakref.WeakSet()


@atexit.register
def _kill_jobs_at_exit() -> None:
    for job in list(_LIVE_JOBS):
        if job.kill_on_exit and job.started and not job._killed:
            logger.info("controller exiting: releasing %s", job.describe())
            try:
                job.kill()
            except Exception as exc:  # noqa: BLE001 - reported; keep releasing the others
                logger.warning("could not release %s at exit: %s", job.describe(), exc)


def _call_attach(attach_to_workers: Any, addresses: list[str], secret: str, name: str) -> Any:
    """Call the actor runtime's attach_to_workers with the job's secret, explaining a mismatch."""
    import inspect

    try:
        params = inspect.signature(attach_to_workers).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        params = {}
    kwargs: dict[str, Any] = {"workers": addresses}
    if "secret" in params:
        kwargs["secret"] = bytes.fromhex(secret)
    if "name" in params:
        kwargs["name"] = name
    if "stream_logs" in params:  # procs on cluster hosts: their output on the controller's console, as before
        kwargs["stream_logs"] = True
    try:
        return attach_to_workers(**kwargs)
    except ValueError as exc:
        if "secret" not in str(exc):
            raise
        raise JobError(
            f"the workers of this job use a different secret than this controller's actor runtime ({exc}); "
            f"create the job without secret=, or set {SECRET_ENV} to the job's secret before the runtime starts"
        ) from exc


def wait_until(
    poll: Any, timeout: float, *, interval: float = 0.5, max_interval: float = 2.0
) -> Any:
    """Call `poll()` until it returns something not None, or the deadline passes (then return None).

    `poll` may raise to abort (e.g. JobFailedError). The interval backs off up to `max_interval`."""
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        result = poll()
        if result is not None:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(delay, remaining))
        delay = min(delay * 1.5, max_interval)


def run_command(
    args: Sequence[str], *, timeout: float = 60.0, check: bool = True, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a scheduler CLI command and capture its output; a missing binary or failure says what to do."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False,
                              env=None if env is None else dict(env))
    except FileNotFoundError as exc:
        raise JobError(f"`{args[0]}` not found on PATH; install it or run the controller where it exists") from exc
    except subprocess.TimeoutExpired as exc:
        raise JobError(f"`{' '.join(args)}` did not answer within {timeout:.0f} s; is the scheduler up?") from exc
    if check and proc.returncode != 0:
        raise JobError(
            f"`{' '.join(args)}` failed with exit code {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    return proc


# --- the worker launcher (runs on the allocated host) ----------------------------------------------------


def detect_host_ip() -> str:
    """The address other hosts reach this one at: the first of `hostname -I`, else the hostname's address.

    Falls back to 127.0.0.1 (with a warning) on a host with no network, which only works single-node."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
        for candidate in out:
            if not candidate.startswith("127.") and candidate != "::1":
                return candidate
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            ip = info[4][0]
            if not ip.startswith("127.") and ip != "::1":
                return ip
    logger.warning("no non-loopback address found for this host; workers will only be reachable locally")
    return "127.0.0.1"


def pick_free_port(host: str) -> int:
    """A port free on `host` right now (the worker binds it a moment later), outside the OS's ephemeral range
    (`regent.ports`)."""
    return free_port(host)


def decode_proc_net_address(field: str) -> tuple[str, int]:
    """("ip", port) from a /proc/net/tcp{,6} address like "0100007F:1F90" (IP in host byte order words)."""
    hex_ip, hex_port = field.rsplit(":", 1)
    raw = bytes.fromhex(hex_ip)
    # The kernel prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(hex_port, 16)


def listening_sockets() -> set[tuple[str, int]] | None:
    """Local TCP (ip, port) pairs in LISTEN state, read from /proc (no connection is made); None without /proc."""
    found: set[tuple[str, int]] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # 0A = TCP_LISTEN
                found.add(decode_proc_net_address(fields[1]))
    return found if readable else None


def is_listening(host: str, port: int) -> bool:
    """Whether something listens on host:port (or on a wildcard address at that port).

    Uses /proc when possible, so the worker never sees a stray connection before its controller's."""
    sockets = listening_sockets()
    if sockets is not None:
        bare = host.strip("[]")
        wanted = {bare, f"::ffff:{bare}", "0.0.0.0", "::"}  # its own address, IPv4-mapped, or a wildcard
        return any((ip, port) in sockets for ip in wanted)
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=1.0):
            return True
    except OSError:
        return False


def worker_command(address: str, secret_file: str | None, python: str | None = None) -> list[str]:
    """The `regent worker` command line (the secret travels by file or environment, never as an argument)."""
    cmd = [python or sys.executable, "-m", "regent.cli", "worker", "--address", address]
    if secret_file:
        cmd += ["--secret-file", secret_file]
    return cmd


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _die_with_parent() -> None:
    """In the worker, before exec: ask Linux to SIGTERM it if the launcher dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def launch_worker(argv: Sequence[str] | None = None) -> int:
    """Entry point run on each allocated host: start `regent worker`, publish its address once it listens.

    Stays as the worker's parent so it can report a worker that dies before listening, forwards SIGTERM,
    SIGINT and SIGHUP (what `scancel` and `sky down` send), and exits with the worker's exit code. With an
    automatically picked port, a worker that exits before listening (the port was taken in between) is
    retried on another port."""
    parser = argparse.ArgumentParser(prog="regent-launch-worker")
    parser.add_argument("--address-dir", help="shared directory to publish worker-<rank>.addr in")
    parser.add_argument("--rank-env", default="SLURM_PROCID", help="env var holding this worker's rank")
    parser.add_argument("--local-rank-env", default=None, help="env var holding the rank within the node")
    parser.add_argument("--host", default=None, help="address to serve on (default: first of hostname -I)")
    parser.add_argument("--interface", default=None, help="serve on this network interface's address")
    parser.add_argument("--port", type=int, default=0, help="base port; 0 = any free port")
    parser.add_argument("--secret-file", default=None, help="file holding the job secret (~ is expanded)")
    parser.add_argument("--listen-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    def fail(message: str, code: int = 1) -> int:
        print(f"regent-launch-worker: {message}", file=sys.stderr, flush=True)
        return code

    rank_text = os.environ.get(args.rank_env)
    if rank_text is None:
        return fail(f"${args.rank_env} is not set; is this running under the scheduler?", 2)
    rank = int(rank_text)
    secret_file = os.path.expanduser(args.secret_file) if args.secret_file else None
    local_rank = int(os.environ.get(args.local_rank_env, "0")) if args.local_rank_env else 0
    try:
        host = args.host or (interface_ip(args.interface) if args.interface else detect_host_ip())
    except JobError as exc:
        return fail(f"rank {rank}: {exc}", 2)

    child: subprocess.Popen | None = None
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    attempts = 1 if args.port else 3
    deadline = time.monotonic() + args.listen_timeout
    for attempt in range(1, attempts + 1):
        port = args.port + local_rank if args.port else pick_free_port(host)
        address = format_address(host, port)
        child = subprocess.Popen(worker_command(address, secret_file), preexec_fn=_die_with_parent)
        while not is_listening(host, port) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.poll() is None and is_listening(host, port):
            break
        if child.poll() is None:  # still not listening at the deadline
            child.terminate()
            child.wait()
            return fail(f"rank {rank}: worker not listening on {address} after {args.listen_timeout:.0f} s")
        if stopping or attempt == attempts:
            return fail(f"rank {rank}: worker exited with code {child.returncode} before listening on {address}",
                        child.returncode or 1)
        fail(f"rank {rank}: worker exited before listening on {address}; retrying on another port")

    assert child is not None
    if args.address_dir:
        _write_atomically(address_file(args.address_dir, rank), address + "\n")
    print(f"{ADDRESS_MARKER} rank={rank} address={address}", flush=True)
    return child.wait()


def parse_interface_addresses(text: str) -> list[str]:
    """Addresses in `ip -o addr show` output, IPv4 first (what most clusters route between nodes)."""
    v4, v6 = [], []
    for line in text.splitlines():
        fields = line.split()
        for kind, bucket in (("inet", v4), ("inet6", v6)):
            if kind in fields:
                address = fields[fields.index(kind) + 1].split("/")[0]
                if not address.startswith("fe80"):  # link-local needs a scope id; useless across hosts
                    bucket.append(address)
    return v4 + v6


def interface_ip(interface: str) -> str:
    """The first address of a network interface (e.g. the InfiniBand or cluster-network one)."""
    try:
        out = subprocess.run(["ip", "-o", "addr", "show", "dev", interface], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise JobError(f"cannot list addresses of interface {interface!r} (`ip` failed: {exc})") from exc
    addresses = parse_interface_addresses(out.stdout)
    if out.returncode != 0 or not addresses:
        raise JobError(f"network interface {interface!r} has no usable address on this host "
                       f"({(out.stderr or out.stdout).strip() or 'no inet lines'}); check `ip addr`")
    return addresses[0]


def launcher_command(python: str, args: Sequence[str]) -> list[str]:
    """`python -c` invocation of `launch_worker` (avoids `-m` of a module its package already imported)."""
    code = "import sys; from regent.jobs.base import launch_worker; sys.exit(launch_worker(sys.argv[1:]))"
    return [python, "-c", code, *args]


def release_recorded(ref: dict[str, Any]) -> str:
    """Release an allocation recorded by `Job.reference()` (of any backend), whose owner is gone."""
    from regent.jobs import get_job_class

    backend = ref.get("backend")
    if not backend:
        raise ValueError(f"not an allocation record (no backend): {ref!r}")
    return get_job_class(str(backend)).release_reference(ref)
