"""Entry point of a proc process (`python -m regent.actor._proc_main`), started by a `LocalSpawner`.

The parent passes everything in the environment: REGENT_BOOT (JSON: id, parent address, sys.path,
modules to preload for warm spares) and REGENT_JOB_SECRET. The proc listens, connects back to its
parent (which then sends "configure": identity, env, rank, bootstrap), and serves until stopped or orphaned.
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib
import json
import logging
import os
import signal
import sys

from regent import settings
from regent.actor._context import install_log_prefix
from regent.actor._process import new_runtime, set_runtime
from regent.actor._runtime import teardown_exit_code
from regent.eventloop import new_event_loop


def main() -> None:
    # Ctrl-C in a terminal reaches the whole process group; the controller decides when procs stop.
    signal.signal(signal.SIGINT, lambda *_: None)  # a handler, not SIG_IGN: exec resets it for children
    # A closed terminal hangs up the whole process group. Procs end with their parent anyway (or, spawned with
    # a detach grace, outlive it on purpose), so the hangup itself must not kill them.
    signal.signal(signal.SIGHUP, lambda *_: None)
    # `kill -USR1 <pid>` prints every thread's Python stack to this proc's stderr, which its owner routes with
    # the proc's prefix: how a stuck trainer is looked into on a cluster without py-spy or gdb
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parent_os_pid = os.getppid()  # its spawner: this proc ends when that process does (`ActorRuntime.orphan_watch`)
    boot = json.loads(settings.REGENT_BOOT.take())
    missing = [p for p in boot.get("sys_path", []) if p not in sys.path]
    sys.path[:0] = missing
    logging.basicConfig(level=settings.REGENT_LOG_LEVEL.get(),
                        format="%(levelname)s %(name)s: %(message)s")
    install_log_prefix(None)  # records of actors get their instance; the proc's own stay as written
    for module in boot.get("preload", []):
        importlib.import_module(module)

    rt = new_runtime(proc_id=boot["id"], is_controller=False, tcp_host=boot.get("tcp_host"),
                     advertise_host=boot.get("advertise_host"), sock_dir=boot.get("sock_dir"))
    set_runtime(rt)
    parent = boot["parent"]
    rt.owner_proc_id = parent["id"]
    rt.directory[parent["id"]] = parent
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    rt.bind_loop(loop)
    loop.run_until_complete(rt.start())
    rt.dial(parent["id"])
    loop.create_task(rt.orphan_watch(parent_os_pid))
    loop.run_forever()
    # the loop stops only for a graceful stop that ends through the interpreter's teardown (exit_gracefully)
    code = teardown_exit_code()
    sys.exit(0 if code is None else code)


if __name__ == "__main__":
    main()
