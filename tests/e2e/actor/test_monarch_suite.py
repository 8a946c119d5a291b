"""What Monarch's own test suite revealed (issue 35), checked with Regent's own tests and real processes.

- `attach_to_workers` right after starting a worker (before it listens) waits for it, as Monarch's does;
  a worker that never comes up fails with Monarch's "attach failed: config push failed during attach";
- an async actor's endpoints see what its `__init__` stored in a `threading.local` (Monarch runs both on
  one thread; Regent's `__init__` runs off the loop);
- `ProcessJob.kill()` is a deliberate end: the procs it takes down are no failure for `unhandled_fault_hook`
  (a worker killed by anything else still is); `JobState` keeps its meshes in `_hosts`, as Monarch's;
- stopping an actor mesh whose `__init__` never returns completes (async and sync actors), and a call that
  was waiting for that `__init__` fails instead of waiting forever;
- a worker serves on a bound socket it inherited (`tcp://HOST:fdN`, Monarch's form);
- Monarch's error wording: a call to a rank whose process died says "failure on mesh ... with event: The actor
  ... and all its descendants have failed"; a stopped mesh "The actor mesh X has status: stopped"; proc_bind
  and concurrent_endpoint misuse; a missing private attribute of a mesh reads as Python's own;
- `Shape.at` with a negative index raises OverflowError (Monarch's index is unsigned);
- a failed call reads "Actor call <mesh>.<endpoint> failed." (Monarch's `ActorError.message`);
- a mesh whose owning actor's process died stops, and a reference to it held elsewhere fails its calls with
  Monarch's "timed out reaching controller ... for mesh X. Assuming controller's proc is dead".
"""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import regent.actor
from regent.actor import Actor, attach_to_workers, config, endpoint, this_host
from regent.actor._process import get_runtime
from regent.actor._shape import Shape, Slice
from regent.jobs.local import ProcessJob

TIMEOUT = 60

WORKER = textwrap.dedent('''
    import sys
    from regent.actor import run_worker_loop_forever
    run_worker_loop_forever(address=sys.argv[1], ca="trust_all_connections")
''')


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Local(Actor):
    def __init__(self) -> None:
        self.local = threading.local()
        self.local.value = 10

    @endpoint
    async def bump(self) -> int:
        self.local.value += 1
        return self.local.value


def test_async_endpoints_see_thread_local_state_set_in_init():
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        local = pm.spawn("local", Local)
        assert [local.bump.call_one().get(timeout=TIMEOUT) for _ in range(2)] == [11, 12]
    finally:
        pm.stop().get(timeout=TIMEOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attach_waits_for_a_worker_that_is_still_starting():
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    hosts = attach_to_workers([address], name="late")  # nothing listens yet
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env["REGENT_JOB_SECRET"] = get_runtime().secret.hex()
    # the worker's interpreter takes far longer to start than the first dial: that dial is refused
    worker = subprocess.Popen([sys.executable, "-c", WORKER, address], env=env, stdout=subprocess.DEVNULL)
    try:
        pm = hosts.spawn_procs(per_host={"gpus": 1})
        pids = pm.spawn("pid", Pid).pid.call().get(timeout=TIMEOUT).values()
        assert len(list(pids)) == 1
        hosts.shutdown().get(timeout=TIMEOUT)
        assert worker.wait(TIMEOUT) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_worker_serves_on_an_inherited_socket():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port, fd = sock.getsockname()[1], sock.fileno()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env["REGENT_JOB_SECRET"] = get_runtime().secret.hex()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, f"tcp://127.0.0.1:fd{fd}"], env=env,
                              stdout=subprocess.PIPE, text=True, pass_fds=(fd,))
    sock.close()
    try:
        assert worker.stdout.readline().split()[-1] == f"tcp://127.0.0.1:{port}"
        hosts = attach_to_workers([f"tcp://127.0.0.1:{port}"], name="inherited")
        pm = hosts.spawn_procs(per_host={"gpus": 1})
        assert len(list(pm.spawn("pid", Pid).pid.call().get(timeout=TIMEOUT).values())) == 1
        hosts.shutdown().get(timeout=TIMEOUT)
        assert worker.wait(TIMEOUT) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_attach_to_a_worker_that_never_listens_fails_in_monarchs_words(tmp_path):
    old = config.attach_timeout
    config.configure(attach_timeout=0.5)
    try:
        never = f"ipc://{tmp_path}/never_bound"
        hosts = attach_to_workers([never], name="never")
        with pytest.raises(ConnectionError) as info:
            hosts.initialized.get(timeout=TIMEOUT)
    finally:
        config.configure(attach_timeout=old)
    assert "attach failed: config push failed during attach" in str(info.value)
    assert f"{tmp_path}/never_bound" in str(info.value)


def test_negative_shape_index_is_an_overflow_as_in_monarch():
    shape = Shape(["rows", "cols"], Slice.new_row_major([2, 3]))
    with pytest.raises(OverflowError):
        shape.at("rows", -1)
    with pytest.raises(ValueError):
        shape.at("rows", 5)


def _wait_for(predicate, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_job_kill_is_not_a_failure_but_a_dying_worker_is():
    rt = get_runtime()
    faults: list[str] = []
    old_hook = regent.actor.unhandled_fault_hook
    regent.actor.unhandled_fault_hook = lambda failure: faults.append(failure.mesh_name)
    killed, crashed = ProcessJob(hosts=1), ProcessJob(hosts=1)
    try:
        assert set(killed.state()._hosts) == {"hosts"}
        meshes = {}
        for name, job in (("killed", killed), ("crashed", crashed)):
            pm = job.host_mesh().spawn_procs(name=f"{name}_procs", per_host={"gpus": 1})
            meshes[name] = pm.spawn(name, Pid)
            meshes[name].pid.call().get(timeout=TIMEOUT)
        killed_procs = list(meshes["killed"]._ref.rank_procs)
        killed.kill()
        assert _wait_for(lambda: all(p in rt.supervision.dead for p in killed_procs))
        # the control: a worker that dies on its own is a failure; its report comes after the kill's would have
        for p in crashed._workers["hosts"]:
            p.kill()
        assert _wait_for(lambda: "crashed" in faults)
        assert "killed" not in faults, faults
    finally:
        regent.actor.unhandled_fault_hook = old_hook
        killed.kill()
        crashed.kill()


class StuckAsync(Actor):
    def __init__(self) -> None:
        threading.Event().wait()

    @endpoint
    async def never(self) -> None:
        pass


class StuckSync(Actor):
    def __init__(self) -> None:
        threading.Event().wait()

    @endpoint
    def never(self) -> None:
        pass


@pytest.mark.parametrize("cls", [StuckAsync, StuckSync])
def test_stop_of_an_actor_whose_init_never_returns_completes(cls):
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        stuck = pm.spawn("stuck", cls)
        waiting = stuck.never.call_one()  # queued behind __init__
        stuck.stop().get(timeout=TIMEOUT)
        with pytest.raises(Exception, match="stopped"):
            waiting.get(timeout=TIMEOUT)
        with pytest.raises(Exception, match="stopped"):
            stuck.never.call_one().get(timeout=TIMEOUT)
        assert pm.spawn("pid", Pid).pid.call_one().get(timeout=TIMEOUT) > 0  # the proc still serves
    finally:
        pm.stop(timeout=0).get(timeout=TIMEOUT)


class Exits(Actor):
    @endpoint
    def die(self) -> None:
        os._exit(1)

    @endpoint
    def ping(self) -> str:
        return "pong"


def test_monarchs_wording_for_dead_ranks_stopped_meshes_and_misuse():
    faults: list[str] = []
    old_hook = regent.actor.unhandled_fault_hook
    regent.actor.unhandled_fault_hook = lambda failure: faults.append(failure.mesh_name)
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        exits = pm.spawn("exits", Exits)
        exits.die.call_one()
        assert _wait_for(lambda: "exits" in faults)
        with pytest.raises(regent.actor.SupervisionError,
                           match=r'failure on mesh "exits" at rank 0 with event: The actor .*Exits exits.* and all '
                                 r'its descendants have failed: the process'):
            exits.ping.call_one().get(timeout=TIMEOUT)
        with pytest.raises(AttributeError, match="'ActorMesh' object has no attribute '_proc_mesh'"):
            exits._proc_mesh  # noqa: B018 - the lookup is what is tested
        pm2 = this_host().spawn_procs(per_host={"gpus": 1})
        pinged = pm2.spawn("pinged", Exits)
        pinged.ping.call_one().get(timeout=TIMEOUT)
        pinged.stop().get(timeout=TIMEOUT)
        with pytest.raises(Exception, match="The actor mesh pinged has status: stopped"):
            pinged.ping.call_one().get(timeout=TIMEOUT)
        pm2.stop().get(timeout=TIMEOUT)
        with pytest.raises(ValueError, match=r"proc_bind length \(1\) must equal procs_per_host \(2\)"):
            this_host().spawn_procs(per_host={"gpus": 2}, proc_bind=[{"cpus": "0"}])
        with pytest.raises(ValueError, match="can only wrap async endpoints"):
            class Bad(Actor):
                @regent.actor.concurrent_endpoint
                def ping(self) -> None:
                    pass
    finally:
        regent.actor.unhandled_fault_hook = old_hook
        pm.stop(timeout=0).get(timeout=TIMEOUT)



class Raises(Actor):
    @endpoint
    async def plain(self) -> None:
        raise ValueError("plain boom")

    @regent.actor.concurrent_endpoint
    async def overlapping(self) -> None:
        raise KeyError("concurrent boom")

    @endpoint
    async def ping(self) -> str:
        return "pong"


def test_a_failed_call_is_named_by_mesh_and_endpoint_as_in_monarch():
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        raises = pm.spawn("raiser", Raises)
        with pytest.raises(regent.actor.ActorError, match=r"^Actor call raiser\.plain failed\.\n") as info:
            raises.slice(gpus=1).plain.call_one().get(timeout=TIMEOUT)
        assert info.value.message == "Actor call raiser.plain failed."
        assert isinstance(info.value.exception, ValueError) and "plain boom" in str(info.value)
        with pytest.raises(regent.actor.ActorError, match=r"^Actor call raiser\.overlapping failed\.") as info:
            raises.slice(gpus=0).overlapping.call_one().get(timeout=TIMEOUT)
        assert isinstance(info.value.exception, KeyError) and "concurrent boom" in str(info.value)
        # the actors survive their endpoints' exceptions
        assert raises.ping.call().get(timeout=TIMEOUT).item(gpus=1) == "pong"
    finally:
        pm.stop(timeout=0).get(timeout=TIMEOUT)


class Owned(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()


class Owner(Actor):
    def __init__(self, procs) -> None:
        self.owned = procs.spawn("owned", Owned)

    @endpoint
    async def get(self):
        return self.owned

    @endpoint
    async def die(self) -> None:
        os._exit(1)


class Names(Actor):
    @endpoint
    def running(self) -> list[str]:
        return sorted(cell.name for cell in get_runtime().actors.running())


def test_a_mesh_whose_owner_process_died_is_stopped_and_its_references_say_the_controller_is_lost():
    old_hook = regent.actor.unhandled_fault_hook
    regent.actor.unhandled_fault_hook = lambda failure: None
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    pm2 = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        owner = pm.spawn("owner", Owner, pm2)
        owned = owner.get.call_one().get(timeout=TIMEOUT)
        assert owned.pid.call_one().get(timeout=TIMEOUT) > 0  # a reference works while the owner lives
        names = pm2.spawn("names", Names)
        assert "owned" in names.running.call_one().get(timeout=TIMEOUT)
        with pytest.raises(regent.actor.SupervisionError):
            owner.die.call_one().get(timeout=TIMEOUT)
        with pytest.raises(regent.actor.SupervisionError,
                           match=r'failure on mesh "owned" with event: .*timed out reaching controller \S+ for mesh '
                                 r"owned\. Assuming controller's proc is dead \(Exited\(1\)\)"):
            owned.pid.call_one().get(timeout=TIMEOUT)
        # the owned actor stops on its proc, which lives on (it belongs to this client, not to the dead owner)
        assert _wait_for(lambda: names.running.call_one().get(timeout=TIMEOUT) == ["names"])
    finally:
        regent.actor.unhandled_fault_hook = old_hook
        pm.stop(timeout=0).get(timeout=TIMEOUT)
        pm2.stop(timeout=0).get(timeout=TIMEOUT)
