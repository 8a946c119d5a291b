"""Network partitions, for real: replicas in network namespaces on a bridge whose links are cut (`tests/support/netns.py`).

Each scenario is a real run: a Lighthouse process in the hub namespace and three replica processes
(`partition_worker.py`, `regent.ft.Manager` over Gloo), each in its own namespace with its own address. A cut
sets a replica's bridge port down: its packets vanish, its sockets stay open, as on a pulled cable.

1. A partitioned replica leaves the quorum by heartbeat timeout and the two others go on committing.
2. After the link heals it rejoins, heals from a peer, and its state matches theirs at an equal step.
3. No split brain (min_replica_size 2 of 3): an isolated replica commits nothing while cut off; and when the
   network splits into the Lighthouse with one replica | two replicas, nobody commits until it heals.
4. The actor layer: a `regent worker` in a namespace (a host name of its own, so the runtime sees another
   machine and uses TCP), attached from the root namespace; cutting its link makes a call fail and supervision
   report it within a bounded time, and after the link is restored a new proc mesh works.

Timings are printed (`-s` shows them) and written to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.netns import Host, NetLab, lab_or_skip

HERE = Path(__file__).resolve().parents[2] / "support"  # the workers' folder
WORKER = HERE / "partition_worker.py"
CONTROLLER = HERE / "partition_controller.py"
LIGHTHOUSE_PORT = 29510  # inside the hub namespace: nothing else can hold it
HEARTBEAT_TIMEOUT_MS = 1500
COLLECTIVE_TIMEOUT_S = 3.0
PARTITION_S = 6.0  # how long a partition is held at least
STARTUP_S = 120.0  # 3 replicas importing torch on a busy 2-core box
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the lab's addresses are local


def _env(**extra: str) -> dict[str, str]:
    """The replicas' environment: no inherited REGENT_FT_*/TORCHFT_* timeouts (they would win over the flags)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REGENT_FT_", "TORCHFT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME=Host.ifname, **extra)
    return env


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


class Run:
    """A Lighthouse in the hub and one replica per host; the test cuts and heals links and reads the records."""

    def __init__(self, lab: NetLab, tmp: Path, replicas: int = 3, min_replica_size: int = 1,
                 lighthouse_min_replicas: int = 1) -> None:
        self.lab = lab
        self.tmp = tmp
        self.hosts = [lab.add_host(f"r{i}") for i in range(replicas)]
        self.stop_file = tmp / "stop"
        self.outs = [tmp / f"r{i}.jsonl" for i in range(replicas)]
        self.logs = [tmp / f"r{i}.log" for i in range(replicas)]
        self.lighthouse_log = tmp / "lighthouse.log"
        self.lighthouse_addr = f"http://{lab.hub.address}:{LIGHTHOUSE_PORT}"
        self.status_url = f"http://{lab.hub.address}:{LIGHTHOUSE_PORT + 1}/status.json"
        self.procs: list[subprocess.Popen] = []
        with open(self.lighthouse_log, "w") as log:
            self.lighthouse = lab.hub.popen(
                [sys.executable, "-m", "regent.cli", "lighthouse", "--bind", f"{lab.hub.address}:{LIGHTHOUSE_PORT}",
                 "--min-replicas", str(lighthouse_min_replicas), "--join-timeout-ms", "1000",
                 "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS), "--quorum-tick-ms", "50"],
                env=_env(), stdout=log, stderr=subprocess.STDOUT)
        self.wait(lambda: "Lighthouse gRPC:" in self.lighthouse_log.read_text(), 60, "the Lighthouse to start")
        for i, host in enumerate(self.hosts):
            with open(self.logs[i], "w") as log:
                self.procs.append(host.popen(
                    [sys.executable, str(WORKER), "--lighthouse", self.lighthouse_addr, "--name", host.name,
                     "--host", host.address, "--out", str(self.outs[i]), "--stop-file", str(self.stop_file),
                     "--min-replica-size", str(min_replica_size), "--timeout", str(COLLECTIVE_TIMEOUT_S),
                     "--quorum-timeout", "5", "--connect-timeout", "10", "--seed", str(i)],
                    env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE)))

    # ---- reading ------------------------------------------------------------------------------------------
    def records(self, i: int) -> list[dict]:
        return _read_jsonl(self.outs[i])

    def commits(self, i: int, after: float = 0.0, before: float = float("inf")) -> list[dict]:
        """Replica i's committed steps (with hash and participants) recorded in (after, before)."""
        return [r for r in self.records(i) if r["kind"] == "state" and after < r["t"] < before]

    def events(self, i: int, kind: str, after: float = 0.0) -> list[dict]:
        return [r for r in self.records(i) if r["kind"] == kind and r["t"] > after]

    def step(self, i: int) -> int:
        return max((r["step"] for r in self.commits(i)), default=0)

    def status(self) -> dict[str, Any] | None:
        """The Lighthouse's status.json (through the lab's root link), None when it does not answer."""
        try:
            with _NO_PROXY.open(self.status_url, timeout=2) as reply:
                return json.load(reply)
        except OSError:
            return None

    def healthy(self, name: str) -> bool | None:
        """Whether the Lighthouse counts replica `name` as heartbeating (None: no status, or unknown)."""
        status = self.status()
        if status is None:
            return None
        rows = [h for h in status["heartbeats"] if h["replica_id"].split(":")[0] == name]
        return any(h["healthy"] for h in rows) if rows else False

    def text(self) -> str:
        parts = [f"--- {p.name}\n{p.read_text()[-6000:]}" for p in [self.lighthouse_log, *self.logs] if p.exists()]
        return "\n".join(parts)

    # ---- waiting ------------------------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> float:
        """Poll `predicate` until truthy; returns the time (time.time()) it was first seen true."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate():
                return time.time()
            dead = [p.args for p in [*self.procs, self.lighthouse] if p.poll() is not None]
            if dead:
                raise AssertionError(f"a process exited while waiting for {what}: {dead}\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.text()}")
            time.sleep(0.05)

    def wait_each(self, predicates: dict[str, Callable[[], Any]], timeout: float) -> dict[str, float]:
        """Poll several predicates together; returns when each was first seen true (time.time())."""
        seen: dict[str, float] = {}
        pending = dict(predicates)

        def step() -> bool:
            for name, predicate in list(pending.items()):
                if predicate():
                    seen[name] = time.time()
                    del pending[name]
            return not pending

        self.wait(step, timeout, f"{sorted(pending)}")
        return seen

    def all_in_quorum(self, replicas: list[int], after: float = 0.0, count: int = 1) -> bool:
        """Each of `replicas` committed `count` steps with all of them participating, after `after`."""
        n = len(self.hosts)
        return all(len([c for c in self.commits(i, after) if c["participants"] == n]) >= count for i in replicas)

    def finish(self, extra_steps: int = 5, timeout: float = 90.0) -> list[dict]:
        """Let every replica run to one common step, then stop; returns their "done" records."""
        target = max(self.step(i) for i in range(len(self.hosts))) + extra_steps
        self.stop_file.write_text(str(target))
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a replica did not stop at step {target}\n{self.text()}") from None
            assert code == 0, f"{p.args} exited with {code}\n{self.text()}"
        done = [self.events(i, "done") for i in range(len(self.hosts))]
        assert all(done), self.text()
        return [d[-1] for d in done]


@pytest.fixture(scope="module")
def partition_and_heal(tmp_path_factory) -> Iterator[dict]:
    """Scenarios 1 and 2 share one run: replica r2 is cut off for a while, then reconnected."""
    tmp = tmp_path_factory.mktemp("partition")
    with lab_or_skip() as lab:
        run = Run(lab, tmp)
        t0 = time.time()
        run.wait(lambda: run.all_in_quorum([0, 1, 2]), STARTUP_S, "three replicas committing together")
        started = time.time() - t0
        assert run.healthy("r2") is True, run.status()
        cut_at = run.hosts[2].cut()
        seen = run.wait_each({
            "majority": lambda: all(any(c["participants"] == 2 for c in run.commits(i, cut_at)) for i in (0, 1)),
            "dropped": lambda: run.healthy("r2") is False,
        }, 60)
        majority_at, unhealthy_at = seen["majority"], seen["dropped"]
        time.sleep(max(0.0, cut_at + PARTITION_S - time.time()))
        run.wait(lambda: all(len(run.commits(i, majority_at)) >= 5 for i in (0, 1)), 60,
                 "r0 and r1 to keep committing")
        heal_at = run.hosts[2].heal()
        during = {i: run.commits(i, cut_at, heal_at) for i in range(3)}
        run.wait(lambda: run.all_in_quorum([0, 1, 2], after=heal_at, count=2), 90, "r2 back in the quorum")
        done = run.finish()
        # precise times from the replicas' own records (the waits above only poll)
        first_pair = max(min(c["t"] for c in run.commits(i, cut_at) if c["participants"] == 2) for i in (0, 1))
        r2_heal = run.events(2, "heal_done", heal_at)
        r2_back = min(c["t"] for c in run.commits(2, heal_at) if c["participants"] == 3)
        r2_tries = [e for e in run.events(2, "commit", cut_at) if e["t"] < heal_at and not e["committed"]]
        result = {"run": run, "started": started, "cut_at": cut_at, "majority_at": first_pair,
                  "unhealthy_at": unhealthy_at, "heal_at": heal_at, "rejoined_at": r2_back,
                  "during": during, "done": done, "records": [run.records(i) for i in range(3)]}
        print(f"\n[partition] startup {started:.1f} s; cut -> r0 and r1 commit without r2 "
              f"{first_pair - cut_at:.2f} s; cut -> the Lighthouse counts r2 dead {unhealthy_at - cut_at:.2f} s; "
              f"partition held {heal_at - cut_at:.1f} s: r0/r1 committed {[len(during[i]) for i in (0, 1)]} steps, "
              f"r2 {len(during[2])} (failed attempts {len(r2_tries)}); heal -> r2 healed "
              f"{(r2_heal[0]['t'] - heal_at) if r2_heal else float('nan'):.2f} s "
              f"({r2_heal[0] if r2_heal else None}), -> r2 commits in a quorum of 3 {r2_back - heal_at:.2f} s; "
              f"done {done}")
        yield result
    assert not lab.leftovers()


@pytest.mark.slow
def test_partitioned_replica_leaves_by_heartbeat_timeout_and_the_rest_commit(partition_and_heal):
    r = partition_and_heal
    run: Run = r["run"]
    # the Lighthouse stopped counting r2 once its heartbeats were overdue, not before
    assert HEARTBEAT_TIMEOUT_MS / 1000 - 0.5 < r["unhealthy_at"] - r["cut_at"] < 15, r
    # r0 and r1 went on in a quorum of two, within a few collective/heartbeat timeouts of the cut
    assert r["majority_at"] - r["cut_at"] < 20, r
    for i in (0, 1):
        twos = [c for c in r["during"][i] if c["participants"] == 2]
        assert len(twos) >= 5, r["during"][i]
        steps = [c["step"] for c in r["during"][i]]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        quorums = [q for q in run.events(i, "quorum", r["cut_at"]) if q["t"] < r["heal_at"]]
        assert any(len(q["participants"]) == 2 and not any(p.startswith("r2:") for p in q["participants"])
                   for q in quorums), quorums
    # r0 and r1 committed the same steps with the same states. The records were read at the heal, while both were
    # committing: one may already have written a step the other writes a moment later (a suite run saw r1's step
    # 88 and not yet r0's), so only the newest steps may be missing on one side.
    h0 = {c["step"]: c["hash"] for c in r["during"][0]}
    h1 = {c["step"]: c["hash"] for c in r["during"][1]}
    common = h0.keys() & h1.keys()
    assert len(common) >= 5 and {s: h0[s] for s in common} == {s: h1[s] for s in common}
    assert all(s > max(common) for s in h0.keys() ^ h1.keys()), (sorted(h0.keys() ^ h1.keys()), max(common))


@pytest.mark.slow
def test_healed_replica_rejoins_and_heals_from_a_peer(partition_and_heal):
    r = partition_and_heal
    records = r["records"]
    heals = [e for e in records[2] if e["kind"] == "heal_done" and e["t"] > r["heal_at"]]
    assert heals, "r2 never healed after the partition"
    assert heals[0]["donor"].split(":")[0] in ("r0", "r1") and heals[0]["bytes"] > 0
    step_at_cut = max(c["step"] for c in records[2] if c["kind"] == "state" and c["t"] < r["cut_at"])
    assert heals[0]["step"] > step_at_cut + 1  # it caught up over the steps it missed, not from scratch
    # at every step all three committed after the heal, they hold bit-identical state
    after = [{c["step"]: c["hash"] for c in rows if c["kind"] == "state" and c["t"] > r["heal_at"]}
             for rows in records]
    common = set(after[0]) & set(after[1]) & set(after[2])
    assert len(common) >= 3, after
    assert all(after[0][s] == after[1][s] == after[2][s] for s in common), after
    done = r["done"]
    assert done[0]["step"] == done[1]["step"] == done[2]["step"]
    assert done[0]["hash"] == done[1]["hash"] == done[2]["hash"]
    assert r["rejoined_at"] - r["heal_at"] < 60


def _in_flight_only(run: Run, i: int, cut_at: float, heal_at: float) -> list[dict]:
    """Replica i's commits while cut off, asserted to be at most the step in flight when the link went down
    (its collective may have completed just before the cut)."""
    step_at_cut = max((c["step"] for c in run.commits(i, before=cut_at)), default=0)
    during = run.commits(i, cut_at, heal_at)
    assert len(during) <= 1 and all(c["step"] <= step_at_cut + 1 for c in during), (i, step_at_cut, during)
    return during


@pytest.mark.slow
def test_no_split_brain_a_minority_side_never_commits(tmp_path):
    """min_replica_size 2 of 3 (the Lighthouse's min_replicas 2). First r0 alone is cut off: it commits
    nothing, r1 and r2 go on. Then the network splits into {Lighthouse, r0} | {r1, r2}: nobody commits (the
    Lighthouse's side is a minority; the majority has no Lighthouse). After each heal all three go on
    together and end bit-identical."""
    with lab_or_skip() as lab:
        run = Run(lab, tmp_path, min_replica_size=2, lighthouse_min_replicas=2)
        run.wait(lambda: run.all_in_quorum([0, 1, 2]), STARTUP_S, "three replicas committing together")

        # phase 1: the isolated replica is the minority
        cut_at = run.hosts[0].cut()
        run.wait(lambda: all(len([c for c in run.commits(i, cut_at) if c["participants"] == 2]) >= 5
                             for i in (1, 2)), 60, "r1 and r2 committing without r0")
        time.sleep(max(0.0, cut_at + PARTITION_S - time.time()))
        heal_at = run.hosts[0].heal()
        isolated = _in_flight_only(run, 0, cut_at, heal_at)
        assert not [c for c in isolated if c["participants"] < 2]
        rejoined_at = run.wait(lambda: run.all_in_quorum([0, 1, 2], after=heal_at, count=2), 90,
                               "r0 back in the quorum")

        # phase 2: the Lighthouse's side holds one replica; the other side two replicas (that still reach each
        # other) and no Lighthouse
        issued_before = (run.status() or {}).get("quorums_issued")
        cut2_at = lab.split(run.hosts[1:])
        time.sleep(PARTITION_S)
        quiet_since = cut2_at + COLLECTIVE_TIMEOUT_S + 1  # after the steps in flight have settled
        status = run.status()
        heal2_at = lab.join(run.hosts[1:])
        stalled = [_in_flight_only(run, i, cut2_at, heal2_at) for i in range(3)]
        for i in range(3):
            assert not [c for c in stalled[i] if c["t"] > quiet_since], (i, stalled[i])
        # the Lighthouse never issued a quorum of r0 alone (one of r0 and a cut replica whose heartbeat was
        # still fresh may be issued: r0 then fails to meet it and commits nothing, as checked above)
        assert status is not None and issued_before is not None
        new_quorums = [q for q in run.events(0, "quorum", cut2_at) if q["t"] < heal2_at]
        assert not [q for q in new_quorums if len(q["participants"]) < 2], new_quorums
        back_at = run.wait(lambda: run.all_in_quorum([0, 1, 2], after=heal2_at, count=2), 90,
                           "all three back after the second heal")
        done = run.finish()
        assert done[0]["step"] == done[1]["step"] == done[2]["step"]
        assert done[0]["hash"] == done[1]["hash"] == done[2]["hash"], done
        print(f"\n[split brain] phase 1: r0 cut {heal_at - cut_at:.1f} s, r0 commits {len(isolated)} "
              f"(in flight), r1/r2 commits {[len(run.commits(i, cut_at, heal_at)) for i in (1, 2)]}, "
              f"heal -> 3-quorum {rejoined_at - heal_at:.2f} s; phase 2: r1+r2 cut {heal2_at - cut2_at:.1f} s, "
              f"commits {[len(s) for s in stalled]}, Lighthouse quorums issued {issued_before} -> "
              f"{status['quorums_issued']}, heal -> 3-quorum {back_at - heal2_at:.2f} s; done {done}")
    assert not lab.leftovers()


class Controller:
    """partition_controller.py in the root namespace: commands in on stdin, JSON observations out on stdout."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, cwd=str(HERE))
        self.seen: list[dict] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, kind: str, timeout: float) -> dict:
        """The next observation of `kind` (the controller bounds its own waits; this only guards the test)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no {kind!r} from the controller within {timeout:.0f} s; saw {self.seen}\n"
                                     f"{self.log.read_text()[-6000:]}")
            if line.startswith("{"):
                row = json.loads(line)
                self.seen.append(row)
                if row["kind"] == kind:
                    return row

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.mark.slow
def test_controller_host_partition_is_reported_and_recovered(tmp_path):
    """A `regent worker` in a namespace, attached from the root namespace through the lab's root link; the
    link to its host is cut while a proc runs there: the call must fail and supervision report the proc within
    a bounded time; after the link is restored a new proc mesh on the same host works. (Run with
    REGENT_TEST_PEER_TIMEOUT=none to see the runtime without dead-peer detection: the call just waits.)"""
    limit = 20.0
    with lab_or_skip() as lab:
        host = lab.add_host("w0")
        secret = secrets.token_hex(32)
        secret_file = tmp_path / "secret"
        secret_file.write_text(secret)
        secret_file.chmod(0o600)
        # a dead peer is given up on after ~3 s of silence (REGENT_PEER_TIMEOUT); a proc whose controller is
        # gone exits after 5 s (REGENT_ORPHAN_TIMEOUT)
        knobs = {"REGENT_PEER_TIMEOUT": os.environ.get("REGENT_TEST_PEER_TIMEOUT", "3"), "REGENT_ORPHAN_TIMEOUT": "5",
                 "REGENT_LOG_LEVEL": "WARNING"}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REGENT_JOB_SECRET", "REGENT_LISTEN"))}
        worker_log = tmp_path / "worker.log"
        with open(worker_log, "w") as log:
            # A host name of its own: the runtime then sees another machine and uses TCP, not Unix sockets
            # (which would bypass the network namespace).
            worker = host.popen([sys.executable, "-m", "regent.cli", "worker", "--address",
                                 f"tcp://{host.address}:29600", "--secret-file", str(secret_file)],
                                hostname="rgt-w0", env={**env, **knobs, "PYTHONUNBUFFERED": "1"},
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while "regent worker serving" not in worker_log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, worker_log.read_text()
            time.sleep(0.05)
        controller = Controller(
            [sys.executable, str(CONTROLLER), "--worker", f"tcp://{host.address}:29600", "--limit", str(limit)],
            {**env, **knobs, "REGENT_JOB_SECRET": secret, "REGENT_LISTEN_HOST": lab.root_address,
             "PYTHONUNBUFFERED": "1"},
            tmp_path / "controller.log")
        try:
            ready = controller.expect("ready", 120)
            assert ready["where"][0] == "rgt-w0", ready  # the actor runs on the namespaced "machine"
            cut_at = host.cut()
            controller.send("cut")
            call = controller.expect("call", limit + 30)
            supervised = controller.expect("supervised", limit + 30)
            heal_at = host.heal()
            controller.send("healed")
            after = controller.expect("after_heal", 150)
            controller.send("quit")
            controller.expect("bye", 60)
        finally:
            controller.close()
        reports = [row for row in controller.seen if row["kind"] == "supervision"]
        first = f"{reports[0]['t'] - cut_at:.2f} s after the cut" if reports else "none"
        print(f"\n[actor partition] call after the cut: {call['outcome']} in {call['seconds']:.2f} s "
              f"({call.get('error') or call.get('value')}); supervision report: {first}; after the heal "
              f"(at +{heal_at - cut_at:.1f} s) a new proc mesh answered: {after}")
        assert call["outcome"] == "error" and call["seconds"] < limit, call
        assert supervised["seen"] and reports, controller.seen
        assert after["outcome"] == "value" and after["value"][0] == "rgt-w0", after
    assert not lab.leftovers()


def test_actor_tcp_connections_give_up_on_a_silent_peer():
    """The fix scenario 4 needs (regent.actor._transport.detect_dead_peer): keepalive probes and a bound on
    unacknowledged data, together about the timeout asked for, so a cut-off peer's connection ends."""
    from regent.actor._transport import detect_dead_peer

    with socket.socket() as sock:
        detect_dead_peer(sock, 3.0)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 3000
        if hasattr(socket, "TCP_KEEPIDLE"):
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            assert idle + interval * probes <= 3
    with socket.socket() as sock:
        detect_dead_peer(sock, None)  # REGENT_PEER_TIMEOUT=none: the kernel's defaults
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
