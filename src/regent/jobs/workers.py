"""`WorkersJob` (`--job workers`): hosts the user already runs `regent worker` on.

No scheduler hands out hosts here: the user starts one worker per machine and lists the addresses,

    # on each host (the same 0600 secret file on every one)
    regent worker --address tcp://10.0.0.2:26600 --secret-file ~/.regent/secret
    # on the controller
    REGENT_JOB_SECRET_FILE=~/.regent/secret regent train --job workers \\
        --job.addresses tcp://10.0.0.2:26600,tcp://10.0.0.3:26600,tcp://10.0.0.4:26600

and each replica's "allocation" is a claim on `hosts` of those addresses. Why claims: every replica makes its
own job (in its own process), so two replicas must never pick the same worker. A claim is an exclusive
`flock` on a small file in a directory private to this user on the controller machine; the kernel drops it
when the claiming process dies, so a crashed controller never leaves a host "taken".

Which host a replica gets: replica i (its job is named `...-<i>`) tries the addresses starting at position
i * hosts, then the rest in order, skipping addresses claimed by another replica and workers that do not
answer a TCP connect. Addresses past replicas * hosts are spares: when a replica's worker dies (the host went
down, the worker was killed), `problem()` reports it like a lost allocation, the orchestrator asks for a fresh
one, and the replica moves to a free, live spare. With no spare it waits (up to the allocation timeout) for a
claimed host to be released or the dead worker to come back, logging what it waits for.

The secret is never handled here beyond what `Job` does: the controller's actor runtime reads it from
REGENT_JOB_SECRET_FILE, each worker from its own `--secret-file`; nothing is started, so nothing is passed on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from regent.jobs.base import Job, JobFailedError, JobTimeoutError

logger = logging.getLogger(__name__)

_ADDRESS_RE = re.compile(r"^tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
_INDEX_RE = re.compile(r"(\d+)$")


def parse_worker_addresses(value: str | Sequence[str]) -> list[str]:
    """`tcp://h:p,tcp://h2:p` (or a list, or items separated by spaces) as a checked list of addresses.

    Raises ValueError naming the bad item and the expected form, before anything is contacted."""
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        for part in re.split(r"[,\s]+", str(item).strip()):
            if not part:
                continue
            match = _ADDRESS_RE.match(part)
            if match is None or not 1 <= int(match["port"]) <= 65535:
                raise ValueError(
                    f"job option addresses: {part!r} is not a worker address; give tcp://HOST:PORT as "
                    f"`regent worker` prints it (\"regent worker serving tcp://10.0.0.2:26600\")")
            if part in out:
                raise ValueError(f"job option addresses: {part} is listed twice; list each worker once")
            out.append(part)
    if not out:
        raise ValueError("--job workers needs --job.addresses tcp://HOST:PORT,... (the `regent worker` "
                         "addresses of your hosts)")
    return out


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of a checked `tcp://host:port` address."""
    match = _ADDRESS_RE.match(address)
    if match is None:
        raise ValueError(f"not a worker address: {address!r}")
    return match["host"].strip("[]"), int(match["port"])


def probe_worker(address: str, timeout: float) -> str | None:
    """None when something accepts a TCP connection at `address`, else why not (refused, timed out, ...).

    Only a connect and a close: the worker drops a connection that never proves the secret."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def default_claim_dir() -> Path:
    """Per-user directory on the controller machine holding the claim lock files."""
    return Path(tempfile.gettempdir()) / f"regent-worker-claims-{os.getuid()}"


class _Claim:
    """An exclusive, non-blocking flock on one address's lock file (released on close or process death)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, directory: Path, address: str, owner: str) -> _Claim | None:
        path = directory / (hashlib.sha1(address.encode()).hexdigest()[:16] + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{address} {owner}\n".encode(), 0)
        return cls(path, fd)

    @staticmethod
    def holder(directory: Path, address: str) -> str:
        path = directory / (hashlib.sha1(address.encode()).hexdigest()[:16] + ".lock")
        with contextlib.suppress(OSError):
            text = path.read_text().split(maxsplit=1)
            if len(text) == 2:
                return text[1].strip()
        return "another replica"

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


class WorkersJob(Job):
    """`hosts` of the listed, already running `regent worker`s, claimed for one replica. See the module doc."""

    backend = "workers"

    def __init__(
        self,
        hosts: int,
        *,
        addresses: str | Sequence[str] = (),
        name: str = "regent",
        gpus_per_host: int | None = None,
        secret: str | bytes | None = None,
        claim_dir: str | None = None,
        probe_timeout: float = 3.0,
    ) -> None:
        checked = parse_worker_addresses(addresses)
        if len(checked) < hosts:
            raise ValueError(f"--job workers: {hosts} host(s) per replica but only {len(checked)} address(es) "
                             f"listed; add more to --job.addresses")
        if probe_timeout <= 0:
            raise ValueError(f"job option probe_timeout={probe_timeout!r} must be positive (seconds)")
        super().__init__(hosts, name=name, gpus_per_host=gpus_per_host, secret=secret, addresses=list(checked),
                         claim_dir=claim_dir, probe_timeout=probe_timeout)
        self.addresses = checked
        self.claim_dir = Path(claim_dir).expanduser() if claim_dir else default_claim_dir()
        self.probe_timeout = float(probe_timeout)
        self._claims: dict[str, _Claim] = {}
        self._claimed: list[str] = []
        self._held: list[str] = []  # what describe() names, also after kill() (the "previous" of the next)

    # --- the contract -------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to launch (the workers already run): only make the claim directory."""
        if self._started or self._killed:
            return
        self.claim_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._mark_started()

    def candidates(self) -> list[str]:
        """The addresses in the order this job tries them: its own slot first (replica i: i * hosts), then the
        rest in list order, so replicas spread over distinct hosts and spares are taken last."""
        match = _INDEX_RE.search(self.name)
        offset = (int(match.group(1)) * self.hosts) % len(self.addresses) if match else 0
        return self.addresses[offset:] + self.addresses[:offset]

    def worker_addresses(self, timeout: float) -> list[str]:
        """Claim `hosts` free, answering workers; wait (up to `timeout`) while all free ones are taken or down.

        Raises JobFailedError at once when no listed worker answers at all (nothing to wait for: the workers
        are not running or the addresses are wrong), JobTimeoutError naming each address's state otherwise."""
        if self._killed:
            raise JobFailedError(f"{self.describe()} was killed")
        self.start()
        deadline = time.monotonic() + timeout
        logged = ""
        while True:
            states = self._claim_round()
            if len(self._claimed) == self.hosts:
                return list(self._claimed)
            summary = "; ".join(f"{a}: {s}" for a, s in states.items())
            if all(s.startswith("down") for s in states.values()):
                self._release_all()
                raise JobFailedError(
                    f"no `regent worker` answers at any of --job.addresses ({summary}); start `regent worker "
                    f"--address ADDRESS --secret-file FILE` on each host, or fix the addresses")
            if summary != logged:
                logger.warning("%s waits for a free, live worker (%d of %d claimed): %s", self.describe(),
                               len(self._claimed), self.hosts, summary)
                logged = summary
            if time.monotonic() >= deadline:
                self._release_all()
                raise JobTimeoutError(
                    f"{self.describe()}: no free, live worker within {timeout:.0f} s ({summary}); list spare "
                    f"hosts in --job.addresses or restart `regent worker` on the dead ones")
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    def _claim_round(self) -> dict[str, str]:
        """One pass over the candidates: claim what is free and answers; the state of each address."""
        states: dict[str, str] = {}
        owner = f"pid {os.getpid()} ({self.unique_name})"
        for address in self.candidates():
            if address in self._claims:
                states[address] = "claimed by this job"
                continue
            if len(self._claimed) == self.hosts:
                break
            claim = _Claim.take(self.claim_dir, address, owner)
            if claim is None:
                states[address] = f"in use by {_Claim.holder(self.claim_dir, address)}"
                continue
            why = probe_worker(address, self.probe_timeout)
            if why is not None:
                claim.release()
                states[address] = f"down ({why})"
                continue
            self._claims[address] = claim
            self._claimed.append(address)
            self._held = list(self._claimed)
            states[address] = "claimed by this job"
        return states

    def problem(self) -> str | None:
        """Why this allocation cannot host a restart (a claimed worker no longer answers), or None.

        The dead worker's claim is dropped at once, so that a worker restarted on that host can be taken
        again by the fresh allocation the orchestrator asks for next."""
        if not self._claimed:
            return None
        dead = []
        for address in list(self._claimed):
            why = probe_worker(address, self.probe_timeout)
            if why is not None:
                dead.append(f"{address} ({why})")
                claim = self._claims.pop(address, None)
                if claim is not None:
                    claim.release()
        if dead:
            return f"the worker at {', '.join(dead)} is gone: its host died or `regent worker` stopped there"
        return None

    def is_alive(self) -> bool:
        """True while started, not killed, and every claimed worker answers."""
        return self._started and not self._killed and self.problem() is None

    def kill(self) -> None:
        """Release the claims. The workers are the user's: they keep running (procs on them are the
        replica's to stop)."""
        self._killed = True
        self._release_all()
        self._host_mesh = None

    def _release_all(self) -> None:
        for claim in self._claims.values():
            claim.release()
        self._claims.clear()
        self._claimed = []

    def describe(self) -> str:
        where = f" on {', '.join(self._held)}" if self._held else ""
        return f"workers job {self.unique_name}{where}"

    def _clone(self) -> Job:
        opts: dict[str, Any] = dict(self._backend_opts)
        return type(self)(self.hosts, name=self.name, gpus_per_host=self.gpus_per_host, secret=self.secret, **opts)
