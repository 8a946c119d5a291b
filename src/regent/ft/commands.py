"""`regent lighthouse`: run a Lighthouse in the foreground until SIGINT/SIGTERM.

Flags match `torchft_lighthouse` (its underscore spellings are accepted too). The default bind is loopback;
serve other hosts with `--bind 0.0.0.0:29510` (or `[::]:29510`). The dashboard is on the gRPC port + 1.

Security (`regent.ft.rpc_security`): with a job secret (`--secret-file`, else `$REGENT_JOB_SECRET` /
`$REGENT_JOB_SECRET_FILE`) every gRPC call must prove it; without one the Lighthouse is open, as TorchFT's.
`--tls-cert/--tls-key` (and `--tls-ca` for mutual TLS; env `REGENT_FT_TLS_*`) serve gRPC and the dashboard
over TLS.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

DEFAULT_BIND = "127.0.0.1:29510"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "lighthouse",
        help="run the quorum server (TorchFT-compatible Lighthouse) with its HTTP dashboard",
        description=(
            "Run a Lighthouse: replicas' managers call it to agree on who trains together. gRPC on --bind "
            "(TorchFT's LighthouseService), the dashboard on the next port. Listens on loopback by default; "
            "use --bind 0.0.0.0:29510 to serve other machines."
        ),
    )
    parser.add_argument(
        "--bind", default=DEFAULT_BIND, help=f"HOST:PORT for gRPC; the dashboard uses PORT+1 (default {DEFAULT_BIND})"
    )
    parser.add_argument(
        "--min-replicas", "--min_replicas", dest="min_replicas", type=int, default=1,
        help="replica groups needed before a new quorum forms (default 1)",
    )
    parser.add_argument(
        "--join-timeout-ms", "--join_timeout_ms", dest="join_timeout_ms", type=int, default=60000,
        help="how long to wait for heartbeating stragglers to join (default 60000)",
    )
    parser.add_argument(
        "--quorum-tick-ms", "--quorum_tick_ms", dest="quorum_tick_ms", type=int, default=100,
        help="how often to re-check for a quorum while waiting (default 100)",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms", "--heartbeat_timeout_ms", dest="heartbeat_timeout_ms", type=int, default=5000,
        help="a replica without a heartbeat for this long is considered dead (default 5000)",
    )
    parser.add_argument(
        "--holder-grace-ms", dest="holder_grace_ms", type=int, default=2000,
        help="Regent: how long a fast quorum waits for a replica that holds the committed step but was not in the "
             "last quorum (one just healed, on its way to the sync); 0 applies TorchFT's rule exactly (default 2000)",
    )
    parser.add_argument(
        "--late-member-ms", dest="late_member_ms", type=int, default=0,
        help="Regent: once a strict majority of the last quorum has joined, wait this long for its other members, "
             "then issue the quorum without them (a paused or hung replica no longer holds up every sync); 0 applies "
             "TorchFT's rules exactly (default 0)",
    )
    parser.add_argument(
        "--state-file", "--state_file", dest="state_file", default=None,
        help="save the last quorum id here so a restarted Lighthouse keeps ids increasing (recommended)",
    )
    parser.add_argument(
        "--secret-file", default=None,
        help="file holding the job secret every call must prove (default: $REGENT_JOB_SECRET or "
             "$REGENT_JOB_SECRET_FILE; none: calls are not authenticated)",
    )
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS (env REGENT_FT_TLS_CERT)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (env REGENT_FT_TLS_KEY)")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM CA bundle: require client certificates signed by it (env REGENT_FT_TLS_CA)")
    parser.add_argument(
        "--frontends", type=int, default=0,
        help="serve gRPC from this many front-end processes sharing the port (Linux SO_REUSEPORT): heartbeats "
             "and request decoding spread over cores, the quorum decision stays in this process (default 0: "
             "one process)",
    )
    parser.add_argument(
        "--frontend-batch-ms", type=float, default=2.0,
        help="how often front ends forward their heartbeats and requests to this process (default 2 ms; "
             "the added liveness lag)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.set_defaults(func=run_lighthouse)
    return parser


def run_lighthouse(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [lighthouse] %(message)s",
    )
    from regent.auth import read_secret_file
    from regent.ft.lighthouse import LighthouseServer, tune_gc
    from regent.ft.rpc_security import TLSFiles

    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        tls = None
        if args.tls_cert or args.tls_key or args.tls_ca:
            env = TLSFiles.from_env()
            tls = TLSFiles(args.tls_cert or env.cert, args.tls_key or env.key, args.tls_ca or env.ca, env.server_name)
        tune_gc()  # this process serves the Lighthouse only
        server = LighthouseServer(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            holder_grace_ms=args.holder_grace_ms,
            late_member_ms=args.late_member_ms,
            state_file=args.state_file,
            secret=secret,
            tls=tls,
            frontends=args.frontends,
            frontend_batch_ms=args.frontend_batch_ms,
        )
    except (OSError, ValueError) as err:
        print(f"regent lighthouse: {err}", file=sys.stderr)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"Lighthouse gRPC:      {server.address()}", flush=True)
    print(f"Lighthouse dashboard: {server.dashboard_url()}", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    return 0
