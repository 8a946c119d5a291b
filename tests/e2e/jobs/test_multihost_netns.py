"""`regent train --job workers` across three "hosts": network namespaces with their own IPs (tests/support/netns.py).

Each host is a namespace on the lab's bridge with its own address and host name, running `regent worker`
(started with `ip netns exec`) that reads the job secret from a 0600 file. The controller runs in the root
namespace and reaches the hosts through the lab's root link; it reads the same file via REGENT_JOB_SECRET_FILE.
Two replicas, one process each; the third host is a spare. Faults:

1. a plain `kill` of replica 1's trainer (fault schedule): replica 1 restarts on its host and heals from
   replica 0 on another host;
2. every process of replica 0's host killed at once (SIGKILL of everything in its namespace, the worker
   included): reported as a lost allocation, replica 0 moves to the spare host and heals from replica 1.

Checked: the heals cross hosts (the donor's and the healer's hosts have different namespace IPs), the replicas
end bit-identical, the secret is on no command line and in no environment it was not put in by this test's
rules, and the controller's sockets use only the lab's addresses and loopback. Namespaces on one machine, not
separate physical machines. Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.netns import Host, lab_or_skip
from tests.support.run_watch import committed_after, read_events, wait_for_events

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(480)]  # make test-long

WORKER_PORT = 26600
ARGS = [
    "--job", "workers", "--replicas", "2", "--procs-per-replica", "1", "--model", "debug", "--no-live",
    "--ft.sync-every", "5", "--train.seq-len", "64", "--train.batch-size", "4",
    "--ft.timeout-s", "10", "--ft.quorum-timeout-s", "120",
    "--faults.hang-timeout", "8", "--lighthouse.join-timeout-ms", "10000",
    "--lighthouse.heartbeat-timeout-ms", "3000", "--job.allocation-timeout", "60s", "--job.probe-timeout", "2",
]


def _namespace_pids(host: Host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=20).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def _proc_text(pid: int, what: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes().decode(errors="replace")
    except OSError:
        return None


def _host_of(events: list[dict], replica: int, at: float) -> str:
    """The namespace IP of the host replica `replica` was on at time `at` (its last allocation before it)."""
    allocs = [e for e in events if e["kind"] == "allocation" and e["replica"] == replica and e["time"] <= at]
    assert allocs, f"no allocation of replica {replica} before {at}"
    match = re.search(r"tcp://([\d.]+):", allocs[-1]["job"])
    assert match, allocs[-1]
    return match.group(1)


def test_two_replicas_on_namespace_hosts_survive_a_host_loss(tmp_path: Path) -> None:
    with lab_or_skip() as lab:
        hosts = [lab.add_host(f"h{i}") for i in range(3)]
        subnet = ipaddress.ip_network(lab.subnet)
        secret = secrets.token_hex(32)
        secret_file = tmp_path / "secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("REGENT_JOB_SECRET", "REGENT_LISTEN", "REGENT_FT_", "TORCHFT_"))}
        base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", REGENT_LOG_LEVEL="WARNING")
        workers: dict[str, subprocess.Popen] = {}
        logs = {}
        for host in hosts:
            logs[host.name] = tmp_path / f"worker-{host.name}.log"
            with open(logs[host.name], "w") as log:
                # its own host name: the runtime sees another machine and uses TCP, not Unix sockets; the
                # trainers it starts advertise the host's address to their peers (REGENT_FT_HOSTNAME)
                workers[host.name] = host.popen(
                    [sys.executable, "-m", "regent.cli", "worker", "--address", f"tcp://{host.address}:{WORKER_PORT}",
                     "--secret-file", str(secret_file)], hostname=f"rgt-{host.name}",
                    env={**base, "REGENT_FT_HOSTNAME": host.address, "GLOO_SOCKET_IFNAME": Host.ifname},
                    stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        for host in hosts:
            while "regent worker serving" not in logs[host.name].read_text():
                assert workers[host.name].poll() is None and time.monotonic() < deadline, logs[host.name].read_text()
                time.sleep(0.05)

        run_dir = tmp_path / "run"
        faults = tmp_path / "faults.jsonl"
        faults.write_text(json.dumps({"at": 4, "replica": 1, "kind": "kill", "rank": 0}) + "\n")
        events_path = run_dir / "events.jsonl"
        addresses = ",".join(f"tcp://{h.address}:{WORKER_PORT}" for h in hosts)
        env = {**base, "REGENT_JOB_SECRET_FILE": str(secret_file), "REGENT_LISTEN_HOST": lab.root_address}
        cmd = [sys.executable, "-m", "regent.cli", "train", *ARGS, "--job.addresses", addresses,
               "--job.claim-dir", str(tmp_path / "claims"), "--lighthouse.bind", f"{lab.root_address}:0",
               "--duration", "90s", "--faults-file", str(faults), "--run-dir", str(run_dir)]
        train_log = tmp_path / "train.log"
        t_start = time.monotonic()
        with open(train_log, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        leaks: list[str] = []
        try:
            # 1. the plain kill of replica 1 heals and replica 1 commits again
            def kill_healed(events: list[dict]) -> bool:
                done = [e for e in events if e["kind"] == "restart_done" and e["replica"] == 1]
                return bool(done) and committed_after(events, 1, done[0]["time"]) >= 1
            events = wait_for_events(proc, events_path, "replica 1 to recover from the kill", kill_healed, 200)

            # the secret: on no command line; not in the environment of the workers or the controller
            trainer_pids = [p for h in hosts for p in _namespace_pids(h) if p != workers[h.name].pid]
            assert trainer_pids, "no trainer processes found in the host namespaces"
            for pid in [*(w.pid for w in workers.values()), *_descendants(proc.pid), *trainer_pids]:
                cmdline = _proc_text(pid, "cmdline")
                if cmdline is not None and secret in cmdline:
                    leaks.append(f"pid {pid} command line")
            for pid in [*(w.pid for w in workers.values()), proc.pid]:
                environ = _proc_text(pid, "environ")
                if environ is not None and secret in environ:
                    leaks.append(f"pid {pid} environment")
            for pid in trainer_pids:  # owner-only, whatever the runtime puts there
                st = os.stat(f"/proc/{pid}/environ")
                assert st.st_mode & 0o077 == 0 and st.st_uid == os.getuid(), (pid, oct(st.st_mode))
            # the controller's sockets: lab addresses and loopback only
            ss = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, timeout=20).stdout
            ss += subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, timeout=20).stdout
            ours = {str(p) for p in _descendants(proc.pid)}
            for line in ss.splitlines():
                if not any(f"pid={p}," in line for p in ours):
                    continue
                local, peer = line.split()[3:5]
                for endpoint in (local, peer):
                    ip = endpoint.rsplit(":", 1)[0].strip("[]")
                    if endpoint is peer and endpoint.endswith(":*"):
                        continue  # a listening socket: no peer
                    if ip in ("*", "0.0.0.0", "::"):
                        leaks.append(f"wildcard listener: {line}")
                        continue
                    addr = ipaddress.ip_address(ip.removeprefix("::ffff:"))
                    if not (addr.is_loopback or addr in subnet):
                        leaks.append(f"socket outside the lab and loopback: {line}")

            # 2. every process of replica 0's host killed at once (the worker too): the host is gone
            h0 = _host_of(events, 0, time.time())
            dead = next(h for h in hosts if h.address == h0)
            t_kill = time.time()
            for _ in range(20):
                pids = _namespace_pids(dead)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)

            def moved(events: list[dict]) -> bool:
                again = [e for e in events if e["kind"] == "allocation" and e["replica"] == 0 and e["time"] > t_kill]
                return bool(again) and committed_after(events, 0, again[0]["time"]) >= 1
            wait_for_events(proc, events_path, "replica 0 to train on the spare host", moved, 150)
            proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        elapsed = time.monotonic() - t_start
        text = train_log.read_text()
        assert proc.returncode == 0, text[-6000:]
        assert not leaks, leaks

        events = read_events(events_path)
        summary = json.loads((run_dir / "summary.json").read_text())
        ips = {h.address for h in hosts}
        first = {r: _host_of(events, r, t_kill) for r in (0, 1)}
        assert first[0] != first[1] and set(first.values()) <= ips, first  # replicas on different hosts
        lost = [e for e in events if e["kind"] == "allocation_lost" and e["replica"] == 0]
        assert lost and h0 in lost[0]["reason"] and "is gone" in lost[0]["reason"], lost
        later = [e for e in events if e["kind"] == "allocation" and e["replica"] == 0 and e["time"] > t_kill]
        spare = _host_of(events, 0, later[0]["time"])
        assert spare not in (first[0], first[1]) and spare in ips, (spare, first)
        # the heals cross hosts: donor and healer on different namespace IPs
        heals = [e for e in events if e["kind"] in ("heal_done", "early_heal_done")]
        crossings = []
        for heal in heals:
            donor = int(re.match(r"replica_(\d+)", heal["donor"]).group(1))
            healer_ip, donor_ip = _host_of(events, heal["replica"], heal["time"]), _host_of(events, donor, heal["time"])
            crossings.append((heal["replica"], healer_ip, donor, donor_ip))
        assert {c[0] for c in crossings} == {0, 1}, (crossings, heals)
        assert all(c[1] != c[3] for c in crossings), crossings
        assert any(c[0] == 0 and c[1] == spare for c in crossings), crossings
        assert summary["replicas_consistent"] is True, summary.get("final_states")
        assert not summary.get("invariant_violations"), summary["invariant_violations"]
        print(f"\n[multihost netns] {elapsed:.0f} s; hosts {sorted(ips)}; replicas first on {first}, replica 0 moved "
              f"to {spare}; heals (healer, its IP, donor, its IP): {crossings}")
    assert not lab.leftovers()
