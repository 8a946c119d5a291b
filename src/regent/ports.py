"""Ports chosen now and bound later, by another process (a torch TCPStore, a worker, a Lighthouse).

A port the OS hands out for `bind(0)` comes from its ephemeral range, and so does every later `bind(0)` and every
outgoing connection's source port: between the choice and the bind, any process on the host may take it. Seen in a
full test run: a trainer's TCPStore (`MASTER_PORT`) pinged a port another process's actor transport had taken in
the seconds the trainer took to start, and the replica hung for a minute before failing ("Ping failed ... Got:
1414416210", which is that transport's hello, b"RGNT"). Ports chosen here come from outside the ephemeral range,
where the OS never hands out ports by itself; they are checked free when chosen."""

from __future__ import annotations

import random
import socket

_LINUX_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # below this, well-known and registered services are common


def ephemeral_range(path: str = _LINUX_RANGE) -> tuple[int, int]:
    """The OS's range for ports it picks itself (Linux: from /proc; elsewhere the IANA range)."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        if 1 <= lo <= hi <= 65535:
            return lo, hi
    except (OSError, ValueError):
        pass  # not Linux, or unreadable: the IANA dynamic range below
    return 49152, 65535


def choice_ranges(lo: int, hi: int) -> list[tuple[int, int]]:
    """Port ranges (inclusive) outside the ephemeral range [lo, hi] and above _LOWEST, widest first."""
    ranges = [(_LOWEST, lo - 1), (hi + 1, 65535)]
    ranges = [(a, b) for a, b in ranges if b - a >= 100]
    return sorted(ranges, key=lambda r: r[0] - r[1])


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on `host` now, for a server another process starts a moment later (see the module doc)."""
    rng = rng or random.SystemRandom()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ranges = choice_ranges(*ephemeral_range())
    for _ in range(64 if ranges else 0):
        a, b = ranges[0]
        port = rng.randint(a, b)
        if _bindable(host, port):  # else taken: another one
            return port
    # no room outside the ephemeral range (an unusual host setting), or all tried were taken: the OS's choice
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_pair(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port P with P and P+1 both free now: the Lighthouse serves gRPC on P and its dashboard on P+1.

    Chosen outside the ephemeral range like `free_port`: inside it, P+1 is often some connection's source port, and
    one taken between the choice and the bind made a Lighthouse asked for port 0 fail (seen in a full test run
    beside a 12,800-client simulation: every one of 50 tries hit a taken P+1)."""
    rng = rng or random.SystemRandom()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ranges = choice_ranges(*ephemeral_range())
    for _ in range(128 if ranges else 0):
        a, b = ranges[0]
        port = rng.randint(a, b - 1)
        if _bindable(host, port) and _bindable(host, port + 1):
            return port
    for _ in range(200):  # no room outside the ephemeral range: the OS's choice of P, P+1 checked
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port < 65535 and _bindable(host, port + 1):
            return port
    raise RuntimeError(f"no free port pair on {host}")
