"""Run configuration: dataclasses, loadable from TOML and overridable from the command line.

Every section is a plain dataclass. A TOML file maps tables to sections (`[ft] sync_every = 20`), and the
command line overrides any field with a dotted flag (`--ft.sync-every 20`, `--train.lr 1e-3`). A bad value
fails here, before anything is launched, with a message that names the fix.
"""

from __future__ import annotations

import difflib
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from regent import settings
from regent.config_values import ConfigError, check_fields, coerce, field_types, parse_duration
from regent.ft.config import FTConfig
from regent.train.config import TrainConfig

__all__ = ["ConfigError", "FaultConfig", "LighthouseConfig", "RunConfig", "parse_duration", "set_option",
           "apply_toml", "load_toml", "validate", "known_options", "FAULT_KINDS", "DEFAULT_FAULT_KINDS"]

# Single-replica kinds hit one trainer (`node`: every process of one replica); `straggler` pauses one trainer for
# `straggler_s`; `correlated` kills several whole replicas within a short window (a rack); `lighthouse` kills
# the Lighthouse and starts it again on the same address; `bitflip` flips one bit of one replica's parameters or
# optimizer state in place (silent corruption, found by the state vote); `supervisor` kills one replica's own process
# (its ReplicaActor, the supervisor of its trainers). `regent train --chaos` turns every kind on.
FaultKind = Literal["exception", "segfault", "kill", "exit", "comm", "hang", "node", "straggler", "correlated",
                    "lighthouse", "bitflip", "supervisor"]
FAULT_KINDS: tuple[str, ...] = typing.get_args(FaultKind)
DEFAULT_FAULT_KINDS = ("kill", "exception", "comm", "hang")


@dataclass
class FaultConfig:
    """When and how faults are injected (the demo's chaos monkey)."""

    enabled: bool = True
    every: float = 30.0  # seconds between injections
    kinds: list[FaultKind] = field(default_factory=lambda: list(DEFAULT_FAULT_KINDS))
    warmup: float = 25.0  # seconds before the first injection
    holdoff: float = 20.0  # seconds a replica is left alone after its restart
    file: str | None = None  # replay this schedule (JSON lines: {"at": s, "replica": r, "kind": k, "rank": i};
    # {"at": s, "kind": "lighthouse"}; {"at": s, "kind": "correlated", "replicas": [..], "offsets": [..]})
    # Hang detection (orchestrate/hang.py): one ping in flight per replica, the next `ping_every_s` after an
    # answer. The time a ping may stay unanswered adapts to the replica's own answers:
    #   clamp(max(hang_latency_k x p99 ping latency, hang_step_k x median step time) + hang_margin_s,
    #         hang_floor_s, hang_timeout)
    # Until a generation has answered ready it gets the start-up allowance max(90 s, 4 x hang_timeout), and
    # hang_timeout until it has taken a step (quorum, heal, first step).
    hang_timeout: float = 15.0  # the ceiling: never wait longer than this for a trainer that stopped answering
    hang_floor_s: float = 4.0  # the least (capped at hang_timeout); keep it above straggler_s
    hang_latency_k: float = 3.0  # x the recent p99 ping latency
    hang_step_k: float = 0.5  # x the recent median step time (a slow machine answers late mid-step)
    hang_margin_s: float = 1.0  # added to the estimate, for scheduling noise
    ping_every_s: float = 0.5  # gap between one answer and the next ping
    # Chaos kinds. A straggler shorter than the hang deadline is tolerated; a longer one is declared hung.
    straggler_s: float = 3.0  # `straggler`: how long one trainer is paused (SIGSTOP, then SIGCONT)
    correlated_size: str = "2"  # `correlated`: how many replicas are killed together ("all": every eligible one)
    correlated_window_s: float = 2.0  # `correlated`: every kill lands within this many seconds of the first
    lighthouse_down_s: float = 3.0  # `lighthouse`: seconds between the kill and the new Lighthouse


@dataclass
class LighthouseConfig:
    address: str | None = None  # use an external Lighthouse instead of starting one
    bind: str = "127.0.0.1:0"
    min_replicas: int = 1
    # How long a quorum waits for replicas that heartbeat but have not asked to join yet (TorchFT's default).
    # It must exceed a DiLoCo local phase (sync_every steps): that wait is what brings a replica that drifted
    # out of phase back into the same sync round as the others. Dead replicas are not waited for (their
    # heartbeats stop), so a long value costs nothing when a replica fails.
    join_timeout_ms: int = 60000
    quorum_tick_ms: int = 50
    heartbeat_timeout_ms: int = 5000
    # Regent's: how long a fast quorum waits for a replica that holds the committed step but was not in the last
    # quorum (one just healed mid-round, on its way to the sync: `regent.ft.quorum.holders_on_their_way`). Without
    # it, such a replica arriving a moment late sits out a whole round. 0: TorchFT's rule exactly.
    holder_grace_ms: int = 2000
    # Regent's: once a strict majority of the last quorum has joined a sync, how long its other members are waited
    # for before the quorum goes on without them (`regent.ft.quorum.late_members`). A DiLoCo replica left out
    # finds the committed step past its own at its next sync and pulls it from a holder, then trains the rest of
    # the round in progress. 0 (off): a paused or hung replica holds up every sync until it is back or declared
    # dead. With an external Lighthouse (`address`), set it to that Lighthouse's --late-member-ms.
    late_member_ms: int = 0


@dataclass
class RunConfig:
    """The whole run. Defaults give the embedded demo: 4 replicas x 2 CPU procs, about 3 minutes."""

    replicas: int = 4
    procs_per_replica: int = 2
    steps: int | None = None
    duration: float | None = 180.0
    recovery: Literal["peer", "restart"] = "peer"
    job: Literal["local", "slurm", "k8s", "skypilot", "workers"] = "local"
    run_dir: str = ""
    seed: int = 0
    no_ft: bool = False
    baseline: str | None = None
    warm_spares: bool = True
    # A standby ReplicaActor with warm trainer processes (local job, --recovery peer, warm spares on): a replica
    # whose own process (its ReplicaActor) dies is replaced by it instead of by a cold one. Costs one idle
    # process and procs_per_replica warm ones (torch imported) on the controller's host.
    standby_replica: bool = True
    # K: consecutive starts that fail before making progress, then a fresh allocation from the job layer (the host
    # may be bad); 0 asks for one at every restart. A replica that recovers fine stays on its host.
    in_place_restarts: int = 3
    # A replica gives up only in a crash loop: this many consecutive starts that fail before committing a
    # step or healing (there is no lifetime cap on restarts; see orchestrate/policy.py).
    crash_loop_starts: int = 5
    restart_backoff_s: float = 1.0  # first backoff between failed starts; doubles, at most 60 s
    # Once a trainer is built and holds the committed state, its training thread runs this much nicer (Linux
    # nice, 0-19; 0 = off). Where processes outnumber cores, a restarting trainer then builds and heals ahead
    # of the survivors' steady-state steps (the vulnerability window), and the control plane (heartbeats, pings,
    # state serving threads) ahead of both. Where each trainer has its own cores it changes nothing.
    training_nice: int = 5
    checkpoint_every: int = 20  # steps between checkpoints for --recovery restart
    # How long the replicas and the Lighthouse train on without a controller (`regent train` killed, its host
    # rebooting) before they stop, their allocations released. Meanwhile a replica that fails stays down and
    # the others go on; everything they report is journaled in RUN_DIR/journal/. 0: they stop with it at once.
    controller_grace: float = 900.0
    live: bool | None = None  # rich live view; None = when stdout is a terminal
    job_options: dict[str, Any] = field(default_factory=dict)  # passed to the job backend (TOML [job_options])
    # Your own trainer instead of the built-in Llama 3 one: "module.path:factory" (regent.orchestrate.user_trainer),
    # with options handed to the factory (--trainer-opt KEY=VALUE, or the TOML [trainer_options] table).
    trainer: str = ""
    trainer_options: dict[str, Any] = field(default_factory=dict)
    wandb_project: str = ""  # mirror the metrics to this Weights & Biases project (needs the wandb extra)
    train: TrainConfig | None = None  # None: the embedded demo's (set in __post_init__)
    ft: FTConfig | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)
    lighthouse: LighthouseConfig = field(default_factory=LighthouseConfig)

    def __post_init__(self) -> None:
        if self.train is None:
            # the embedded demo: small enough that 8 trainer processes make progress on a laptop CPU
            self.train = TrainConfig(seq_len=64, batch_size=4, data_max_bytes=4_000_000)
        if self.ft is None:
            # A DiLoCo quorum waits for the slowest replica's whole local phase; a restarted replica waits
            # in it for the next sync boundary. Give it minutes, not seconds.
            self.ft = FTConfig(quorum_timeout_s=600.0, timeout_s=20.0)
        if not self.run_dir:
            self.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


SECTIONS = ("train", "ft", "faults", "lighthouse")


def _option_name(dotted: str, toml: bool) -> str:
    """How the user wrote (or should write) an option: `--ft.sync-every` on the command line, `[ft] sync_every`
    in a TOML file."""
    if toml:
        section, _, key = dotted.rpartition(".")
        return f"[{section}] {key}" if section else key
    return "--" + dotted.replace("_", "-")


def known_options(cfg: RunConfig) -> list[str]:
    """Every settable option as `key` or `section.key` (underscored), for suggestions."""
    names = [k for k in field_types(cfg) if k not in (*SECTIONS, *_TABLES)]
    for section in SECTIONS:
        names += [f"{section}.{k}" for k in field_types(getattr(cfg, section))]
    return names


def _closest(key: str, cfg: RunConfig) -> str | None:
    """The known option nearest to an unknown one (a typo, or the right key in another section)."""
    known = known_options(cfg)
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if match:
        return match[0]
    leaf = key.rpartition(".")[2]  # `--sync-every 5` or `--train.sync-every 5`: the key of another section
    leaves = {name.rpartition(".")[2]: name for name in reversed(known)}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8)
    return leaves[match[0]] if match else None


def _unknown(cfg: RunConfig, key: str, toml: bool, what: str) -> ConfigError:
    guess = _closest(key, cfg)
    name = _option_name(key, toml)
    if guess is not None:
        return ConfigError(f"unknown {what} {name}; did you mean {_option_name(guess, toml)}?")
    section = key.split(".", 1)[0] if "." in key else ""
    if section in SECTIONS:
        keys = ", ".join(sorted(field_types(getattr(cfg, section))))
        return ConfigError(f"unknown {what} {name}; the keys of [{section}] are {keys}")
    return ConfigError(f"unknown {what} {name}; sections are {', '.join(SECTIONS)} (see `regent train --help`)")


_TABLES = ("job_options", "trainer_options")


def set_option(cfg: RunConfig, dotted: str, value: Any, *, toml: bool = False) -> None:
    """Set `section.key` (or a top-level key) from a string or TOML value, with type checking. An unknown key
    is refused naming the closest known one; `toml` words the messages for a --config file."""
    key = dotted.replace("-", "_")
    target: Any = cfg
    if key.startswith("job."):  # --job.partition gpu: a job backend option (checked in validate)
        cfg.job_options[key[4:]] = value
        return
    what = "key" if toml else "option"
    if "." in key:
        section, field_name = key.split(".", 1)
        if section not in SECTIONS:
            raise _unknown(cfg, key, toml, f"config section {section!r} in" if not toml else "key")
        target = getattr(cfg, section)
    else:
        field_name = key
        if key in SECTIONS:
            raise ConfigError(f"{_option_name(key, toml)} is a section, not an option; set its keys, e.g. "
                              f"{_option_name(key + '.' + next(iter(field_types(getattr(cfg, key)))), toml)}")
        if key in _TABLES:
            raise ConfigError(f"{_option_name(key, toml)} is a table; use --job.KEY VALUE / --trainer-opt KEY=VALUE "
                              f"or a [{key}] table in --config")
    types = field_types(target)
    if field_name not in types:
        raise _unknown(cfg, key, toml, what)
    setattr(target, field_name, coerce(value, types[field_name], _option_name(key, toml)))


def load_toml(path: str) -> dict[str, Any]:
    """Read a --config file; any problem with it is one ConfigError line that names the file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - python 3.10: `tomli` is a dependency there (pyproject.toml)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} not found; pass an existing file to --config") from exc
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def apply_toml(cfg: RunConfig, data: dict[str, Any]) -> None:
    for key, value in data.items():
        if key in ("job_options", "trainer_options"):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a TOML table, e.g. [{key}] name = \"value\"")
            getattr(cfg, key).update(value)
        elif isinstance(value, dict):
            if key not in SECTIONS:
                guess = difflib.get_close_matches(key, [*SECTIONS, *_TABLES], n=1, cutoff=0.5)
                hint = f"did you mean [{guess[0]}]?" if guess else f"tables are {', '.join((*SECTIONS, *_TABLES))}"
                raise ConfigError(f"unknown table [{key}]; {hint}")
            for sub, v in value.items():
                set_option(cfg, f"{key}.{sub}", v, toml=True)
        else:
            set_option(cfg, key, value, toml=True)


def constant_batch_choice(cfg: RunConfig) -> tuple[bool, str]:
    """Whether the run trains with a constant global batch (`ft.constant_batch`), and why: the value given, or,
    when none was (None), the default for this mode and data path. Pure, so the controller's launch line and
    every trainer decide the same."""
    given = getattr(cfg.ft, "constant_batch", None)
    if given is not None:
        return bool(given), "set by --ft.constant-batch"
    if getattr(cfg, "no_ft", False):
        return False, "no fault tolerance (--no-ft): one replica group, nothing to cover"
    if getattr(cfg, "trainer", ""):
        return False, f"the user trainer {cfg.trainer} reads its own batches"
    from regent.train.data import data_kind

    if data_kind(cfg.train.data) == "hf":
        return False, "a streamed hf: dataset cannot read another replica's shard"
    if cfg.ft.mode == "diloco":
        return False, ("DiLoCo's default: a restarted replica trains in the round in progress instead of sitting it "
                       "out; its missed samples are recorded as skipped (--ft.constant-batch covers them)")
    return True, "per-step mode's default: survivors take a missing replica's micro-batches"


def validate(cfg: RunConfig) -> None:
    """Refuse a bad configuration before anything starts."""
    check_fields(cfg, lambda name: _option_name(name, toml=False))  # types, Literal values included
    for section in SECTIONS:
        check_fields(getattr(cfg, section), lambda name, s=section: _option_name(f"{s}.{name}", toml=False))
    if cfg.replicas < 1:
        raise ConfigError("--replicas must be at least 1")
    if cfg.procs_per_replica < 1:
        raise ConfigError("--procs-per-replica must be at least 1")
    if cfg.steps is not None and cfg.steps < 1:
        raise ConfigError("--steps must be a positive number of steps")
    if cfg.steps is None and cfg.duration is not None and cfg.duration <= 0:
        raise ConfigError(f"--duration must be positive, not {cfg.duration:g}s; write it like 180s, 3m or 1h30m")
    if cfg.steps is None and cfg.duration is None:
        raise ConfigError("give either --steps N or --duration like 180s")
    _validate_lighthouse(cfg)
    if cfg.controller_grace < 0:
        raise ConfigError(f"--controller-grace must be 0 or more, not {cfg.controller_grace:g}s; write it like 15m")
    if cfg.job == "workers":
        _validate_workers_job(cfg)
    if cfg.job_options:
        from regent.orchestrate.allocation import check_job_options

        try:
            check_job_options(cfg.job, cfg.procs_per_replica, cfg.job_options)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    if cfg.faults.enabled and not cfg.faults.kinds and not cfg.faults.file:
        raise ConfigError("--fault-kinds is empty; give at least one kind or pass --no-faults")
    if cfg.faults.every <= 0:
        raise ConfigError("--fault-every must be positive (for example 30s); use --no-faults to disable")
    if cfg.faults.file and not Path(cfg.faults.file).is_file():
        raise ConfigError(f"--faults-file {cfg.faults.file} does not exist")
    _validate_fault_knobs(cfg)
    if cfg.in_place_restarts < 0 or cfg.crash_loop_starts < 1:
        raise ConfigError("--in-place-restarts must be at least 0 (0: a fresh allocation at every restart) and "
                          "--crash-loop-starts at least 1")
    if cfg.restart_backoff_s < 0:
        raise ConfigError("--restart-backoff-s must be zero or positive")
    if not 0 <= cfg.training_nice <= 19:
        raise ConfigError(f"--training-nice {cfg.training_nice}: use 0 (off) to 19, a Linux nice increment")
    if cfg.baseline and not (Path(cfg.baseline) / "metrics.jsonl").is_file():
        raise ConfigError(f"--baseline {cfg.baseline} has no metrics.jsonl; point it at a finished run directory")
    if cfg.ft.mode == "diloco" and cfg.ft.sync_every < 1:
        raise ConfigError("--ft.sync-every must be at least 1")
    if cfg.ft.constant_batch:
        from regent.train.data import data_kind

        if cfg.trainer:
            raise ConfigError("--ft.constant-batch needs the built-in trainer's data path; a user trainer "
                              f"({cfg.trainer}) reads its own batches: drop --ft.constant-batch")
        if data_kind(cfg.train.data) == "hf":
            raise ConfigError("--ft.constant-batch cannot read another replica's shard of a streamed hf: dataset; "
                              "prepare shards (regent data prepare) or drop --ft.constant-batch")
    if cfg.no_ft and cfg.replicas != 1:
        raise ConfigError("--no-ft trains a single replica group; pass --replicas 1 (or drop --no-ft)")
    from regent.orchestrate.sinks import MissingSinkPackage, check_available
    from regent.train.models.llama3 import MODEL_CONFIGS  # late: keeps `regent --help` light

    try:
        check_available(cfg.train.tensorboard, cfg.wandb_project)
    except MissingSinkPackage as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.trainer:
        if cfg.no_ft:
            raise ConfigError("--trainer runs under the orchestrator; drop --no-ft")
        from regent.orchestrate.user_trainer import load_factory

        try:
            load_factory(cfg.trainer)  # fail here, before anything launches, if it cannot be found
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    elif cfg.train.spec != "llama3":
        from regent.train.spec import get_spec

        try:
            flavors = get_spec(cfg.train.spec).flavors
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if cfg.train.model not in flavors:
            raise ConfigError(f"--model {cfg.train.model!r} is not a flavor of --train.spec {cfg.train.spec}; "
                              f"choose from {', '.join(flavors)}")
    elif cfg.train.model not in MODEL_CONFIGS:
        raise ConfigError(f"--model {cfg.train.model!r} is unknown; choose from {', '.join(MODEL_CONFIGS)}")
    for section in (cfg.train, cfg.ft):
        try:
            section.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def _validate_lighthouse(cfg: RunConfig) -> None:
    """Sizes and timings the quorum needs: a quorum of `min_replicas` must be possible with `--replicas`."""
    lc = cfg.lighthouse
    if lc.min_replicas < 1:
        raise ConfigError(f"--lighthouse.min-replicas must be at least 1, not {lc.min_replicas}")
    if not lc.address and cfg.replicas < lc.min_replicas:
        raise ConfigError(f"--replicas {cfg.replicas} is below --lighthouse.min-replicas {lc.min_replicas}: no "
                          f"quorum could ever form; pass --replicas {lc.min_replicas} or more, or lower "
                          "--lighthouse.min-replicas")
    min_size = cfg.ft.min_replica_size
    if not cfg.no_ft and cfg.replicas < min_size:
        raise ConfigError(f"--replicas {cfg.replicas} is below --ft.min-replica-size {min_size}: no step could "
                          f"ever commit; pass --replicas {min_size} or more, or lower --ft.min-replica-size")
    for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
        if getattr(lc, name) <= 0:
            raise ConfigError(f"--lighthouse.{name.replace('_', '-')} must be a positive number of milliseconds, "
                              f"not {getattr(lc, name)}")
    for name in ("holder_grace_ms", "late_member_ms"):
        if getattr(lc, name) < 0:
            raise ConfigError(f"--lighthouse.{name.replace('_', '-')} must be zero (off) or a positive number of "
                              f"milliseconds, not {getattr(lc, name)}")
    if cfg.faults.warmup < 0 or cfg.faults.holdoff < 0:
        raise ConfigError("--faults.warmup and --faults.holdoff must be zero or positive (for example 20s)")


def _validate_fault_knobs(cfg: RunConfig) -> None:
    """The hang rule's and the chaos kinds' knobs: refuse values that would make them meaningless."""
    f = cfg.faults
    if f.hang_timeout <= 0 or f.hang_floor_s <= 0 or f.ping_every_s <= 0:
        raise ConfigError("--faults.hang-timeout, --faults.hang-floor-s and --faults.ping-every-s must be positive")
    if min(f.hang_latency_k, f.hang_step_k, f.hang_margin_s) < 0:
        raise ConfigError("--faults.hang-latency-k, --faults.hang-step-k and --faults.hang-margin-s must be >= 0")
    if f.straggler_s <= 0 or f.correlated_window_s < 0 or f.lighthouse_down_s < 0:
        raise ConfigError("--faults.straggler-s must be positive; --faults.correlated-window-s and "
                          "--faults.lighthouse-down-s zero or positive")
    size = str(f.correlated_size).strip().lower()
    if size != "all" and not (size.isdigit() and int(size) >= 2):
        raise ConfigError(f"--faults.correlated-size must be a number of replicas (2 or more) or all, "
                          f"not {f.correlated_size!r}")
    if f.enabled and "bitflip" in f.kinds and not f.file and cfg.ft is not None and not cfg.no_ft \
            and cfg.ft.vote_interval() == 0:
        raise ConfigError("the bitflip fault is found only by state votes, which --ft.vote-every 0 turns off; "
                          "drop bitflip from --fault-kinds or vote (--ft.vote-every 10)")
    if cfg.lighthouse.address and f.enabled and "lighthouse" in f.kinds and not f.file:
        raise ConfigError("the lighthouse fault kills the Lighthouse this run started; with --lighthouse.address "
                          "(an external one) drop it from --fault-kinds")


def _validate_workers_job(cfg: RunConfig) -> None:
    """`--job workers`: the addresses must be given and well formed, and the controller must share the workers'
    secret (a fresh random one would only fail later, at the first attach, with a less obvious message)."""
    from regent.jobs.workers import parse_worker_addresses

    try:
        parse_worker_addresses(cfg.job_options.get("addresses", ()))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not (settings.REGENT_JOB_SECRET_FILE.is_set() or settings.REGENT_JOB_SECRET.is_set()):
        raise ConfigError("--job workers: set REGENT_JOB_SECRET_FILE to the secret file given to each `regent worker "
                          "--secret-file` (the controller must prove the same secret)")
