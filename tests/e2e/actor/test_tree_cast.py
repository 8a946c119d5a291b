"""Tree fan-out over `regent worker` hosts, aggregated supervision of a lost host, and spawning over hosts.

Sizes are small (3 hosts x 4 procs x 4 actors); the large sizes are in benchmarks/actor_scale_bench.py.
Message counts come from the runtime's counters (`Runtime.stats`), not from timing.
"""

import os
import signal
import time

import pytest

import regent.actor
from regent.actor import Actor, Channel, SupervisionError, current_rank, endpoint, send, this_host
from regent.actor._process import get_runtime
from regent.jobs.local import ProcessJob

TIMEOUT = 60
HOSTS, PROCS, ACTORS = 3, 4, 4


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


class Member(Actor):
    def __init__(self):
        self.seen = []

    @endpoint
    def who(self) -> tuple:
        return (str(current_rank()), os.getpid())

    @endpoint
    def add(self, x: int) -> int:
        self.seen.append(x)
        return x + current_rank().rank

    @endpoint
    def record(self, x: int) -> None:
        self.seen.append(x)

    @endpoint
    def history(self) -> list:
        return list(self.seen)

    @endpoint
    def fail_on(self, rank: int) -> int:
        if current_rank().rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return rank

    @endpoint
    def sleep(self, s: float) -> int:
        time.sleep(s)
        return 1


@pytest.fixture(scope="module")
def job():
    j = ProcessJob(hosts=HOSTS, env={"REGENT_EXIT_WINDOW": "0.3"})
    try:
        yield j
    finally:
        j.kill()


@pytest.fixture(scope="module")
def members(job):
    procs = job.host_mesh().spawn_procs(per_host={"procs": PROCS})
    mesh = procs.colocated("actors", ACTORS).spawn("members", Member)
    mesh.initialized.get(timeout=TIMEOUT)
    yield procs, mesh
    procs.stop().get(timeout=TIMEOUT)


def sent_during(fn):
    rt = get_runtime()
    before = rt.stats.copy()
    out = fn()
    after = rt.stats.copy()
    after.subtract(before)
    return out, after


def test_call_over_hosts_is_one_message_per_host(members):
    _procs, mesh = members
    n = HOSTS * PROCS * ACTORS
    vm, sent = sent_during(lambda: mesh.add.call(100).get(timeout=TIMEOUT))
    assert vm.values() == [100 + r for r in range(n)]  # complete and in rank order
    assert sent["casts"] == 1 and sent["cast_sent"] == HOSTS and sent["m_sent"] == 0
    # the replies came back gathered: one batch per host
    assert sent["reply_batches"] == HOSTS
    # several actors really share each process, and each host's procs are its worker's children
    who = mesh.who.call().get(timeout=TIMEOUT)
    pids = [pid for _point, pid in who.values()]
    assert len(set(pids)) == HOSTS * PROCS
    assert all(len(set(pids[i:i + ACTORS])) == 1 for i in range(0, n, ACTORS))
    assert who.item(hosts=2, procs=3, actors=1)[0] == "{'hosts': 2/3, 'procs': 3/4, 'actors': 1/4}"


@pytest.mark.parametrize("mode,messages", [("proc", HOSTS * PROCS), ("actor", HOSTS * PROCS * ACTORS)])
def test_flat_modes_for_comparison(members, mode, messages):
    _procs, mesh = members
    rt = get_runtime()
    rt.cast_mode = mode
    try:
        vm, sent = sent_during(lambda: mesh.add.call(7).get(timeout=TIMEOUT))
    finally:
        rt.cast_mode = "tree"
    assert vm.values() == [7 + r for r in range(HOSTS * PROCS * ACTORS)]
    assert sent["cast_sent"] + sent["m_sent"] == messages


def test_slices_stream_choose_and_errors_through_the_tree(members):
    _procs, mesh = members
    part = mesh.slice(hosts=1)
    # ranks inside a slice count from 0 (the view's own points), as for a direct call
    assert part.add.call(0).get(timeout=TIMEOUT).values() == list(range(PROCS * ACTORS))
    assert [p for p, _ in part.who.call().get(timeout=TIMEOUT).values()][-1] == "{'procs': 3/4, 'actors': 3/4}"
    got = sorted(f.get(timeout=TIMEOUT) for f in mesh.add.stream(0))
    assert got == list(range(HOSTS * PROCS * ACTORS))
    assert mesh.add.choose(0).get(timeout=TIMEOUT) in range(HOSTS * PROCS * ACTORS)
    with pytest.raises(regent.actor.ActorError, match="rank 5 refuses"):
        mesh.fail_on.call(5).get(timeout=TIMEOUT)
    # a port gets one reply per actor
    port, receiver = Channel.open()
    send(mesh.add, (1,), {}, port=port)
    assert sorted(receiver.recv().get(timeout=TIMEOUT) for _ in range(HOSTS * PROCS * ACTORS)) == \
        list(range(1, HOSTS * PROCS * ACTORS + 1))


def test_order_is_kept_between_tree_casts_and_direct_calls(members):
    """Broadcasts go through the hosts' agents, call_one goes straight to the process: each actor still
    sees one sender's messages in the order they were sent."""
    _procs, mesh = members
    one = mesh.slice(hosts=2, procs=1, actors=3)
    start = len(one.history.call_one().get(timeout=TIMEOUT))
    for i in range(20):
        mesh.record.broadcast(i)
        one.record.broadcast(-i)
    history = one.history.call_one().get(timeout=TIMEOUT)[start:]
    expected = [x for i in range(20) for x in (i, -i)]
    assert history == expected
    assert all(h[-20:] == list(range(20)) for h in mesh.slice(hosts=0).history.call().get(timeout=TIMEOUT).values())


def test_host_losing_all_procs_is_one_supervision_report(members, monkeypatch):
    """Runs last of the tests on `members`: it kills every proc of host 1."""
    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    _procs, mesh = members
    rt = get_runtime()
    who = mesh.who.call().get(timeout=TIMEOUT)
    victims = sorted({pid for point, pid in who.values() if point.startswith("{'hosts': 1/3")})
    assert len(victims) == PROCS
    inflight = mesh.slice(hosts=1).sleep.call(30)
    reports_before = rt.stats["supervision_reports"]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(SupervisionError):
        inflight.get(timeout=TIMEOUT)
    lost = list(range(PROCS * ACTORS, 2 * PROCS * ACTORS))
    assert wait_for(lambda: len(faults) >= len(lost))
    time.sleep(1.0)  # any further (storm) report would have come by now
    # one report on the wire, one MeshFailure per rank at the API (Monarch's hook sees a failure per rank)
    assert [f.crashed_ranks for f in faults] == [[r] for r in lost], [str(f) for f in faults]
    assert all(f.mesh_name == "members" and "Killed(sig=9)" in f.report() for f in faults)
    assert rt.stats["supervision_reports"] - reports_before == 1
    # the other hosts still answer; the lost ranks fail fast
    assert len(mesh.slice(hosts=0).who.call().get(timeout=TIMEOUT)) == PROCS * ACTORS
    with pytest.raises(SupervisionError, match="members"):
        mesh.who.call().get(timeout=TIMEOUT)


class Owner(Actor):
    """Owns a mesh over the job's hosts and records what `__supervise__` receives."""

    def __init__(self, hosts):
        self.seen = []
        self.procs = hosts.spawn_procs(per_host={"procs": 2})
        self.children = self.procs.colocated("actors", 2).spawn("kids", Member)

    def __supervise__(self, failure):
        self.seen.append((failure.mesh_name, failure.crashed_ranks))
        return True

    @endpoint
    def child_pids(self) -> list:
        return [pid for _p, pid in self.children.who.call().get(timeout=TIMEOUT).values()]

    @endpoint
    def seen_failures(self) -> list:
        return list(self.seen)

    @endpoint
    def stop_children(self) -> None:
        self.procs.stop().get(timeout=TIMEOUT)


def test_owner_actor_supervises_a_lost_host_once_per_rank(job):
    owner_procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        owner = owner_procs.spawn("owner", Owner, job.host_mesh())
        pids = owner.child_pids.call_one().get(timeout=TIMEOUT)
        assert len(pids) == HOSTS * 2 * 2
        host0 = sorted(set(pids[:4]))
        for pid in host0:
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: owner.seen_failures.call_one().get(timeout=TIMEOUT))
        time.sleep(1.0)
        assert owner.seen_failures.call_one().get(timeout=TIMEOUT) == [("kids", [r]) for r in range(4)]
        owner.stop_children.call_one().get(timeout=TIMEOUT)
    finally:
        owner_procs.stop().get(timeout=TIMEOUT)


def test_spawn_over_hosts_is_one_exchange_per_host(job):
    rt = get_runtime()
    before = rt.stats.copy()
    procs = job.host_mesh().spawn_procs(per_host={"procs": 2})
    try:
        procs.initialized.get(timeout=TIMEOUT)
        spawned = rt.stats.copy()
        spawned.subtract(before)
        assert spawned["host_spawn_sent"] == HOSTS
        def spawn():
            mesh = procs.spawn("fresh", Member)
            mesh.initialized.get(timeout=TIMEOUT)
            return mesh

        mesh, sent = sent_during(spawn)
        assert sent["cast_sent"] == HOSTS  # the actors too: one spawn message per host, not per proc
        assert [p for p, _ in mesh.who.call().get(timeout=TIMEOUT).values()][-1] == "{'hosts': 2/3, 'procs': 1/2}"
    finally:
        procs.stop().get(timeout=TIMEOUT)


def test_whole_host_gone_agent_included_is_one_report(job, monkeypatch):
    """The machine is lost: its `regent worker` dies with its procs, so no exit report comes; the controller
    sees the connections drop and still makes one report per mesh (a failure per rank at the API). Runs last: it
    kills host 2 of the module's job."""
    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    procs = job.host_mesh().spawn_procs(per_host={"procs": 2})
    try:
        mesh = procs.colocated("actors", 2).spawn("gone", Member)
        who = mesh.who.call().get(timeout=TIMEOUT)
        victims = sorted({pid for point, pid in who.values() if point.startswith("{'hosts': 2/3")})
        assert len(victims) == 2
        worker = job.worker_pids()[2]
        with open(f"/proc/{worker}/task/{worker}/children") as f:
            on_host = [int(p) for p in f.read().split()]  # these procs and the `members` fixture's
        assert set(victims) <= set(on_host)
        for pid in [worker, *on_host]:
            os.kill(pid, signal.SIGKILL)
        expected = sorted([("gone", [r]) for r in range(8, 12)] + [("members", [r]) for r in range(32, 48)])
        assert wait_for(lambda: len(faults) >= len(expected))
        time.sleep(1.0)
        assert sorted((f.mesh_name, f.crashed_ranks) for f in faults) == expected
        assert len(mesh.slice(hosts=0).who.call().get(timeout=TIMEOUT)) == 4
    finally:
        procs.stop().get(timeout=TIMEOUT)
