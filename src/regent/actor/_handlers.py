"""Messages every process understands: deliver to an actor, spawn or stop one, report a failure,
configure or stop this proc, and (on workers) start, kill or pre-warm procs for a remote owner."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import sys
from typing import Any

from regent.actor._cell import Cell
from regent.actor._config import config
from regent.actor._context import Instance, set_current
from regent.actor._errors import format_remote_traceback
from regent.actor._pickle import loads
from regent.actor._proc import _controller_local, ensure_self_proc
from regent.actor._runtime import DEAD, ERROR, OK, ROOT_KEY, Runtime, exit_gracefully
from regent.actor._spawner import LOG_SYNC_MARK, _env, _OneShot, apply_proc_bind, spawner_of
from regent.actor._tree import deliver_in_order, post_many, relay_cast
from regent.actor._tree import proc_exited as tree_proc_exited

logger = logging.getLogger("regent.actor")


_ROOT_CREATOR: list[Instance] = []


def root_creator() -> Instance:
    """The `creator` of actors spawned outside any actor: the root client instance, named "root"."""
    if not _ROOT_CREATOR:
        _ROOT_CREATOR.append(Instance(ROOT_KEY, "root", "RootClientActor", ([], [], 0), None))
    return _ROOT_CREATOR[0]


def install_handlers(rt: Runtime) -> None:
    def h_msg(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        item = ("m", msg[2], body, buffers, msg[3], msg[4])
        if len(msg) > 5:  # ordered with the sender's other messages to this process (see _tree)
            deliver_in_order(rt, msg[5], msg[6], lambda: post(msg[1], item))
        else:
            post(msg[1], item)

    def h_mc(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        _, origin, seq, mesh_id, method, reply, labels, sizes, items = msg
        deliver_in_order(rt, origin, seq, lambda: post_many(rt, post, spawn_cell, mesh_id, method, reply, labels,
                                                            sizes, items, body, buffers))

    def h_cast(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        relay_cast(rt, msg, body, buffers)

    def post(key: str, item: tuple) -> None:
        cell = rt.cells.get(key)
        if cell is not None:
            cell.post(item)
            return
        dead = rt.dead_cells.get(key)
        if dead is not None:
            if item[4] is not None:
                rt.send_reply(item[4], DEAD, dead)
            return
        # the spawn message may still be on its way (another sender's connection): hold the message
        rt.unknown.setdefault(key, []).append(item)
        if len(rt.unknown[key]) == 1:
            rt.loop.call_later(config.spawn_timeout, expire_unknown, key)

    def expire_unknown(key: str) -> None:
        for item in rt.unknown.pop(key, []):
            if item[4] is not None:
                rt.send_reply(item[4], DEAD, f"no actor {key} in process {rt.proc_id}")

    def h_spawn(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        _, key, mesh_id, rank, name, point, owner, is_async, reply = msg
        spawn_cell(key, mesh_id, rank, name, point, owner, is_async, reply, body, buffers)

    def spawn_cell(key: str, mesh_id: str, rank: int, name: str, point: tuple, owner: tuple, is_async: bool,
                   reply: tuple | None, body: Any, buffers: list) -> None:
        try:
            cls, args, kwargs = loads(body, buffers)
        except Exception as exc:  # noqa: BLE001 - reported: a spawn whose arguments cannot be read is a supervision event
            text = f"Supervision event: actor {name}[{rank}] failed during spawn: {format_remote_traceback(exc)}"
            rt.dead_cells[key] = text
            rt.send_reply(reply, DEAD, text)
            rt.send(owner[0], ("f", mesh_id, rank, text))
            return
        proc = rt.self_proc or ensure_self_proc(rt)
        if owner[1] in rt.cells:
            creator = rt.cells[owner[1]].ctx
        elif owner[1] == ROOT_KEY:
            creator = root_creator()  # spawned by a program, outside any actor: Monarch's root instance
        else:
            creator = None
        cell = Cell(rt, key, mesh_id, rank, point, name, owner, cls, args, kwargs, is_async, reply, proc, creator)
        rt.cells[key] = cell
        for item in rt.unknown.pop(key, []):
            cell.post(item)
        cell.start()

    def h_fail(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        _, mesh_id, rank, text = msg
        rt.rank_failed(mesh_id, rank, text)

    def h_stop_actor(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        if len(msg) > 4:  # after the sender's earlier messages to this process (a tree cast may be behind)
            deliver_in_order(rt, msg[4], msg[5], lambda: stop_actor(msg[1], msg[2], msg[3]))
        else:
            stop_actor(msg[1], msg[2], msg[3])

    def stop_actor(key: str, reason: str, reply: tuple | None) -> None:
        cell = rt.cells.get(key)
        if cell is None:
            if reply is not None:
                rt.send_reply(reply, OK, None)
            return
        cell.post(("stop", reply, reason))

    def h_configure(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        rt.loop.create_task(configure_self(rt, msg[1], body, buffers, msg[2]))

    def h_stop_proc(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        def stop() -> None:
            rt.loop.create_task(stop_self(rt, msg[2]))

        deliver_in_order(rt, msg[3] if len(msg) > 3 else None, msg[4] if len(msg) > 4 else None, stop)

    def h_host_spawn(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        _, specs, events, reply = msg
        rt.loop.create_task(host_spawn(rt, specs, bytes(body), events, reply))

    def h_host_kill(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        for pid in msg[1]:
            spawner_of(rt).kill(pid)

    def h_host_keep_warm(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        spawner_of(rt).keep_warm(msg[1], msg[2], msg[3] if len(msg) > 3 else 0.0)

    def h_host_shutdown(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        logger.warning("worker %s shutting down at its controller's request", rt.proc_id)
        spawner_of(rt).kill_all()
        rt.loop.call_later(0.2, exit_gracefully, 0)

    def h_log_level(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        """ProcMesh.logging_option: set the root logger's level, then mark this point in both output streams
        (the client applies its new forwarding mode once every proc's marks came through its pipes)."""
        _, level, token, reply = msg
        logging.getLogger().setLevel(level)
        mark = f"{LOG_SYNC_MARK}{token}\n".encode()
        for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
            with contextlib.suppress(Exception):  # a closed or redirected stream: the client stops waiting for it
                stream.flush()
                os.write(fd, mark)
        rt.send_reply(reply, OK, None)

    def h_goc(conn: Any, msg: tuple, body: Any, buffers: list) -> None:
        _, name, reply = msg

        async def run() -> None:
            try:
                cls, args, kwargs = loads(body, buffers)
                mesh = await _controller_local(rt, name, cls, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                rt.send_reply(reply, ERROR, (exc, str(exc), format_remote_traceback(exc)))
                return
            rt.send_reply(reply, OK, mesh)

        rt.loop.create_task(run())

    rt.handlers.update(m=h_msg, mc=h_mc, cast=h_cast, s=h_spawn, f=h_fail, stop_actor=h_stop_actor, configure=h_configure,
                       stop_proc=h_stop_proc, host_spawn=h_host_spawn, host_kill=h_host_kill,
                       host_keep_warm=h_host_keep_warm, host_shutdown=h_host_shutdown, goc=h_goc,
                       log_level=h_log_level)


async def configure_self(rt: Runtime, cfg: dict, body: Any, buffers: list, reply: tuple) -> None:
    """In a new proc: take the identity, env and rank the spawner gives, then run the bootstrap."""
    new_pid = cfg["id"]
    if new_pid != rt.proc_id:
        old = rt.proc_id
        rt.proc_id = new_pid
        rt.info["id"] = new_pid
        rt.directory.pop(old, None)
        rt.directory[new_pid] = rt.info
    os.environ.update(cfg.get("env") or {})
    from regent.actor._config import RuntimeConfig

    vars(config).update(vars(RuntimeConfig.from_env()))  # a claimed spare takes its owner's knobs
    sys.path[:0] = [p for p in cfg.get("sys_path", []) if p not in sys.path]
    rt.owner_proc_id = cfg["owner"]
    rt.root_info = cfg.get("root")
    if rt.root_info is not None:
        rt.directory.setdefault(rt.root_info["id"], rt.root_info)
    rank = (cfg["labels"], cfg["sizes"], cfg["rank"])
    proc = ensure_self_proc(rt)
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


async def stop_self(rt: Runtime, reply: tuple | None) -> None:
    """Stop every actor of this proc (running `__cleanup__`), say goodbye to peers, and exit."""
    waits = []
    for cell in list(rt.cells.values()):
        fut = rt.loop.create_future()
        port = rt.new_port(_OneShot(fut))
        cell.post(("stop", (rt.proc_id, port, 0), "proc mesh stopped"))
        waits.append(fut)
    if waits:
        await asyncio.wait(waits, timeout=config.stop_timeout)
    if reply is not None:
        rt.send_reply(reply, OK, None)
    await asyncio.sleep(0)
    for conn in list(rt.connections):
        with contextlib.suppress(Exception):  # a peer that is gone already needs no goodbye
            conn.send(_env(("bye",)), b"")
            conn.flush()
    rt.stopping = True
    if rt.spawner is not None:
        rt.spawner.kill_all()
    await asyncio.sleep(0.05)
    exit_gracefully(0)  # atexit handlers and finalizers run; the interpreter is not torn down (see there)


async def host_spawn(rt: Runtime, specs: list[dict], bootstrap: bytes, events: tuple, reply: tuple) -> None:
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
        # procs that exit together (a host losing them all) are reported in one event, so their owner
        # gets one supervision report naming every rank; a quiet spell of `exit_window_s` ends the batch
        tree_proc_exited(rt, pid, reason)
        exits.append((pid, reason))
        now = rt.loop.time()
        if timer[0] is None:
            timer[1] = now
        else:
            timer[0].cancel()
        delay = min(rt.exit_window_s, max(0.0, timer[1] + 10 * rt.exit_window_s - now))
        timer[0] = rt.loop.call_later(delay, flush_exits)

    def on_output(pid: str, stream: str, text: str) -> None:
        rt.send_reply(events, OK, ("out", pid, stream, text))

    try:
        infos = await spawner_of(rt).spawn(specs, bootstrap, on_exit, on_output, release=False)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller as a spawn failure
        rt.send_reply(reply, ERROR, (exc, f"worker {rt.proc_id} could not spawn procs", format_remote_traceback(exc)))
        return
    rt.send_reply(reply, OK, infos)
