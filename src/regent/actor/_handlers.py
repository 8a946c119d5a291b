"""Messages every process understands: deliver to an actor, spawn or stop one, report a failure,
configure or stop this proc, and (on workers) start, kill or pre-warm procs for a remote owner."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from typing import Any

from regent.actor._cell import Cell
from regent.actor._config import RuntimeConfig, config
from regent.actor._context import Instance, set_current
from regent.actor._errors import format_remote_traceback
from regent.actor._messages import (
    Adopt,
    Cast,
    CastItems,
    Configure,
    Deliver,
    GetOrSpawnController,
    HostKeepWarm,
    HostKill,
    HostShutdown,
    HostSpawn,
    LogLevel,
    RankFailed,
    Spawn,
    StopActor,
    StopProc,
)
from regent.actor._pickle import loads
from regent.actor._process import ActorRuntime, stop_self
from regent.actor._runtime import DEAD, ERROR, OK, exit_gracefully
from regent.actor._spawner import (
    LOG_SYNC_MARK,
    _write_output,
    apply_proc_bind,
    log_destination_after,
    spawner_of,
)
from regent.actor._supervision import ROOT_KEY
from regent.actor._tree import post_many, relay_cast

logger = logging.getLogger("regent.actor")


_ROOT_CREATOR: list[Instance] = []


def root_creator() -> Instance:
    """The `creator` of actors spawned outside any actor: the root client instance, named "root"."""
    if not _ROOT_CREATOR:
        _ROOT_CREATOR.append(Instance(ROOT_KEY, "root", "RootClientActor", ([], [], 0), None))
    return _ROOT_CREATOR[0]


class ProcHandlers:
    """What this process does with each kind of message (besides the runtime's own: hello, whereis, replies,
    bye). One method per message type of `_messages`; the runtime is built with their `table()`."""

    def __init__(self, rt: ActorRuntime) -> None:
        self.rt = rt

    def table(self) -> dict[str, Any]:
        return {
            Deliver.KIND: self.on_deliver, CastItems.KIND: self.on_cast_items, Cast.KIND: self.on_cast,
            Spawn.KIND: self.on_spawn, RankFailed.KIND: self.on_rank_failed, StopActor.KIND: self.on_stop_actor,
            Configure.KIND: self.on_configure, StopProc.KIND: self.on_stop_proc, HostSpawn.KIND: self.on_host_spawn,
            HostKill.KIND: self.on_host_kill, HostKeepWarm.KIND: self.on_host_keep_warm,
            HostShutdown.KIND: self.on_host_shutdown, GetOrSpawnController.KIND: self.on_get_or_spawn_controller,
            LogLevel.KIND: self.on_log_level, Adopt.KIND: self.on_adopt,
        }

    # ---- actors ------------------------------------------------------------------------------------------
    def on_deliver(self, conn: Any, msg: Deliver, body: Any, buffers: list) -> None:
        item = ("m", msg.method, body, buffers, msg.reply, msg.point)
        if msg.origin is not None:  # ordered with the sender's other messages to this process (see _tree)
            self.rt.tree.deliver_in_order(msg.origin, msg.seq, lambda: self.post(msg.key, item))
        else:
            self.post(msg.key, item)

    def on_cast_items(self, conn: Any, msg: CastItems, body: Any, buffers: list) -> None:
        self.rt.tree.deliver_in_order(msg.origin, msg.seq, lambda: post_many(
            self.rt, self.post, self.spawn_cell, msg.mesh_id, msg.method, msg.reply, msg.labels, msg.sizes,
            msg.items, body, buffers))

    def on_cast(self, conn: Any, msg: Cast, body: Any, buffers: list) -> None:
        relay_cast(self.rt, msg, body, buffers)

    def post(self, key: str, item: tuple) -> None:
        rt = self.rt
        cell = rt.actors.get(key)
        if cell is not None:
            cell.post(item)
            return
        dead = rt.actors.why_dead(key)
        if dead is not None:
            if item[4] is not None:
                rt.send_reply(item[4], DEAD, dead)
            return
        # the spawn message may still be on its way (another sender's connection): hold the message
        if rt.actors.hold(key, item):
            rt.loop.call_later(config.spawn_timeout, self.expire_unknown, key)

    def expire_unknown(self, key: str) -> None:
        rt = self.rt
        for item in rt.actors.take_held(key):
            if item[4] is not None:
                rt.send_reply(item[4], DEAD, f"no actor {key} in process {rt.proc_id}")

    def on_spawn(self, conn: Any, msg: Spawn, body: Any, buffers: list) -> None:
        self.spawn_cell(msg.key, msg.mesh_id, msg.rank, msg.name, msg.point, msg.owner, msg.is_async, msg.reply,
                        body, buffers)

    def spawn_cell(self, key: str, mesh_id: str, rank: int, name: str, point: tuple, owner: tuple,
                   is_async: bool, reply: tuple | None, body: Any, buffers: list) -> None:
        rt = self.rt
        try:
            cls, args, kwargs = loads(body, buffers)
        except Exception as exc:  # noqa: BLE001 - reported: a spawn whose arguments cannot be read is a supervision event
            text = f"Supervision event: actor {name}[{rank}] failed during spawn: {format_remote_traceback(exc)}"
            rt.actors.mark_dead(key, text)
            rt.send_reply(reply, DEAD, text)
            rt.send(owner[0], RankFailed(mesh_id, rank, text))
            return
        proc = rt.self_proc or rt.ensure_self_proc()
        owner_cell = rt.actors.get(owner[1])
        if owner_cell is not None:
            creator = owner_cell.ctx
        elif owner[1] == ROOT_KEY:
            creator = root_creator()  # spawned by a program, outside any actor: Monarch's root instance
        else:
            creator = None
        cell = Cell(rt, key, mesh_id, rank, point, name, owner, cls, args, kwargs, is_async, reply, proc, creator)
        for item in rt.actors.add(key, cell):
            cell.post(item)
        cell.start()

    def on_rank_failed(self, conn: Any, msg: RankFailed, body: Any, buffers: list) -> None:
        self.rt.supervision.rank_failed(msg.mesh_id, msg.rank, msg.text)

    def on_stop_actor(self, conn: Any, msg: StopActor, body: Any, buffers: list) -> None:
        if msg.origin is not None:  # after the sender's earlier messages to this process (a tree cast may be behind)
            self.rt.tree.deliver_in_order(msg.origin, msg.seq, lambda: self.stop_actor(msg.key, msg.reason, msg.reply))
        else:
            self.stop_actor(msg.key, msg.reason, msg.reply)

    def stop_actor(self, key: str, reason: str, reply: tuple | None) -> None:
        cell = self.rt.actors.get(key)
        if cell is None:
            if reply is not None:
                self.rt.send_reply(reply, OK, None)
            return
        cell.post(("stop", reply, reason))

    def on_get_or_spawn_controller(self, conn: Any, msg: GetOrSpawnController, body: Any, buffers: list) -> None:
        rt = self.rt

        async def run() -> None:
            try:
                cls, args, kwargs = loads(body, buffers)
                mesh = await rt.parts.spawn_controller(rt, msg.name, cls, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                rt.send_reply(msg.reply, ERROR, (exc, str(exc), format_remote_traceback(exc)))
                return
            rt.send_reply(msg.reply, OK, mesh)

        rt.loop.create_task(run())

    # ---- this proc ---------------------------------------------------------------------------------------
    def on_configure(self, conn: Any, msg: Configure, body: Any, buffers: list) -> None:
        self.rt.loop.create_task(configure_self(self.rt, msg.cfg, body, buffers, msg.reply))

    def on_stop_proc(self, conn: Any, msg: StopProc, body: Any, buffers: list) -> None:
        def stop() -> None:
            self.rt.loop.create_task(stop_self(self.rt, msg.reply, teardown=True))

        self.rt.tree.deliver_in_order(msg.origin, msg.seq, stop)

    def on_adopt(self, conn: Any, msg: Adopt, body: Any, buffers: list) -> None:
        """A new controller takes this proc over (`adopt_proc_mesh`): its predecessor died, so failures, the
        orphan watch and `get_or_spawn_controller` must now point at the new one. While the current owner is
        still connected that would make two controllers, so it is refused unless forced."""
        rt = self.rt
        new = msg.owner
        new_id = new["id"]
        old = rt.owner_proc_id
        if old is not None and old != new_id and not msg.force and rt.owner_connected():
            text = (f"proc {rt.proc_id} is owned by live controller {old}; adopting it would give it two "
                    "controllers (stop that one first, or adopt with force=True)")
            rt.send_reply(msg.reply, ERROR, (RuntimeError(text), text, ""))
            return
        rt.learn(new_id, new)
        rt.owner_proc_id = new_id
        rt.root_info = new
        rt.parent_os_pid = None  # the process that started this proc no longer owns it: its death must not end it
        for cell in rt.actors.running():  # actors the old controller spawned report their failures to the new one
            if cell.owner[0] == old:
                cell.owner = (new_id, cell.owner[1])
        if msg.detach_grace is not None:
            rt.detach_grace = float(msg.detach_grace)
        leave = getattr(rt, "_leave_detached", None)  # stage A's detached mode, where it exists
        if callable(leave):
            leave()
        logger.info("proc %s adopted by controller %s (previous owner %s)", rt.proc_id, new_id, old)
        rt.send_reply(msg.reply, OK, {"proc_id": rt.proc_id, "os_pid": os.getpid(), "previous_owner": old,
                                      "detached_since": getattr(rt, "detached_since", None)})

    def on_log_level(self, conn: Any, msg: LogLevel, body: Any, buffers: list) -> None:
        """ProcMesh.logging_option: set the root logger's level, then mark this point in both output streams
        (the client applies its new forwarding mode once every proc's marks came through its pipes)."""
        logging.getLogger().setLevel(msg.level)
        mark = f"{LOG_SYNC_MARK}{msg.token}\n".encode()
        for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
            with contextlib.suppress(Exception):  # a closed or redirected stream: the client stops waiting for it
                stream.flush()
                os.write(fd, mark)
        self.rt.send_reply(msg.reply, OK, None)

    # ---- host agents (`regent worker`) -------------------------------------------------------------------
    def on_host_spawn(self, conn: Any, msg: HostSpawn, body: Any, buffers: list) -> None:
        self.rt.loop.create_task(host_spawn(self.rt, msg.specs, bytes(body), msg.events, msg.reply))

    def on_host_kill(self, conn: Any, msg: HostKill, body: Any, buffers: list) -> None:
        for pid in msg.pids:
            spawner_of(self.rt).kill(pid)

    def on_host_keep_warm(self, conn: Any, msg: HostKeepWarm, body: Any, buffers: list) -> None:
        spawner_of(self.rt).keep_warm(msg.n, msg.preload, msg.refill_delay_s)

    def on_host_shutdown(self, conn: Any, msg: HostShutdown, body: Any, buffers: list) -> None:
        logger.warning("worker %s shutting down at its controller's request", self.rt.proc_id)
        spawner_of(self.rt).kill_all()
        self.rt.loop.call_later(0.2, exit_gracefully, 0)


def handler_table(rt: ActorRuntime) -> dict[str, Any]:
    """The handlers of this module's message kinds, which the runtime is built with (`ProcessParts.handlers`)."""
    return ProcHandlers(rt).table()


async def configure_self(rt: ActorRuntime, cfg: dict, body: Any, buffers: list, reply: tuple) -> None:
    """In a new proc: take the identity, env and rank the spawner gives, then run the bootstrap."""
    new_pid = cfg["id"]
    if new_pid != rt.proc_id:
        old = rt.proc_id
        rt.proc_id = new_pid
        rt.info["id"] = new_pid
        rt.directory.pop(old, None)
        rt.directory[new_pid] = rt.info
    os.environ.update(cfg.get("env") or {})
    vars(config).update(vars(RuntimeConfig.from_env()))  # a claimed spare takes its owner's knobs
    sys.path[:0] = [p for p in cfg.get("sys_path", []) if p not in sys.path]
    rt.owner_proc_id = cfg["owner"]
    rt.root_info = cfg.get("root")
    rt.host_python = cfg.get("python")  # `this_host()` here spawns under the interpreter this proc was given
    if cfg.get("detach_grace") is not None:
        rt.detach_grace = float(cfg["detach_grace"])
        if cfg.get("detach_log_dir"):
            rt.detach_log = os.path.join(cfg["detach_log_dir"], f"detached-{new_pid}.log")
    if rt.root_info is not None:
        rt.directory.setdefault(rt.root_info["id"], rt.root_info)
    rank = (cfg["labels"], cfg["sizes"], cfg["rank"])
    proc = rt.ensure_self_proc()
    rt.proc_context = Instance(ROOT_KEY, cfg["name"], "Proc", rank, proc)
    try:
        if cfg.get("bind"):
            apply_proc_bind(cfg["bind"])  # before the bootstrap, so threads it starts are pinned too
        if bytes(body):
            fn = loads(body, buffers)
            set_current(rt.proc_context, rank)
            if inspect.iscoroutinefunction(fn):
                await fn()
            else:
                def run() -> Any:
                    set_current(rt.proc_context, rank)
                    return fn()

                result = await rt.loop.run_in_executor(None, run)
                if inspect.isawaitable(result):
                    await result
    except BaseException as exc:  # noqa: BLE001 - reported to the spawner as a bootstrap failure
        rt.send_reply(reply, ERROR, (exc, f"bootstrap of proc {cfg['name']} rank {cfg['rank']} failed",
                                     format_remote_traceback(exc)))
        return
    rt.send_reply(reply, OK, None)


async def host_spawn(rt: ActorRuntime, specs: list[dict], bootstrap: bytes, events: tuple, reply: tuple) -> None:
    """On a worker: start procs for a remote owner; forward their exits and output to it."""

    exits: list[tuple[str, str | None]] = []
    timer: list[Any] = [None, 0.0]

    def flush_exits() -> None:
        timer[0] = None
        batch = list(exits)
        exits.clear()
        if batch:
            rt.send_reply(events, OK, ("exits", batch))

    def on_exit(pid: str, reason: str | None) -> None:
        # procs that exit together (a host losing them all) are reported in one event (aggregated on the wire
        # only: the owner still gets a MeshFailure per rank); a quiet spell of `exit_window_s` ends the batch
        rt.tree.proc_exited(pid, reason)
        exits.append((pid, reason))
        now = rt.loop.time()
        if timer[0] is None:
            timer[1] = now
        else:
            timer[0].cancel()
        delay = min(rt.supervision.exit_window_s, max(0.0, timer[1] + 10 * rt.supervision.exit_window_s - now))
        timer[0] = rt.loop.call_later(delay, flush_exits)

    # Where each proc's lines go: to the owner, or printed here, on this worker's own stdout/stderr (Monarch's
    # `stream_logs=False`: nothing is lost, it is where the proc runs); a `logging_option` sync mark switches it
    to_owner = {(spec["pid"], stream): spec.get("output_to_owner", True) for spec in specs
                for stream in ("stdout", "stderr")}

    def on_output(pid: str, stream: str, text: str) -> None:
        before, after_mark = log_destination_after(text)
        if after_mark is not None:
            if before and not to_owner.get((pid, stream), True):
                _write_output(pid, stream, before + "\n")  # a partial line printed just before the mark
                text = text[len(before):]
            to_owner[(pid, stream)] = after_mark
            rt.send_reply(events, OK, ("out", pid, stream, text))  # the owner waits for every mark
        elif to_owner.get((pid, stream), True):
            rt.send_reply(events, OK, ("out", pid, stream, text))
        else:
            _write_output(pid, stream, text)

    try:
        infos = await spawner_of(rt).spawn(specs, bootstrap, on_exit, on_output, release=False)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller as a spawn failure
        rt.send_reply(reply, ERROR, (exc, f"worker {rt.proc_id} could not spawn procs", format_remote_traceback(exc)))
        return
    rt.send_reply(reply, OK, infos)
