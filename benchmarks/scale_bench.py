"""Lighthouse scale: server CPU per heartbeat with many replica groups, and the cost of new incarnations.

    .venv/bin/python benchmarks/scale_bench.py                          # every section, every server
    .venv/bin/python benchmarks/scale_bench.py --groups 1024 4096 --ids 10000
    .venv/bin/python benchmarks/scale_bench.py --src /tmp/before/src    # the same against another source tree
    .venv/bin/python benchmarks/scale_bench.py --profile /tmp/lh.prof   # cProfile of the server's loop thread
    .venv/bin/python benchmarks/scale_bench.py --only join --servers regent torchft
    .venv/bin/python benchmarks/scale_bench.py --only steady --groups 1024 --servers regent regent-grpcio torchft \
        --src /tmp/before/src                                           # grpcio's server: a tree before 1ba06ef+1

Why a raw HTTP/2 client: the quantity measured is the server's CPU, and the machine may be shared, so the client
must be cheap and must not share the server's GIL. It speaks just enough HTTP/2 to send unary gRPC calls the way
tonic (TorchFT's client) does: one connection per replica group, one stream per call, byte-identical headers.

Sections:
- steady: N groups ("group<i>:<uuid>"), each on its own connection (one Manager per group), heartbeat
  round-robin at a fixed total rate (`--rate`, at most one call in flight per group). Reported: server CPU
  (the Lighthouse process's threads, from /proc/<pid>/task/*/schedstat) per answered heartbeat over `--seconds`, then its CPU
  per second with the N entries in the table and no calls for `--seconds / 2` (the periodic tick's cost, which
  each heartbeat pays a share of: that share is idle CPU / rate).
- incarnations: `--ids` new ids of new groups, pipelined on one connection ("fresh"); then every one of those
  groups comes back under a new uuid while its older id is still in the table ("churn"). Reported: server CPU
  per new id and in total.
- join: N groups (`--join-groups`, each its own connection) send their quorum request at once to a Lighthouse that
  wants all N (min_replicas = N); reported: the time until every group has its answer (median of
  `--join-rounds` rounds on the same connections) and the server CPU meanwhile. The answers carry every member,
  so their size grows with N squared; the client only counts frames.

Every section runs against each server of `--servers`, one after the other in the same run: `regent` (the
default `regent lighthouse`, served by `grpc_lite`), `regent-grpcio` (`--server grpcio`: grpcio's asyncio server,
removed from Regent after commit 1ba06ef, so it needs `--src` of a tree from before; kept to re-measure the
decision), `regent-h2` (the same Lighthouse with the `h2` library's HTTP/2 connection in place of `grpc_lite`'s
own: `h2_connection.py`, needs `pip install h2`) and `torchft` (TorchFT's Rust Lighthouse, the anchor; used by default when torchft-nightly is installed).

The server is `regent lighthouse` (the CLI users run) in its own process; `--src DIR` puts DIR first on its
PYTHONPATH, so an older checkout (`git archive <rev> src | tar -x -C /tmp/before`) is measured the same way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ft_bench import free_port_pair  # noqa: E402 - the sibling benchmark's helper (stdlib-only imports)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
HEARTBEAT_PATH = b"/torchft.LighthouseService/Heartbeat"
QUORUM_PATH = b"/torchft.LighthouseService/Quorum"
SERVERS = ("regent", "regent-h2", "regent-grpcio", "torchft")


# ---- a minimal gRPC-over-HTTP/2 client ----------------------------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream_id.to_bytes(4, "big") + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """'Literal without indexing, new name' (RFC 7541 6.2.2); names and values here are under 127 bytes."""
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def heartbeat_message(replica_id: str) -> bytes:
    """A length-prefixed `LighthouseHeartbeatRequest{replica_id}` (field 1, a string), as gRPC frames it."""
    rid = replica_id.encode()
    body = b"\x0a" + _varint(len(rid)) + rid
    return b"\x00" + len(body).to_bytes(4, "big") + body


class H2Client:
    """One HTTP/2 connection sending unary calls; counts the calls answered (DATA then trailers) and failed."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._authority = f"{host}:{port}".encode()
        self._headers: dict[bytes, bytes] = {}
        self._next_stream = 1
        self._buf = bytearray()
        self._with_data: set[int] = set()
        big = 2**31 - 1
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, big))
                          + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", big - 65_535)))

    def request(self, message: bytes, path: bytes = HEARTBEAT_PATH) -> bytes:
        """The frames of one call (not sent)."""
        headers = self._headers.get(path)
        if headers is None:
            headers = self._headers[path] = b"".join(_literal(k, v) for k, v in (
                (b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", self._authority),
                (b"content-type", b"application/grpc"), (b"te", b"trailers")))
        sid = self._next_stream
        self._next_stream += 2
        return frame(HEADERS, END_HEADERS, sid, headers) + frame(DATA, END_STREAM, sid, message)

    def feed(self, data: bytes) -> tuple[int, int]:
        """Parse what the server sent; returns (calls answered, calls failed) completed by it."""
        buf = self._buf
        buf += data
        ok = failed = pos = 0
        reply = b""
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            pos += 9 + length
            if kind == DATA and sid:
                self._with_data.add(sid)
            elif kind == HEADERS and flags & END_STREAM:
                if sid in self._with_data:
                    self._with_data.discard(sid)
                    ok += 1
                else:
                    failed += 1  # trailers only: an error status
            elif kind == RST_STREAM:
                failed += 1
            elif kind == SETTINGS and not flags & ACK:
                reply += frame(SETTINGS, ACK, 0)
            elif kind == GOAWAY:
                raise ConnectionError("server sent GOAWAY")
        del buf[:pos]
        if reply:
            self.sock.sendall(reply)
        return ok, failed


# ---- the server under test ------------------------------------------------------------------------------------------


def quorum_message(replica_id: str, step: int = 0) -> bytes:
    """A length-prefixed `LighthouseQuorumRequest` as TorchFT's Manager sends it (built with the generated
    classes: the client's encoding cost is not the quantity measured)."""
    from regent.ft.proto import torchft_pb2

    member = torchft_pb2.QuorumMember(replica_id=replica_id, address=f"http://10.0.0.1:{29600}",
                                      store_address="10.0.0.1:29700", step=step, world_size=8)
    body = torchft_pb2.LighthouseQuorumRequest(requester=member).SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def start_lighthouse(port: int, src: str | None, profile: str | None, kind: str = "regent",
                     min_replicas: int = 1, frontends: int = 0,
                     heartbeat_timeout_ms: int = 5000) -> subprocess.Popen:
    """`kind`: regent (`regent lighthouse`), regent-grpcio (`--server grpcio`, trees up to 1ba06ef), torchft
    (TorchFT's Rust `torchft_lighthouse`, the anchor). `frontends`: Regent's `--frontends N`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    flags = ["--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas), "--join_timeout_ms", "60000",
             "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    if profile and kind == "regent":
        cmd = [PYTHON, str(Path(__file__).resolve()), "--serve-profiled", str(port), profile]
    elif kind == "regent-h2":
        cmd = [PYTHON, str(Path(__file__).resolve().parent / "h2_connection.py"), "--serve", str(port)]
    elif kind == "torchft":
        exe = shutil.which("torchft_lighthouse") or str(Path(PYTHON).parent / "torchft_lighthouse")
        cmd = [exe, *flags]
    else:
        cmd = [PYTHON, "-m", "regent.cli", "lighthouse", "--log-level", "WARNING", *flags]
        if kind == "regent-grpcio":
            cmd += ["--server", "grpcio"]
        if frontends:
            cmd += ["--frontends", str(frontends)]
    # stderr goes to a file, not a pipe nobody reads: a chatty server must not block on it, and a failed start
    # reports why
    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err_file)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return proc
            except OSError:
                if proc.poll() is not None:
                    err_file.seek(0)
                    tail = err_file.read()[-2000:].decode(errors="replace").strip()
                    raise RuntimeError(f"the Lighthouse ({cmd[0]}) exited with {proc.returncode}: {tail}") from None
                time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"no Lighthouse on 127.0.0.1:{port} after 60 s")


def stop_lighthouse(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, all threads, in nanoseconds from /proc/<pid>/task/*/schedstat (utime + stime in
    /proc/<pid>/stat counts whole 10 ms clock ticks: too coarse for a near-idle server)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its children (the Lighthouse and its front ends)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in children:
            try:
                total += cpu_seconds(int(child))
            except FileNotFoundError:
                continue
    return total


def serve_profiled(port: int, out: str) -> None:
    """Internal mode: a Lighthouse whose loop thread runs under cProfile from SIGUSR1 on; stats go to `out` at
    SIGTERM."""
    import cProfile
    import threading

    from regent.ft.lighthouse import LighthouseServer

    server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=60000)
    prof = cProfile.Profile(time.thread_time)  # CPU time: on a busy machine wall time counts others
    # SIGUSR1 (sent as a measured window starts) profiles the loop thread from then on: enable() there.
    signal.signal(signal.SIGUSR1, lambda *_: server._loop.call_soon_threadsafe(prof.enable))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    done = threading.Event()
    server._loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
    done.wait(10)
    prof.dump_stats(out)
    server.shutdown()


# ---- sections ---------------------------------------------------------------------------------------------------------


def bench_steady(port: int, pid: int, groups: int, rate: float, seconds: float, warmup: float,
                 profiling: bool = False) -> dict:
    """Heartbeats from `groups` groups, one connection each, round-robin at `rate` calls/s in total."""
    tag = uuid.uuid4().hex[:8]
    conns = [H2Client(port) for _ in range(groups)]
    messages = [heartbeat_message(f"group{i}:{tag}-{uuid.uuid4()}") for i in range(groups)]
    sel = selectors.DefaultSelector()
    for i, c in enumerate(conns):
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, i)
    idle = collections.deque(range(groups))
    answered = failed = sent = 0

    def run_for(duration: float, send: bool = True) -> None:
        nonlocal answered, failed, sent
        start = time.monotonic()
        sent_at_start = sent
        end = start + duration
        while True:
            now = time.monotonic()
            if now >= end:
                return
            due = int((now - start) * rate) - (sent - sent_at_start) if rate > 0 else len(idle)
            for _ in range(min(due, len(idle)) if send else 0):
                i = idle.popleft()
                conns[i].sock.send(conns[i].request(messages[i]))
                sent += 1
            for key, _ in sel.select(timeout=0.002):
                i = key.data
                try:
                    data = conns[i].sock.recv(65536)
                except BlockingIOError:
                    continue
                if not data:
                    raise ConnectionError("the Lighthouse closed a connection")
                ok, bad = conns[i].feed(data)
                answered += ok
                failed += bad
                if ok or bad:
                    idle.append(i)

    for i in range(groups):  # every group's first heartbeat (a new incarnation), then the steady state
        conns[i].sock.send(conns[i].request(messages[i]))
    idle.clear()
    while len(idle) < groups:
        run_for(0.1, send=False)
    run_for(warmup)
    if profiling:
        os.kill(pid, signal.SIGUSR1)
    cpu0, answered0, t0 = tree_cpu_seconds(pid), answered, time.monotonic()
    run_for(seconds)
    cpu1, answered1, t1 = tree_cpu_seconds(pid), answered, time.monotonic()
    while len(idle) < groups:  # let the calls in flight finish, then listen to the quiet
        run_for(0.1, send=False)
    cpu2, t2 = tree_cpu_seconds(pid), time.monotonic()
    run_for(seconds / 2, send=False)
    idle_ms_per_s = 1e3 * (tree_cpu_seconds(pid) - cpu2) / (time.monotonic() - t2)
    for c in conns:
        sel.unregister(c.sock)
        c.sock.close()
    calls = answered1 - answered0
    # a failed call (error status or reset stream) is a result, not a crash of the benchmark: reported per row
    return {"section": "steady", "groups": groups, "calls": calls, "failed": failed, "calls_per_s": calls / (t1 - t0),
            "server_cpu_s": cpu1 - cpu0, "us_per_heartbeat": 1e6 * (cpu1 - cpu0) / max(calls, 1),
            "idle_cpu_ms_per_s": idle_ms_per_s}


def pipelined(port: int, pid: int, ids: list[str], window: int = 256) -> tuple[float, float]:
    """Send one heartbeat per id on one connection, `window` in flight. Returns (server CPU s, wall s)."""
    client = H2Client(port)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    in_flight = answered = failed = 0
    pending = iter(ids)
    exhausted = False
    while answered + failed < len(ids):
        batch = []
        while not exhausted and in_flight < window:
            rid = next(pending, None)
            if rid is None:
                exhausted = True
                break
            batch.append(client.request(heartbeat_message(rid)))
            in_flight += 1
        if batch:
            client.sock.sendall(b"".join(batch))
        data = client.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the Lighthouse closed the connection")
        ok, bad = client.feed(data)
        answered += ok
        failed += bad
        in_flight -= ok + bad
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    client.sock.close()
    if failed:
        raise RuntimeError(f"{failed} heartbeats failed")
    return cpu1 - cpu0, t1 - t0


def bench_incarnations(port: int, pid: int, n: int, profiling: bool = False) -> list[dict]:
    if profiling:
        os.kill(pid, signal.SIGUSR1)
    groups = [f"inc{i}" for i in range(n)]
    rows = []
    for phase in ("fresh", "churn"):
        ids = [f"{g}:{uuid.uuid4()}" for g in groups]
        cpu, wall = pipelined(port, pid, ids)
        rows.append({"section": "incarnations", "phase": phase, "ids": n, "server_cpu_s": cpu, "wall_s": wall,
                     "us_per_id": 1e6 * cpu / n})
    return rows


def send_and_collect(conns: list, sel: selectors.BaseSelector, requests: list[bytes],
                     limit_s: float) -> tuple[int, int, int]:
    """Send each connection its request at once and read until every one is answered: (ok, errors, bytes read).
    `sel` has every connection's socket registered, non-blocking, with its index as data."""
    for c, req in zip(conns, requests):
        c.sock.sendall(req)
    return collect_answers(conns, sel, limit_s)


def collect_answers(conns: list, sel: selectors.BaseSelector, limit_s: float) -> tuple[int, int, int]:
    """Read until every connection's request (already sent) is answered: (ok, errors, bytes read)."""
    t0 = time.monotonic()
    done = failed = nbytes = 0
    while done < len(conns):
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError(f"only {done}/{len(conns)} quorum answers after {limit_s:.0f} s")
        for key, _ in sel.select(timeout=0.05):
            try:
                data = conns[key.data].sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                raise ConnectionError("the Lighthouse closed a connection")
            nbytes += len(data)
            ok, bad = conns[key.data].feed(data)
            done += ok + bad
            failed += bad
    return done - failed, failed, nbytes


def bench_join(port: int, pid: int, groups: int, rounds: int = 3) -> dict:
    """`groups` groups, one connection each, send their quorum request at once (the server wants all of them:
    min_replicas = groups); the time until every one has its answer, and the server CPU meanwhile. Several
    rounds on the same connections (each a new quorum, as after a step); the median round is reported."""
    conns = [H2Client(port) for _ in range(groups)]
    tag = uuid.uuid4().hex[:8]
    ids = [f"group{i}:{tag}" for i in range(groups)]
    sel = selectors.DefaultSelector()
    for i, c in enumerate(conns):
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, i)
    walls, cpus, reply_bytes, failed = [], [], 0, 0
    for r in range(rounds):
        requests = [c.request(quorum_message(rid, step=r), QUORUM_PATH) for c, rid in zip(conns, ids)]
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        _, bad, nbytes = send_and_collect(conns, sel, requests, limit_s=120)
        reply_bytes += nbytes
        failed += bad  # an error status is a result (reported), and that group is answered
        walls.append(time.monotonic() - t0)
        cpus.append(cpu_seconds(pid) - cpu0)
    for c in conns:
        sel.unregister(c.sock)
        c.sock.close()
    mid = sorted(range(rounds), key=lambda i: walls[i])[rounds // 2]
    return {"section": "join", "groups": groups, "rounds": rounds, "wall_ms": 1e3 * walls[mid],
            "server_cpu_ms": 1e3 * cpus[mid], "all_wall_ms": [round(1e3 * w, 1) for w in walls],
            "reply_mb_per_round": reply_bytes / rounds / 1e6, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("steady", "incarnations", "join"), action="append")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                        help="Lighthouses to measure side by side (default: regent, and torchft when installed)")
    parser.add_argument("--groups", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--join-groups", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--join-rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=5000.0, help="heartbeats/s in total (0: as fast as possible)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per group count")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--ids", type=int, default=10_000, help="new incarnations per phase")
    parser.add_argument("--frontends", type=int, default=0,
                        help="Regent's `--frontends N` for the regent server (CPU counts the front ends too)")
    parser.add_argument("--src", help="a source tree to put first on the server's PYTHONPATH")
    parser.add_argument("--profile", help="write a cProfile of the server's loop thread here (one server run)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--serve-profiled", nargs=2, metavar=("PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_profiled:
        serve_profiled(int(args.serve_profiled[0]), args.serve_profiled[1])
        return 0
    sections = args.only or ["steady", "incarnations", "join"]
    servers = args.servers or (["regent"] + (["torchft"] if shutil.which("torchft_lighthouse")
                                             or (Path(PYTHON).parent / "torchft_lighthouse").exists() else []))
    if "torchft" not in servers:
        print("torchft_lighthouse not found: measuring Regent only (pip install torchft-nightly)")
    rows: list[dict] = []

    def run(kind: str, min_replicas: int, measure, section: str, groups: int) -> None:
        port = free_port_pair()
        proc = start_lighthouse(port, args.src, args.profile, kind, min_replicas,
                                frontends=args.frontends if kind == "regent" else 0)
        try:
            measured = measure(port, proc.pid)
        except (OSError, RuntimeError, TimeoutError) as err:  # a server that breaks under the load is a result
            measured = [{"section": section, "groups": groups, "error": f"{type(err).__name__}: {err}"}]
        finally:
            stop_lighthouse(proc)
        for row in measured:
            row["server"] = kind
            row["frontends"] = args.frontends if kind == "regent" else 0
            rows.append(row)
            print(json.dumps(row), flush=True)

    for kind in servers:
        profiling = bool(args.profile) and kind == "regent"
        if "steady" in sections:
            for groups in args.groups:
                run(kind, 1, lambda port, pid, g=groups, p=profiling: [bench_steady(
                    port, pid, g, args.rate, args.seconds, args.warmup, profiling=p)], "steady", groups)
        if "incarnations" in sections:
            run(kind, 1, lambda port, pid, p=profiling: bench_incarnations(port, pid, args.ids, profiling=p),
                "incarnations", args.ids)
        if "join" in sections:
            for groups in args.join_groups:
                run(kind, groups, lambda port, pid, g=groups: [bench_join(port, pid, g, args.join_rounds)], "join", groups)
    print(f"\nload average while measuring: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for r in rows:
        label = r["server"] + (f" ({r['frontends']} fe)" if r.get("frontends") else "")
        who = f"{label:<14}"
        if "error" in r:
            print(f"{who} {r['section']:<13} {r['groups']:>6}         FAILED: {r['error']}")
        elif r["section"] == "steady":
            print(f"{who} steady        {r['groups']:>6} groups  {r['us_per_heartbeat']:8.1f} us server CPU/heartbeat "
                  f"({r['calls_per_s']:.0f} heartbeats/s, {r['failed']} failed); with no calls "
                  f"{r['idle_cpu_ms_per_s']:.1f} ms/s")
        elif r["section"] == "join":
            print(f"{who} join          {r['groups']:>6} groups  {r['wall_ms']:8.1f} ms until all answered "
                  f"(rounds {r['all_wall_ms']}), server CPU {r['server_cpu_ms']:.1f} ms, "
                  f"{r['reply_mb_per_round']:.1f} MB of answers, {r['failed']} failed")
        else:
            print(f"{who} incarnations  {r['phase']:>6} {r['ids']:>6} ids  {r['server_cpu_s']:8.2f} s server CPU "
                  f"({r['us_per_id']:.1f} us/id)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
