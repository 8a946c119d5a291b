"""The `regent` command. Argument parsing only; each subcommand lives next to the code it drives.

Each subcommand module exposes `add_parser(subparsers)`, which registers its parser and sets
`func=<callable(args) -> int>`. Modules are imported lazily so `regent worker` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that defines add_parser(subparsers)
SUBCOMMANDS: dict[str, str] = {
    "worker": "regent.actor.commands",
    "lighthouse": "regent.ft.commands",
    "simulate": "regent.ft.simulate",
    "train": "regent.orchestrate.commands",
    "report": "regent.orchestrate.commands",
    "check": "regent.orchestrate.commands",
    "data": "regent.train.commands",
    "k8s": "regent.jobs.k8s_manifest",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="regent", description="Fault-tolerant distributed training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for name, module_name in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        if module_name in seen:
            continue
        seen.add(module_name)
        module = importlib.import_module(module_name)
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(only)
    if only == "train":
        # `regent train` accepts dotted overrides such as --ft.sync-every 20
        args, extra = parser.parse_known_args(argv)
        args._extra = extra
    else:
        args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    code = int(args.func(args) or 0)
    if from_command_line and only == "train":
        _exit_without_finalizing(code)
    return code


def _exit_without_finalizing(code: int) -> None:
    """End `regent train` once the run is written, skipping interpreter finalization.

    A complete run has, rarely, ended in SIGSEGV while the interpreter tore down (native threads of the actor
    runtime and torch outliving the modules they call into), turning a good run into a failed command. The
    atexit handlers (stop the meshes this process owns, release allocations) still run first.
    """
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not change the exit code
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
