"""Endpoint adverbs, ports, ValueMesh, futures, context: real procs over real sockets."""

import asyncio
import operator
import os
import time

import numpy as np
import pytest

from regent.actor import (
    Accumulator,
    Actor,
    ActorError,
    Channel,
    Port,
    ValueMesh,
    as_endpoint,
    concurrent_endpoint,
    context,
    current_rank,
    current_size,
    endpoint,
    get_or_spawn_controller,
    send,
    this_host,
    this_proc,
)

TIMEOUT = 60


class Counter(Actor):
    def __init__(self, start: int = 0):
        self.v = start
        self.log = []

    @endpoint
    def incr(self, by: int = 1) -> None:
        self.v += by

    @endpoint
    def value(self) -> int:
        return self.v

    @endpoint
    def record(self, x: int) -> None:
        self.log.append(x)

    @endpoint
    def get_log(self) -> list:
        return self.log

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    @endpoint
    def where(self) -> tuple:
        inst = context().actor_instance
        return str(current_rank()), current_size(), str(inst.rank), inst.name, os.getpid()

    @endpoint
    def emit(self, port: Port, n: int) -> None:
        r = context().actor_instance.rank["gpus"]
        for i in range(n):
            port.send(r * 100 + i)

    @endpoint
    def call_fn(self, fn):
        return fn()

    @endpoint
    def getenv(self, name: str):
        return os.environ.get(name)

    @endpoint
    def nbytes_and_sum(self, arr):
        return arr.nbytes, float(arr.sum()), bool(arr.flags.writeable)

    @endpoint(explicit_response_port=True)
    def doubled(self, port: Port, x: int) -> None:
        port.send(2 * x)

    def plain(self) -> str:
        return "plain"


class AsyncWorker(Actor):
    def __init__(self):
        self.started = []

    @endpoint
    async def ping(self, x):
        await asyncio.sleep(0)
        return x

    @concurrent_endpoint
    async def slow(self, tag: str, delay: float) -> str:
        self.started.append(tag)
        await asyncio.sleep(delay)
        return tag

    @endpoint
    async def started_order(self) -> list:
        return self.started


class Collector(Actor):
    def __init__(self, producers):
        self.producers = producers

    @endpoint
    async def gather(self, n: int) -> list:
        port, rx = Channel[int].open()
        self.producers.emit.broadcast(port, n)
        return sorted([await rx.recv() for _ in range(n * len(self.producers))])


class Registry(Actor):
    def __init__(self):
        self.pid = os.getpid()

    @endpoint
    def whoami(self) -> int:
        return self.pid


class AsksForController(Actor):
    @endpoint
    def lookup(self) -> int:
        reg = get_or_spawn_controller("registry", Registry).get(timeout=TIMEOUT)
        return reg.whoami.call_one().get(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, env={"REGENT_TEST_ENV": "yes"})
    pm.initialized.get(timeout=TIMEOUT)
    yield pm
    pm.stop().get(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def counter(procs):
    return procs.spawn("counter", Counter, 10)


def test_call_returns_value_mesh(counter):
    vm = counter.value.call().get(timeout=TIMEOUT)
    assert isinstance(vm, ValueMesh)
    assert vm.extent.labels == ["gpus"] and len(vm) == 2
    assert vm.item(gpus=1) >= 10


def test_call_one_requires_exactly_one_rank(counter):
    with pytest.raises(ValueError, match=r"call_one requires exactly 1 actor, but mesh has 2"):
        counter.value.call_one()
    assert counter.slice(gpus=0).echo.call_one("hi").get(timeout=TIMEOUT) == "hi"


def test_broadcast_is_fifo_per_sender(procs):
    c = procs.spawn("fifo", Counter)
    for i in range(300):
        c.record.broadcast(i)
    logs = c.get_log.call().get(timeout=TIMEOUT)
    assert all(log == list(range(300)) for log in logs.values())


def test_choose_and_stream(counter):
    assert counter.echo.choose(7).get(timeout=TIMEOUT) == 7
    futures = list(counter.echo.stream(3))
    assert len(futures) == 2
    assert sorted(f.get(timeout=TIMEOUT) for f in futures) == [3, 3]


def test_accumulator_folds_stream(procs):
    c = procs.spawn("acc", Counter, 1)
    c.incr.broadcast()
    total = Accumulator(c.value, 0, operator.add).accumulate().get(timeout=TIMEOUT)
    assert total == 4


def test_send_with_port_and_channel(counter):
    port, rx = Channel.open()
    send(counter.echo, ("x",), {}, port=port)
    got = [rx.recv().get(timeout=TIMEOUT) for _ in range(2)]
    assert got == ["x", "x"]


def test_ports_as_arguments_keep_order(counter):
    port, rx = Channel.open()
    counter.emit.broadcast(port, 50)
    got = [rx.recv().get(timeout=TIMEOUT) for _ in range(100)]
    for r in (0, 1):
        assert [v for v in got if v // 100 == r] == [r * 100 + i for i in range(50)]


def test_ranked_channel(counter):
    port, rx = Channel.open_ranked()
    counter.emit.broadcast(port, 1)
    got = sorted(rx.recv().get(timeout=TIMEOUT) for _ in range(2))
    assert got == [(0, 0), (1, 100)]


def test_future_get_timeout_does_not_consume(counter):
    fut = counter.slice(gpus=0).sleep.call_one(1.0)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    assert fut.get(timeout=TIMEOUT) == 1.0
    assert fut.get() == 1.0  # cached


def test_future_await_and_cached(counter):
    async def main():
        fut = counter.slice(gpus=1).echo.call_one(5)
        a = await fut
        b = await fut
        return a, b

    assert asyncio.run(main()) == (5, 5)


def test_arguments_checked_at_send_time(counter):
    with pytest.raises(TypeError, match="echo"):
        counter.echo.call(1, 2)
    with pytest.raises(TypeError):
        counter.incr.broadcast(nope=1)
    with pytest.raises(TypeError):
        counter._ref.proc_mesh.spawn("bad", Counter, 1, 2, 3)


def test_mixing_sync_and_async_endpoints_rejected(procs):
    class Mixed(Actor):
        @endpoint
        def a(self):
            return 1

        @endpoint
        async def b(self):
            return 2

    with pytest.raises(ValueError, match="mixes both async and sync endpoints"):
        procs.spawn("mixed", Mixed)


def test_concurrent_endpoint_rules():
    with pytest.raises(ValueError):

        class SyncConcurrent(Actor):
            @concurrent_endpoint
            def f(self):
                return 1

    with pytest.raises(ValueError, match="concurrent_endpoint does not wrap @endpoint"):

        class Stacked(Actor):
            @concurrent_endpoint
            @endpoint
            async def f(self):
                return 1


def test_concurrent_endpoint_overlaps(procs):
    w = procs.slice(gpus=0).spawn("async_worker", AsyncWorker)
    t0 = time.monotonic()
    slow = w.slow.call_one("slow", 1.5)
    fast = w.slow.call_one("fast", 0.0)
    assert fast.get(timeout=TIMEOUT) == "fast"
    assert time.monotonic() - t0 < 1.4 or not slow.done()
    assert slow.get(timeout=TIMEOUT) == "slow"
    assert w.started_order.call_one().get(timeout=TIMEOUT) == ["slow", "fast"]
    assert w.ping.call_one(3).get(timeout=TIMEOUT) == 3


def test_not_an_endpoint_and_as_endpoint(counter):
    with pytest.raises(RuntimeError, match="endpoint"):
        counter.plain()
    assert as_endpoint(counter.plain).call().get(timeout=TIMEOUT).values() == ["plain", "plain"]


def test_explicit_response_port(counter):
    assert counter.doubled.call(21).get(timeout=TIMEOUT).values() == [42, 42]


def test_context_and_ranks(counter):
    vm = counter.where.call().get(timeout=TIMEOUT)
    (msg_rank, size, inst_rank, name, pid0) = vm.item(gpus=0)
    assert msg_rank == "{'gpus': 0/2}" and size == {"gpus": 2}
    assert inst_rank == "{'gpus': 0/2}" and name == "counter"
    assert vm.item(gpus=1)[0] == "{'gpus': 1/2}"
    assert pid0 != os.getpid()
    # a message sent to a slice is ranked within the slice; the instance keeps its mesh rank
    one = counter.slice(gpus=1).where.call_one().get(timeout=TIMEOUT)
    assert one[0] == "{}" and one[2] == "{'gpus': 1/2}"


def test_lambdas_travel_by_value(counter):
    vm = counter.call_fn.call(lambda: current_rank()["gpus"]).get(timeout=TIMEOUT)
    assert vm.values() == [0, 1]


def test_env_reaches_procs(counter):
    assert counter.getenv.call("REGENT_TEST_ENV").get(timeout=TIMEOUT).values() == ["yes", "yes"]


def test_bootstrap_runs_per_proc_with_rank():
    def boot():
        os.environ["BOOT_RANK"] = str(current_rank()["gpus"])

    pm = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=boot)
    try:
        c = pm.spawn("b", Counter)
        assert c.getenv.call("BOOT_RANK").get(timeout=TIMEOUT).values() == ["0", "1"]
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_failing_bootstrap_fails_initialized():
    def boot():
        raise RuntimeError("bad bootstrap")

    pm = this_host().spawn_procs(per_host={"gpus": 1}, bootstrap=boot)
    with pytest.raises(ActorError, match="bad bootstrap"):
        pm.initialized.get(timeout=TIMEOUT)
    pm.stop().get(timeout=TIMEOUT)


def test_meshes_as_arguments(procs, counter):
    coll = procs.slice(gpus=0).spawn("collector", Collector, counter)
    assert coll.gather.call_one(2).get(timeout=TIMEOUT) == [0, 1, 100, 101]


def test_value_mesh_passes_back_into_endpoints(counter):
    vm = counter.echo.call(1).get(timeout=TIMEOUT)
    back = counter.slice(gpus=0).echo.call_one(vm).get(timeout=TIMEOUT)
    assert back.values() == [1, 1]


def test_large_array_argument_out_of_band(counter):
    arr = np.arange(4 * 1024 * 1024, dtype=np.float64)  # 32 MB
    nbytes, total, writeable = counter.slice(gpus=0).nbytes_and_sum.call_one(arr).get(timeout=TIMEOUT)
    assert nbytes == arr.nbytes and total == float(arr.sum()) and writeable


def test_get_or_spawn_controller_is_a_singleton(procs):
    a = get_or_spawn_controller("registry", Registry).get(timeout=TIMEOUT)
    b = get_or_spawn_controller("registry", Registry).get(timeout=TIMEOUT)
    pid = a.whoami.call_one().get(timeout=TIMEOUT)
    assert pid == os.getpid()  # lives in the client process
    assert b.whoami.call_one().get(timeout=TIMEOUT) == pid
    asker = procs.slice(gpus=1).spawn("asker", AsksForController)
    assert asker.lookup.call_one().get(timeout=TIMEOUT) == pid


def test_this_proc_spawns_in_client(procs):
    local = this_proc().spawn("local_counter", Counter, 3)
    assert local.where.call_one().get(timeout=TIMEOUT)[4] == os.getpid()
    assert this_host().extent.labels == []


def _wait_in_fd(fd: int, needle: str, count: int = 1, timeout: float = 30) -> str:
    """What capfd has captured on `fd` so far, read without truncating it: readouterr() truncates after reading,
    so a line another process wrote between its read and its truncate was lost (a CI flake)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        if seen.count(needle) >= count or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def test_worker_output_is_forwarded_with_rank_prefix(capfd, counter):
    counter.call_fn.call(lambda: print("marker-from-actor", flush=True)).get(timeout=TIMEOUT)
    seen = _wait_in_fd(1, "marker-from-actor", count=2)
    assert "gpus=0] marker-from-actor" in seen and "gpus=1] marker-from-actor" in seen


def test_actor_log_records_carry_actor_prefix(capfd, counter):
    import logging

    counter.slice(gpus=1).call_fn.call_one(lambda: logging.getLogger("user").warning("log-marker")).get(
        timeout=TIMEOUT)
    seen = _wait_in_fd(2, "log-marker")
    line = next(line for line in seen.splitlines() if "log-marker" in line)
    assert "gpus=1]" in line and "[actor=<root>.<test_actor_adverbs.Counter counter{'gpus': 1/2}>]" in line


class MeshUser(Actor):
    @endpoint
    async def use(self, mesh) -> int:
        return await mesh.value.call_one()


class MeshMaker(Actor):
    @endpoint
    async def spawn_and_share(self, user) -> int:
        pm = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = pm.spawn("inner", Counter, 5)
        try:
            # passed on before its proc is even up: the receiver asks us for the address
            return await user.use.call_one(mesh)
        finally:
            await pm.stop()


def test_mesh_passed_before_its_procs_are_up(procs):
    user = procs.slice(gpus=1).spawn("mesh_user", MeshUser)
    maker = procs.slice(gpus=0).spawn("mesh_maker", MeshMaker)
    assert maker.spawn_and_share.call_one(user).get(timeout=TIMEOUT) == 5


def test_port_exception_reaches_receiver():
    port, rx = Channel.open()
    port.exception(KeyError("missing"))
    with pytest.raises(ActorError, match="missing"):
        rx.recv().get(timeout=TIMEOUT)
    port.send(1)
    assert rx.recv().get(timeout=TIMEOUT) == 1


def test_send_choose_reaches_one_actor(counter):
    port, rx = Channel.open()
    send(counter.echo, ("one",), {}, port=port, selection="choose")
    assert rx.recv().get(timeout=TIMEOUT) == "one"
    nothing = rx.recv()
    with pytest.raises(TimeoutError):
        nothing.get(timeout=0.3)


def test_stream_yields_in_arrival_order(counter):
    futures = list(counter.sleep.stream(0.0))
    assert [f.get(timeout=TIMEOUT) for f in futures] == [0.0, 0.0]
    slow_first = counter.call_fn.stream(lambda: (time.sleep(0.8 if current_rank()["gpus"] == 0 else 0),
                                                 current_rank()["gpus"])[1])
    assert [f.get(timeout=TIMEOUT) for f in slow_first] == [1, 0]


def test_future_result_and_exception_helpers(counter):
    ok = counter.slice(gpus=0).echo.call_one(9)
    assert ok.result(timeout=TIMEOUT) == 9 and ok.exception(timeout=TIMEOUT) is None
    with pytest.raises(TypeError):
        from regent.actor import Future

        Future()
