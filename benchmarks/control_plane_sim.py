"""The control plane at 1k, 4k and 12.8k replica groups: the simulator (`regent.ft.simulate`) against Regent's
Lighthouse and TorchFT's, and one quorum round's Lighthouse time with and without the compact answer.

    .venv/bin/python benchmarks/control_plane_sim.py                       # everything, as in RESULTS.md
    .venv/bin/python benchmarks/control_plane_sim.py --only sim --groups 1000
    .venv/bin/python benchmarks/control_plane_sim.py --only round --round-groups 1024 4096 12800

Sections:
- sim: N simulated groups in `--workers` client processes heartbeat (interval per row: 100 ms where the box can
  carry it, else 1 s: the rate is in the table), join a quorum round every `--quorum-every` s (Regent: compact
  answers; TorchFT: full, and no rounds past 1k groups, where its full answers take minutes), fail at
  `--faults-per-s` (half crash, half hang) and restart as new incarnations after `--down` s. Reported: heartbeat
  lag (send to answer; the Lighthouse applies a heartbeat before it answers), quorum round time, missed and
  false failures (Regent only: TorchFT's Lighthouse does not expose its heartbeat table), the Lighthouse's CPU.
  Regent's Lighthouse runs in the coordinator process (CPU: its loop thread); TorchFT's is its own process.
- round: N groups (`--round-groups`, one connection each, scale_bench's raw HTTP/2 client) ask for the same quorum
  at once (min_replicas = N); the time until all are answered and the Lighthouse process's CPU meanwhile, median
  of `--rounds`, full answers (TorchFT's, O(N^2) bytes) against compact ones (O(N)).

`--frontends 0 4` runs every Regent row once per value: 0 is one process (as before), N > 0 is the Lighthouse
with N front-end processes sharing its port (`regent.ft.frontends`); its CPU is then the owner's plus the front
ends' (the owner's alone in its own column), and "into table" is how late the batched heartbeats reached the
owner's liveness table (the simulator's lag then ends at the front end's answer).

- frontend: one front end's CPU per call (`regent lighthouse --frontends 1`: the Lighthouse process tree's CPU
  less the owner's), N groups (`--round-groups`, one connection each): `--rounds` + 2 rounds of one heartbeat per
  group, then `--rounds` rounds of compact joins (the first of each kind dropped as warm-up); median per call.
  HTTP/2, HPACK, protobuf, the pre-decoding and the answers, and the socket calls: what decides a round's wall
  time once the owner is fast (issue 37).

- owner: the quorum owner's own CPU for a round of N front-end joins (`--round-groups`), in process, without
  the front ends' processes or clients: the link frames front ends send (pre-decoded joins, `--owner-batch` per
  frame; `--secret`: nonces spent) into the owner's link handler, until every call is answered: the part of a
  round with front ends that stays on one core.

Writes benchmarks/results/control_plane_sim.json and, with matplotlib, control_plane_sim.png.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
from ft_bench import free_port_pair  # noqa: E402
from scale_bench import (  # noqa: E402
    QUORUM_PATH,
    H2Client,
    collect_answers,
    cpu_seconds,
    send_and_collect,
    start_lighthouse,
    stop_lighthouse,
    tree_cpu_seconds,
)

from regent.ft.simulate import SimConfig, format_report, run_simulation, torchft_lighthouse_exe  # noqa: E402


def quorum_message(replica_id: str, step: int, compact: bool) -> bytes:
    from regent.ft.proto import torchft_pb2

    member = torchft_pb2.QuorumMember(replica_id=replica_id, address="http://10.0.0.1:29600",
                                      store_address="10.0.0.1:29700", step=step, world_size=8)
    request = torchft_pb2.LighthouseQuorumRequest(requester=member)
    if compact:
        request.regent_compact.SetInParent()
    body = request.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _round_client(port: int, first: int, count: int, rounds: int, compact: bool, pipe, warm: bool = True) -> None:
    """One of `--round-clients` processes: groups first..first+count, one connection each. Per round: build the
    requests, say ready, wait for go, send them all, read every answer, report (started, sent, answered, failed,
    bytes, own CPU). CLOCK_MONOTONIC is one clock for every process of the host. `warm`: first one heartbeat per
    connection, as a Manager heartbeats from its start: its first quorum call then rides a connection whose
    HTTP/2 settings and header table are set up (without it the first round also pays every connection's setup)."""
    from scale_bench import heartbeat_message

    conns, sel = open_clients(port, count)
    if warm:
        for i, c in enumerate(conns):
            c.sock.sendall(c.request(heartbeat_message(f"group{first + i}:x")))
        _, failed, _ = collect_answers(conns, sel, limit_s=300)
        if failed:
            raise RuntimeError(f"{failed} warm-up heartbeats failed")
    for r in range(rounds):
        requests = [c.request(quorum_message(f"group{first + i}:x", r, compact), QUORUM_PATH)
                    for i, c in enumerate(conns)]
        pipe.send("ready")
        pipe.recv()
        cpu0, t0 = time.process_time(), time.monotonic()
        for c, req in zip(conns, requests):
            c.sock.sendall(req)
        sent = time.monotonic()
        _, failed, got = collect_answers(conns, sel, limit_s=300)
        pipe.send((t0, sent, time.monotonic(), failed, got, time.process_time() - cpu0))
    for c in conns:
        c.sock.close()


def _rounds_from_clients(port: int, pid: int, groups: int, rounds: int, compact: bool,
                         clients: int, warm: bool = True) -> tuple[list, list, list, list, int, list]:
    """Each round's (wall, after the last join left its client, tree CPU, owner CPU), bytes, clients' CPU: the
    joins sent by `clients` processes at once, so that the clients' own Python (one process sends 12,800
    requests and reads 12,800 answers in ~0.3 s on a 16-core host) does not stand in for the Lighthouse's time."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    share = [groups // clients + (1 if k < groups % clients else 0) for k in range(clients)]
    pipes, procs, first = [], [], 0
    for n in share:
        here, there = ctx.Pipe()
        p = ctx.Process(target=_round_client, args=(port, first, n, rounds, compact, there, warm), daemon=True)
        p.start()
        pipes.append(here)
        procs.append(p)
        first += n
    walls, afters, cpus, owner_cpus, client_cpus, nbytes = [], [], [], [], [], 0
    try:
        for _ in range(rounds):
            for pipe in pipes:
                if not pipe.poll(300):
                    raise TimeoutError("a round client did not get ready in 300 s")
                pipe.recv()
            cpu0, owner0 = tree_cpu_seconds(pid), cpu_seconds(pid)
            for pipe in pipes:
                pipe.send("go")
            reports = []
            for pipe in pipes:
                if not pipe.poll(330):
                    raise TimeoutError("a round client did not finish its round in 330 s")
                reports.append(pipe.recv())
            cpus.append(tree_cpu_seconds(pid) - cpu0)
            owner_cpus.append(cpu_seconds(pid) - owner0)
            if any(r[3] for r in reports):
                raise RuntimeError(f"{sum(r[3] for r in reports)} quorum calls failed")
            walls.append(max(r[2] for r in reports) - min(r[0] for r in reports))
            afters.append(max(r[2] for r in reports) - max(r[1] for r in reports))
            client_cpus.append(max(r[5] for r in reports))
            nbytes += sum(r[4] for r in reports)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return walls, afters, cpus, owner_cpus, nbytes, client_cpus


def join_round(kind: str, groups: int, rounds: int, compact: bool, frontends: int = 0,
               heartbeat_timeout_ms: int = 5000, clients: int = 1, warm: bool = True) -> dict:
    """`groups` groups ask for one quorum at once, `rounds` times; the median round's wall time and server CPU
    (with front ends: the owner's, and the owner's plus the front ends'). `clients` > 1: the groups' joins come
    from that many processes, and the row adds the time from the last join's send to the last answer."""
    port = free_port_pair()
    proc = start_lighthouse(port, None, None, kind, min_replicas=groups, frontends=frontends,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)
    if clients > 1:
        try:
            walls, afters, cpus, owner_cpus, nbytes, client_cpus = _rounds_from_clients(
                port, proc.pid, groups, rounds, compact, clients, warm)
        finally:
            stop_lighthouse(proc)
        mid = sorted(range(rounds), key=lambda i: walls[i])[rounds // 2]
        return {"section": "round", "server": kind, "groups": groups, "compact": compact,
                "wall_ms": 1e3 * walls[mid], "after_last_join_ms": 1e3 * afters[mid],
                "all_after_last_join_ms": [round(1e3 * a) for a in afters], "client_cpu_ms": 1e3 * client_cpus[mid],
                "clients": clients, "warm": warm, "server_cpu_ms": 1e3 * cpus[mid], "owner_cpu_ms": 1e3 * owner_cpus[mid],
                "frontends": frontends, "all_wall_ms": [round(1e3 * w) for w in walls],
                "bytes_per_answer": nbytes / rounds / groups}
    try:
        conns, sel = open_clients(port, groups)
        walls, cpus, owner_cpus, nbytes = [], [], [], 0
        for r in range(rounds):
            requests = [c.request(quorum_message(f"group{i}:x", r, compact), QUORUM_PATH) for i, c in enumerate(conns)]
            cpu0, owner0, t0 = tree_cpu_seconds(proc.pid), cpu_seconds(proc.pid), time.monotonic()
            _, failed, got = send_and_collect(conns, sel, requests, limit_s=300)
            nbytes += got
            walls.append(time.monotonic() - t0)
            cpus.append(tree_cpu_seconds(proc.pid) - cpu0)
            owner_cpus.append(cpu_seconds(proc.pid) - owner0)
            if failed:
                raise RuntimeError(f"{failed} quorum calls failed")
        for c in conns:
            c.sock.close()
    finally:
        stop_lighthouse(proc)
    mid = sorted(range(rounds), key=lambda i: walls[i])[rounds // 2]
    return {"section": "round", "server": kind, "groups": groups, "compact": compact, "wall_ms": 1e3 * walls[mid],
            "server_cpu_ms": 1e3 * cpus[mid], "owner_cpu_ms": 1e3 * owner_cpus[mid], "frontends": frontends,
            "all_wall_ms": [round(1e3 * w) for w in walls], "bytes_per_answer": nbytes / rounds / groups}


def open_clients(port: int, groups: int) -> tuple[list, selectors.BaseSelector]:
    """One non-blocking HTTP/2 client per group, registered for reading under its index."""
    conns = [H2Client(port) for _ in range(groups)]
    sel = selectors.DefaultSelector()
    for i, c in enumerate(conns):
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, i)
    return conns, sel


def frontend_round(pid: int, conns: list, sel: selectors.BaseSelector, requests: list[bytes], settle: float) -> float:
    """Send each connection its call, read every answer, wait `settle` s: the front ends' CPU meanwhile (the
    Lighthouse process tree's less the owner's), seconds."""
    tree0, owner0 = tree_cpu_seconds(pid), cpu_seconds(pid)
    _, failed, _ = send_and_collect(conns, sel, requests, limit_s=300)
    time.sleep(settle)
    if failed:
        raise RuntimeError(f"{failed} calls failed")
    return (tree_cpu_seconds(pid) - tree0) - (cpu_seconds(pid) - owner0)


def frontend_rows(groups_list: list[int], rounds: int) -> list[dict]:
    """One front end's CPU per heartbeat and per compact join (the `frontend` section): the Lighthouse's process
    tree less the owner, measured around each round of one call per group (a heartbeat round includes the front
    end's batch reaching the owner, 50 ms later)."""
    from scale_bench import HEARTBEAT_PATH, heartbeat_message

    rows = []
    for groups in groups_list:
        port = free_port_pair()
        proc = start_lighthouse(port, None, None, "regent", min_replicas=groups, frontends=1,
                                heartbeat_timeout_ms=120_000)
        try:
            conns, sel = open_clients(port, groups)

            beats = [1e6 * frontend_round(proc.pid, conns, sel, [c.request(heartbeat_message(f"group{i}:x"),
                                                                            HEARTBEAT_PATH) for i, c in enumerate(conns)],
                                          0.05) / groups for _ in range(rounds + 3)][1:]
            joins = [1e6 * frontend_round(proc.pid, conns, sel, [c.request(quorum_message(f"group{i}:x", r, True),
                                                                            QUORUM_PATH) for i, c in enumerate(conns)],
                                          0.0) / groups for r in range(rounds + 1)][1:]
            for c in conns:
                c.sock.close()
        finally:
            stop_lighthouse(proc)
        row = {"section": "frontend", "groups": groups, "us_per_heartbeat": sorted(beats)[len(beats) // 2],
               "us_per_join": sorted(joins)[len(joins) // 2], "all_heartbeat_us": [round(x, 1) for x in beats],
               "all_join_us": [round(x, 1) for x in joins], "load_avg": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def owner_frames(groups: int, step: int, batch: int, secret: bytes | None = None) -> list[bytes]:
    """The link frames N compact joins become in front ends (`regent.ft.joins`: one K_JOINS frame per `batch`
    calls), made outside the timed section: that work is the front ends'. With `secret`, each call carries a fresh
    proof's nonce, as a front end forwards it."""
    from regent.ft.frontends import K_JOINS, frame
    from regent.ft.joins import encode_joins, join_record
    from regent.ft.lighthouse import decode_quorum_request
    from regent.ft.rpc_security import make_token, proof_nonce

    records = []
    for i in range(groups):
        raw = quorum_message(f"group{i}:x", step, True)[5:]
        nonce = proof_nonce(make_token(secret, "/torchft.LighthouseService/Quorum").encode()) if secret else (0, 0)
        records.append(join_record(i + 1, nonce, decode_quorum_request(raw), raw))
    return [frame(K_JOINS, encode_joins(records[i:i + batch])) for i in range(0, groups, batch)]


def owner_join_rows(groups_list: list[int], rounds: int, batch: int = 16, secret: bool = False,
                    tune: bool = True) -> list[dict]:
    """The quorum owner's own CPU for a round of N front-end joins, without the front ends' processes or any
    client: the link frames a front end sends (`owner_frames`) go into a real `_OwnerLink` of the owner's loop
    (`data_received`, as from the socket), timed on that thread until the tick has answered every call (the
    round's plan, `compact.encode_plan`, and the K_SHARES frames included; the socket write is not). Median of
    `rounds`; the part of a round that stays on one core whatever the front ends do. The collector is tuned as
    in `regent lighthouse` (`lighthouse.tune_gc`; `tune=False` leaves this process's collector alone). With
    `secret`, every call's nonce is spent in the owner."""
    import asyncio

    from regent.ft.frontends import FrontendPool, _OwnerLink
    from regent.ft.lighthouse import LighthouseServer, tune_gc

    if tune:
        tune_gc()  # as `regent lighthouse` does in its process
    key = os.urandom(32) if secret else None
    rows = []
    for groups in groups_list:
        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, secret=key or b"", frontends=0)
        try:
            cpus = []
            for r in range(rounds + 1):  # the first round (the table filling up) is a warm-up
                frames = owner_frames(groups, r, batch, key)

                async def one_round(frames: list[bytes] = frames, server: LighthouseServer = server) -> float:
                    link = _OwnerLink(FrontendPool(server, 1, "127.0.0.1", 0, {}), 0)
                    t0 = time.thread_time()
                    for data in frames:
                        link.data_received(data)
                    while link.joins or link.calls or link.flush_pending:  # until answered, the answers framed
                        await asyncio.sleep(0)
                    return time.thread_time() - t0

                cpu = server._call_in_loop(one_round()).result(timeout=300)
                if r:
                    cpus.append(cpu)
        finally:
            server.shutdown()
        cpus.sort()
        row = {"section": "owner", "groups": groups, "batch": batch, "secret": secret,
               "owner_cpu_ms": 1e3 * cpus[len(cpus) // 2], "us_per_join": 1e6 * cpus[len(cpus) // 2] / groups,
               "all_ms": [round(1e3 * c, 1) for c in cpus], "load_avg": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sim_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    torchft = torchft_lighthouse_exe() is not None and not args.no_torchft
    for groups in args.groups:
        interval = args.interval_ms / 1000 if args.interval_ms else (0.1 if groups <= 1000 else 1.0)
        base = dict(groups=groups, workers=args.workers, duration_s=args.seconds, heartbeat_interval_s=interval,
                    heartbeat_timeout_s=5.0, quorum_every_s=args.quorum_every, join_timeout_ms=60_000,
                    faults_per_s=args.faults_per_s, down_s=args.down, warmup_s=4.0, seed=args.seed)
        servers = [("regent", SimConfig(**base, compact=True, frontends=n, frontend_batch_ms=args.frontend_batch_ms))
                   for n in args.frontends]
        if torchft and groups <= 4096:
            servers.append(("torchft", SimConfig(**{**base, "quorum_every_s": base["quorum_every_s"]
                                                    if groups <= 1000 else 0.0})))
        for server, cfg in servers:
            try:
                report = run_simulation(cfg, server, log=lambda m: print("  " + m, flush=True))
            except Exception as err:  # noqa: BLE001 - a size the box cannot reach is a result, recorded as such
                report = {"server": server, "config": {"groups": groups}, "error": f"{type(err).__name__}: {err}"}
                print(f"{server} {groups}: FAILED {report['error']}", flush=True)
            else:
                print(format_report(report), flush=True)
            report["section"] = "sim"
            report["load_avg"] = os.getloadavg()[0]
            rows.append(report)
    return rows


def plot(rows: list[dict], path: Path) -> bool:
    """Heartbeat lag (simulator rows), a round's time (the 200 ms target is a time: wall, and after the last join
    where clients were several processes) and its Lighthouse CPU (spread over the front ends' cores), by groups."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    sims = [r for r in rows if r["section"] == "sim" and "error" not in r]
    for server, fes in sorted({(r["server"], r["config"].get("frontends", 0)) for r in sims}):
        pts = sorted((r["config"]["groups"], r["heartbeat_lag"]["p99_ms"]) for r in sims
                     if r["server"] == server and r["config"].get("frontends", 0) == fes)
        name = f"{server}, {fes} front ends" if fes else server
        a.plot(*zip(*pts), marker="o", label=f"{name} p99 heartbeat lag")
    a.set(xscale="log", yscale="log", xlabel="replica groups", ylabel="ms", title="heartbeat lag (simulator)")
    if sims:
        a.legend(fontsize=8)
    rounds = [r for r in rows if r["section"] == "round" and "error" not in r]

    def label(r: dict) -> str:
        if r["server"] == "torchft":
            return "TorchFT, full"
        fes = r.get("frontends", 0)
        return ("Regent, " + ("compact" if r["compact"] else "full (TorchFT's answer)")
                + (f", {fes} front ends" if fes else ""))

    for name in sorted({label(r) for r in rounds}):
        mine = sorted((r for r in rounds if label(r) == name), key=lambda r: r["groups"])
        marker = "s" if name.startswith("TorchFT") else "o"
        line = b.plot([r["groups"] for r in mine], [r["wall_ms"] for r in mine], marker=marker, label=f"{name}: wall")
        after = [(r["groups"], r["after_last_join_ms"]) for r in mine if r.get("after_last_join_ms") is not None]
        if after:
            b.plot(*zip(*after), marker=marker, linestyle="--", color=line[0].get_color(),
                   label=f"{name}: after the last join")
        c.plot([r["groups"] for r in mine], [r["server_cpu_ms"] for r in mine], marker=marker, label=name)
    b.axhline(200, color="grey", linestyle=":", label="target at 12,800: 200 ms")
    b.set(xscale="log", yscale="log", xlabel="replica groups", ylabel="ms", title="one quorum round: time")
    c.set(xscale="log", yscale="log", xlabel="replica groups", ylabel="ms of CPU, all processes",
          title="one quorum round: Lighthouse CPU")
    for ax in (b, c):
        if rounds:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("sim", "round", "frontend", "owner"), action="append")
    parser.add_argument("--groups", type=int, nargs="+", default=[1000, 4000, 12800])
    parser.add_argument("--round-groups", type=int, nargs="+", default=[1024, 4096, 12800])
    parser.add_argument("--full-up-to", type=int, default=4096, help="largest round measured with full answers")
    parser.add_argument("--torchft-rounds-up-to", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quorum-every", type=float, default=5.0)
    parser.add_argument("--faults-per-s", type=float, default=1.0)
    parser.add_argument("--down", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torchft", action="store_true")
    parser.add_argument("--frontends", type=int, nargs="+", default=[0],
                        help="Regent rows once per value: 0 one process, N front-end processes (default 0)")
    parser.add_argument("--interval-ms", type=float, default=0.0,
                        help="heartbeat interval of every sim row (default: 100 ms up to 1,000 groups, 1 s past)")
    parser.add_argument("--frontend-batch-ms", type=float, default=2.0,
                        help="front ends' batching interval in the sim rows (0: once per loop turn)")
    parser.add_argument("--round-heartbeat-timeout-ms", type=int, default=5000,
                        help="round rows: the Lighthouse's heartbeat timeout (the clients only join: on a loaded box "
                             "sending 12,800 joins can outlast 5 s, and the first joiners then expire)")
    parser.add_argument("--owner-batch", type=int, default=16,
                        help="owner rows: Quorum calls per front-end link frame (default 16)")
    parser.add_argument("--round-clients", type=int, default=1,
                        help="round rows: the joins come from this many client processes (>1 adds the time from "
                             "the last join's send to the last answer)")
    parser.add_argument("--round-cold", action="store_true",
                        help="round rows with --round-clients > 1: no heartbeat on each connection before the first "
                             "round (by default one, as a Manager heartbeats before its first quorum)")
    parser.add_argument("--secret", action="store_true", help="owner rows: with a job secret (nonces spent)")
    parser.add_argument("--out", default=str(HERE / "results" / "control_plane_sim.json"))
    args = parser.parse_args(argv)
    sections = args.only or ["sim", "round", "frontend", "owner"]
    rows: list[dict] = []
    if "sim" in sections:
        rows += sim_rows(args)
    if "round" in sections:
        torchft = torchft_lighthouse_exe() is not None and not args.no_torchft
        for groups in args.round_groups:
            plans = [("regent", True, n) for n in args.frontends]
            if groups <= args.full_up_to:
                plans += [("regent", False, n) for n in args.frontends]
            if torchft and groups <= args.torchft_rounds_up_to:
                plans.append(("torchft", False, 0))
            for kind, compact, n in plans:
                try:
                    row = join_round(kind, groups, args.rounds, compact, n, args.round_heartbeat_timeout_ms,
                                     args.round_clients, not args.round_cold)
                except Exception as err:  # noqa: BLE001 - recorded as a result
                    row = {"section": "round", "server": kind, "groups": groups, "compact": compact,
                           "frontends": n, "error": f"{type(err).__name__}: {err}"}
                row["load_avg"] = os.getloadavg()[0]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if "frontend" in sections:
        rows += frontend_rows(args.round_groups, args.rounds)
    if "owner" in sections:
        rows += owner_join_rows(args.round_groups, args.rounds, args.owner_batch, args.secret)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nload average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; rows in {out}")
    print("\n| server | front ends | groups | heartbeats/s | lag p50 / p99 / max ms | late | rounds (p50 / max ms) | "
          "faults | missed | false | Lighthouse CPU (owner) | into table mean / p99 / max ms |")
    print("|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        if r["section"] != "sim":
            continue
        fes = r["config"].get("frontends", 0)
        if "error" in r:
            print(f"| {r['server']} | {fes} | {r['config']['groups']} | FAILED: {r['error']} |")
            continue
        lag, q = r["heartbeat_lag"], r["quorum"]
        owner = "" if r.get("owner_cpu_share") is None else f" ({100 * r['owner_cpu_share']:.0f}%)"
        apply = (r.get("frontends") or {}).get("heartbeat_apply_lag")
        into = f"{apply['mean_ms']:.1f} / <={apply['p99_ms_le']:.0f} / {apply['max_ms']:.0f}" if apply else "-"
        rounds = f"{q['rounds']} ({q['p50_ms']:.0f} / {q['max_ms']:.0f})" if q.get("rounds") else "-"
        miss = "n/a" if r["missed_failures"] is None else len(r["missed_failures"])
        false = "n/a" if r["false_failures"] is None else len(r["false_failures"])
        print(f"| {r['server']} | {fes} | {r['config']['groups']} | {r['heartbeats_per_s']:.0f} | {lag['p50_ms']:.1f} / "
              f"{lag['p99_ms']:.0f} / {lag['max_ms']:.0f} | {r['counters'].get('late', 0)} | {rounds} | {r['faults']} | "
              f"{miss} | {false} | {100 * r['lighthouse_cpu_share']:.0f}%{owner} | {into} |")
    print("\n| server | front ends | groups | answer | wall ms (rounds) | Lighthouse CPU ms (owner) | front ends' CPU "
          "per join, us | bytes per answer |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if r["section"] != "round":
            continue
        kind = "compact" if r["compact"] else "full"
        fes = r.get("frontends", 0)
        if "error" in r:
            print(f"| {r['server']} | {fes} | {r['groups']} | {kind} | FAILED: {r['error']} | | |")
            continue
        per_join = f"{1e3 * (r['server_cpu_ms'] - r['owner_cpu_ms']) / r['groups']:.1f}" if fes else "-"
        if "after_last_join_ms" in r:  # several client processes: the Lighthouse's time after the last join too
            kind += (f", {r['clients']} clients; after the last join {r['after_last_join_ms']:.0f} "
                     f"{r['all_after_last_join_ms']}; a client's CPU {r['client_cpu_ms']:.0f}")
        print(f"| {r['server']} | {fes} | {r['groups']} | {kind} | {r['wall_ms']:.0f} {r['all_wall_ms']} | "
              f"{r['server_cpu_ms']:.0f} ({r['owner_cpu_ms']:.0f}) | {per_join} | {r['bytes_per_answer']:.0f} |")
    print("\n| one front end: groups | CPU per heartbeat, us (rounds) | CPU per compact join, us (rounds) |")
    print("|---:|---:|---:|")
    for r in rows:
        if r["section"] == "frontend":
            print(f"| {r['groups']} | {r['us_per_heartbeat']:.1f} {r['all_heartbeat_us']} | {r['us_per_join']:.1f} "
                  f"{r['all_join_us']} |")
    print("\n| quorum owner alone: groups | joins per frame | secret | CPU ms per round (rounds) | us per join |")
    print("|---:|---:|---|---:|---:|")
    for r in rows:
        if r["section"] == "owner":
            print(f"| {r['groups']} | {r['batch']} | {'yes' if r['secret'] else 'no'} | {r['owner_cpu_ms']:.0f} "
                  f"{r['all_ms']} | {r['us_per_join']:.1f} |")
    if plot(rows, out.with_suffix(".png")):
        print(f"plot: {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
