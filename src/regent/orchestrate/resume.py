"""`regent train --resume RUN_DIR`: a new controller takes over a run whose controller was lost.

What a successor needs is recorded by the controller in RUN_DIR/controller/ (`attach.json`: where the Lighthouse
and the replicas are, as actor-layer references; the job secret's fingerprint and where the secret is; the run
marker). The replicas trained on meanwhile (`--controller-grace`) and journaled what they reported
(orchestrate/relay.py). Everything here checks before anything is written: a wrong `--resume` changes nothing
on disk (`check_resumable`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regent import settings
from regent.orchestrate.config import ConfigError, RunConfig, apply_toml
from regent.orchestrate.events import read_jsonl

logger = logging.getLogger(__name__)

ATTACH_FILE = "attach.json"
LOCK_FILE = "lock"
SECRET_FILE = "secret"
LEASE_FILE = "lease"
LEASE_RENEW_S = 2.0  # how often a live controller renews its lease
# A lease older than this means its controller is stopped (SIGSTOP, a frozen VM) or hung: it holds its lock but
# supervises nothing. Generous against a busy machine's scheduling delays (the renewal is its own thread).
LEASE_STALE_S = 30.0
# What a resume may change: how long the replicas wait for a controller, and how this one shows progress.
RESUME_MAY_CHANGE = frozenset({"controller_grace", "live"})


class ResumeRefused(Exception):
    """`--resume` cannot go on; the message is one line, nothing was written. `code`: the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ResumePlan:
    run_dir: Path
    cfg: RunConfig
    attach: dict[str, Any]
    secret_file: str | None  # the recorded secret (None: the caller's environment must hold it)
    alive: list[int] = field(default_factory=list)  # recorded pids of the run still alive (on this machine)
    # the run's processes run on another machine (its controller's): the address of one that accepts a
    # connection, which the resume then adopts over the network (None: nothing there answered, or not remote)
    remote: str | None = None
    # a controller of this machine that holds the lock but stopped renewing its lease: killed before the take-over
    stale_holder: int | None = None


def controller_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "controller"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """A reader never sees half a file: write next to it, then rename over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def write_secret(run_dir: Path, secret: bytes) -> Path:
    """The job secret for a successor, readable by this user only (the directory too)."""
    d = controller_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    path = d / SECRET_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())
    return path


class ControllerLock:
    """Held (flock) for a controller's whole life: a second controller of the same run is refused. The kernel
    drops it when the process dies, however it dies."""

    def __init__(self, run_dir: Path) -> None:
        self.path = controller_dir(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ControllerLease:
    """Renewed every `LEASE_RENEW_S` by a thread of the live controller. The lock says a controller process
    exists; the lease says it still works: a stopped or hung one keeps the lock (the kernel drops it only at
    exit) but not the lease, so a successor can take over instead of being refused forever.

    Also the fence: a controller whose lease was written by another one (a successor took the run over while it
    was stopped, from another machine) calls `on_replaced` instead of renewing: the replicas are the
    successor's now, and two controllers must never drive them."""

    def __init__(self, run_dir: Path, on_replaced: Any) -> None:
        self.path = controller_dir(run_dir) / LEASE_FILE
        self._on_replaced = on_replaced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mine: dict[str, Any] = {}

    def start(self) -> None:
        from regent.actor._runtime import machine_id

        self._mine = {"pid": os.getpid(), "host": socket.gethostname(), "machine": machine_id()}
        self._write()
        self._thread = threading.Thread(target=self._renew, name="regent-controller-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _write(self) -> None:
        write_json_atomic(self.path, {**self._mine, "renewed": time.time()})

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            holder = read_lease(self.path.parent.parent)
            if holder and (holder.get("pid"), holder.get("machine")) != (self._mine["pid"], self._mine["machine"]):
                self._on_replaced(holder)
                return
            try:
                self._write()
            except OSError as exc:  # a full or unreachable disk: reported, retried at the next renewal
                logger.warning("renewing the controller lease %s: %r", self.path, exc)


def read_lease(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((controller_dir(run_dir) / LEASE_FILE).read_text())
    except (OSError, ValueError):
        return None


def lease_age(run_dir: Path, now: float | None = None) -> float | None:
    """Seconds since the run's controller last renewed its lease; None when no lease was ever written (a run
    started before leases: its holder cannot be told from a working one)."""
    lease = read_lease(run_dir)
    if not lease or not isinstance(lease.get("renewed"), (int, float)):
        return None
    return (time.time() if now is None else now) - float(lease["renewed"])


def lock_is_held(run_dir: Path) -> bool:
    """Whether a live controller holds this run (a read-only probe: it creates nothing)."""
    path = controller_dir(run_dir) / LOCK_FILE
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def config_from_run(run_dir: Path) -> RunConfig:
    """The RunConfig the run was started with, from its config.json (it round-trips exactly)."""
    data = json.loads((run_dir / "config.json").read_text())
    cfg = RunConfig()
    apply_toml(cfg, data)
    return cfg


def flat_config(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict with its sections' keys dotted (`ft.sync_every`), to compare two configs key by key."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in ("train", "ft", "faults", "lighthouse"):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(run_dir: str | Path, environ: dict[str, str] | None = None,
                    takeover: bool = False, lease_stale_s: float = LEASE_STALE_S) -> ResumePlan:
    """Everything a resume needs, checked before anything is written; `ResumeRefused` with one line otherwise.

    `takeover`: the run was controlled from another machine that is gone (a rescheduled pod, a requeued SLURM
    job): nothing of it can be adopted from here, so the run goes on from its backstop."""
    from regent.actor._runtime import machine_id
    from regent.auth import SECRET_ENV, SECRET_FILE_ENV, fingerprint, read_secret_file

    env = os.environ if environ is None else environ
    run = Path(run_dir)
    attach_path = controller_dir(run) / ATTACH_FILE
    if not run.is_dir() or not attach_path.exists() or not (run / "config.json").exists():
        raise ResumeRefused(f"--resume {run}: no run there (no {ATTACH_FILE} and config.json; it is written by "
                            "`regent train` once its replicas have started)")
    try:
        attach = json.loads(attach_path.read_text())
    except (OSError, ValueError) as exc:
        raise ResumeRefused(f"--resume {run}: cannot read {attach_path} ({exc})") from exc
    finished = [e for e in read_jsonl(run / "events.jsonl") if e.get("kind") == "run_finished"]
    if finished or (run / "summary.json").exists():
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(finished[-1]["time"])) if finished else "its end"
        raise ResumeRefused(f"run {run} finished at {at}; nothing to resume")
    ctl = attach.get("controller", {})
    elsewhere = bool(ctl.get("machine")) and ctl["machine"] != machine_id()
    stale_holder = None
    if lock_is_held(run):
        age = lease_age(run)
        lease = read_lease(run) or {}
        if age is None or age < lease_stale_s:
            raise ResumeRefused(f"run {run} is still controlled by pid {ctl.get('pid')} on {ctl.get('host')}"
                                + (f" (lease renewed {age:.0f}s ago)" if age is not None else "")
                                + "; stop that controller first (or let it be)")
        if lease.get("machine") == machine_id() and isinstance(lease.get("pid"), int):
            stale_holder = int(lease["pid"])  # stopped or hung here: the resume kills it, then takes over
        elif not takeover:
            raise ResumeRefused(f"run {run}'s controller (pid {lease.get('pid')} on {lease.get('host')}) holds its "
                                f"lock but has not renewed its lease for {age:.0f}s (stopped or hung); pass "
                                "--takeover to go on here from the run's backstop (it exits if it wakes)")
    if elsewhere and not takeover:
        problem = cross_host_problem(attach, settings.REGENT_LISTEN_HOST.get(env))
        if problem is not None:
            raise ResumeRefused(f"run {run} was controlled from {ctl.get('host')} and {problem}; resume it on "
                                f"{ctl.get('host')}, or, if that machine is gone, pass --takeover to go on here "
                                "from the run's backstop")
    secret_file = str(controller_dir(run) / SECRET_FILE) if attach.get("secret") == "file" else None
    try:
        if secret_file is not None:
            secret, source = read_secret_file(secret_file), secret_file
        elif settings.REGENT_JOB_SECRET.is_set(env):
            secret, source = bytes.fromhex(settings.REGENT_JOB_SECRET.get(env)), f"${SECRET_ENV}"
        elif settings.REGENT_JOB_SECRET_FILE.is_set(env):
            source = settings.REGENT_JOB_SECRET_FILE.get(env)
            secret = read_secret_file(source)
        else:
            raise ResumeRefused(f"run {run} was started with the job secret from the environment; set "
                                f"{SECRET_ENV} or {SECRET_FILE_ENV} as it was")
    except (OSError, ValueError) as exc:
        raise ResumeRefused(f"--resume {run}: cannot read the job secret ({exc})") from exc
    if fingerprint(secret) != attach.get("job"):
        raise ResumeRefused(f"the job secret from {source} is not run {run}'s (fingerprint {fingerprint(secret)} "
                            f"!= {attach.get('job')})")
    try:
        cfg = config_from_run(run)
    except (OSError, ValueError, ConfigError) as exc:
        raise ResumeRefused(f"--resume {run}: cannot read its config.json ({exc})") from exc
    cfg.run_dir = str(run.resolve())  # the run's files (backstop included) are where --resume points
    remote = reachable(recorded_addresses(attach, lighthouse=False)) if elsewhere and not takeover else None
    if elsewhere and not takeover and remote is None:
        raise ResumeRefused(f"nothing of run {run} answers on {ctl.get('host')} (its replicas at "
                            f"{', '.join(recorded_addresses(attach, lighthouse=False)[:2])}); if that machine is "
                            "gone, pass --takeover to go on here from the run's backstop")
    lh_refs = recorded_addresses(attach, replicas=False)
    if remote is not None and lh_refs and not cfg.lighthouse.address and reachable(lh_refs) is None:
        # its replicas dial the Lighthouse at the address it had there: one started here could not serve them
        raise ResumeRefused(f"run {run}'s replicas on {ctl.get('host')} are alive but its Lighthouse there is not "
                            f"({lh_refs[0]} does not answer); resume it on {ctl.get('host')}, where a new one can "
                            "serve on the address they dial")
    plan = ResumePlan(run, cfg, attach, secret_file, alive=[] if elsewhere else recorded_alive(attach),
                      stale_holder=stale_holder, remote=remote)
    if not plan.alive and plan.remote is None:
        committed = max((int(m.get("step") or 0) for m in read_jsonl(run / "metrics.jsonl")), default=0)
        from regent.ft.backstop import complete_steps

        if committed > 0 and not complete_steps(run / "backstop", cfg.procs_per_replica):
            raise ResumeRefused(f"nothing of run {run} is alive and it has no backstop: committed step {committed} "
                                "cannot be restored; not resuming", code=1)
    return plan


def recorded_addresses(attach: dict[str, Any], lighthouse: bool = True, replicas: bool = True) -> list[str]:
    """The TCP addresses of the run's recorded processes: its Lighthouse's, its replicas' (respawned ones too)."""
    from regent.orchestrate.replica_set import recorded_proc_refs

    refs = [(attach.get("lighthouse") or {}).get("procs")] if lighthouse else []
    refs += recorded_proc_refs(attach.get("replicas") or {}) if replicas else []
    return [str(info["tcp"]) for ref in refs for info in ((ref or {}).get("infos") or {}).values()
            if isinstance(info, dict) and info.get("tcp")]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: resolved by whoever dials it


def cross_host_problem(attach: dict[str, Any], listen_host: str) -> str | None:
    """Why a controller on another machine than the run's cannot adopt its processes (None: it can): they must
    have listened on an address other machines reach (the run started with REGENT_LISTEN_HOST set to the host's
    cluster address, as a multi-host run is), and this controller must listen on one too (their replies and
    reports come back to it)."""
    from regent.actor._transport import parse_address

    addresses = recorded_addresses(attach)
    if not addresses:
        return "it recorded no address of its processes"
    local = sorted({a for a in addresses if _is_loopback(str(parse_address(a)[1][0]))})
    if local:
        return (f"its processes listen on loopback only ({local[0]}; the run was started without "
                "REGENT_LISTEN_HOST set to that host's address)")
    if _is_loopback(listen_host):
        return (f"this controller would listen on {listen_host}, which its processes there cannot reach; set "
                "REGENT_LISTEN_HOST to this host's address")
    return None


def reachable(addresses: list[str], timeout_s: float = 2.0) -> str | None:
    """The first of `addresses` (tcp://HOST:PORT) that accepts a TCP connection (closed at once, before any
    handshake): that process is still alive on its machine. None when none answers."""
    from regent.actor._transport import parse_address

    for address in addresses:
        host, port = parse_address(address)[1]
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return address
        except OSError:
            continue
    return None


def recorded_alive(attach: dict[str, Any]) -> list[int]:
    """The run's recorded processes (Lighthouse and replicas, respawned ones too) that are still alive and still
    the run's (the pid carries the run's marker: not a reused pid)."""
    from regent.orchestrate.replica_set import recorded_proc_refs

    refs = [(attach.get("lighthouse") or {}).get("procs"), *recorded_proc_refs(attach.get("replicas") or {})]
    return [int(pid) for ref in refs for pid in ((ref or {}).get("os_pids") or {}).values()
            if pid and is_ours(int(pid), str(attach.get("marker")))]


def is_ours(pid: int, marker: str) -> bool:
    """Process `pid` of this machine is alive and carries the run's marker (not a reused pid)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{settings.REGENT_RUN_MARKER.name}={marker}".encode() in environ and pid_alive(pid)


def end_if_ours(pid: int | None, marker: str) -> bool:
    """SIGKILL process `pid` if it is still this run's (a recorded proc that did not answer: hung, not gone);
    True when it was."""
    if not pid or not is_ours(int(pid), marker):
        return False
    with contextlib.suppress(OSError):
        os.kill(int(pid), signal.SIGKILL)
    logger.warning("process %d of the run did not answer its adoption; ended it (SIGKILL)", pid)
    return True


def last_rseqs(run_dir: Path) -> dict[int, int]:
    """Per replica, the highest journal sequence number the run's files hold: a re-attached replica resends
    what comes after it."""
    last: dict[int, int] = {}
    for name in ("events.jsonl", "metrics.jsonl"):
        for rec in read_jsonl(run_dir / name):
            r, n = rec.get("replica"), rec.get("rseq")
            if r is not None and n is not None:
                last[int(r)] = max(last.get(int(r), 0), int(n))
    return last


def allocations_to_release(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The allocations a resumed controller must free when nothing of its run answered: each replica's newest
    `allocation` with a release record (an older one was killed by its replica when it moved on), unless an
    `allocation_released` already names it. (replica, record) in replica order."""
    newest: dict[int, dict[str, Any]] = {}
    released: set[str] = set()
    for e in events:
        if e.get("kind") == "allocation" and e.get("replica") is not None:
            newest[int(e["replica"])] = e
        elif e.get("kind") == "allocation_released" and e.get("job"):
            released.add(str(e["job"]))
    return [(r, e["release"]) for r, e in sorted(newest.items())
            if isinstance(e.get("release"), dict) and str(e.get("job")) not in released]


def secret_source_env(plan: ResumePlan) -> dict[str, str]:
    """What the resuming controller's environment needs before its runtime starts: the recorded secret."""
    from regent.auth import SECRET_FILE_ENV

    return {SECRET_FILE_ENV: plan.secret_file} if plan.secret_file else {}


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    return False
