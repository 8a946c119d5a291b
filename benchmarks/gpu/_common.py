"""Plumbing shared by the GPU benchmarks: where results go, what machine this is, and one process per GPU.

Every benchmark here is one script that re-invokes itself once per rank (`--worker-rank i`), so a run needs
no launcher. Each worker sees exactly one accelerator through `regent.platform.child_visibility_env` (CUDA or
ROCm), the same pinning the actor runtime uses. Ranks meet through an explicit `tcp://` rendezvous, never
through MASTER_ADDR/MASTER_PORT/RANK: the fault-tolerance Manager reads those variables for its own
group-local store, and a benchmark must not hand it the default group's port.

Results are JSON lines appended to `<out>/results.jsonl`; `<out>` is `--out`, else `$OUT` (the device tool's
result folder), else `runs/gpu-bench`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform as host_platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from regent import platform
from regent.train.launch import stop_processes

# NVLink multicast (NVLS) can take a shared host's GPUs out of service; these must stay off everywhere,
# including in children that are started with their own environment.
SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in SAFE_NCCL_ENV.items():
    os.environ[_name] = _value

log = logging.getLogger("regent.bench")


def default_out() -> str:
    return os.environ.get("OUT") or "runs/gpu-bench"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=default_out(), help="result folder (default $OUT or runs/gpu-bench)")
    parser.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_logging(tag: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[{tag}] %(asctime)s %(name)s %(levelname)s: %(message)s")


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (imports torch; call it in a worker)."""
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": host_platform.node(),
        "python": host_platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.detect_platform(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    if platform.device_type() == "cuda":
        info["device"] = torch.cuda.get_device_name()
        info["visible_devices"] = torch.cuda.device_count()
        info["peak_bf16_flops"] = platform.peak_bf16_flops()
        nccl = getattr(torch.cuda, "nccl", None)
        if nccl is not None:
            try:
                info["nccl"] = ".".join(str(v) for v in nccl.version())
            except Exception:  # noqa: BLE001 - version() needs the NCCL library, absent on some builds: the field is left out
                pass
    return info


def append_result(out: str, record: dict[str, Any]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    record = {"time": time.time(), **record}
    with open(Path(out) / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print("RESULT " + json.dumps(record), flush=True)


def worker_env(rank: int) -> dict[str, str]:
    """The environment of worker `rank`: one pinned accelerator, NVLS off, one OpenMP thread on CPU."""
    env = dict(os.environ)
    env.update(SAFE_NCCL_ENV)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if platform.torch_build_platform() == "cpu" or env.get(platform.PLATFORM_ENV, "").lower() == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.update(platform.child_visibility_env(rank, env))
    return env


def launch_workers(script: str, argv: list[str], nprocs: int, timeout: float, extra_args: list[str] | None = None,
                   ) -> int:
    """Run `script argv --worker-rank i --rendezvous tcp://...` for i < nprocs; stop all if one fails."""
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(nprocs):
        command = [sys.executable, script, *argv, *(extra_args or []), "--worker-rank", str(rank),
                   "--rendezvous", rendezvous]
        procs.append(subprocess.Popen(command, env=worker_env(rank)))
    return wait_workers(procs, timeout)


def worker_or_launcher(script: str, args: Any, argv: list[str] | None, worker: Any) -> int:
    """The `main` of a script that runs one worker per GPU: be worker `args.worker_rank`, or launch `args.gpus`
    of them (this same script) and wait for them up to `args.timeout` seconds."""
    if args.worker_rank is not None:
        return worker(args)
    return launch_workers(script, list(sys.argv[1:] if argv is None else argv), args.gpus, args.timeout)


def end_worker() -> int:
    """A worker's last step: leave the default process group (if any)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def wait_workers(procs: list[subprocess.Popen], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"worker {rank} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
            stop(procs)
            return code
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            print(f"workers still running after {timeout:.0f} s; stopping them", file=sys.stderr, flush=True)
            stop(procs)
            return 124
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    stop_processes(procs, grace_s=15)


def init_default_group(rank: int, world_size: int, rendezvous: str, backend: str | None = None):
    """Join the benchmark's own default group (NCCL on GPU, Gloo on CPU) and return this rank's device."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = platform.device_for_local_rank(0)  # the worker sees only its own accelerator
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(backend or platform.backend(), init_method=rendezvous, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=600),
                                device_id=device if device.type == "cuda" else None)
    return device


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_list(text: str, kind: type = int) -> list:
    return [kind(item) for item in str(text).split(",") if item.strip()]
