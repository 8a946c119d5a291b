"""Monarch conformance (issue 18): no call waits forever, and same names behave the same.

- an async actor whose `__init__` blocks does not freeze its process; calls to it wait for construction;
- a pickled mesh handed to a program with another job secret raises at once, naming the fix; with the
  same secret (REGENT_JOB_SECRET / REGENT_JOB_SECRET_FILE) it works, and a program the client starts itself
  shares its secret without one set;
- `initialized` of host and proc meshes resolves to True (and fails for an unreachable host);
- `creator` of a client-spawned actor is the root instance, named "root";
- an empty log message inside an actor stays empty;
- `ProcessJob.state()` gives independent host meshes: stopping one does not stop another's procs;
- `Shape.at` raises ValueError (unknown label, out of range), OverflowError (negative); `Shape(labels, slice=...)`;
- supervision wording: "The actor <name> and all its descendants have failed", "at rank 0";
- `proc_bind` pins the spawned processes' CPUs.
"""

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from regent.actor import (
    Actor,
    SupervisionError,
    attach_to_workers,
    config,
    context,
    current_rank,
    endpoint,
    this_host,
)
from regent.actor._shape import Extent, Shape, Slice
from regent.jobs.local import ProcessJob

TIMEOUT = 60

# In the proc process: the gate a blocked `__init__` waits on, opened by another actor's endpoint.
GATE = threading.Event()


class BlockedInit(Actor):
    def __init__(self):
        self.rank = current_rank().rank  # the actor's context is there while __init__ runs off the loop
        self.opened = GATE.wait(TIMEOUT)

    @endpoint
    async def value(self) -> tuple:
        return ("constructed", self.opened, self.rank)


class Opener(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def open(self) -> None:
        GATE.set()


@pytest.fixture(scope="module")
def one():
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    yield pm
    pm.stop().get(timeout=TIMEOUT)


def test_blocking_async_init_keeps_the_process_responsive(one):
    blocked = one.spawn("blocked", BlockedInit)
    early = blocked.value.call_one()  # sent while __init__ is blocked: must wait for it, not race it
    opener = one.spawn("opener", Opener)
    # the same process still delivers other actors' messages (before the fix: nothing, forever)
    assert opener.ping.call_one().get(timeout=TIMEOUT) == "pong"
    with pytest.raises(TimeoutError):
        early.get(timeout=0.5)
    opener.open.call_one().get(timeout=TIMEOUT)
    assert early.get(timeout=TIMEOUT) == ("constructed", True, 0)
    assert blocked.initialized.get(timeout=TIMEOUT) is None


# ------------------------------------------------------------------------------------ a second client
ACTORS = '''
from regent.actor import Actor, endpoint

class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x
'''

FIRST = '''
import os, pickle, sys, time
from regent.actor import this_host
from conf_actors import Echo

out = sys.argv[1]
pm = this_host().spawn_procs(per_host={"gpus": 1})
am = pm.spawn("echo", Echo)
assert am.echo.call_one(1).get(timeout=60) == 1
with open(out + ".tmp", "wb") as f:
    pickle.dump((pm, am), f)
os.rename(out + ".tmp", out)
deadline = time.monotonic() + 60
while not os.path.exists(out + ".done") and time.monotonic() < deadline:
    time.sleep(0.05)
pm.stop().get(timeout=60)
'''

SECOND = '''
import pickle, sys, time
from conf_actors import Echo

t0 = time.monotonic()
try:
    with open(sys.argv[1], "rb") as f:
        pm, am = pickle.load(f)
    print("echo", am.echo.call_one(2).get(timeout=30))
    mine = pm.spawn("mine", Echo)  # spawning on the first client's procs works too
    print("spawned", mine.echo.call_one(3).get(timeout=30))
except Exception as exc:
    print("raised", type(exc).__name__, round(time.monotonic() - t0, 2), exc)
finally:
    open(sys.argv[1] + ".done", "w").close()
'''


def _two_clients(tmp_path, first_env: dict, second_env: dict) -> str:
    (tmp_path / "conf_actors.py").write_text(ACTORS)
    (tmp_path / "first.py").write_text(FIRST)
    (tmp_path / "second.py").write_text(SECOND)
    base = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    base["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    handoff = str(tmp_path / "mesh.pkl")
    first = subprocess.Popen([sys.executable, str(tmp_path / "first.py"), handoff], env={**base, **first_env})
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(handoff):
            assert first.poll() is None, "the first client exited early"
            assert time.monotonic() < deadline, "the first client did not hand over its mesh"
            time.sleep(0.05)
        second = subprocess.run([sys.executable, str(tmp_path / "second.py"), handoff], env={**base, **second_env},
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert first.wait(timeout=TIMEOUT) == 0
    finally:
        if first.poll() is None:
            first.kill()
    return second.stdout


def test_second_client_with_another_secret_raises_at_once_naming_the_fix(tmp_path):
    out = _two_clients(tmp_path, {"REGENT_JOB_SECRET": "aa" * 32}, {"REGENT_JOB_SECRET": "bb" * 32})
    assert out.startswith("raised ForeignJobError"), out
    seconds = float(out.split()[2])
    assert seconds < 10, out  # at unpickling, not after a timeout
    assert "REGENT_JOB_SECRET" in out and "REGENT_JOB_SECRET_FILE" in out


def test_second_client_sharing_the_secret_file_uses_the_mesh(tmp_path):
    secret = tmp_path / "job.secret"
    secret.write_text("cd" * 32)
    os.chmod(secret, 0o600)
    env = {"REGENT_JOB_SECRET_FILE": str(secret)}
    out = _two_clients(tmp_path, env, env)
    assert out.split("\n")[:2] == ["echo 2", "spawned 3"], out


STARTS_A_CHILD = '''
import multiprocessing, os, subprocess, sys
from regent.actor import this_host
from conf_actors import Echo

def child(queue, am):
    queue.put(am.echo.call_one(5).get(timeout=60))

if __name__ == "__main__":
    assert not any(k.startswith("REGENT_JOB_SECRET") for k in os.environ)
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    am = pm.spawn("echo", Echo)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue, am))
    p.start()
    print("child", queue.get(timeout=60))
    p.join(60)
    print("exit", p.exitcode)
    # the secret itself is not in the environment programs started here inherit, only a private file's path
    shown = subprocess.run(["env"], capture_output=True, text=True).stdout
    from regent.actor._process import get_runtime
    print("leaked", get_runtime().secret.hex() in shown)
    pm.stop().get(timeout=60)
'''


def test_a_program_the_client_starts_joins_its_job_without_a_secret_set(tmp_path):
    """A client that made up its own job secret hands it to the programs it starts (as to its procs), so a
    `multiprocessing` child given one of its meshes uses it (Monarch's test_client_hard_exit_cleanup)."""
    (tmp_path / "conf_actors.py").write_text(ACTORS)
    (tmp_path / "first.py").write_text(STARTS_A_CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    out = subprocess.run([sys.executable, str(tmp_path / "first.py")], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT * 2)
    assert out.stdout.split("\n")[:3] == ["child 5", "exit 0", "leaked False"], out.stdout + out.stderr


# ------------------------------------------------------------------------------------ same name, same behaviour
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_initialized_resolves_to_true_and_fails_for_an_unreachable_host(one):
    assert this_host().initialized.get(timeout=TIMEOUT) is True
    assert one.initialized.get(timeout=TIMEOUT) is True
    gone = attach_to_workers([f"tcp://127.0.0.1:{_closed_port()}"], name="gone")
    old, config.attach_timeout = config.attach_timeout, 0.5  # a refused worker is dialled again until then
    try:
        with pytest.raises(ConnectionError, match="host 0 of host mesh gone .* cannot be reached"):
            gone.initialized.get(timeout=TIMEOUT)
    finally:
        config.attach_timeout = old


class Child(Actor):
    @endpoint
    def creator_name(self) -> str | None:
        creator = context().actor_instance.creator
        return None if creator is None else creator.name


class Creator(Actor):
    def __init__(self):
        self.child = this_proc_spawn()

    @endpoint
    def names(self) -> tuple:
        creator = context().actor_instance.creator
        return (creator.name, creator.creator, self.child.creator_name.call_one().get(timeout=TIMEOUT))


def this_proc_spawn():
    from regent.actor import this_proc

    return this_proc().spawn("child", Child)


def test_creator_of_a_client_spawned_actor_is_root(one):
    c = one.spawn("creator", Creator)
    root_name, root_creator, child_creator = c.names.call_one().get(timeout=TIMEOUT)
    assert root_name == "root" and root_creator is None
    assert child_creator == "creator"


class Logs(Actor):
    @endpoint
    def log(self) -> list:
        seen = []

        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())

        log = logging.getLogger("conformance.empty")
        log.propagate = False
        log.addHandler(Keep())
        log.warning("")
        log.warning("hello %s", "there")
        return seen


def test_empty_log_message_stays_empty(one):
    empty, text = one.spawn("logs", Logs).log.call_one().get(timeout=TIMEOUT)
    assert empty == ""
    assert text.startswith("[actor=") and text.endswith("] hello there")


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


@pytest.mark.slow
def test_process_job_state_meshes_stop_independently(monkeypatch):
    import regent.actor

    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    with ProcessJob(hosts=1) as job:
        a, b = job.state().hosts, job.state().hosts
        assert a is not b and a.initialized.get(timeout=TIMEOUT) is True
        pa = a.spawn_procs(per_host={"gpus": 1}).spawn("a", Pid)
        procs_b = b.spawn_procs(per_host={"gpus": 1})
        pb = procs_b.spawn("b", Pid)
        pid_a = pa.pid.call_one().get(timeout=TIMEOUT)
        pid_b = pb.pid.call_one().get(timeout=TIMEOUT)
        a.stop().get(timeout=TIMEOUT)
        assert pb.pid.call_one().get(timeout=TIMEOUT) == pid_b  # b's procs were not stopped with a's
        with pytest.raises(SupervisionError):
            pa.pid.call_one().get(timeout=TIMEOUT)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid_a}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid_a}")
        procs_b.stop().get(timeout=TIMEOUT)
    assert not faults, faults


def test_shape_at_is_monarchs():
    shape = Shape(["hosts", "gpus"], slice=Slice.new_row_major([2, 3]))
    assert shape == Shape(["hosts", "gpus"], ndslice=Slice.new_row_major([2, 3]))
    assert shape.at("gpus", 2).ranks() == [2, 5]
    with pytest.raises(ValueError, match="no dimension 'cpus'"):
        shape.at("cpus", 0)
    with pytest.raises(ValueError, match="out of range"):
        shape.at("gpus", 3)
    with pytest.raises(OverflowError, match="negative"):
        shape.at("gpus", -1)
    with pytest.raises(TypeError):
        Shape(["hosts"])
    assert Shape.from_extent(Extent(["x"], [4])).ndslice.sizes == [4]


class Dies(Actor):
    @endpoint
    def die(self) -> None:
        raise SystemExit("gone")

    @endpoint
    def ok(self) -> str:
        return "ok"


class Middle(Actor):
    def __init__(self):
        from regent.actor import this_proc

        self.inner = this_proc().spawn("inner", Dies)

    @endpoint
    def kill_inner(self) -> None:
        self.inner.die.broadcast()


def test_supervision_reports_use_monarchs_words(one, monkeypatch):
    import regent.actor

    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    middle = one.spawn("middle", Middle)
    middle.kill_inner.call_one().get(timeout=TIMEOUT)  # inner dies, middle does not handle it: escalates
    deadline = time.monotonic() + TIMEOUT
    while not faults and time.monotonic() < deadline:
        time.sleep(0.05)
    assert faults, "no failure reached the client"
    report = faults[0].report()
    assert report.startswith("The actor test_actor_conformance.Middle middle{'gpus': 0/1} and all its "
                             "descendants have failed:"), report
    # the nested actor's own report, with its name{rank}, is in it
    assert "The actor test_actor_conformance.Dies inner{} and all its descendants have failed:" in report, report
    with pytest.raises(SupervisionError, match=r'failure on mesh "middle" at rank 0 with event'):
        middle.kill_inner.call_one().get(timeout=TIMEOUT)


# ------------------------------------------------------------------------------------ proc_bind
class Affinity(Actor):
    @endpoint
    def cpus(self) -> list:
        import threading as _threading

        seen = []
        t = _threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        t.start()
        t.join()
        return [sorted(os.sched_getaffinity(0)), seen[0]]


def test_proc_bind_pins_cpus():
    have = sorted(os.sched_getaffinity(0))
    if len(have) < 2:
        pytest.skip("needs at least 2 CPUs")
    pm = this_host().spawn_procs(per_host={"gpus": 2},
                                 proc_bind=[{"cpus": str(have[0])}, {"physcpubind": f"{have[1]}"}])
    try:
        vm = pm.spawn("aff", Affinity).cpus.call().get(timeout=TIMEOUT)
        assert vm.item(gpus=0) == [[have[0]], [have[0]]]  # the process and threads it starts later
        assert vm.item(gpus=1) == [[have[1]], [have[1]]]
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_proc_bind_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match="membind"):
        this_host().spawn_procs(per_host={"gpus": 1}, proc_bind=[{"membind": "0"}])
    with pytest.raises(ValueError, match="unknown keys"):
        this_host().spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpu": "0"}])
    with pytest.raises(ValueError, match="bad entry"):
        this_host().spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpus": "x-1"}])


def test_proc_bind_asking_for_missing_cpus_fails_initialized():
    pm = this_host().spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpus": "4095"}])
    with pytest.raises(Exception, match="proc_bind asks for CPUs \\[4095\\]"):
        pm.initialized.get(timeout=TIMEOUT)
