"""The replicated process group: one communicator per group rank, spanning the same rank of every replica.

It is thrown away and rebuilt on every new quorum (`configure`) under a unique rendezvous prefix
(`/regent/{quorum_id}/{group_rank}`) on the primary replica's TCPStore, so a rebuild can never meet the
leftovers of an older one.

Hung collectives. We do *not* use a subprocess ("baby") group. Choice and reasons:
- Gloo (CPU, and what crosses replicas in most deployments): every Gloo operation carries its own timeout
  and fails with an error when a peer stops responding, and a dead peer resets the TCP connection at once.
  On top of that a userspace watchdog fails the returned future at the deadline and calls `abort()`, so
  the caller is released within `timeout` even if the backend misbehaves.
- NCCL (RCCL on ROCm): the communicator is created in non-blocking mode (`config.blocking = False`) so that
  `abort()` (ncclCommAbort) can interrupt a hung kernel; the same watchdog triggers it.
After an error or abort the group reports `errored()` until the next `configure`, which builds a fresh
communicator. A subprocess group would cost a second CUDA context per rank and an extra copy through shared
memory for every byte, for a guarantee we get from the two mechanisms above.
"""

from __future__ import annotations

import atexit
import datetime
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from regent import settings
from regent.ft.build_notice import BuildNotice
from regent.ft.types import to_seconds

logger = logging.getLogger(__name__)

# Point-to-point messages per NCCL group when a batch is coalesced (REGENT_P2P_WINDOW overrides; read once).
COALESCE_WINDOW = settings.REGENT_P2P_WINDOW.get()


def default_backend() -> str:
    """The collective backend for this machine, from `regent.platform.backend()`."""
    from regent import platform

    name = platform.backend()
    return "nccl" if name in ("nccl", "rccl") else "gloo"


def parse_store_address(store_addr: str) -> tuple[str, int, str]:
    """'host:port/prefix/parts' -> ('host', port, '/prefix/parts'). IPv6 hosts may be bracketed."""
    hostport, slash, prefix = store_addr.partition("/")
    host, colon, port = hostport.rpartition(":")
    if not colon or not port.isdigit() or not host:
        raise ValueError(
            f"bad store address {store_addr!r}: expected 'host:port/prefix' "
            "(the store_address a replica advertised in its quorum request)"
        )
    return host.strip("[]"), int(port), (slash + prefix) if slash else ""


class _Watchdog:
    """One thread that runs a callback when a deadline passes, unless cancelled first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def schedule(self, delay: float, callback: Callable[[], None]) -> int:
        with self._cond:
            token = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + delay, token, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="regent-ft-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return token

    def cancel(self, token: int) -> None:
        with self._cond:
            self._cancelled.add(token)

    def stop(self) -> None:
        """At exit, before the interpreter finalizes: end the thread. Callbacks hold operations' futures, and a
        daemon thread that frees a torch future once finalization has begun aborts the process (the future's
        destructor gives up the GIL, and taking it back then ends the thread inside C++: "terminate called
        without an active exception", seen at the end of TorchFT's test files). What is left in the heap is
        freed by the main thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                deadline, token = self._heap[0][:2]
                now = time.monotonic()
                if token in self._cancelled:
                    heapq.heappop(self._heap)
                    self._cancelled.discard(token)
                    continue
                if deadline > now:
                    self._cond.wait(deadline - now)
                    continue
                callback = heapq.heappop(self._heap)[2]
            try:
                callback()
            except Exception:  # a watchdog must survive a bad callback
                logger.exception("watchdog callback failed")
            del callback  # a callback's closure (its group) must not outlive it in this thread's frame


_WATCHDOG = _Watchdog()
atexit.register(_WATCHDOG.stop)


class _AbandonedWork:
    """Gloo operations whose callers were released (timeout or abort) while the operation still runs.

    Each still ends by itself, by Gloo's own per-operation timeout, on a leaked communicator. If the
    interpreter finalizes first, the operation's timeout fires into a half-torn-down process and Gloo throws
    from its thread ("terminate called after throwing gloo::IoException ... Application timeout caused pair
    closure": a SIGABRT at the end of an otherwise clean run, seen in CI). At exit we wait for them, bounded
    by their own deadlines.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, float] = {}  # id -> deadline (monotonic)
        self._ids = itertools.count()
        self._registered = False

    def add(self, inner: torch.futures.Future, deadline: float) -> None:
        key = next(self._ids)
        with self._cond:
            self._pending[key] = deadline
            if not self._registered:
                import atexit

                atexit.register(self.drain)
                self._registered = True

        def finished(_fut: torch.futures.Future) -> None:
            with self._cond:
                self._pending.pop(key, None)
                self._cond.notify_all()

        inner.add_done_callback(finished)

    def drain(self) -> None:
        with self._cond:
            while self._pending:
                left = max(self._pending.values()) - time.monotonic()
                if left <= 0:
                    logger.warning("%d abandoned Gloo operation(s) still running at exit", len(self._pending))
                    return
                self._cond.wait(left)


_ABANDONED = _AbandonedWork()


# Rendezvous threads given up on (`ReplicatedGroup._connect`), with the time their blocking call ends by itself.
_abandoned_connects: list[tuple[threading.Thread, float]] = []


@atexit.register
def _await_abandoned_connects() -> None:
    """Let given-up rendezvous threads finish before the interpreter finalizes.

    Such a thread sits in C++ (a store connect to a dead host retries until its timeout). If the interpreter
    finalizes first, the thread's return into Python ends it with a forced unwind through torch's C++, and the
    process aborts ("terminate called without an active exception"; seen in CI: a test gave a rendezvous up
    and the suite ended within the connect timeout). Each wait is bounded by that thread's own deadline.
    """
    for thread, ends_by in list(_abandoned_connects):
        left = ends_by - time.monotonic()
        if thread.is_alive() and left > 0:
            logger.info("waiting up to %.1f s for a given-up rendezvous to time out before exit", left)
            thread.join(left)


def _leak(obj: Any) -> None:
    """Keep `obj` alive until the process ends, past interpreter finalization (see `abort`)."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class Work(torch.futures.Future):
    """What an operation returns: a torch future (`wait`, `then`, `value`) that also answers torch's `Work`
    calls (`get_future`, `is_completed`), so code written against TorchFT's groups runs unchanged."""

    def get_future(self) -> torch.futures.Future:
        return self

    def is_completed(self) -> bool:
        return self.done()


def _settle(out: torch.futures.Future, done: torch.futures.Future, transform: Callable[[Any], Any]) -> None:
    try:
        value = done.value()
        transform(value)
    except Exception as err:  # noqa: BLE001 - not dropped: handed to the caller, whose wait() raises it
        out.set_exception(err)
        return
    out.set_result(value)


class ReplicatedGroup:
    """A reconfigurable communicator across replicas (for one group rank).

    All operations return a `torch.futures.Future` (or complete synchronously for point-to-point) and fail
    instead of hanging: after `timeout` the future errors, the group is aborted and `errored()` is set.
    """

    def __init__(
        self,
        backend: str | None = None,
        timeout: float | datetime.timedelta = 60.0,
        connect_timeout: float | datetime.timedelta = 60.0,
    ) -> None:
        self.backend = backend or default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {self.backend!r}; use 'gloo' or 'nccl' (RCCL on ROCm is 'nccl')")
        self.timeout = to_seconds(timeout)
        # Coalesce batched point-to-point messages where the backend can (NCCL); REGENT_P2P_COALESCE=0 turns
        # it off (for comparison, or for a NCCL build where it misbehaves).
        self.coalesce_p2p = settings.REGENT_P2P_COALESCE.get()
        self.connect_timeout = to_seconds(connect_timeout)
        self._lock = threading.Lock()
        # pinned host buffers for Gloo collectives on GPU tensors, by (dtype, numel), free ones only
        self._staging: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.stage_host_tensors = False  # tests: run the GPU tensors' staging path on CPU tensors too
        self._pg: Any = None
        self._store: Any = None
        self._generation = 0
        self._error: Exception | None = None
        # whether the error reached an operation (one failed, was in flight, or was tried after it): an abort
        # that comes once every operation has completed leaves their results valid (see `error_hit_operations`)
        self._error_hit_ops = False
        self._rank = -1
        self._world_size = 0
        self.replica_id = ""
        self._waiter: _EventWaiter | None = None
        self._side_stream: Any = None
        self._connecting_pg: Any = None  # the NCCL communicator of a rendezvous in progress
        # collectives in flight of the current generation: fail(err) settles the caller's future with err
        self._inflight: dict[int, Callable[[Exception], None]] = {}
        self._next_op = 0
        self._op_timeout = self.timeout  # Gloo's own per-operation timeout of the current communicator
        # a member whose step failed tells the build's peers, whose collectives then fail at once (build_notice)
        self._notice = _notice_for(self)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, **_newer: Any) -> None:
        """Drop the old communicator and rendezvous a new one at `store_addr` ('host:port/unique/prefix').
        Newer TorchFT callers also pass quorum_id, group_rank, group_world_size, global_ranks: the prefix in
        `store_addr` already makes each build unique, so they are not needed here."""
        self.abort(reason=None)
        with self._lock:
            generation = self._generation  # any abort from here on gives this rendezvous up
        host, port, prefix = parse_store_address(store_addr)
        if not prefix:
            raise ValueError(f"store address {store_addr!r} has no prefix; each configure needs a unique one")
        timeout = datetime.timedelta(seconds=self.timeout)
        made: dict[str, Any] = {}

        def connect_store() -> Any:
            # On the rendezvous thread too: the store's host is the quorum's primary, and if it died after the
            # quorum formed, the client retries its connect for the whole connect timeout. Seen in the soak: a
            # member stuck here for 139 s, deaf to the supervisor's report that the primary was dead.
            made["store"] = dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self.connect_timeout),
                wait_for_workers=False,
            )
            return dist.PrefixStore(prefix, made["store"])

        if self.backend == "gloo":
            def build() -> Any:
                # Rendezvous may wait for a peer that is still starting (connect timeout); operations then
                # use the (usually shorter) collective timeout.
                pg = dist.ProcessGroupGloo(
                    connect_store(), rank, world_size,
                    datetime.timedelta(seconds=max(self.connect_timeout, self.timeout)),
                )
                pg._set_default_timeout(timeout)
                self._op_timeout = self.timeout
                return pg
        else:
            def build() -> Any:
                prefixed = connect_store()
                opts = dist.ProcessGroupNCCL.Options()
                opts.config.blocking = False
                # torch's own NCCL watchdog tears the whole process down on a timeout; keep it far behind
                # ours, which aborts just this communicator and lets training go on.
                opts._timeout = datetime.timedelta(seconds=max(600.0, 10 * self.timeout))
                pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
                self._connecting_pg = pg
                pg.eager_connect_single_device(torch.device("cuda", device))
                return pg
        device = torch.cuda.current_device() if self.backend == "nccl" else -1
        pg = self._connect(build, store_addr, generation)
        with self._lock:
            self._generation += 1
            self._pg = pg
            self._store = made["store"]
            self._error = None
            self._error_hit_ops = False
            self._rank = rank
            self._world_size = world_size
            self.replica_id = replica_id
            self._notice.set_build(self._generation, made["store"], prefix)
        logger.info("replicated group configured at %s: rank %d of %d", store_addr, rank, world_size)

    def _connect(self, build: Callable[[], Any], store_addr: str, generation: int) -> Any:
        """Run the rendezvous (`build`) on a helper thread so that it can be given up on.

        A peer that dies between the quorum and the rendezvous never connects, and NCCL's connect waits
        for it far longer than any step (torch's non-blocking init allows 30 minutes). The caller waits at
        most `connect_timeout`, and `abort()` (a supervisor reporting the peer dead) ends the wait at once;
        the abandoned communicator is aborted in the background and leaked.
        """
        done = threading.Event()
        box: dict[str, Any] = {}
        self._connecting_pg = None

        def run() -> None:
            try:
                box["pg"] = build()
                if self._generation != generation:
                    _leak(box["pg"])  # connected after all, but given up: never destroyed (see `abort`)
            except BaseException as err:  # noqa: BLE001 (re-raised on the caller's thread)
                box["error"] = err
            finally:
                done.set()

        thread = threading.Thread(target=run, name="regent-ft-connect", daemon=True)
        thread.start()
        started = time.monotonic()
        deadline = started + self.connect_timeout
        try:
            while not done.wait(0.02):
                cancelled = self._generation != generation
                if cancelled or time.monotonic() > deadline:
                    abandoned = self._connecting_pg
                    # the store connect, then Gloo's own rendezvous, end by their timeouts (blocking calls we
                    # cannot cut): the thread is done by then
                    ends_by = started + self.connect_timeout + max(self.connect_timeout, self.timeout) + 5.0
                    _abandoned_connects[:] = [(t, e) for t, e in _abandoned_connects if t.is_alive()]
                    _abandoned_connects.append((thread, ends_by))
                    if abandoned is not None:
                        _leak(abandoned)
                        threading.Thread(target=_abort_communicator, args=(abandoned,), name="regent-ft-abort",
                                         daemon=True).start()
                    why = (f"given up: {self._error}" if cancelled and self._error is not None
                           else "given up" if cancelled else f"timed out after {self.connect_timeout:.3g} s")
                    raise ConnectionError(f"replicated group rendezvous at {store_addr} {why}")
        finally:
            self._connecting_pg = None
        if "error" in box:
            raise box["error"]
        return box["pg"]

    def generation(self) -> int:
        """Counts builds and aborts: a decision taken about one build of the group can name it (`abort`'s
        `only_generation`), so that it cannot hit the next build."""
        with self._lock:
            return self._generation

    def abort(self, reason: Exception | None = None, wait: bool = True, fail_pending: bool = False,
              only_generation: int | None = None) -> bool:
        """Tear the communicator down (interrupts a hung collective, or a rendezvous in progress);
        `errored()` reports `reason`.

        `wait=False` aborts on a helper thread: needed when called from a backend callback thread, which
        the abort would otherwise try to join (C++ terminates the process on that self-join).

        `fail_pending`: also fail the callers' futures of collectives in flight now, with `reason` (Gloo only:
        NCCL's abort ends its collectives itself, and a caller released before the kernel has stopped could
        race it on the tensor). Gloo's abort leaves them waiting for their peers until the timeout; the
        operation then finishes (by timing out) in the background, on the leaked communicator: a process that
        exits through the interpreter's normal shutdown within that time can crash in it, so this is for
        processes that leave with `os._exit`, as Regent's actor processes do.

        `only_generation` (from `generation()`): abort only if the group is still that build. Returns
        whether it aborted.
        """
        with self._lock:
            if only_generation is not None and only_generation != self._generation:
                return False  # that build is gone already (aborted, or replaced by a newer one): nothing to do
            pg, self._pg = self._pg, None
            self._store = None
            self._generation += 1
            self._notice.clear()
            failed = reason is not None or self._error is not None
            if reason is not None and self._error is None:
                self._error = reason
            if self._inflight:
                self._error_hit_ops = True
            fail_now = fail_pending and reason is not None and self.backend != "nccl"
            pending = list(self._inflight.values()) if fail_now else []
        for fail in pending:
            fail(reason)
        if pg is None:
            return True
        if failed:
            # Never destroy a communicator that failed. If its last reference died with an in-flight work
            # object on one of its own worker threads, its destructor would join that very thread; and
            # destroying one whose peer vanished can terminate the process at exit (seen with Gloo after a
            # peer was frozen). What leaks per failure is a few threads, reclaimed by the OS at exit. A
            # healthy communicator replaced at a new quorum has no work in flight and is destroyed here.
            _leak(pg)
        if wait:
            _abort_communicator(pg)
        else:
            threading.Thread(target=_abort_communicator, args=(pg,), name="regent-ft-abort", daemon=True).start()
        return True

    def shutdown(self) -> None:
        self.abort(reason=None)

    def errored(self) -> Exception | None:
        """The first error since the last `configure`, or None."""
        return self._error

    def error_hit_operations(self) -> bool:
        """Whether the group's error (`errored()`) reached an operation: one failed or timed out, was in flight
        when the group was aborted, or was tried on the aborted group. False for an abort that came after every
        operation had completed (a peer reported dead right after a sync finished): those results are valid,
        and a step that waited for them can still commit; the next operation on the group fails."""
        with self._lock:
            return self._error is not None and self._error_hit_ops

    def announce_abandoned(self, who: str) -> bool:
        """This member will issue none of the current build's remaining collectives (its step failed): tell the
        build's peers, whose collectives waiting for it then fail at once instead of at the timeout
        (`build_notice`). Returns at once; False if no build is up."""
        return self._notice.announce(who)

    def _peer_abandoned(self, generation: int, who: str) -> None:
        err = RuntimeError(f"peer replica {who} abandoned this build of the replicated group (its step failed; "
                           "it issues none of the step's remaining collectives); rebuilt at the next quorum")
        if self.abort(err, wait=False, fail_pending=True, only_generation=generation):
            logger.warning("replicated group (rank %d): %s", self._rank, err)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---- operations ------------------------------------------------------------------------------------
    def _current(self) -> tuple[Any, int]:
        with self._lock:
            if self._pg is None:
                self._error_hit_ops = True
                raise RuntimeError(
                    "replicated group is not configured (or was aborted"
                    + (f" after: {self._error}" if self._error else "")
                    + "); the Manager reconfigures it at the next quorum"
                )
            return self._pg, self._generation

    def _fail(self, generation: int, err: Exception) -> None:
        with self._lock:
            if generation != self._generation:
                return
            self._error_hit_ops = True  # an operation of this generation failed
        logger.warning("replicated group error (rank %d): %s; aborting communicator", self._rank, err)
        self.abort(reason=err, wait=False)

    def allreduce(
        self, tensors: torch.Tensor | list[torch.Tensor],
        op: dist.ReduceOp.RedOpType | dist.AllreduceOptions = dist.ReduceOp.SUM,
    ) -> Work:
        """In-place allreduce; the future resolves to the tensor list, or errors within `timeout`. `op` is a
        ReduceOp or torch's AllreduceOptions (as TorchFT's groups take); AVG works on Gloo too (summed, then
        divided by the group size)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        reduce_op = op.reduceOp if isinstance(op, dist.AllreduceOptions) else op
        average = reduce_op == dist.ReduceOp.AVG and self.backend == "gloo"
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if average else reduce_op
        staged = self._host_staged(tensors)
        if staged is not None:  # Gloo and GPU tensors: averaged on the host, before the copy back
            host, back = staged
            size = self._world_size
            return self._run("allreduce", lambda pg: pg.allreduce(host, opts), tensors,
                             after=lambda: back(lambda h: h.div_(size) if average else None))
        out = self._run("allreduce", lambda pg: pg.allreduce(tensors, opts), tensors)
        if not average:
            return out
        size = self._world_size
        averaged = Work()
        out.add_done_callback(lambda f: _settle(averaged, f, lambda v: [t.div_(size) for t in v]))
        return averaged

    def _host_staged(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable] | None:
        """Gloo given GPU tensors (replicas sharing a GPU, `--ft.backend gloo`): run the collective on host
        copies and copy the results back before the future resolves. Torch's Gloo path for CUDA tensors copies
        back on a stream of its own and completes its future without waiting for that copy, so a consumer
        could read the old values (replicas diverged on an H200 with two replicas on one GPU). None when there
        is nothing to stage."""
        if self.backend != "gloo" or not any(self._staged(t) for t in tensors):
            return None
        taken: list[torch.Tensor] = []
        host = []
        for t in tensors:
            if not self._staged(t):
                host.append(t)
                continue
            buf = self._staging_buffer(t)
            taken.append(buf)
            view = buf.view(t.shape)
            view.copy_(t)  # into pinned memory: returns once the kernels that produced `t` and the copy are done
            host.append(view)

        def back(on_host: Callable[[torch.Tensor], Any]) -> None:
            devices = set()
            try:
                for t, h in zip(tensors, host, strict=True):
                    on_host(h)
                    if t is not h:
                        t.copy_(h)
                        devices.add(t.device)
                for device in devices:  # the copies are finished before anyone is told the result is ready
                    if device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
            finally:
                with self._lock:
                    for buf in taken:
                        self._staging.setdefault((buf.dtype, buf.numel()), []).append(buf)

        return host, back

    def _staging_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer for `t`, reused across steps (allocating new host copies every step grew a
        healed replica's RSS from 1.7 to 3.5 GB in 70 s on an H200; pinned copies are also faster)."""
        with self._lock:
            pool = self._staging.get((t.dtype, t.numel()))
            if pool:
                return pool.pop()
        return torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)

    def _staged(self, t: torch.Tensor) -> bool:
        return t.is_cuda or self.stage_host_tensors

    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], root: int | dist.BroadcastOptions = 0) -> Work:
        """In-place broadcast from replica rank `root` (an int or torch's BroadcastOptions)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        opts = root if isinstance(root, dist.BroadcastOptions) else dist.BroadcastOptions()
        if not isinstance(root, dist.BroadcastOptions):
            opts.rootRank = root
        staged = self._host_staged(tensors)
        if staged is not None:
            host, back = staged
            return self._run("broadcast", lambda pg: pg.broadcast(host, opts), tensors,
                             after=lambda: back(lambda h: None))
        return self._run("broadcast", lambda pg: pg.broadcast(tensors, opts), tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: torch.Tensor | list[torch.Tensor],
                  opts: Any = None) -> Work:
        """Gather every replica's `input_tensors` into `output_tensors[i][rank]` (torch's list-of-lists form)."""
        inputs = [input_tensors] if isinstance(input_tensors, torch.Tensor) else list(input_tensors)
        from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

        flat_out = [t for row in output_tensors for t in row]
        staged_in, staged_out = self._host_staged(inputs), self._host_staged(flat_out)
        if staged_in is not None or staged_out is not None:
            host_in = staged_in[0] if staged_in is not None else inputs
            host_flat, back = staged_out if staged_out is not None else (flat_out, None)
            it = iter(host_flat)
            host_out = [[next(it) for _ in row] for row in output_tensors]
            return self._run("allgather", lambda pg: pg.allgather(host_out, host_in, opts or AllgatherOptions()),
                             output_tensors, after=(lambda: back(lambda h: None)) if back is not None else None)
        return self._run("allgather", lambda pg: pg.allgather(output_tensors, inputs, opts or AllgatherOptions()),
                         output_tensors)

    def _run(self, what: str, issue: Callable[[Any], Any], value: Any, after: Callable[[], None] | None = None) -> Work:
        """Issue a collective; `after` runs once it has succeeded, before the returned future resolves."""
        pg, generation = self._current()
        try:
            work = issue(pg)
            inner = self._gpu_done(work) if self.backend == "nccl" else work.get_future()
        except Exception as err:
            self._fail(generation, err)
            raise
        return self._guard(inner, generation, what, value, after)

    def getBackendName(self) -> str:  # torch's ProcessGroup spelling, kept for TorchFT code
        return f"regent-{self.backend}"

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """The deadline of each later operation (the watchdog aborts the group past it)."""
        self.timeout = to_seconds(timeout)

    def _gpu_done(self, work: Any) -> torch.futures.Future:
        """A future that completes when the collective has *finished on the GPU*.

        NCCL's own future completes once the kernel is queued, so a hung peer would never trip the
        watchdog: a side stream is made to wait for the collective, an event is recorded behind it, and one
        waiter thread per group resolves the futures as their events complete (in stream order). The side
        stream keeps the caller's stream free: gradient buckets all-reduced from backward hooks overlap the
        rest of backward instead of stalling it (consumers wait through the CUDA-aware future `_guard`
        returns).
        """
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side_stream):
            work.wait()  # non-blocking for NCCL: the side stream waits for the collective's stream
            event = torch.cuda.Event()
            event.record(self._side_stream)
        fut: torch.futures.Future = torch.futures.Future()
        if self._waiter is None:
            self._waiter = _EventWaiter()
        self._waiter.put(event, fut)
        return fut

    def _register_inflight(self, op: int, generation: int, fail_now: Callable[[Exception], None]) -> Exception | None:
        """Let `abort(fail_pending=True)` fail operation `op` of build `generation` at once. Returns the
        group's error instead if that build was already aborted: the abort came between `_current()` and
        here, could not see the operation, and the caller must fail it now, or it would wait out the full
        timeout for a peer that is gone (a 20 s survivor stall in the session-7 soak)."""
        with self._lock:
            if generation == self._generation:
                self._inflight[op] = fail_now
                return None
            return self._error

    def _guard(self, inner: torch.futures.Future, generation: int, what: str, value: Any,
               after: Callable[[], None] | None = None) -> Work:
        # NCCL completes its work future as soon as the collective is *enqueued*: the result is ready only on
        # NCCL's stream. A CUDA-aware future (devices=...) completed from the callback below (whose current
        # stream already waits on the collective) records an event, and every later `wait()` or `then()`
        # waits on it. With a plain Future the caller could read the tensor before the all-reduce has run.
        out = Work(devices=[self.device] if self.backend == "nccl" else None)
        settled = threading.Lock()
        state = {"done": False}
        with self._lock:
            op, self._next_op = self._next_op, self._next_op + 1

        def claim() -> bool:
            with settled:
                if state["done"]:
                    return False
                state["done"] = True
            with self._lock:
                self._inflight.pop(op, None)
            return True

        op_deadline = time.monotonic() + max(self.timeout, self._op_timeout) + 2.0  # Gloo's own timeout ends it by then

        def abandon() -> None:
            if self.backend != "nccl" and not inner.done():
                _ABANDONED.add(inner, op_deadline)

        def fail_now(err: Exception) -> None:  # abort(fail_pending=True)
            with self._lock:
                self._error_hit_ops = True
            if claim():
                _WATCHDOG.cancel(token)
                abandon()
                out.set_exception(err)

        def on_timeout() -> None:
            err = TimeoutError(
                f"{what} on the replicated group timed out after {self.timeout:.3g} s "
                "(a peer replica stopped responding); the group is aborted and rebuilt at the next quorum"
            )
            if claim():
                abandon()
                self._fail(generation, err)  # errored() is set before anyone sees the failed future
                out.set_exception(err)

        token = _WATCHDOG.schedule(self.timeout, on_timeout)
        reason = self._register_inflight(op, generation, fail_now)
        if reason is not None and self.backend != "nccl":
            fail_now(reason)
        started = time.monotonic()
        inflight = self._inflight  # not `self`: a pending check must not keep the group (and its communicator) alive
        self._notice.watch(generation, lambda: op in inflight)

        def on_done(fut: torch.futures.Future) -> None:
            _WATCHDOG.cancel(token)
            try:
                fut.value()
                self._notice.completed(time.monotonic() - started)
            except Exception as err:  # noqa: BLE001 - reported: the group is failed and the caller's future raises it
                if claim():
                    self._fail(generation, err)
                    out.set_exception(err)
                return
            if after is not None and not state["done"]:  # not after a timeout: the caller has moved on
                try:
                    after()
                except Exception as err:  # noqa: BLE001 - not dropped: the caller's future raises it
                    if claim():
                        out.set_exception(err)
                    return
            if claim():
                out.set_result(value)

        inner.add_done_callback(on_done)
        return out

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0, abortable: bool = False,
             pinned: tuple[Any, int] | None = None) -> None:
        """Blocking point-to-point send; raises (and marks the group errored) after `timeout`.

        `abortable` (Gloo): an abort with `fail_pending` (a peer reported dead) fails the wait at once
        instead of after `timeout`, as it does collectives. Gloo cannot cancel the operation itself: it
        goes on in the background on the abandoned communicator, reading `tensors` until it ends, so ask
        for it only where a late read or write is harmless (`_wait_abortable`).

        `pinned` (from `pin()`): post on that build of the communicator even if the group was aborted since
        (the wait then fails at once, and Gloo delivers the message in the background)."""
        self._p2p_batch("send", [tensors], dst, tag, abortable, pinned)

    def pin(self) -> tuple[Any, int]:
        """The communicator now and its build, for a sender whose messages must all be posted once the first
        is: a healer that got a state description waits, without a way out, for the state it announced."""
        return self._current()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0, abortable: bool = False) -> None:
        """Blocking point-to-point receive into `tensors` (in place); raises after `timeout`. `abortable`:
        as for `send`; the abandoned receive may still write into `tensors` later, so only for buffers
        nobody reads after a failure."""
        self._p2p_batch("recv", [tensors], src, tag, abortable)

    def send_many(self, tensors: list[torch.Tensor], dst: int, first_tag: int = 0, abortable: bool = False,
                  pinned: tuple[Any, int] | None = None) -> None:
        """Send each tensor as its own message (tags first_tag, first_tag+1, ...), all issued before any is
        waited for; raises after `timeout` for the whole batch. On NCCL a host round-trip per message costs
        about a millisecond, more than moving a small tensor, so a state of hundreds of tensors goes as one
        batch (the receiver posts `recv_many` with the same tensors' shapes in the same order)."""
        self._p2p_batch("send", [[t] for t in tensors], dst, first_tag, abortable, pinned)

    def recv_many(self, tensors: list[torch.Tensor], src: int, first_tag: int = 0, abortable: bool = False) -> None:
        """Receive into each tensor in place, in order (the counterpart of `send_many`)."""
        self._p2p_batch("recv", [[t] for t in tensors], src, first_tag, abortable)

    def _coalesced(self, pg: Any, what: str, batch: list[list[torch.Tensor]], peer: int, first_tag: int) -> list:
        """Issue the batch in windows of one NCCL group each (ncclGroupStart/End, as `batch_isend_irecv`
        does): one launch per window instead of one per message. Falls back to one message at a time if
        this torch cannot coalesce (found out before anything is issued)."""
        works = []
        for start in range(0, len(batch), COALESCE_WINDOW):
            try:
                pg._start_coalescing()
            except (AttributeError, TypeError, RuntimeError) as err:
                if start:
                    raise
                logger.warning("point-to-point coalescing unavailable (%s); sending message by message", err)
                self.coalesce_p2p = False
                return [getattr(pg, what)(tensors, peer, first_tag + i) for i, tensors in enumerate(batch)]
            try:
                for i in range(start, min(start + COALESCE_WINDOW, len(batch))):
                    getattr(pg, what)(batch[i], peer, first_tag + i)
            finally:
                work = pg._end_coalescing()
            works.append(work)
        return works

    def _p2p_batch(self, what: str, batch: list[list[torch.Tensor]], peer: int, first_tag: int,
                   abortable: bool = False, pinned: tuple[Any, int] | None = None) -> None:
        pg, generation = pinned if pinned is not None else self._current()
        deadline = time.monotonic() + self.timeout
        try:
            if self.coalesce_p2p and len(batch) > 1 and getattr(pg, "supports_coalescing", False):
                works = self._coalesced(pg, what, batch, peer, first_tag)
            else:
                works = [getattr(pg, what)(tensors, peer, first_tag + i) for i, tensors in enumerate(batch)]
            if abortable and self.backend != "nccl":
                self._wait_abortable(works, generation, deadline, what, peer)
            else:
                _wait_works(works, deadline, what, peer, self.timeout)
            if self.backend == "nccl":
                self._wait_stream_done(torch.cuda.current_stream(), deadline, what, peer)
        except Exception as err:  # noqa: BLE001 - reported: _p2p_failed() fails the group and re-raises
            self._p2p_failed(generation, err, what, peer)

    def _wait_abortable(self, works: list, generation: int, deadline: float, what: str, peer: int) -> None:
        """Wait for `works` unless the group is aborted with `fail_pending` first: then raise its reason now.

        Gloo has no way to cancel a posted send or receive, no future for them, and a wait that times out
        closes the connection, so a helper thread waits on the works (holding them, and through them their
        tensors, until they end: by completion, error, or the deadline) while the caller waits for whichever
        comes first. Without this a healer whose donor was told to abort before sending waited out the whole
        timeout for a header that never came, while the other replicas waited for it at the Lighthouse (a
        15 s stall of the committed step in the session-17 soak)."""
        done = threading.Event()
        outcome: dict[str, BaseException | None] = {}  # "first": None (the works ended well) or the error; first wins

        def wait_works() -> None:
            try:
                _wait_works(works, deadline, what, peer, self.timeout)
                outcome.setdefault("first", None)
            except Exception as err:  # noqa: BLE001 - not dropped: the caller raises it (unless aborted first)
                outcome.setdefault("first", err)
            finally:
                done.set()

        def fail_now(reason: Exception) -> None:  # abort(fail_pending=True)
            outcome.setdefault("first", reason)
            done.set()

        with self._lock:
            op, self._next_op = self._next_op, self._next_op + 1
        reason = self._register_inflight(op, generation, fail_now)
        if reason is not None:  # before the helper starts: works that end at once must not win over the abort
            fail_now(reason)
        threading.Thread(target=wait_works, name=f"regent-ft-{what}-wait", daemon=True).start()
        try:
            done.wait(max(0.0, deadline - time.monotonic()) + 5.0)  # the helper ends by the deadline
        finally:
            with self._lock:
                self._inflight.pop(op, None)
        if "first" not in outcome:
            raise TimeoutError(f"{what} with replica rank {peer} timed out after {self.timeout:.3g} s")
        if outcome["first"] is not None:
            raise outcome["first"]

    def _wait_stream_done(self, stream: Any, deadline: float, what: str, peer: int) -> None:
        """Host-wait for everything queued on `stream` so far, never past `deadline`."""
        event = torch.cuda.Event()
        event.record(stream)
        if not _wait_event(event, max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{what} with replica rank {peer} timed out after {self.timeout:.3g} s")

    def _p2p_failed(self, generation: int, err: Exception, what: str, peer: int) -> None:
        """Mark the group failed and re-raise; a backend's own timeout becomes a `TimeoutError`."""
        self._fail(generation, err)
        if isinstance(err, TimeoutError):
            raise err
        if "Timed out" in str(err):
            raise TimeoutError(f"{what} with replica rank {peer} timed out: {err}") from err
        raise err


def _wait_works(works: list, deadline: float, what: str, peer: int, timeout: float) -> None:
    for work in works:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
            raise TimeoutError(f"{what} with replica rank {peer} timed out after {timeout:.3g} s")


class _EventWaiter:
    """One thread that resolves futures when their CUDA events complete (FIFO, i.e. stream order)."""

    def __init__(self) -> None:
        import queue

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="regent-ft-cuda-waiter", daemon=True).start()

    def put(self, event: Any, fut: torch.futures.Future) -> None:
        self._queue.put((event, fut))

    def _run(self) -> None:
        while True:
            event, fut = self._queue.get()
            try:
                event.synchronize()  # returns once done, or once an abort has killed the hung kernel
                fut.set_result(None)
            except Exception as err:  # noqa: BLE001 - reported: the waiting future raises it
                fut.set_exception(err)


def _wait_event(event: Any, timeout: float) -> bool:
    """Poll a CUDA event until it completes or `timeout` passes (never blocks past the deadline)."""
    deadline = time.monotonic() + timeout
    pause = 0.00005
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.0005)  # a coarser poll would add up to its period to every transfer
    return True


def _notice_for(group: ReplicatedGroup) -> BuildNotice:
    """The group's `BuildNotice`, holding the group only weakly. A strong cycle (group -> notice -> bound method
    -> group) would leave dropped groups to the cyclic collector, which can run at any moment, interpreter
    shutdown included, and destroy a live Gloo communicator there; so a dropped group is freed at once, as
    before the notice, and stops its notice's thread."""
    ref = weakref.ref(group)

    def on_abandoned(generation: int, who: str) -> None:
        live = ref()
        if live is not None:
            live._peer_abandoned(generation, who)

    def timeout() -> float:
        live = ref()
        return live.timeout if live is not None else 60.0

    notice = BuildNotice(_WATCHDOG.schedule, on_abandoned, timeout)
    weakref.finalize(group, notice.close)
    return notice


def _abort_communicator(pg: Any) -> None:
    try:
        pg.abort()
    except Exception as err:  # noqa: BLE001 - the communicator may already be broken; we drop it anyway
        logger.debug("abort of old communicator failed: %s", err)



# ---- TorchFT's names ----------------------------------------------------------------------------------------
class ProcessGroupGloo(ReplicatedGroup):
    """TorchFT's `ProcessGroupGloo`: the replicated group over Gloo."""

    def __init__(self, timeout: float | datetime.timedelta = 60.0,
                 connect_timeout: float | datetime.timedelta = 60.0) -> None:
        super().__init__("gloo", timeout=timeout, connect_timeout=connect_timeout)


class ProcessGroupNCCL(ReplicatedGroup):
    """TorchFT's `ProcessGroupNCCL` (RCCL on ROCm): non-blocking communicator, aborted by the watchdog."""

    def __init__(self, timeout: float | datetime.timedelta = 60.0,
                 connect_timeout: float | datetime.timedelta = 60.0) -> None:
        super().__init__("nccl", timeout=timeout, connect_timeout=connect_timeout)


# TorchFT's "baby" groups run the communicator in a subprocess so that a hang can always be aborted. Regent
# gets that guarantee in-process (see the module docstring), so the names give the same groups.
ProcessGroupBabyGloo = ProcessGroupGloo
ProcessGroupBabyNCCL = ProcessGroupNCCL


# ---- wrappers (TorchFT's `ProcessGroupWrapper` family) -----------------------------------------------------
class ProcessGroupWrapper:
    """A group that forwards everything to another one, so that a subclass can change a few operations (inject
    errors, swallow them) while the Manager, the transports and DDP still see a whole replicated group.

    Args:
        pg: the group to wrap; None builds a `ReplicatedGroup` with `timeout`.
        timeout: the operation timeout of the group built when `pg` is None.
    """

    def __init__(self, pg: Any = None, timeout: float | datetime.timedelta = 60.0) -> None:
        self._wrapped = pg if pg is not None else ReplicatedGroup(timeout=timeout)

    @property
    def parent(self) -> Any:
        """The wrapped group (TorchFT's name)."""
        return self._wrapped

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper does not define: everything else is the wrapped group's.
        if name == "_wrapped":
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, **newer: Any) -> None:
        """Rebuild the wrapped group for a new quorum."""
        self._wrapped.configure(store_addr, replica_id, rank, world_size, **newer)

    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor],
                  op: dist.ReduceOp.RedOpType | dist.AllreduceOptions = dist.ReduceOp.SUM) -> Work:
        """The wrapped group's allreduce (defined here so that subclasses can extend it)."""
        return self._wrapped.allreduce(tensors, op)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._wrapped!r})"


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps a group so that a test can make its next allreduce fail (`report_future_error`), the way a
    collective fails when a peer dies mid-step, without killing anything.

    The failure is on the returned future only: the collective itself still runs on every replica (so the peers
    are not left waiting) and the wrapped group stays healthy, as after an error the Manager survives. A new
    quorum (`configure`) drops an error that no allreduce took.

    Args:
        pg: the group to wrap.
    """

    def __init__(self, pg: Any) -> None:
        super().__init__(pg=pg)
        self._future_error: Exception | None = None
        self._error_lock = threading.Lock()

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, **newer: Any) -> None:
        """Rebuild the wrapped group; a reported error not yet used is dropped."""
        with self._error_lock:
            self._future_error = None
        super().configure(store_addr, replica_id, rank, world_size, **newer)

    def report_future_error(self, e: Exception) -> None:
        """Make the future of the next allreduce fail with `e`.

        Args:
            e: the exception that future raises.
        """
        with self._error_lock:
            self._future_error = e

    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor],
                  op: dist.ReduceOp.RedOpType | dist.AllreduceOptions = dist.ReduceOp.SUM) -> Work:
        """The wrapped allreduce; its future fails with the reported error, if any, once the collective is done."""
        work = super().allreduce(tensors, op)
        with self._error_lock:
            err, self._future_error = self._future_error, None
        if err is None:
            return work
        failed = Work()

        def fail(_done: torch.futures.Future) -> None:
            failed.set_exception(err)

        work.add_done_callback(fail)
        return failed
