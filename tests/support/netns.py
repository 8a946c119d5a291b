"""Network namespaces joined by a bridge: several "hosts" on one machine whose links a test can cut.

Why: a network partition (packets silently dropped, TCP connections left open on both sides) behaves unlike a
killed process or a refused connection, and only a link cut in the kernel shows it. A `NetLab` makes

- a hub namespace holding a bridge (the lab's switch, address 10.77.S.1/24), where e.g. a Lighthouse runs;
- one namespace per `Host`, with a loopback and `eth0` (10.77.S.<10+i>/24), a veth pair whose other end is a
  port of the bridge;
- optionally a veth from the root namespace to the bridge (10.77.S.254/24 on the root side), so that this
  process, or a controller started here, reaches the hosts.

`Host.cut()` sets the host's bridge port down: the host's packets vanish in both directions, as with a pulled
cable, while its own interface stays configured and every socket stays open. `Host.heal()` sets it up again.
`NetLab.split(hosts)` partitions a group of hosts from the rest (the hub included) while they still reach each
other (their ports move to a bridge of their own); `NetLab.join(hosts)` undoes it.
In the root namespace only the lab's own veth (and the /24 route that comes with its address) is added; no
existing interface or route is changed. `close()` kills what runs in the lab's namespaces and deletes them,
which removes every veth and the bridge with them.

Needs root, `ip` (iproute2) and, for `popen(hostname=...)`, `unshare` (util-linux). `unavailable_reason()`
says why a lab cannot be made here; the `netlab` fixture skips with it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

PREFIX = "rgtlab"
_NAME = re.compile(rf"^{PREFIX}-(?P<owner>\d+)-(?P<lab>[0-9a-f]+)-(?P<what>[a-z0-9]+)$")
_IP_TIMEOUT_S = 20.0


class NetnsUnavailable(RuntimeError):
    """Namespaces, veths or bridges cannot be made on this machine (not root, no iproute2, EPERM, no module)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS`; raise (with its stderr) on failure, `NetnsUnavailable` when the kernel refuses."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        err = proc.stderr.strip()
        text = f"`ip {' '.join(args)}` failed ({proc.returncode}): {err}"
        if re.search(r"Operation not permitted|Permission denied|not supported|Unknown device type", err):
            raise NetnsUnavailable(text)
        raise RuntimeError(text)
    return proc


def unavailable_reason() -> str | None:
    """None when this process can make network namespaces (it tries one), else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-0-probe"
    try:
        _ip("netns", "add", probe)
    except (NetnsUnavailable, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace: {exc}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process in `netns` (a lab namespace: everything in it was started by the lab's owner)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose owning process is dead (a test run killed before its finalizers):
    only names this module makes (`rgtlab-<owner pid>-<lab>-<part>`) with that pid no longer alive."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match is None or _pid_alive(int(match["owner"])):
            continue
        _kill_namespace_processes(name)
        _ip("netns", "delete", name, check=False)
        removed.append(name)
    return removed


class Namespace:
    """A network namespace of the lab, and how to start processes in it."""

    def __init__(self, lab: NetLab, name: str, netns: str, address: str) -> None:
        self.lab = lab
        self.name = name
        self.netns = netns
        self.address = address

    def command(self, argv: Sequence[str], hostname: str | None = None) -> list[str]:
        """`argv` run inside this namespace; with `hostname`, also in a UTS namespace of its own with that host
        name (why: processes that compare host names, like the actor runtime choosing Unix sockets for peers
        on "the same machine", must see another machine, or they bypass the network)."""
        cmd = ["ip", "netns", "exec", self.netns]
        if hostname is not None:
            if shutil.which("unshare") is None:
                raise NetnsUnavailable("`unshare` (util-linux) is not installed; needed for a host name of its own")
            cmd += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        return cmd + [str(a) for a in argv]

    def popen(self, argv: Sequence[str], hostname: str | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start `argv` in this namespace (`ip netns exec` execs it: the Popen's pid is the program's own).
        The lab kills it at `close()` if it is still running."""
        proc = subprocess.Popen(self.command(argv, hostname), **kwargs)
        self.lab.processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.address} in {self.netns}>"


class Host(Namespace):
    """A host: a namespace on the lab's bridge through one veth pair (`eth0` inside, `port` on the bridge)."""

    ifname = "eth0"

    def __init__(self, lab: NetLab, name: str, netns: str, address: str, port: str) -> None:
        super().__init__(lab, name, netns, address)
        self.port = port
        self.bridge = "br0"  # the bridge its port is on (see `NetLab.split`)

    def cut(self) -> float:
        """Partition this host from everyone (hub, other hosts, root namespace). Returns the time (time.time())
        once the cut is in effect."""
        _ip("-n", self.lab.hub.netns, "link", "set", self.port, "down")
        return time.time()

    def heal(self) -> float:
        """Reconnect this host. Returns the time (time.time()) just before the link came back: from then on
        traffic may flow (`cut` returns the time once the cut is in effect)."""
        start = time.time()
        _ip("-n", self.lab.hub.netns, "link", "set", self.port, "up")
        return start

    def is_cut(self) -> bool:
        out = _ip("-n", self.lab.hub.netns, "-o", "link", "show", self.port).stdout
        flags = re.search(r"<([^>]*)>", out)
        return flags is None or "UP" not in flags.group(1).split(",")


class NetLab:
    """A bridge in a hub namespace, hosts on it, and (with `root_link`) a veth to it from the root namespace.

    Use as a context manager or call `close()`: the namespaces (and with them every veth and the bridge) are
    deleted and the processes in them killed, also when a test failed."""

    def __init__(self, root_link: bool = True) -> None:
        self.owner = os.getpid()
        self.lab_id = f"{random.getrandbits(20):05x}"
        self.subnet = self._free_subnet()
        self.root_link = root_link
        self.processes: list[subprocess.Popen] = []
        self.hosts: list[Host] = []
        self._made: list[str] = []
        self._bridges = 0
        self._root_veth = f"rg{self.lab_id}r"
        self.root_address = str(self.subnet.network_address + 254) if root_link else None
        try:
            self.hub = self._make_hub()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A 10.77.S.0/24 that no address or route of the root namespace (or another lab's root veth) uses."""
        used = _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", check=False).stdout
        nets = [ipaddress.ip_network(m, strict=False) for m in re.findall(r"\d+\.\d+\.\d+\.\d+(?:/\d+)?", used)]
        choices = list(range(1, 254))
        random.shuffle(choices)
        for third in choices:
            candidate = ipaddress.ip_network(f"10.77.{third}.0/24")
            if not any(candidate.overlaps(n) for n in nets):
                return candidate
        raise RuntimeError("no free 10.77.S.0/24 subnet for a network lab")

    def _netns(self, what: str) -> str:
        name = f"{PREFIX}-{self.owner}-{self.lab_id}-{what}"
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _make_hub(self) -> Namespace:
        hub = self._netns("hub")
        prefix = self.subnet.prefixlen
        _ip("-n", hub, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        # A fixed MAC: a bridge otherwise takes the lowest of its ports' MACs, so `split`/`join` would change the
        # hub's MAC and hosts with the old one in their ARP cache would lose the hub for up to ~30 s.
        _ip("-n", hub, "link", "set", "br0", "address", "02:77:00:00:00:01")
        _ip("-n", hub, "addr", "add", f"{self.subnet.network_address + 1}/{prefix}", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        if self.root_link:
            _ip("link", "add", self._root_veth, "type", "veth", "peer", "name", "uplink", "netns", hub)
            _ip("-n", hub, "link", "set", "uplink", "master", "br0", "up")
            _ip("addr", "add", f"{self.root_address}/{prefix}", "dev", self._root_veth)
            _ip("link", "set", self._root_veth, "up")
        return Namespace(self, "hub", hub, str(self.subnet.network_address + 1))

    def add_host(self, name: str) -> Host:
        """A new host namespace on the bridge, at 10.77.S.<10 + its index>."""
        if not re.fullmatch(r"[a-z0-9]{1,8}", name):
            raise ValueError(f"host name {name!r}: use 1-8 lowercase letters or digits")
        index = len(self.hosts)
        netns = self._netns(name)
        port = f"p{index}"
        address = str(self.subnet.network_address + 10 + index)
        hub = self.hub.netns
        _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", Host.ifname, "netns", netns)
        _ip("-n", hub, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", Host.ifname)
        _ip("-n", netns, "link", "set", Host.ifname, "up")
        host = Host(self, name, netns, address, port)
        self.hosts.append(host)
        return host

    def split(self, hosts: Sequence[Host]) -> float:
        """Partition `hosts` from the rest of the lab (the hub, the root link, the other hosts) while they still
        reach each other: their ports move to a bridge of their own (with no address, so no way out). Why not
        `cut()` each: that would leave every host alone, and a partition of two sides needs both sides to work.
        Returns the time (time.time()) once the split is in effect."""
        self._bridges += 1
        bridge = f"br{self._bridges}"
        hub = self.hub.netns
        _ip("-n", hub, "link", "add", bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("-n", hub, "link", "set", bridge, "up")
        for host in hosts:
            _ip("-n", hub, "link", "set", host.port, "master", bridge)
            host.bridge = bridge
        return time.time()

    def join(self, hosts: Sequence[Host]) -> float:
        """Undo `split` for `hosts`: their ports go back to the lab's bridge. Returns the time (time.time()) just
        before the first one did."""
        start = time.time()
        hub = self.hub.netns
        left = set()
        for host in hosts:
            if host.bridge != "br0":
                _ip("-n", hub, "link", "set", host.port, "master", "br0")
                left.add(host.bridge)
                host.bridge = "br0"
        for bridge in left - {h.bridge for h in self.hosts}:
            _ip("-n", hub, "link", "delete", bridge)
        return start

    def close(self) -> None:
        """Kill the lab's processes, delete its namespaces (their veths and bridge go with them)."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for netns in reversed(self._made):
            _kill_namespace_processes(netns)
            _ip("netns", "delete", netns, check=False)
        self._made.clear()
        if self.root_link and _ip("link", "show", self._root_veth, check=False).returncode == 0:
            _ip("link", "delete", self._root_veth, check=False)  # normally gone with its peer in the hub

    def leftovers(self) -> list[str]:
        """What `close()` should have removed but did not (empty after a clean close)."""
        names = [n for n in _namespaces() if n.startswith(f"{PREFIX}-{self.owner}-{self.lab_id}-")]
        if self.root_link and _ip("link", "show", self._root_veth, check=False).returncode == 0:
            names.append(self._root_veth)
        return names

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def lab_or_skip(root_link: bool = True) -> Iterator[NetLab]:
    """A `NetLab` for one test, closed afterwards (also on failure); skips the test where none can be made."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sweep_stale()
    try:
        lab = NetLab(root_link=root_link)
    except NetnsUnavailable as exc:
        pytest.skip(f"network lab unavailable: {exc}")
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def netlab() -> Iterator[NetLab]:
    """A `NetLab` with a root link; every namespace and veth it made is gone after the test, pass or fail."""
    with lab_or_skip() as lab:
        yield lab
