"""Actor meshes and messaging: `ActorMesh`, endpoint adverbs, `ValueMesh`, ports and channels.

A call is pickled once (in the caller's thread), then one small envelope per rank carries it to each
actor's process; replies come back to a port in the caller's process. Every waiting call is registered
with the runtime under the processes and ranks it waits on, so a death fails it instead of hanging it.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from typing import Any, Generic, TypeVar

from regent.actor._actor import EndpointProperty, endpoints_of
from regent.actor._config import config
from regent.actor._errors import ActorError, SupervisionError
from regent.actor._future import Future
from regent.actor._messages import Deliver, StopActor, encode
from regent.actor._pickle import dumps, loads
from regent.actor._port import DroppingPort, Port  # noqa: F401 (DroppingPort: re-exported)
from regent.actor._process import ActorRuntime, get_runtime
from regent.actor._runtime import ERROR, OK, learn_addresses
from regent.actor._shape import Extent, MeshTrait, Point, Shape
from regent.actor._supervision import CONTROLLERS_KEY, ROOT_KEY, MeshState, PendingReply
from regent.actor._tree import send_cast

logger = logging.getLogger("regent.actor")
R = TypeVar("R")


# ---------------------------------------------------------------------------------------------- ValueMesh
class ValueMesh(MeshTrait, Generic[R]):
    """One value per rank of a mesh: `item(**coords)`, `items()`, `values()`, iteration over (Point, value)."""

    def __init__(self, shape: Shape, values: list) -> None:
        ranks = shape.ranks()
        if len(ranks) != len(values):
            raise ValueError(f"ValueMesh of {len(ranks)} ranks given {len(values)} values")
        self._shape = shape
        self._by_rank = dict(zip(ranks, values))

    def _new_with_shape(self, shape: Shape) -> ValueMesh:
        vm = ValueMesh.__new__(ValueMesh)
        vm._shape = shape
        vm._by_rank = {r: self._by_rank[r] for r in shape.ranks()}
        return vm

    def item(self, **coords: int) -> R:
        extent = self._shape.extent
        for label in coords:
            if label not in extent:
                raise KeyError(f"ValueMesh has no dimension {label!r}; dimensions are {extent.labels}")
        missing = [label for label in extent.labels if label not in coords and extent[label] != 1]
        if missing:
            raise KeyError(f"item() needs a coordinate for {missing}")
        shape = self._shape
        for label in extent.labels:
            shape = shape.select(label, coords.get(label, 0))
        return self._by_rank[shape.ranks()[0]]

    def values(self) -> list[R]:
        return [self._by_rank[r] for r in self._shape.ranks()]

    def items(self) -> list[tuple[Point, R]]:
        extent = self._shape.extent
        return [(Point(i, extent), self._by_rank[r]) for i, r in enumerate(self._shape.ranks())]

    def get(self, local_rank: int) -> R:
        return self._by_rank[self._shape.ranks()[local_rank]]

    def __iter__(self):
        return iter(self.items())

    def __len__(self) -> int:
        return len(self._shape)

    def __repr__(self) -> str:
        return f"ValueMesh({self._shape.extent}, {self.values()!r})"

    def __reduce__(self):
        return (ValueMesh, (self._shape, self.values()))


def check_frame_size(nbytes: int, what: str) -> None:
    """Refuse, in the caller, a message the receiver would reject as oversized."""
    if nbytes + 4096 > config.max_frame_bytes:
        raise ValueError(
            f"message for {what}() is {nbytes} bytes, over the frame limit of {config.max_frame_bytes} bytes; "
            "send less per call or raise REGENT_MAX_FRAME_BYTES on every process"
        )


# ---------------------------------------------------------------------------------------------- replies
def decode_reply(status: int, body: Any, buffers: list, endpoint: str) -> tuple[bool, Any]:
    """(ok, value-or-exception) from a reply frame."""
    if status == OK:
        return True, loads(body, buffers)
    if status == ERROR:
        try:
            exc, message, tb = loads(body, buffers)
        except Exception as err:  # noqa: BLE001 - an exception type the caller cannot unpickle
            return False, ActorError(RuntimeError(f"remote exception could not be unpickled: {err!r}"))
        if isinstance(exc, ActorError):
            return False, exc
        return False, ActorError(exc, message, tb)
    text = loads(body, buffers)
    return False, SupervisionError(text, endpoint=endpoint)


class Gather(PendingReply):
    """Collects one reply per rank of a call; resolves a Future with a ValueMesh (or a single value)."""

    def __init__(self, rt: ActorRuntime, future: Future, shape: Shape | None, targets: list, endpoint: str,
                 single: bool) -> None:
        self.rt = rt
        self.future = future
        self.shape = shape
        self.targets = targets
        self.endpoint = endpoint
        self.single = single
        self.values: list[Any] = [None] * len(targets)
        self.remaining = len(targets)
        self.got = [False] * len(targets)
        self.port_id = rt.new_port(self)

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        if self.future.done() or self.got[index]:
            return
        try:
            ok, value = decode_reply(status, body, buffers, self.endpoint)
        except Exception as exc:  # noqa: BLE001 - reported: the caller's future fails with it
            ok, value = False, ActorError(exc, f"reply to {self.endpoint}() could not be unpickled")
        if not ok:
            self._finish(value)
            return
        self.got[index] = True
        self.values[index] = value
        self.remaining -= 1
        if self.remaining == 0:
            self._finish(None)

    def fail_rank(self, index: int, error: BaseException) -> None:
        if isinstance(error, SupervisionError) and not error.endpoint:
            error.endpoint = self.endpoint
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        self.rt.supervision.untrack(self)
        if error is not None:
            self.future._set_exception(error)
        elif self.single:
            self.future._set_result(self.values[0])
        else:
            self.future._set_result(ValueMesh(self.shape, self.values))


class StreamReplies(PendingReply):
    """Resolves the i-th future with the i-th reply to arrive."""

    def __init__(self, rt: ActorRuntime, futures: list[Future], targets: list, endpoint: str) -> None:
        self.rt = rt
        self.futures = futures
        self.targets = targets
        self.endpoint = endpoint
        self.next = 0
        self.got = [False] * len(targets)
        self.port_id = rt.new_port(self)

    def _push(self, ok: bool, value: Any) -> None:
        if self.next >= len(self.futures):
            return
        fut = self.futures[self.next]
        self.next += 1
        if ok:
            fut._set_result(value)
        else:
            fut._set_exception(value)
        if self.next == len(self.futures):
            self.rt.supervision.untrack(self)

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        if self.got[index]:
            return
        self.got[index] = True
        try:
            ok, value = decode_reply(status, body, buffers, self.endpoint)
        except Exception as exc:  # noqa: BLE001 - reported: the caller's stream yields it
            ok, value = False, exc
        self._push(ok, value)

    def fail_rank(self, index: int, error: BaseException) -> None:
        if self.got[index]:
            return
        self.got[index] = True
        if isinstance(error, SupervisionError) and not error.endpoint:
            error.endpoint = self.endpoint
        self._push(False, error)


# ---------------------------------------------------------------------------------------------- meshes
class ActorMeshRef:
    """Per-process shared part of an actor mesh (all slices of it share one)."""

    def __init__(self, mesh_id: str, name: str, cls: type, extent: Extent, rank_procs: list[str],
                 owner: tuple[str, str], state: MeshState) -> None:
        self.mesh_id = mesh_id
        self.name = name
        self.cls = cls
        self.extent = extent
        self.rank_procs = rank_procs
        self.owner = owner
        self.state = state
        self.endpoints = endpoints_of(cls)
        self.initialized: Future | None = None
        self.proc_mesh: Any = None


class ActorMesh(MeshTrait, Generic[R]):
    """A mesh of actors of one class. Endpoints are attributes: `mesh.method.call(...)`."""

    def __init__(self, ref: ActorMeshRef, shape: Shape) -> None:
        self._ref = ref
        self._shape = shape
        self._ranks = shape.ranks()  # root ranks of this view, computed once (hot path)
        extent = shape.extent
        self._labels, self._sizes = extent.labels, extent.sizes

    def _new_with_shape(self, shape: Shape) -> ActorMesh:
        return ActorMesh(self._ref, shape)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        ref = self.__dict__.get("_ref")
        if ref is None:
            raise AttributeError(name)
        prop = ref.endpoints.get(name)
        if prop is not None:
            ep = Endpoint(self, name, prop)
            self.__dict__[name] = ep  # later lookups skip __getattr__
            return ep
        attr = getattr(ref.cls, name, None)
        if callable(attr):
            return NotAnEndpoint(self, name)
        if name.startswith("_"):  # not an endpoint name: Python's own wording for a missing attribute
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(f"{ref.cls.__qualname__} mesh has no endpoint {name!r}")

    @property
    def initialized(self) -> Future:
        if self._ref.initialized is None:
            return Future._resolved(None)
        return self._ref.initialized

    @property
    def _name(self) -> Future:
        return Future._resolved(self._ref.name)

    def stop(self, reason: str = "stopped by client") -> Future:
        rt = get_runtime()
        ref = self._ref
        ranks = self._shape.ranks()
        fut = Future._new()
        targets = [(ref.mesh_id, r, ref.rank_procs[r]) for r in ranks]

        def on_loop() -> None:
            if ref.state.stopped is not None or not ranks:
                fut._set_result(None)
                return
            gather = Gather(rt, Future._new(), self._shape, targets, f"{ref.name}.stop", False)
            rt.supervision.track(gather)

            def done(_: Future) -> None:
                if len(ranks) == ref.extent.nelements:
                    ref.state.stopped = f"The actor mesh {ref.name} has status: stopped ({reason})"
                fut._set_result(None)

            gather.future.add_done_callback(done)
            for i, r in enumerate(ranks):
                pid = ref.rank_procs[r]
                rt.send(pid, StopActor(f"{ref.mesh_id}/{r}", reason, (rt.proc_id, gather.port_id, i),
                                       rt.proc_id, rt.tree.next_seq(pid)))

        rt.run_on_loop(on_loop)
        return fut

    def __reduce_ex__(self, protocol: int):
        ref = self._ref
        rt = get_runtime()
        infos = {pid: rt.directory.get(pid) for pid in set(ref.rank_procs)}
        return (
            _rebuild_actor_mesh,
            (ref.mesh_id, ref.name, ref.cls, ref.extent.labels, ref.extent.sizes, ref.rank_procs, infos,
             ref.owner, self._shape, rt.info),
        )

    def reference(self) -> dict:
        """A JSON-able description of the whole actor mesh (also when called on a slice) that outlives this
        process: a new controller with the same job secret gives it to `attach_actor_mesh` to take the mesh
        over once this one is gone. Unlike a pickle, it names no referrer, so nothing in it needs this
        process alive."""
        ref = self._ref
        rt = get_runtime()
        procs = list(dict.fromkeys(ref.rank_procs))
        return {
            "kind": "actor_mesh", "version": REFERENCE_VERSION, "mesh_id": ref.mesh_id, "name": ref.name,
            "cls": f"{ref.cls.__module__}:{ref.cls.__qualname__}", "labels": list(ref.extent.labels),
            "sizes": list(ref.extent.sizes), "rank_procs": list(ref.rank_procs),
            "infos": {pid: rt.directory.get(pid) for pid in procs}, "job": rt.info["job"],
            "os_pids": reference_os_pids(rt, procs), "machine": rt.info["machine"],
        }

    def __repr__(self) -> str:
        return f"<ActorMesh {self._ref.name} {self._ref.cls.__qualname__} {self._shape.extent}>"


REFERENCE_VERSION = 1  # of the dicts `ProcMesh.reference()` and `ActorMesh.reference()` write


def reference_os_pids(rt: ActorRuntime, procs: list[str]) -> dict[str, int | None]:
    """The OS pid of each proc this process started or adopted (None for others, e.g. procs on workers)."""
    out: dict[str, int | None] = {}
    for pid in procs:
        os_pid = rt.spawner.os_pid(pid) if rt.spawner is not None else None
        if os_pid is None and pid in rt.adopted_os_pids:
            os_pid = rt.adopted_os_pids[pid][0]
        out[pid] = os_pid
    return out


def _rebuild_actor_mesh(mesh_id, name, cls, labels, sizes, rank_procs, infos, owner, shape,
                        referrer=None) -> ActorMesh:
    rt = get_runtime()
    learn_addresses(rt, infos, referrer, "ActorMesh")
    owner = tuple(owner)
    ref = actor_mesh_refs.get((id(rt), mesh_id))
    if ref is None:
        state = MeshState(mesh_id, name, "actor", list(rank_procs), None, _controller(rt, owner))
        state = _register_state(rt, state)
        ref = ActorMeshRef(mesh_id, name, cls, Extent(labels, sizes), list(rank_procs), owner, state)
        actor_mesh_refs[(id(rt), mesh_id)] = ref
    elif ref.owner != owner and ref.state.owner_key is None:
        # a reference from the mesh's new owner (it took the mesh over, `attach_actor_mesh`): supervised by it
        ref.owner = owner
        rt.run_on_loop(rt.supervision.set_controller, ref.state, _controller(rt, owner))
    return ActorMesh(ref, shape)


def _controller(rt: ActorRuntime, owner: tuple[str, str]) -> tuple[str, str] | None:
    """The owner of a referenced mesh whose loss leaves the reference unsupervised: an actor of another
    process. A client owner (the root, or its `get_or_spawn_controller` singletons) is not: its loss is the
    procs' orphan timeout or detach grace (`HostMesh.spawn_procs(detach_grace=...)`), which a new controller
    may end by adopting the meshes."""
    if owner[0] == rt.proc_id or owner[1] in (ROOT_KEY, CONTROLLERS_KEY):
        return None
    return owner


def _register_state(rt: ActorRuntime, state: MeshState) -> MeshState:
    if rt.on_loop_thread():
        return rt.supervision.register_mesh(state)
    existing = rt.supervision.mesh_states.get(state.mesh_id)
    if existing is not None:
        return existing
    rt.run_on_loop(rt.supervision.register_mesh, state)
    return state


actor_mesh_refs: dict[tuple[int, str], ActorMeshRef] = {}


class NotAnEndpoint:
    """A plain method looked up on a mesh: calling it explains how to make it an endpoint."""

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._name} is not an endpoint of {self._mesh._ref.cls.__qualname__}; decorate it with @endpoint "
            f"or call it through as_endpoint(mesh.{self._name}).call(...)"
        )


class Endpoint(Generic[R]):
    """An endpoint of a mesh, with the adverbs `call`, `call_one`, `choose`, `stream`, `broadcast`."""

    def __init__(self, mesh: ActorMesh, name: str, prop: EndpointProperty) -> None:
        self._mesh = mesh
        self._name = name
        self._prop = prop
        self._label = f"{mesh._ref.name}.{name}"

    def _prepare(self, args: tuple, kwargs: dict, ranks: list[int]) -> tuple[Any, list, str | None]:
        self._prop.check_args(args, kwargs, self._mesh._ref.name)
        problem = self._mesh._ref.state.problem(ranks)
        if problem is not None:
            return None, [], problem
        body, buffers = dumps((args, kwargs))
        if buffers or len(body) > 1 << 20:
            check_frame_size(len(body) + sum(b.nbytes for b in buffers), self._label)
        return body, buffers, None

    def _send(self, ranks: list[int], body: Any, buffers: list, reply_port: int | None,
              reply_proc: str | None = None, pending: PendingReply | None = None,
              fixed_index: int | None = None) -> None:
        rt = get_runtime()
        ref = self._mesh._ref
        labels, sizes = self._mesh._labels, self._mesh._sizes
        view_ranks = self._mesh._ranks
        reply_proc = reply_proc or rt.proc_id
        method = self._name
        me = rt.proc_id

        def on_loop() -> None:
            if len(ranks) > 1 and rt.cast_mode != "actor":
                # tree fan-out (see _tree): one message per host agent or process, not one per actor
                full = len(ranks) == len(view_ranks)
                items = [(r, i if full else view_ranks.index(r), i if fixed_index is None else fixed_index)
                         for i, r in enumerate(ranks)]
                reply = None
                if reply_port is not None:
                    batched = isinstance(pending, Gather) and reply_proc == me
                    reply = (reply_proc, reply_port, "b" if batched else "d")
                relays: list[str] = []

                def cast() -> None:
                    relays.extend(send_cast(rt, ref.mesh_id, method, ref.rank_procs, labels, sizes, items,
                                            body, buffers, reply, rt.cast_mode == "tree"))

                if pending is not None:
                    # the relaying agents are known only once grouped; track before sending, then add them
                    rt.supervision.track(pending)
                    cast()
                    if relays:
                        rt.supervision.track_relays(pending, relays)
                else:
                    cast()
                return
            if pending is not None:
                rt.supervision.track(pending)
            for i, r in enumerate(ranks):
                local = view_ranks.index(r) if len(ranks) != len(view_ranks) else i
                reply = None
                if reply_port is not None:
                    reply = (reply_proc, reply_port, i if fixed_index is None else fixed_index)
                pid = ref.rank_procs[r]
                env = encode(Deliver(f"{ref.mesh_id}/{r}", method, reply, (labels, sizes, local), me,
                                     rt.tree.next_seq(pid)))
                rt.send_raw(pid, env, body, buffers)
            rt.stats["m_sent"] += len(ranks)

        rt.run_on_loop(on_loop)

    def _gather(self, args: tuple, kwargs: dict, ranks: list[int], single: bool, shape: Shape | None) -> Future:
        fut = Future._new()
        body, buffers, problem = self._prepare(args, kwargs, ranks)
        if problem is not None:
            fut._set_exception(SupervisionError(problem, endpoint=self._label))
            return fut
        rt = get_runtime()
        ref = self._mesh._ref
        targets = [(ref.mesh_id, r, ref.rank_procs[r]) for r in ranks]
        gather = Gather(rt, fut, shape, targets, self._label, single)
        self._send(ranks, body, buffers, gather.port_id, pending=gather)
        shared = rt.shared_sync_thread
        if shared is not None and threading.current_thread() is shared.thread and any(
                pid == rt.proc_id and getattr(rt.actors.get(f"{mesh_id}/{r}"), "shared", None) is not None
                for mesh_id, r, pid in targets):
            fut._no_block_thread = threading.get_ident()  # its get() would wait on this very thread: refuse it
        return fut

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[R]]:
        """Send to every actor of the mesh; the Future gives a ValueMesh of the replies."""
        return self._gather(args, kwargs, self._mesh._ranks, False, self._mesh._shape)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        ranks = self._mesh._ranks
        if len(ranks) != 1:
            raise ValueError(f"call_one requires exactly 1 actor, but mesh has {len(ranks)}")
        return self._gather(args, kwargs, ranks, True, None)

    def choose(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Send to one actor of the mesh (a healthy one, picked at random)."""
        ranks = self._mesh._ranks
        if not ranks:
            raise ValueError("choose on an empty mesh")
        healthy = [r for r in ranks if r not in self._mesh._ref.state.failed] or ranks
        return self._gather(args, kwargs, [random.choice(healthy)], True, None)

    def stream(self, *args: Any, **kwargs: Any):
        """Send to every actor; yields one Future per reply, in arrival order."""
        ranks = self._mesh._ranks
        futures = [Future._new() for _ in ranks]
        body, buffers, problem = self._prepare(args, kwargs, ranks)
        if problem is not None:
            for f in futures:
                f._set_exception(SupervisionError(problem, endpoint=self._label))
            return iter(futures)
        rt = get_runtime()
        ref = self._mesh._ref
        targets = [(ref.mesh_id, r, ref.rank_procs[r]) for r in ranks]
        stream = StreamReplies(rt, futures, targets, self._label)
        self._send(ranks, body, buffers, stream.port_id, pending=stream)
        return iter(futures)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Fire and forget to every actor. If the endpoint raises, the actor dies (supervision)."""
        ranks = self._mesh._ranks
        body, buffers, problem = self._prepare(args, kwargs, ranks)
        if problem is not None:
            logger.warning("broadcast %s() to an unhealthy mesh dropped: %s", self._label, problem)
            return
        self._send(ranks, body, buffers, None)

    def _send_to_port(self, args: tuple, kwargs: dict, port: Port | None, selection: str) -> None:
        ranks = self._mesh._ranks
        if selection == "choose":
            ranks = [random.choice(ranks)]
        elif selection != "all":
            raise ValueError(f"selection must be 'all' or 'choose', got {selection!r}")
        body, buffers, problem = self._prepare(args, kwargs, ranks)
        if problem is not None:
            if port is not None:
                port.exception(SupervisionError(problem, endpoint=self._label))
            return
        if port is None:
            self._send(ranks, body, buffers, None)
        else:
            self._send(ranks, body, buffers, port._port_id, reply_proc=port._proc_id,
                       fixed_index=port._index)

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("rref needs Monarch's tensor engine, which Regent does not provide")

    def __repr__(self) -> str:
        return f"<Endpoint {self._label}>"


def as_endpoint(not_an_endpoint: Any, *, propagate: Any = None, explicit_response_port: bool = False) -> Endpoint:
    """Call a plain (undecorated) actor method through the endpoint machinery."""
    if isinstance(not_an_endpoint, Endpoint):
        return not_an_endpoint
    if not isinstance(not_an_endpoint, NotAnEndpoint):
        raise TypeError("as_endpoint expects mesh.method for a method that is not an endpoint")
    mesh = not_an_endpoint._mesh
    fn = getattr(mesh._ref.cls, not_an_endpoint._name)
    prop = EndpointProperty(fn, propagate, explicit_response_port)
    return Endpoint(mesh, not_an_endpoint._name, prop)


def send(endpoint: Endpoint, args: tuple, kwargs: dict, port: Port | None = None, selection: str = "all") -> None:
    """Low-level send: replies (one per actor) go to `port`; no port means fire-and-forget."""
    endpoint._send_to_port(tuple(args), dict(kwargs), port, selection)


class PortReceiver(Generic[R]):
    """The receiving end of a channel: `recv()` gives a Future of the next message, in order."""

    def __init__(self, rt: ActorRuntime, ranked: bool = False, once: bool = False) -> None:
        self._rt = rt
        self._ranked = ranked
        self._once = once
        self._items: deque = deque()
        self._waiters: deque[Future] = deque()
        self._port_id = rt.new_port(self)

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        try:
            ok, value = decode_reply(status, body, buffers, "port")
        except Exception as exc:  # noqa: BLE001 - reported: the port's reader receives it
            ok, value = False, exc
        if ok and self._ranked:
            value = (index, value)
        if self._waiters:
            fut = self._waiters.popleft()
            fut._set_result(value) if ok else fut._set_exception(value)
        else:
            self._items.append((ok, value))
        if self._once:
            self._rt.drop_port(self._port_id)

    def recv(self) -> Future[R]:
        fut = Future._new()

        def on_loop() -> None:
            if self._items:
                ok, value = self._items.popleft()
                fut._set_result(value) if ok else fut._set_exception(value)
            else:
                self._waiters.append(fut)

        self._rt.run_on_loop(on_loop)
        return fut

    def ranked(self) -> PortReceiver:
        self._ranked = True
        return self

    def close(self) -> None:
        self._rt.drop_port(self._port_id)


class Channel(Generic[R]):
    """`Channel.open()` gives `(Port, PortReceiver)`; generic use: `Channel[int].open()`."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port, PortReceiver]:
        rt = get_runtime()
        receiver = PortReceiver(rt, once=once)
        return Port(rt.proc_id, receiver._port_id), receiver

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port, PortReceiver]:
        rt = get_runtime()
        receiver = PortReceiver(rt, ranked=True, once=once)
        return Port(rt.proc_id, receiver._port_id), receiver


# ---------------------------------------------------------------------------------------------- Accumulator
class Accumulator(Generic[R]):
    """Fold the replies of `endpoint.stream(...)` left to right, starting from `identity`."""

    def __init__(self, endpoint: Endpoint, identity: Any, combine: Any) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future:
        futures = list(self._endpoint.stream(*args, **kwargs))
        result = Future._new()
        state = {"acc": self._identity, "left": len(futures)}
        if not futures:
            result._set_result(self._identity)
            return result

        def step(i: int) -> None:
            def on_done(f: Future) -> None:
                if result.done():
                    return
                try:
                    state["acc"] = self._combine(state["acc"], f._outcome())
                except BaseException as exc:  # noqa: BLE001 - reported: the reduction's future fails with it
                    result._set_exception(exc)
                    return
                if i + 1 < len(futures):
                    step(i + 1)
                else:
                    result._set_result(state["acc"])

            futures[i].add_done_callback(on_done)

        step(0)
        return result
