"""`regent worker --address tcp://HOST:PORT [--secret-file F]`: serve this host to a Regent controller.

A worker starts procs when a controller (`attach_to_workers([...])`) asks, reaps them, and forwards their
exit status and output to that controller. It never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from regent import settings
from regent.actor._context import install_log_prefix
from regent.actor._process import new_runtime, set_runtime
from regent.actor._runtime import new_id, remove_sock_dir
from regent.actor._transport import inherited_listener, parse_address, split_address
from regent.auth import job_secret_from_env, read_secret_file, user_secret
from regent.eventloop import new_event_loop

logger = logging.getLogger("regent.actor.worker")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="serve this host to a Regent controller",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True,
                   help="where to listen, tcp://HOST:PORT (port 0 picks one; the chosen address is printed), "
                        "or tcp://NAME:PORT@tcp://0.0.0.0:PORT to listen on the second and be dialled as NAME")
    p.add_argument("--secret-file", default=None,
                   help="file holding the job secret (hex); default: $REGENT_JOB_SECRET, $REGENT_JOB_SECRET_FILE, "
                        "else this user's ~/.config/regent/job-secret")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when the process that started this worker exits (used by ProcessJob)")
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(level=settings.REGENT_LOG_LEVEL.get(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else job_secret_from_env()
    except (OSError, ValueError) as exc:
        print(f"regent worker: cannot read the job secret: {exc}", file=sys.stderr)
        return 2
    try:
        run_worker_loop_forever(args.address, secret=secret, exit_with_parent=args.exit_with_parent)
    except ValueError as exc:
        print(f"regent worker: {exc}", file=sys.stderr)
        return 2
    return 0


def worker_user_secret() -> bytes:
    """This user's default secret (`regent.auth.user_secret`) for a worker given none: a client of the same user
    with none given proves it too. ValueError (one line) when it is turned off, unsafe or cannot be made: a
    worker never serves without a secret."""
    try:
        secret = user_secret()
    except OSError as exc:
        raise ValueError(f"no job secret, and this user's default one cannot be made ({exc}); set "
                         "REGENT_JOB_SECRET_FILE (or pass --secret-file / secret=)") from None
    if secret is None:
        raise ValueError("no job secret: set REGENT_JOB_SECRET or REGENT_JOB_SECRET_FILE, or pass --secret-file "
                         "(REGENT_USER_SECRET_FILE is off)")
    return secret


def run_worker_loop_forever(address: str, ca: str = "trust_all_connections", secret: bytes | None = None,
                            exit_with_parent: bool = False, *, private_key: object = None) -> None:
    """Serve this host to Regent controllers (`attach_to_workers`) at `address` until killed or shut down.

    Monarch's name and address forms: `tcp://HOST:PORT` or `ipc:///PATH`; `tcp://NAME:P@tcp://0.0.0.0:P`
    binds the second address and tells peers (and the procs it starts) to dial NAME, for hosts reached
    through another name than the interface they listen on; a leading `<proc-id>@` is accepted and ignored;
    `tcp://HOST:fdN` serves on the bound socket inherited as file descriptor N (no port race at start-up).
    Connections must prove the job secret (`secret`, or REGENT_JOB_SECRET / REGENT_JOB_SECRET_FILE, else this
    user's default secret file, which a client of the same user given none uses too) instead of TLS, so `ca`
    must be "trust_all_connections" and `private_key` None.
    """
    if private_key is not None or ca != "trust_all_connections":
        raise NotImplementedError("TLS security plumbing: only ca='trust_all_connections' (and no private_key) "
                                  "is supported; connections are authenticated with the job secret")
    install_log_prefix(None)  # the worker's own records stay as written
    address, inherited = inherited_listener(address)  # Monarch's tcp://HOST:fdN: serve on a socket handed over
    dial, bind = split_address(address)
    if bind.startswith("tcp://*") or dial.startswith("tcp://*"):
        raise NotImplementedError(f"wild-card host in {address!r}: give the host to listen on "
                                  "(tcp://0.0.0.0:PORT, or tcp://NAME:PORT@tcp://0.0.0.0:PORT to be dialled as NAME)")
    kind, where = parse_address(bind)
    tcp_host = where[0] if kind == "tcp" else None
    advertise = None
    if dial != bind and kind == "tcp":
        dial_kind, dial_where = parse_address(dial)
        advertise = dial_where[0] if dial_kind == "tcp" else None
    secret = secret or job_secret_from_env() or worker_user_secret()
    rt = new_runtime(proc_id=new_id("worker"), is_controller=False, secret=secret, tcp_host=tcp_host,
                     advertise_host=advertise)
    set_runtime(rt)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    rt.bind_loop(loop)
    loop.run_until_complete(rt.start())
    served = rt.advertised(loop.run_until_complete(rt.listen_extra(bind, inherited)))
    print(f"regent worker serving {served}", flush=True)

    def terminate(*_: object) -> None:
        if rt.spawner is not None:
            rt.spawner.kill_all()
        remove_sock_dir(rt.sock_dir)
        os._exit(0)  # like Python's own SIGTERM death: no atexit handlers (a graceful end is `host.shutdown()`)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    if exit_with_parent:
        parent = os.getppid()

        async def watch_parent() -> None:
            while True:
                await asyncio.sleep(0.5)
                if os.getppid() != parent:
                    logger.warning("parent process exited; worker exits")
                    terminate()

        loop.create_task(watch_parent())
    loop.run_forever()
