"""Stop and cleanup, orphan exit, ProcessJob hosts, warm spares, and the `regent worker` command."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from regent.actor import Actor, SupervisionError, current_rank, endpoint, this_host
from regent.actor._process import get_runtime
from regent.jobs.local import ProcessJob

TIMEOUT = 60


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        return "Z" not in state.split()[1]
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return False


class Leaf(Actor):
    def __init__(self, path: str):
        self.path = path

    @endpoint
    def ok(self) -> str:
        return "ok"

    def __cleanup__(self, exc):
        with open(self.path, "a") as f:
            f.write(f"leaf{current_rank()} exc={exc}\n")


class Parent(Actor):
    def __init__(self, path: str):
        self.path = path
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.leaves = self.procs.spawn("leaf", Leaf, path)

    @endpoint
    def leaves_ok(self) -> list:
        return self.leaves.ok.call().get(timeout=TIMEOUT).values()

    def __cleanup__(self, exc):
        with open(self.path, "a") as f:
            f.write("parent\n")


def test_proc_mesh_stop_runs_cleanup_children_first(tmp_path):
    path = str(tmp_path / "cleanup.log")
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    parent = pm.spawn("parent", Parent, path)
    assert parent.leaves_ok.call_one().get(timeout=TIMEOUT) == ["ok", "ok"]
    pm.stop().get(timeout=TIMEOUT)
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[-1] == "parent"
    assert sorted(lines[:-1]) == ["leaf{'gpus': 0/2} exc=None", "leaf{'gpus': 1/2} exc=None"]
    with pytest.raises(SupervisionError, match="stopped"):
        parent.leaves_ok.call_one().get(timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match="already been stopped"):
        pm.spawn("late", Leaf, path)


def test_actor_mesh_stop_runs_cleanup_and_later_calls_fail(tmp_path):
    path = str(tmp_path / "leaf.log")
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        leaves = pm.spawn("leaves", Leaf, path)
        assert leaves.ok.call().get(timeout=TIMEOUT).values() == ["ok", "ok"]
        leaves.stop().get(timeout=TIMEOUT)
        with open(path) as f:
            assert len(f.read().splitlines()) == 2
        with pytest.raises(SupervisionError, match="stopped"):
            leaves.ok.call().get(timeout=TIMEOUT)
        # the procs are still there for other actors
        assert pm.spawn("more", Leaf, path).ok.call().get(timeout=TIMEOUT).values() == ["ok", "ok"]
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_slice_of_proc_mesh_cannot_be_stopped():
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with pytest.raises(ValueError, match="not owned"):
            pm.slice(gpus=0).stop()
    finally:
        pm.stop().get(timeout=TIMEOUT)


@pytest.mark.slow
def test_orphaned_procs_exit_after_controller_is_killed(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, time
        from regent.actor import Actor, endpoint, this_host
        from regent.jobs.local import ProcessJob

        class P(Actor):
            @endpoint
            def pid(self):
                return os.getpid()

        local = this_host().spawn_procs(per_host={"gpus": 2}).spawn("p", P)
        job = ProcessJob(hosts=1)
        remote = job.host_mesh().spawn_procs(per_host={"gpus": 1}).spawn("r", P)
        pids = local.pid.call().get(timeout=60).values() + remote.pid.call().get(timeout=60).values()
        print(json.dumps(pids), flush=True)
        time.sleep(600)
    """))
    env = dict(os.environ, REGENT_ORPHAN_TIMEOUT="2", OMP_NUM_THREADS="1")
    ctl = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = json.loads(ctl.stdout.readline())
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait()
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30), [
            p for p in pids if pid_alive(p)
        ]
    finally:
        if ctl.poll() is None:
            ctl.kill()


class Where(Actor):
    @endpoint
    def where(self) -> tuple:
        import sys as _sys

        return (str(current_rank()), os.getpid(), os.getppid(), os.environ.get("WARM_ENV"),
                "xml.dom.minidom" in _sys.modules)


@pytest.mark.slow
def test_process_job_with_two_hosts(monkeypatch):
    import regent.actor

    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    job = ProcessJob(hosts=2)
    try:
        hosts = job.host_mesh()
        assert hosts.extent.labels == ["hosts"] and len(hosts) == 2
        # the workers read the job secret at start: its file is not left on disk
        assert job._secret_file and not os.path.exists(job._secret_file)
        assert job.host_mesh() is hosts and job.state().hosts is not hosts  # state() attaches anew (Monarch)
        pm = hosts.spawn_procs(per_host={"gpus": 2})
        w = pm.spawn("w", Where)
        vm = w.where.call().get(timeout=TIMEOUT)
        assert [v[0] for v in vm.values()] == [
            "{'hosts': 0/2, 'gpus': 0/2}", "{'hosts': 0/2, 'gpus': 1/2}",
            "{'hosts': 1/2, 'gpus': 0/2}", "{'hosts': 1/2, 'gpus': 1/2}",
        ]
        workers = job.worker_pids()
        assert [v[2] for v in vm.values()] == [workers[0], workers[0], workers[1], workers[1]]
        assert w.slice(hosts=1, gpus=0).where.call_one().get(timeout=TIMEOUT)[0] == "{}"
        # a proc on a worker host dies: the controller (owner) sees it through the worker
        victim = vm.item(hosts=1, gpus=1)[1]
        inflight = w.slice(hosts=1, gpus=1).where.call_one()
        inflight.get(timeout=TIMEOUT)
        os.kill(victim, signal.SIGKILL)
        assert wait_for(lambda: faults)
        assert faults[0].crashed_ranks == [3] and "Killed(sig=9)" in faults[0].report()
        pm.stop().get(timeout=TIMEOUT)
        assert not any(pid_alive(v[1]) for v in vm.values())
    finally:
        job.kill()
    assert not any(pid_alive(p) for p in workers)


def test_local_procs_exit_at_once_when_their_spawner_dies(tmp_path):
    """Not after the orphan timeout (here 600 s): a proc whose parent process is gone exits within a second or
    two, and takes what it spawned with it (a killed `regent train` leaves no trainer behind)."""
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent("""
        import json, os, time
        from regent.actor import Actor, endpoint, this_host

        class Nested(Actor):
            @endpoint
            def pid(self):
                return os.getpid()

        class P(Actor):
            @endpoint
            def pids(self):
                inner = this_host().spawn_procs(per_host={"gpus": 1}).spawn("n", Nested)
                return [os.getpid(), *inner.pid.call().get(timeout=60).values()]

        local = this_host().spawn_procs(per_host={"gpus": 1}).spawn("p", P)
        print(json.dumps(local.pids.call_one().get(timeout=120)), flush=True)
        time.sleep(600)
    """))
    env = dict(os.environ, REGENT_ORPHAN_TIMEOUT="600", OMP_NUM_THREADS="1")
    ctl = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = json.loads(ctl.stdout.readline())
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait()
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=20), [p for p in pids if pid_alive(p)]
    finally:
        if ctl.poll() is None:
            ctl.kill()


def test_warm_spare_is_claimed_by_spawn_procs():
    rt = get_runtime()
    this_host().keep_warm(1, preload=["xml.dom.minidom"]).get(timeout=TIMEOUT)
    assert wait_for(lambda: rt.spawner is not None and len(rt.spawner.spares) == 1, timeout=TIMEOUT)
    spare = rt.spawner.spares[0]
    spare_os_pid = spare.process.pid
    started_before = time.monotonic()
    pm = this_host().spawn_procs(per_host={"gpus": 1}, env={"WARM_ENV": "claimed"})
    try:
        rank, pid, ppid, warm_env, preloaded = pm.spawn("w", Where).where.call_one().get(timeout=TIMEOUT)
        assert pid == spare_os_pid and ppid == os.getpid()
        assert warm_env == "claimed" and preloaded
        pm.initialized.get(timeout=TIMEOUT)
        assert pm.spares_claimed == 1  # what a restart reports as warm comes from here
        assert rank == "{'gpus': 0/1}"
        assert time.monotonic() - started_before < TIMEOUT
        # a replacement spare is started in the background
        assert wait_for(lambda: len(rt.spawner.spares) == 1 and rt.spawner.spares[0].process.pid != pid,
                        timeout=TIMEOUT)
    finally:
        pm.stop().get(timeout=TIMEOUT)
        this_host().keep_warm(0).get(timeout=TIMEOUT)
    assert wait_for(lambda: not rt.spawner.spares)


def test_a_spare_that_dies_while_starting_is_replaced(tmp_path, monkeypatch):
    # Seen in a soak: a spare killed while it started (it was still importing) was never replaced, and every
    # later restart of that replica was a cold start. Here the first spare's preload exits; the next one works.
    marker = tmp_path / "first-start-happened"
    (tmp_path / "regent_flaky_preload.py").write_text(textwrap.dedent(f"""
        import os
        if not os.path.exists({str(marker)!r}):
            open({str(marker)!r}, "w").close()
            os._exit(3)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # the spares inherit this process's sys.path
    rt = get_runtime()
    this_host().keep_warm(1, preload=["regent_flaky_preload"]).get(timeout=TIMEOUT)
    try:
        assert wait_for(lambda: rt.spawner is not None and len(rt.spawner.spares) == 1, timeout=TIMEOUT)
        assert marker.exists()  # the first start did fail
        assert rt.spawner.spare_retry_s == 0.0  # and the success reset the back-off
    finally:
        this_host().keep_warm(0).get(timeout=TIMEOUT)
    assert wait_for(lambda: not rt.spawner.spares and not rt.spawner.starting_spares, timeout=TIMEOUT)


def test_claimed_spare_is_refilled_after_the_delay():
    # The replacement's imports would compete with the claimed proc's start: it begins `refill_delay_s` later.
    rt = get_runtime()
    this_host().keep_warm(1, preload=["xml.dom.minidom"], refill_delay_s=2.0).get(timeout=TIMEOUT)
    assert wait_for(lambda: rt.spawner is not None and len(rt.spawner.spares) == 1, timeout=TIMEOUT)
    pm = this_host().spawn_procs(per_host={"gpus": 2})  # one spare for two procs: one warm, one cold
    try:
        pm.spawn("w", Where).where.call().get(timeout=TIMEOUT)
        claimed = time.monotonic()
        assert not rt.spawner.spares and rt.spawner.starting_spares == 0  # nothing started yet
        pm.initialized.get(timeout=TIMEOUT)
        assert pm.spares_claimed == 1
        assert wait_for(lambda: rt.spawner.starting_spares + len(rt.spawner.spares) == 1, timeout=TIMEOUT)
        assert time.monotonic() - claimed > 1.0
    finally:
        pm.stop().get(timeout=TIMEOUT)
        this_host().keep_warm(0).get(timeout=TIMEOUT)
    assert wait_for(lambda: not rt.spawner.spares and not rt.spawner.starting_spares, timeout=TIMEOUT)
    with pytest.raises(ValueError, match="refill_delay_s"):
        rt.spawner.keep_warm(1, [], refill_delay_s=-1)


def test_worker_command_requires_a_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env["REGENT_USER_SECRET_FILE"] = "off"  # no per-user default either (test_user_secret_e2e.py covers it)
    proc = subprocess.run([sys.executable, "-m", "regent.cli", "worker", "--address", "tcp://127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "secret" in proc.stderr


def test_worker_with_wrong_secret_is_refused(tmp_path):
    secret = tmp_path / "wrong.secret"
    secret.write_text("00" * 32)
    worker = subprocess.Popen(
        [sys.executable, "-m", "regent.cli", "worker", "--address", "tcp://127.0.0.1:0",
         "--secret-file", str(secret)], stdout=subprocess.PIPE, text=True)
    try:
        address = worker.stdout.readline().split()[-1]
        from regent.actor import attach_to_workers

        pm = attach_to_workers([address]).spawn_procs(per_host={"gpus": 1})
        with pytest.raises(Exception, match="secret"):
            pm.initialized.get(timeout=TIMEOUT)
    finally:
        worker.terminate()
        worker.wait(10)


@pytest.mark.slow
def test_worker_host_keeps_warm_spares_and_shuts_down():
    job = ProcessJob(hosts=1)
    try:
        hosts = job.host_mesh()
        worker = job.worker_pids()[0]
        hosts.keep_warm(1, preload=["xml.dom.minidom"]).get(timeout=TIMEOUT)
        claimed = None
        deadline = time.monotonic() + TIMEOUT
        while claimed is None and time.monotonic() < deadline:
            pm = hosts.spawn_procs(per_host={"gpus": 1}, env={"WARM_ENV": "remote"})
            _, pid, ppid, warm_env, preloaded = pm.spawn("w", Where).where.call_one().get(timeout=TIMEOUT)
            assert ppid == worker and warm_env == "remote"
            pm.initialized.get(timeout=TIMEOUT)
            assert pm.spares_claimed == (1 if preloaded else 0)  # a cold start is not reported as warm
            if preloaded:
                claimed = pid
            pm.stop().get(timeout=TIMEOUT)
        assert claimed is not None, "no warm spare was ever claimed"
        hosts.shutdown().get(timeout=TIMEOUT)
        assert wait_for(lambda: not pid_alive(worker))
        with pytest.raises(RuntimeError, match="already been shut down"):
            hosts.spawn_procs(per_host={"gpus": 1})
    finally:
        job.kill()


class Busy(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def work(self, seconds: float) -> None:
        time.sleep(seconds)


def test_stop_with_timeout_kills_busy_procs_quickly():
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    busy = pm.spawn("busy", Busy)
    pids = busy.pid.call().get(timeout=TIMEOUT).values()
    busy.work.broadcast(60)
    time.sleep(0.2)
    t0 = time.monotonic()
    pm.stop(timeout=0.5).get(timeout=TIMEOUT)
    assert time.monotonic() - t0 < 8
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=10)


class SockDir(Actor):
    @endpoint
    def where(self) -> tuple:
        return os.getpid(), get_runtime().sock_dir


def test_socket_directories_are_removed_however_a_proc_ends(monkeypatch):
    """Each process's private unix-socket directory goes with it: a SIGKILLed proc's is removed by its spawner,
    a stopped proc's by itself (they used to pile up in /tmp, one per process ever started)."""
    import regent.actor

    faults: list = []  # the SIGKILL is a real fault; unhandled, it would end this client (CI saw exactly that)
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("sockdir", SockDir)
    (pid0, dir0), (pid1, dir1) = mesh.where.call().get(timeout=TIMEOUT).values()
    assert os.path.isdir(dir0) and os.path.isdir(dir1) and dir0 != dir1
    os.kill(pid0, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(dir0)), dir0
    assert wait_for(lambda: len(faults) == 1), faults  # reported, before the stop that would mute it
    procs.stop().get(timeout=TIMEOUT)
    assert wait_for(lambda: not os.path.exists(dir1)), dir1


def test_controller_removes_its_socket_directory_at_exit(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent("""
        import json, os
        from regent.actor import Actor, endpoint, this_host
        from regent.actor._process import get_runtime

        class SockDir(Actor):
            @endpoint
            def where(self):
                return get_runtime().sock_dir

        mesh = this_host().spawn_procs(per_host={"gpus": 1}).spawn("s", SockDir)
        print(json.dumps([get_runtime().sock_dir, mesh.where.call_one().get(timeout=120)]), flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    dirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(d.startswith(os.path.join(os.path.realpath(os.path.dirname(d)), "regent-")) for d in dirs)
    assert not [d for d in dirs if os.path.exists(d)]


def test_stale_socket_directories_are_swept_and_live_ones_kept(tmp_path):
    """What a SIGKILLed process leaves (a socket nobody listens on) is removed by the next controller; a socket
    in use, a fresh directory, and anything that is not a socket directory stay."""
    import socket as _socket

    from regent.actor._runtime import STALE_SOCK_DIR_AGE_S, sweep_stale_sock_dirs

    old = time.time() - STALE_SOCK_DIR_AGE_S - 10

    def sock_dir(name: str, listen: bool) -> tuple:
        d = tmp_path / name
        d.mkdir(mode=0o700)
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.bind(str(d / "rt.sock"))
        if listen:
            s.listen()
        else:
            s.close()  # the file stays, nobody listens: what a killed process leaves
        return d, s

    dead, _ = sock_dir("regent-dead", listen=False)
    live, server = sock_dir("regent-live", listen=True)
    fresh, _ = sock_dir("regent-fresh", listen=False)
    empty = tmp_path / "regent-empty"
    empty.mkdir()
    other = tmp_path / "regent-other"
    other.mkdir()
    (other / "data.txt").write_text("not ours")
    secret = tmp_path / "regent-secret-x"
    secret.write_text("00")
    for p in (dead, live, empty, other, secret):
        os.utime(p, (old, old))
    try:
        assert sweep_stale_sock_dirs(str(tmp_path)) == 2
        assert not dead.exists() and not empty.exists()
        assert live.exists() and fresh.exists() and other.exists() and secret.exists()
    finally:
        server.close()
