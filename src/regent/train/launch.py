"""Launch one replica group (no fault tolerance) as `procs` local processes: `regent train --no-ft`.

The parent validates everything it can before spawning, then starts one subprocess per rank with
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK and the device-visibility variables from
`regent.platform.child_visibility_env`. If any rank fails, the others are stopped and its exit code returned.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from regent import platform
from regent.ports import free_port
from regent.train.config import TrainConfig
from regent.train.data import build_tokenizer, check_data

log = logging.getLogger(__name__)


def validate_launch(cfg: TrainConfig, procs: int, steps: int, run_dir: str) -> str:
    """Check arguments before anything starts; returns the platform. Raises ValueError naming the fix."""
    cfg.validate()
    if not isinstance(procs, int) or procs < 1:
        raise ValueError(f"--procs-per-replica must be a positive integer, got {procs!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {steps!r}")
    if not run_dir:
        raise ValueError("--run-dir is required: the directory for metrics.jsonl and summary.json")
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ValueError(f"--run-dir {run_dir!r} exists and is not a directory; choose another path")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_file():
        raise ValueError(f"--tokenizer {cfg.tokenizer!r} does not exist; pass a tokenizer.json or leave it unset")
    if cfg.data is not None:  # a glob matching nothing, a bad shard directory, hf: without `datasets`
        check_data(cfg.data, build_tokenizer(cfg.tokenizer), seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                   num_shards=procs)
    plat = platform.detect_platform()
    if plat != "cpu":
        import torch

        visible = torch.cuda.device_count()
        if procs > visible:
            raise ValueError(
                f"--procs-per-replica {procs} needs {procs} GPUs but {visible} are visible; "
                f"lower --procs-per-replica or set {platform.PLATFORM_ENV}=cpu"
            )
    elif procs > 64:
        raise ValueError(f"--procs-per-replica {procs} CPU processes is too many for one host; use <= 64")
    return plat


def run_no_ft(cfg: TrainConfig, procs: int, steps: int, run_dir: str) -> int:
    """Train one replica group in `procs` local processes for `steps` steps; returns an exit code."""
    plat = validate_launch(cfg, procs, steps, run_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    config_path = os.path.join(run_dir, "train_config.json")
    with open(config_path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // procs)
    children: list[subprocess.Popen] = []
    for rank in range(procs):
        env = dict(os.environ)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(procs),
                   LOCAL_RANK=str(rank))
        if plat == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(threads))
        else:
            env.update(platform.child_visibility_env(rank))
        command = [sys.executable, "-m", "regent.train.launch", "--config", config_path, "--steps", str(steps),
                   "--run-dir", run_dir]
        children.append(subprocess.Popen(command, env=env))
    print(f"regent train --no-ft: {procs} process(es) on {plat}, model {cfg.model}, {steps} steps, "
          f"run dir {run_dir}", flush=True)
    try:
        return _wait_all(children)
    except KeyboardInterrupt:
        stop_processes(children)
        return 130


def _wait_all(children: list[subprocess.Popen]) -> int:
    while True:
        codes = [child.poll() for child in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"rank {rank} exited with code {code}; stopping the other ranks", file=sys.stderr, flush=True)
            stop_processes(children)
            return code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def stop_processes(children: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Terminate the children still running, then kill those that have not exited `grace_s` later."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.time() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def worker_main(config_path: str, steps: int, run_dir: str) -> int:
    """One rank: join the group, train `steps` steps, write metrics (rank 0) and summary.json."""
    import torch
    import torch.distributed as dist

    from regent.train.trainer import Trainer

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with open(config_path) as f:
        cfg = TrainConfig.from_dict(json.load(f))
    if world_size > 1:
        device = platform.device_for_local_rank(int(os.environ.get("LOCAL_RANK", rank)))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(platform.backend(), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=300),
                                device_id=device if device.type == "cuda" else None)
    trainer = Trainer(cfg, rank=rank, world_size=world_size, run_dir=run_dir)
    records = []
    try:
        for _ in range(steps):
            record = trainer.train_step()
            records.append(record)
            if rank == 0 and (record["step"] % cfg.log_every == 0 or record["step"] == steps):
                mfu = f" mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
                print(f"step {record['step']:>5}/{steps} loss {record['loss']:.4f} grad_norm "
                      f"{record['grad_norm']:.3f} tok/s/device {record['tokens_per_s_per_device']:,.0f}{mfu} "
                      f"mem {record['peak_mem_bytes'] / 2**30:.2f} GiB", flush=True)
        trainer.close()
        if rank == 0:
            warm = records[min(len(records) - 1, 2):]  # the first steps include compile/warm-up
            summary = {
                "steps": len(records), "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
                "tokens_per_s": sum(r["tokens_per_s"] for r in warm) / len(warm),
                "tokens_per_s_per_device": sum(r["tokens_per_s_per_device"] for r in warm) / len(warm),
                "mfu": (sum(r["mfu"] for r in warm) / len(warm)) if warm[0]["mfu"] is not None else None,
                "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records), "world_size": world_size,
                "model": cfg.model, "num_params": trainer.num_params,
            }
            with open(os.path.join(run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of `regent train --no-ft` (started by run_no_ft)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    return worker_main(args.config, args.steps, args.run_dir)


if __name__ == "__main__":
    # Exit without interpreter finalization once the rank's results are written and its group destroyed: a
    # native thread torn down during finalization aborted a finished rank now and then ("terminate called
    # without an active exception", exit -6, after all 20 steps in the test suite), failing a good run.
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
