"""Recovery timeline on GPUs: from a killed replica to that replica participating again, phase by phase.

    python benchmarks/gpu/recovery_timeline.py --model 1b --trials cold,warm

Two replicas x 1 GPU train `--model` with Regent's Manager in per-step mode (the gradient all-reduce crosses
replicas every step on the Manager's NCCL group); a Lighthouse runs in this launching process. For each
trial, once both replicas have committed `--settle` steps together, replica 1 is killed with SIGKILL and
brought back:

* `cold`: a new process is started from nothing (interpreter, `import torch`, CUDA context, model and
  optimizer on the GPU, Manager), as a plain process supervisor would.
* `warm`: a spare process, started ahead of the fault, has already imported torch, created its CUDA context
  and built the model and optimizer; on the fault it is told to go and only constructs its Manager.

Every process writes its phase times (wall clock, same host) to `--events-dir` (`<out>/recovery`); the Manager's own
events (quorum, heal_started, heal_done, commit) are recorded with them. Phases reported per trial:

  detect      kill -> the supervisor (this script) sees the process exit
  survivor    kill -> the survivor's first failed commit (its all-reduce errors or times out: `--ft-timeout`)
  respawn     exit seen -> the new process runs Python code (cold) / the spare is signalled (warm)
  imports     -> `import torch` done (cold only)
  cuda_init   -> CUDA context ready (cold only)
  build       -> model + optimizer on the GPU (cold only)
  manager     -> Manager constructed (heartbeating the Lighthouse)
  quorum      -> the first quorum that includes the new replica
  transfer    the heal: the survivor's state (params + AdamW state + step) received over NCCL, in place
  first_step  heal done -> first committed step with both replicas participating
  total       kill -> participating again
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

T_START = time.time()  # as early as possible: the respawn phase ends when the new interpreter runs this

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--trials", default="cold,warm", help="comma list of cold and warm")
    parser.add_argument("--settle", type=int, default=5, help="steps both replicas commit together before a kill")
    parser.add_argument("--ft-timeout", type=float, default=10.0, help="Manager collective timeout, seconds")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=900, help="give up on the whole run after this")
    parser.add_argument("--events-dir", default=None, help="per-process phase logs (default <out>/recovery)")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--name", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    args.events_dir = args.events_dir or str(Path(args.out) / "recovery")
    bad = set(_common.parse_list(args.trials, str)) - {"cold", "warm"}
    if bad:
        parser.error(f"unknown trial kind(s) {sorted(bad)}; use cold and/or warm")
    return args


# ---- one replica process --------------------------------------------------------------------------------


class PhaseLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    def __call__(self, kind: str, **details) -> None:
        self._f.write(json.dumps({"time": time.time(), "kind": kind, **details}, default=str) + "\n")


def replica_main(args: argparse.Namespace) -> int:
    """Train as replica `args.replica` until the stop file appears (role train), or wait to be told (spare)."""
    run = Path(args.events_dir)
    log = PhaseLog(run / f"{args.name}.jsonl")
    log("process_started", at=T_START)
    _common.setup_logging(args.name)
    import torch

    log("torch_imported")
    from regent import platform

    device = platform.device_for_local_rank(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    log("cuda_ready")
    info_path = run / "machine.json"
    if not info_path.exists():
        info_path.write_text(json.dumps(_common.machine_info()))
    torch.set_num_threads(1)
    from regent.ft.manager import Manager
    from regent.ft.step import FaultTolerantStep
    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, lr=3e-4, warmup_steps=10,
                      max_steps=10_000)
    trainer = Trainer(cfg, rank=0, world_size=1, replica_index=args.replica, num_replicas=2, device=device)
    log("built")
    if args.role == "spare":
        go = run / f"{args.name}.go"
        log("spare_ready")
        while not go.exists():
            time.sleep(0.005)
        log("go")

    def on_event(kind: str, details: dict) -> None:
        log("manager_" + kind, **{k: v for k, v in details.items() if k not in ("replica_id",)})

    manager = Manager(load_state_dict=trainer.load_state_dict, state_dict=trainer.state_dict, min_replica_size=1,
                      use_async_quorum=True, timeout=args.ft_timeout, quorum_timeout=120, connect_timeout=60,
                      group_rank=0, group_world_size=1, lighthouse_addr=args.lighthouse,
                      replica_id=f"replica_{args.replica}", init_sync=True, on_event=on_event)
    log("manager_ready")

    ft = FaultTolerantStep(manager, per_step=True)  # the quorum, gradient allreduce and commit vote of a step
    stop = run / "stop"
    while not stop.exists():
        ft.start()
        record = trainer.train_step(ft)
        log("step", step=record["step"], committed=record["committed"], participants=manager.num_participants(),
            quorum_id=manager.quorum_id(), step_time_s=record["step_time_s"])
    log("stopped", step=trainer.step)
    manager.shutdown(wait=False)
    os._exit(0)  # skip interpreter teardown of NCCL/gRPC threads


# ---- the supervisor ---------------------------------------------------------------------------------------


def _events(path: Path) -> list[dict]:
    from regent.orchestrate.events import read_jsonl  # src is on PYTHONPATH where this runs

    return list(read_jsonl(path))


def _first(events: list[dict], kind: str, after: float = 0.0, **match) -> dict | None:
    for e in events:
        if e["kind"] == kind and e["time"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


class Supervisor:
    def __init__(self, args: argparse.Namespace, lighthouse: str) -> None:
        self.args = args
        self.lighthouse = lighthouse
        self.run = Path(args.events_dir)
        self.run.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.counter = 0
        self.deadline = time.monotonic() + args.timeout

    def spawn(self, replica: int, role: str) -> str:
        self.counter += 1
        name = f"r{replica}-{role}-{self.counter}"
        command = [sys.executable, __file__, "--role", role, "--replica", str(replica), "--name", name,
                   "--lighthouse", self.lighthouse, "--out", self.args.out, "--events-dir", self.args.events_dir,
                   "--model", self.args.model,
                   "--seq-len", str(self.args.seq_len), "--batch-size", str(self.args.batch_size),
                   "--ft-timeout", str(self.args.ft_timeout)]
        self.procs[name] = subprocess.Popen(command, env=_common.worker_env(replica))
        return name

    def events(self, name: str) -> list[dict]:
        return _events(self.run / f"{name}.jsonl")

    def wait_for(self, what: str, predicate, poll: float = 0.02):
        while True:
            value = predicate()
            if value:
                return value
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(poll)

    def together(self, name: str, after: float, count: int):
        """The `count`-th step after `after` that `name` committed with 2 participants."""
        steps = [e for e in self.events(name) if e["kind"] == "step" and e["time"] >= after and e["committed"]
                 and e["participants"] == 2]
        return steps[count - 1] if len(steps) >= count else None

    def trial(self, kind: str, victim: str, survivor: str) -> tuple[dict, str]:
        self.wait_for("both replicas training together",
                      lambda: self.together(victim, 0, self.args.settle) and self.together(survivor, 0, 1))
        spare = None
        if kind == "warm":
            spare = self.spawn(1, "spare")
            self.wait_for("the warm spare", lambda: _first(self.events(spare), "spare_ready"))
        t_kill = time.time()
        self.procs[victim].send_signal(signal.SIGKILL)
        self.procs[victim].wait()
        t_exit = time.time()
        if kind == "cold":
            new = self.spawn(1, "train")
            t_respawn = time.time()
        else:
            new = spare
            (self.run / f"{new}.go").touch()
            t_respawn = time.time()
        back = self.wait_for("the new replica to participate", lambda: self.together(new, t_kill, 1))
        ev = self.events(new)
        surv = self.events(survivor)
        failed = _first(surv, "step", t_kill, committed=False)
        alone = _first(surv, "step", t_kill, committed=True, participants=1)
        heal_start = _first(ev, "manager_heal_started")
        heal = _first(ev, "manager_heal_done")
        quorum = _first(ev, "manager_quorum")
        manager_ready = _first(ev, "manager_ready")

        def t(e: dict | None, key: str = "time") -> float | None:
            return None if e is None else e[key]

        started = t(_first(ev, "process_started"), "at") if kind == "cold" else t(_first(ev, "go"))
        marks = [
            ("detect", t_kill, t_exit),
            ("respawn", t_exit, started),
            ("imports", started, t(_first(ev, "torch_imported")) if kind == "cold" else started),
            ("cuda_init", t(_first(ev, "torch_imported")) if kind == "cold" else started,
             t(_first(ev, "cuda_ready")) if kind == "cold" else started),
            ("build", t(_first(ev, "cuda_ready")) if kind == "cold" else started,
             t(_first(ev, "built")) if kind == "cold" else started),
            ("manager", t(_first(ev, "built")) if kind == "cold" else started, t(manager_ready)),
            ("quorum", t(manager_ready), t(quorum)),
            ("heal_wait", t(quorum), t(heal_start)),
            ("transfer", t(heal_start), t(heal)),
            ("first_step", t(heal), t(back)),
        ]
        phases = {name: (b - a if a is not None and b is not None else None) for name, a, b in marks}
        phases["total"] = back["time"] - t_kill
        phases["survivor_detect"] = (failed["time"] - t_kill) if failed else None
        phases["survivor_alone_again"] = (alone["time"] - t_kill) if alone else None
        result = {"trial": kind, "phases_s": phases, "respawn_signal_s": t_respawn - t_exit,
                  "heal": {k: heal.get(k) for k in ("bytes", "seconds", "step", "donor")} if heal else None,
                  "heal_gbps": heal["bytes"] / heal["seconds"] / 1e9 if heal and heal.get("seconds") else None}
        return result, new

    def stop_all(self) -> None:
        (self.run / "stop").touch()
        end = time.monotonic() + 60
        for p in self.procs.values():
            try:
                p.wait(timeout=max(1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def supervise(args: argparse.Namespace) -> int:
    from regent.ft.lighthouse import LighthouseServer

    _common.setup_logging("recovery supervisor")
    run = Path(args.events_dir)
    if run.exists():
        for old in run.iterdir():
            old.unlink()
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=30_000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=args.heartbeat_timeout_ms) as lighthouse:
        sup = Supervisor(args, lighthouse.address())
        survivor = sup.spawn(0, "train")
        victim = sup.spawn(1, "train")
        results = []
        try:
            for kind in _common.parse_list(args.trials, str):
                result, victim = sup.trial(kind, victim, survivor)
                results.append(result)
                phases = ", ".join(f"{k} {v:.2f}s" for k, v in result["phases_s"].items() if v is not None)
                print(f"recovery ({kind}): {phases}", flush=True)
        finally:
            sup.stop_all()
    record = {"bench": "recovery_timeline", "model": args.model, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "ft_timeout_s": args.ft_timeout,
              "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "trials": results}
    info_path = run / "machine.json"
    if info_path.exists():
        record.update(json.loads(info_path.read_text()))
    _common.append_result(args.out, record)
    return 0 if len(results) == len(_common.parse_list(args.trials, str)) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role is not None:
        return replica_main(args)
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
