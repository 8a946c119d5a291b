"""`regent train` and `regent report`: parsing only; the work happens in regent.orchestrate.run."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Any, NoReturn

from regent.orchestrate.config import (
    FAULT_KINDS,
    ConfigError,
    RunConfig,
    apply_toml,
    load_toml,
    parse_duration,
    set_option,
    validate,
)

TRAIN_EPILOG = """\
Any config field can be overridden with a dotted flag, e.g. --train.lr 1e-3 --ft.sync-every 10
--faults.warmup 20s --lighthouse.join-timeout-ms 5000. Sections: train, ft, faults, lighthouse.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="fault-tolerant training (the demo by default)",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.error = _one_line_error  # type: ignore[method-assign]
    p.add_argument("--config", help="TOML file; command-line flags override it")
    p.add_argument("--replicas", type=int, help="replica groups (default 4)")
    p.add_argument("--procs-per-replica", type=int, help="processes (GPUs) per replica group (default 2)")
    p.add_argument("--model", help="debug | 150m | 1b | 8b (default debug)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="stop after N committed steps")
    g.add_argument("--duration", help="stop after this wall time, e.g. 180s or 3m (default 180s); a --faults-file replay "
                        "runs on until its last fault is recovered (at most 180 s more)")
    p.add_argument("--fault-every", help="inject one fault every F seconds, e.g. 30s")
    p.add_argument("--fault-kinds", help=f"comma list of: {','.join(FAULT_KINDS)} (default kill,exception,comm,hang)")
    p.add_argument("--chaos", action="store_true",
                   help="every fault kind, at --fault-every: process faults plus straggler (a paused trainer), "
                        "correlated (several replicas killed together) and lighthouse (Lighthouse killed and "
                        "restarted on its address); tune with --faults.straggler-s, --faults.correlated-size, "
                        "--faults.correlated-window-s, --faults.lighthouse-down-s")
    p.add_argument("--faults-file", help="replay a fault schedule (JSON lines) instead of random faults")
    p.add_argument("--no-faults", action="store_true", help="inject no faults")
    p.add_argument("--recovery", choices=["peer", "restart"], help="peer healing (default) or checkpoint restart")
    p.add_argument("--job", choices=["local", "slurm", "k8s", "skypilot", "workers"],
                   help="where hosts come from (workers: your own `regent worker`s, --job.addresses)")
    p.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="take over the run in RUN_DIR whose controller was lost: re-attach to its live replicas "
                        "(respawning one whose process died; from another machine too, when the run's processes "
                        "listen on a routable REGENT_LISTEN_HOST), or restore its backstop when nothing is alive, "
                        "and go on with its own config")
    p.add_argument("--takeover", action="store_true",
                   help="with --resume: the run's controller ran on another machine that is gone (a rescheduled "
                        "pod, a requeued SLURM job); go on here from the run's backstop")
    p.add_argument("--seed", type=int, help="seed for the model, data and fault schedule")
    p.add_argument("--no-ft", action="store_true", help="plain training of one replica group, no fault tolerance")
    p.add_argument("--baseline", help="a fault-free run directory to compare the loss against in the report")
    p.add_argument("--no-warm-spares", action="store_true", help="start restarted processes cold")
    p.add_argument("--controller-grace", metavar="DURATION",
                   help="how long replicas train on without this controller (killed, its host down) before "
                        "they stop, e.g. 15m (default 15m; 0: they stop with it)")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live terminal view")
    p.add_argument("--trainer", metavar="MODULE:FACTORY",
                   help="your own trainer instead of the built-in Llama 3 one (see regent.orchestrate.user_trainer)")
    p.add_argument("--trainer-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an option for --trainer's factory (repeatable; strings)")
    p.add_argument("--engine", choices=["regent", "torchtitan"],
                   help="torchtitan: TorchTitan's own Trainer in each replica (regent.orchestrate.titan_engine; "
                        "needs the titan extra and --titan.config)")
    p.add_argument("--titan.config", dest="titan_config", metavar="NAME|FLAVOR|FILE.toml",
                   help="--engine torchtitan: a TorchTitan config (llama3_debugmodel, MODULE:FUNCTION), a llama3 "
                        "flavor (debugmodel) or a TOML file naming one")
    p.add_argument("--titan.args", dest="titan_args", metavar="'--training.seq_len 256 ...'",
                   help="--engine torchtitan: TorchTitan CLI overrides (write --titan.args='--a.b 1 ...')")
    p.set_defaults(func=run_train)

    r = sub.add_parser("report", help="regenerate report.html and the figures of a run directory")
    r.add_argument("run_dir")
    r.add_argument("--baseline", help="a fault-free run directory to draw for comparison")
    r.set_defaults(func=run_report)

    c = sub.add_parser("check", help="check a run directory: exit 1 with one line per violation, 0 if it holds",
                       description="The run checker (README: Checking a run): no committed progress lost without a "
                                   "counted reset, every live replica compared at one step on its whole state, "
                                   "figures measured to the end of training.")
    c.add_argument("run_dir")
    c.set_defaults(func=run_check)


def _one_line_error(message: str) -> NoReturn:
    """argparse's errors for `regent train` as one line, like every other refused input (no usage block)."""
    print(f"regent train: error: {message}; see `regent train --help`", file=sys.stderr)
    sys.exit(2)


_DIRECT = {
    "replicas": "replicas",
    "procs_per_replica": "procs_per_replica",
    "model": "train.model",
    "steps": "steps",
    "recovery": "recovery",
    "job": "job",
    "run_dir": "run_dir",
    "seed": "seed",
    "baseline": "baseline",
    "fault_every": "faults.every",
    "fault_kinds": "faults.kinds",
    "faults_file": "faults.file",
    "trainer": "trainer",
    "controller_grace": "controller_grace",
}


def config_from_args(args: argparse.Namespace, extra: list[str], base: RunConfig | None = None) -> RunConfig:
    """Defaults (or `base`: a resumed run's recorded config), then the TOML file, then flags, then dotted
    overrides; validated."""
    cfg = copy.deepcopy(base) if base is not None else RunConfig()
    if args.config:
        data = load_toml(args.config)
        try:
            apply_toml(cfg, data)
        except ConfigError as exc:
            raise ConfigError(f"config file {args.config}: {exc}") from exc
    for attr, dotted in _DIRECT.items():
        value = getattr(args, attr, None)
        if value is not None:
            set_option(cfg, dotted, value)
    if args.duration is not None:
        cfg.duration = parse_duration(args.duration)
        cfg.steps = None
    elif args.steps is not None:
        cfg.duration = None
    if getattr(args, "chaos", False):
        if args.no_faults or args.fault_kinds is not None:
            raise ConfigError("--chaos turns on every fault kind; drop --no-faults / --fault-kinds, or --chaos")
        cfg.faults.enabled = True
        cfg.faults.kinds = list(FAULT_KINDS)
    if args.no_faults:
        cfg.faults.enabled = False
    if args.no_ft:
        cfg.no_ft = True
        cfg.faults.enabled = False
    if args.no_warm_spares:
        cfg.warm_spares = False
    if args.no_live:
        cfg.live = False
    for opt in getattr(args, "trainer_opt", None) or []:
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise ConfigError(f"--trainer-opt {opt!r}: write it as KEY=VALUE")
        cfg.trainer_options[key] = value
    _apply_engine(cfg, args)
    _apply_dotted(cfg, extra)
    if cfg.faults.file:
        cfg.faults.enabled = True
    if cfg.seed and "train.seed" not in " ".join(extra):
        cfg.train.seed = cfg.seed
    validate(cfg)
    return cfg


TITAN_TRAINER = "regent.orchestrate.titan_engine:make_trainer"


def _apply_engine(cfg: RunConfig, args: argparse.Namespace) -> None:
    """`--engine torchtitan --titan.config X`: TorchTitan's trainer as a user trainer, refused before launch
    when TorchTitan does not import here (with how to install it)."""
    engine = getattr(args, "engine", None)
    titan_config, titan_args = getattr(args, "titan_config", None), getattr(args, "titan_args", None)
    if engine != "torchtitan":
        if titan_config or titan_args:
            raise ConfigError("--titan.config/--titan.args go with --engine torchtitan")
        return
    if cfg.trainer and cfg.trainer != TITAN_TRAINER:
        raise ConfigError("--engine torchtitan runs TorchTitan's trainer; drop --trainer")
    cfg.trainer = TITAN_TRAINER
    if titan_config:
        cfg.trainer_options["titan.config"] = titan_config
    if titan_args:
        cfg.trainer_options["titan.args"] = titan_args
    if cfg.steps is not None:  # TorchTitan's schedule spans the run
        cfg.trainer_options["regent.steps"] = str(cfg.steps)
    if not cfg.trainer_options.get("titan.config"):
        raise ConfigError("--engine torchtitan needs --titan.config, e.g. --titan.config debugmodel (a llama3 "
                          "flavor) or llama3_debugmodel (a TorchTitan config)")
    from regent.orchestrate.titan_engine import TitanUnavailable, check_available

    try:
        check_available()
    except TitanUnavailable as exc:
        raise ConfigError(str(exc)) from exc


def _apply_dotted(cfg: RunConfig, extra: list[str]) -> None:
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}; see `regent train --help`")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            value = extra[i + 1]
            i += 2
        else:
            value = "true"
            i += 1
        set_option(cfg, key, value)


def run_train(args: argparse.Namespace) -> int:
    from regent.orchestrate.preflight import preflight

    if getattr(args, "resume", None):
        return resume_train(args)
    try:
        cfg = config_from_args(args, getattr(args, "_extra", []))
        preflight(cfg)  # this machine: GPUs, data and tokenizer files, the Lighthouse port or address
    except ConfigError as exc:
        print(f"regent train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.no_ft:
        from regent.train.launch import run_no_ft

        steps = cfg.steps if cfg.steps is not None else cfg.train.max_steps
        try:
            return run_no_ft(cfg.train, procs=cfg.procs_per_replica, steps=steps, run_dir=cfg.run_dir)
        except ValueError as exc:
            print(f"regent train: error: {exc}", file=sys.stderr)
            return 2
    from regent.orchestrate.run import run

    return run(cfg)


def resume_train(args: argparse.Namespace) -> int:
    """`regent train --resume RUN_DIR`: checked first (one line and nothing written when it cannot be), then
    the run goes on under this controller (orchestrate/resume.py)."""
    from regent.orchestrate.resume import RESUME_MAY_CHANGE, ResumeRefused, check_resumable, flat_config

    try:
        plan = check_resumable(args.resume, takeover=bool(getattr(args, "takeover", False)))
        given = config_from_args(args, getattr(args, "_extra", []), base=plan.cfg)
    except ResumeRefused as exc:
        print(f"regent train: {exc}", file=sys.stderr)
        return exc.code
    except ConfigError as exc:
        print(f"regent train: error: {exc}", file=sys.stderr)
        return 2
    recorded, wanted = flat_config(dataclasses.asdict(plan.cfg)), flat_config(dataclasses.asdict(given))
    clash = [k for k in sorted(set(recorded) | set(wanted))
             if k not in RESUME_MAY_CHANGE and k != "run_dir" and recorded.get(k) != wanted.get(k)]
    if clash:
        k = clash[0]
        print(f"regent train: --{k.replace('_', '-')} {wanted.get(k)!r} contradicts run {plan.run_dir} "
              f"({k}={recorded.get(k)!r}); a resumed run keeps its config: drop the flag", file=sys.stderr)
        return 2
    for key in RESUME_MAY_CHANGE:
        setattr(plan.cfg, key, getattr(given, key))
    if plan.stale_holder is not None and not _end_stale_controller(plan):
        return 2
    from regent.orchestrate.run import run

    return run(plan.cfg, resume=plan)


def _end_stale_controller(plan: Any) -> bool:
    """The run's controller on this machine holds its lock but stopped renewing its lease (SIGSTOPped, hung):
    it supervises nothing, and would fight this one if it woke. SIGKILL it (a stopped process dies too), wait
    for the kernel to drop its lock. Its replicas and Lighthouse outlive it (the controller grace)."""
    import signal
    import time

    from regent.orchestrate.resume import lease_age, lock_is_held

    pid = plan.stale_holder
    age = lease_age(plan.run_dir) or 0.0
    print(f"[regent] the run's controller (pid {pid}) has not renewed its lease for {age:.0f}s (stopped or hung): "
          "ending it and taking over", flush=True)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it ended by itself meanwhile
    except PermissionError:
        print(f"regent train: cannot end the stale controller pid {pid} (not yours); stop it, then --resume",
              file=sys.stderr)
        return False
    deadline = time.monotonic() + 30
    while lock_is_held(plan.run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    if lock_is_held(plan.run_dir):
        print(f"regent train: the stale controller pid {pid} still holds the run's lock 30 s after SIGKILL",
              file=sys.stderr)
        return False
    return True


def run_report(args: argparse.Namespace) -> int:
    from regent.orchestrate.report import write_report

    path = write_report(args.run_dir, baseline=args.baseline)
    print(f"report written to {path}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from regent.orchestrate.invariants import main

    return main([args.run_dir])


def parse_train_argv(argv: list[str]) -> Any:
    """Used by tests and scripts: build a validated RunConfig from `regent train` arguments."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_parser(sub)
    args, extra = parser.parse_known_args(["train", *argv])
    return config_from_args(args, extra)
