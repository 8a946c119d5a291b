"""Checks against this machine before `regent train` launches anything: GPUs, files, ports, the Lighthouse.

`config.validate` checks the configuration against itself (pure). `preflight` checks it against the world:
each problem is one `ConfigError` whose message names the problem and the fix, raised before any process,
allocation or Lighthouse is started.

- more processes per replica than GPUs this host makes visible (local job on a GPU platform; a CPU run
  has no GPU limit), or replicas that would share a GPU over NCCL (which refuses two ranks on one device);
- a `--train.data` glob that matches no file; a shard directory that is missing, half-written, corrupt, of
  another tokenizer or smaller than one global batch; `hf:` without `datasets`; a `--train.tokenizer` that is
  missing or unreadable
  (local job: on a cluster the trainers read them on their own nodes);
- a `--lighthouse.bind` port (or the dashboard's, port + 1) already taken on this host;
- an external `--lighthouse.address` that does not accept a connection within `connect_timeout_s`, does not
  answer gRPC, or refuses this run's proof of the job secret.

Each check is a plain function with injectable inputs, so tests can call them directly with real sockets.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path
from typing import Any

from regent.orchestrate.config import ConfigError, RunConfig

LIGHTHOUSE_CONNECT_TIMEOUT_S = 3.0


def preflight(cfg: RunConfig, *, connect_timeout_s: float = LIGHTHOUSE_CONNECT_TIMEOUT_S) -> None:
    """Raise `ConfigError` for the first thing on this machine that would make the run fail after launch."""
    if cfg.job == "local":
        check_gpus(cfg.procs_per_replica)
        if not cfg.no_ft:
            check_shared_gpus(cfg.replicas, cfg.procs_per_replica, cfg.ft.backend)
        if not cfg.trainer:
            check_data(cfg)
    if cfg.no_ft:
        return
    if cfg.baseline:
        check_baseline(cfg)
    lc = cfg.lighthouse
    if lc.address:
        check_lighthouse_reachable(lc.address, connect_timeout_s, rpc_env=cfg.ft.rpc_env())
    else:
        check_bind_free(lc.bind)


# What a baseline run must share with the run it is the fault-free pace of (config.json keys, dotted).
BASELINE_KEYS = ("replicas", "procs_per_replica", "train.model", "ft.mode", "train.batch_size", "train.seq_len",
                 "ft.sync_every")


def baseline_mismatches(run: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """The BASELINE_KEYS on which two config.json dicts differ, as "key: run vs baseline"."""
    def get(d: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d

    return [f"{k}: {get(run, k)!r} here, {get(base, k)!r} in the baseline" for k in BASELINE_KEYS
            if get(run, k) != get(base, k)]


def check_baseline(cfg: RunConfig) -> None:
    """A goodput against a baseline means something only when the baseline trained the same thing the same way."""
    import dataclasses
    import json

    path = os.path.join(cfg.baseline, "config.json")
    try:
        with open(path) as f:
            base = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--baseline {cfg.baseline}: cannot read its config.json ({exc}); pass the run directory "
                          "of a finished fault-free run") from exc
    diff = baseline_mismatches(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), base)
    if diff:
        raise ConfigError(f"--baseline {cfg.baseline} is not a run of this config ({'; '.join(diff)}); its pace "
                          "would make goodput meaningless")


def visible_gpus(environ: dict[str, str] | None = None) -> tuple[int, str]:
    """How many GPUs this process may use, and how that was learned (for the message)."""
    env = os.environ if environ is None else environ
    for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = env.get(name)
        if value is not None and value.strip() != "":
            return len([v for v in value.split(",") if v.strip()]), f"{name}={value}"
    import torch

    return torch.cuda.device_count(), "torch.cuda.device_count()"


def check_gpus(procs_per_replica: int) -> None:
    """One GPU per trainer process on a GPU platform (regent.platform decides; `GPU_PLATFORM=cpu` lifts it)."""
    from regent import platform

    try:
        plat = platform.detect_platform()
    except ValueError as exc:  # a bad GPU_PLATFORM value
        raise ConfigError(str(exc)) from exc
    if plat == "cpu":
        return
    count, source = visible_gpus()
    if count == 0:
        raise ConfigError(f"the platform is {plat} but no GPU is visible ({source}); check the device visibility "
                          f"variables or run on CPU with {platform.PLATFORM_ENV}=cpu")
    if procs_per_replica > count:
        raise ConfigError(f"--procs-per-replica {procs_per_replica} needs {procs_per_replica} GPUs per replica but "
                          f"this host has {count} visible ({source}); pass --procs-per-replica {count} or fewer, "
                          f"or run on CPU with {platform.PLATFORM_ENV}=cpu")


def cross_replica_gpu_clash(replicas: int, procs_per_replica: int, gpus: int) -> tuple[int, int, int] | None:
    """(group rank, replica a, replica b) of two members of one cross-replica group that land on the same GPU
    when replica i's rank g gets GPU (i * G + g) mod gpus (`replica.replica_gpu_env`), or None."""
    if gpus <= 0:
        return None
    for g in range(procs_per_replica):
        seen: dict[int, int] = {}
        for i in range(replicas):
            gpu = (i * procs_per_replica + g) % gpus
            if gpu in seen:
                return g, seen[gpu], i
            seen[gpu] = i
    return None


def check_shared_gpus(replicas: int, procs_per_replica: int, backend: str | None) -> None:
    """NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"); every quorum would fail after
    launch. Replicas may share GPUs over Gloo (`--ft.backend gloo`), which stages through host memory."""
    from regent import platform

    plat = platform.detect_platform()
    if plat == "cpu" or (backend or platform.backend()) not in ("nccl", "rccl"):
        return
    count, source = visible_gpus()
    clash = cross_replica_gpu_clash(replicas, procs_per_replica, count)
    if clash is None:
        return
    g, a, b = clash
    need = replicas * procs_per_replica
    raise ConfigError(f"--replicas {replicas} x --procs-per-replica {procs_per_replica} needs {need} GPUs for NCCL "
                      f"but this host has {count} visible ({source}): rank {g} of replicas {a} and {b} would share "
                      f"a GPU, and NCCL refuses two ranks of one group on one device. Pass --ft.backend gloo "
                      f"(replicas share GPUs; the cross-replica average goes through host memory), fewer replicas, "
                      f"or a host with {need} GPUs")


def check_data(cfg: RunConfig) -> None:
    """The data (a text glob, a shard directory or hf:NAME) and the tokenizer file the built-in trainer will read:
    missing files, a half-written or corrupt shard directory, shards of another tokenizer, too little data."""
    train = cfg.train
    tokenizer = None
    if train.tokenizer is not None:
        path = Path(train.tokenizer).expanduser()
        if not path.is_file():
            raise ConfigError(f"--train.tokenizer {train.tokenizer} does not exist; pass a tokenizer.json file, or "
                              "leave it unset for the byte-level tokenizer")
        from regent.train.data import HFTokenizer

        try:
            tokenizer = HFTokenizer(str(path))
        except ValueError as exc:  # the `tokenizers` package is missing
            raise ConfigError(str(exc)) from exc
        except Exception as exc:  # the tokenizers library raises a bare Exception for a bad file
            raise ConfigError(f"--train.tokenizer {train.tokenizer} cannot be loaded ({exc}); pass a Hugging Face "
                              "tokenizer.json file") from exc
    if train.data is not None and _spec_reads_data(train.spec):
        from regent.train.data import ByteTokenizer
        from regent.train.data import check_data as check_train_data

        shards = cfg.procs_per_replica * (1 if cfg.no_ft else cfg.replicas)
        try:
            check_train_data(train.data, tokenizer or ByteTokenizer(), seq_len=train.seq_len,
                             batch_size=train.batch_size, num_shards=shards)
        except ValueError as exc:
            raise ConfigError(f"--train.data: {exc}") from exc


def _spec_reads_data(spec: str) -> bool:
    """Whether the model spec reads `--train.data` through the built-in loader (a spec with its own
    dataloader may give the option another meaning)."""
    if spec == "llama3":
        return True
    from regent.train.spec import get_spec

    return get_spec(spec).build_dataloader is None


def split_hostport(text: str, what: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or 'http://host:port/' -> (host, port)."""
    addr = text.strip()
    for prefix in ("http://", "https://", "grpc://"):
        addr = addr.removeprefix(prefix)
    addr = addr.rstrip("/")
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT; write it like 127.0.0.1:29510")
    return host, int(port)


def check_bind_free(bind: str) -> None:
    """The Lighthouse's gRPC port and its dashboard (port + 1) must be free on this host (port 0: any)."""
    host, port = split_hostport(bind, "--lighthouse.bind")
    if port == 0:
        return
    for p, role in ((port, "the Lighthouse's gRPC port"), (port + 1, "the dashboard's port (gRPC port + 1)")):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the Lighthouse binds
            try:
                sock.bind((host, p))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"--lighthouse.bind {bind}: {host} is not an address of this machine; bind to "
                                      f"one of its own (127.0.0.1, or 0.0.0.0 for all)") from exc
                why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise ConfigError(f"--lighthouse.bind {bind}: port {p}, {role}, {why}; pick another port "
                                  f"(--lighthouse.bind {host or '0.0.0.0'}:0 picks a free one) or stop what holds "
                                  "it") from exc


def check_lighthouse_reachable(address: str, timeout_s: float = LIGHTHOUSE_CONNECT_TIMEOUT_S,
                               rpc_env: dict[str, str] | None = None) -> None:
    """An external Lighthouse must accept a TCP connection (refused ones are retried until `timeout_s`) and
    answer a gRPC call as a gRPC server does (an unknown method: UNIMPLEMENTED). Something else on that port
    (an HTTP server, a proxy) is refused too. The probe is made the way the run's trainers will call: over TLS
    for an https:// address or with `--ft.tls-*`, and signed with the job secret this process has
    ($REGENT_JOB_SECRET / _FILE) unless `--ft.rpc-auth false`; a Lighthouse that refuses the proof is
    refused here, before launch, instead of failing every quorum after it. `rpc_env`: the run's
    `cfg.ft.rpc_env()` (None: this process's environment as it is)."""
    host, port = split_hostport(address, "--lighthouse.address")
    unreachable = (f"Lighthouse at {address} unreachable after {timeout_s:g} s ({{why}}); is it running there? "
                   "start it with `regent lighthouse`, fix --lighthouse.address, or drop --lighthouse.address to "
                   "let this run start its own")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host or "127.0.0.1", port), timeout=max(left, 0.1)):
                break
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError) and left > 0.2:
                time.sleep(0.2)
                continue
            why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
            raise ConfigError(unreachable.format(why=why)) from exc
    security = _probe_security(rpc_env)
    target = f"{host or '127.0.0.1'}:{port}" if ":" not in host else f"[{host}]:{port}"
    outcome = _grpc_probe(target, max(deadline - time.monotonic(), 1.0), security,
                          tls=address.strip().startswith("https://"))
    if outcome is None:
        return
    kind, why = outcome
    if kind == "refused":
        if security.secret:
            fix = ("this run's job secret is not the Lighthouse's: give both the same file (`regent lighthouse "
                   "--secret-file F` and REGENT_JOB_SECRET_FILE=F for `regent train`)")
        else:
            fix = ("the Lighthouse requires the job secret and this run has none yet: set REGENT_JOB_SECRET_FILE "
                   "to the file given to `regent lighthouse --secret-file`")
        raise ConfigError(f"Lighthouse at {address} refused this run's calls ({why}); {fix}")
    raise ConfigError(unreachable.format(why=why))


def _probe_security(rpc_env: dict[str, str] | None) -> Any:
    """The client side of `rpc_security` as the run's trainers will have it (the run's --ft.* settings laid
    over this process's environment)."""
    from regent.ft import rpc_security

    saved = {k: os.environ.get(k) for k in rpc_env or {}}
    try:
        os.environ.update(rpc_env or {})
        return rpc_security.Security.resolve()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _grpc_probe(target: str, timeout_s: float, security: Any = None,
                tls: bool = False) -> tuple[str, str] | None:
    """None when a gRPC server answers at `target` and takes our proof; else ("refused", why) when it refuses
    the proof, or ("unreachable", why). The probe calls a method no Lighthouse has, so it changes nothing
    there (a heartbeat would make the Lighthouse wait for a replica); the secret's check runs before the
    method lookup, so a wrong proof is refused as UNAUTHENTICATED and a right one ends in UNIMPLEMENTED."""
    import grpc

    from regent.ft import rpc_security

    security = security if security is not None else rpc_security.Security()
    with security.channel(target, force_tls=tls) as channel:
        call = channel.unary_unary("/torchft.LighthouseService/RegentPreflight")
        try:
            call(b"", timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            code, details = exc.code(), str(exc.details() or "")
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return "refused", f"{code.name}: {details}"
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                if tls or security.tls.enabled:
                    return "unreachable", (f"the port accepts connections but no TLS gRPC answered: "
                                           f"{details or code.name}; check --ft.tls-* and the address's scheme")
                return "unreachable", f"the port accepts connections but nothing answered gRPC: {details or code.name}"
            if details.startswith("Received http2 header with status"):  # HTTP without gRPC: not a Lighthouse
                return "unreachable", f"the port answers HTTP, not the Lighthouse's gRPC ({details})"
    return None
