"""Cost of Regent's fault tolerance around TorchTitan's own trainer, on one GPU, in one run.

    python benchmarks/gpu/titan_ft_overhead.py --batch-size 8 --steps 30 --warmup 8 --compile 0,1
    python benchmarks/gpu/titan_ft_overhead.py --dry-run      # tiny model on CPU (gloo): checks the plumbing

Modes, each a fresh process (one after the other, same GPU, same TorchTitan config, same step count):

* `titan`     -- TorchTitan alone: its `Trainer` from `titan_speed.py`'s `regent_speed_config` (the `regent1b`
                 flavor = Regent's `1b` shape, synthetic data, FSDP2 on 1 GPU, AdamW, no activation
                 checkpointing, no CUDA graphs, per-step metric logging), run by its own `Trainer.train()`,
                 launched as torchrun would (RANK/WORLD_SIZE/MASTER_* set, TorchTitan starts the group).
* `regent_ft` -- the same TorchTitan config driven the way `regent train --engine torchtitan` drives it: a
                 `regent.orchestrate.session.TrainingSession` (what each trainer actor runs) whose trainer is
                 `regent.orchestrate.titan_engine:make_trainer` (TorchTitan's `Trainer` built through the
                 engine's `resolve_config`/`prepare_config`, its `forward_backward_step` driven by
                 `ExternalTrainer.train_step`), a `regent.ft` Manager in per-step mode (`ft.mode=ddp`: a quorum
                 every step, started before forward and overlapped with it, the gradient average on the
                 Manager's group, the commit vote) and a Lighthouse in the launching process (the orchestrator's
                 defaults); 1 replica x 1 process. The engine keeps TorchTitan's data (`data=config`: the same
                 synthetic dataloader as `titan`) and its attention (`attn=config`: causal SDPA).
* `regent`    -- (optional) the same trainer under `ExternalTrainer.train_step` with no Manager: what Regent's
                 driving of TorchTitan's step costs without fault tolerance.

Each mode runs `--warmup` untimed steps, then `--steps` timed ones; a step's time is wall-clock between
device synchronizations after consecutive steps (both drives already synchronise once per step: TorchTitan's
per-step loss log, Regent's loss read and commit). Tokens/s per GPU = batch x seq_len x steps / timed time.
Peak memory is `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the whole process. `regent_ft`
also reports where its step time goes (forward+backward, the gradient hook, clipping, the commit vote, the
optimizer), timed at the points where the step is already synchronised, plus the CUDA time of the gradient
hook. Not included: the trainer actor's per-step metric message to the controller and the durable backstop
(`--backstop-every-s`, default 0 = off; `regent train` saves one every 120 s, off the critical path).

Needs torchtitan importable (see titan_speed.py: `pip install --no-index --no-deps --target /tmp/titan-site
.whl/titan/*.whl`) and `src/` on PYTHONPATH. Results: one JSON record per (compile, mode) plus one summary per
compile setting in `<out>/results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import titan_speed  # its config function, flavor and synthetic data are reused, not copied

MODES = ("titan", "regent_ft", "regent")
TITAN_CONFIG = "titan_speed:regent_speed_config"  # TorchTitan's ConfigManager imports this file's sibling


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--batch-size", type=int, default=8, help="local batch (titan_speed's 1-GPU anchor: 8)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation, quorum set-up)")
    parser.add_argument("--compile", default="0", help="comma list of 0/1: TorchTitan's per-block torch.compile")
    parser.add_argument("--modes", default="titan,regent_ft", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--compiled-modes", default=None, help="modes for --compile 1 (default: --modes)")
    parser.add_argument("--attn", choices=("sdpa", "flex"), default="sdpa")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--backstop-every-s", type=float, default=0.0,
                        help="regent_ft: the durable backstop's interval (0 = off, the default here)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="do not start a further compile setting once this many seconds have passed (0 = no limit)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="stop every mode process by this many seconds after the start (0 = no limit)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per mode process")
    parser.add_argument("--dry-run", action="store_true", help="tiny flavor on CPU (gloo); figures meaningless")
    parser.add_argument("--worker", choices=MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile-on", type=int, default=0, help=argparse.SUPPRESS)
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    args.mode_list = _common.parse_list(args.modes, str)
    args.compiled_mode_list = _common.parse_list(args.compiled_modes, str) if args.compiled_modes else args.mode_list
    unknown = set(args.mode_list + args.compiled_mode_list) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step is never timed)")
    if args.dry_run:
        args.batch_size, args.seq_len = min(args.batch_size, 2), 64
    return args


def titan_cli(args: argparse.Namespace) -> list[str]:
    """TorchTitan overrides, the same for every mode (the engine adds none that change the step's work)."""
    return ["--training.local_batch_size", str(args.batch_size), "--training.seq_len", str(args.seq_len),
            "--training.steps", str(args.warmup + args.steps), "--debug.seed", "0"]  # same initial weights


def titan_env(args: argparse.Namespace, compile_on: int) -> dict[str, str]:
    """What titan_speed's config function reads (flavor, attention, compile, CUDA graphs off, loss, lr)."""
    return {titan_speed.ENV_FLAVOR: titan_speed.TINY_FLAVOR if args.dry_run else titan_speed.FLAVOR,
            titan_speed.ENV_ATTN: args.attn, titan_speed.ENV_DRY: "1" if args.dry_run else "0",
            titan_speed.ENV_GRAPHS: "0", titan_speed.ENV_COMPILE: str(compile_on), titan_speed.ENV_LOSS: "ce",
            "TITAN_SPEED_LR": str(args.lr)}


# ---------------------------------------------------------------------------------------------------------
# Parent: a Lighthouse, then one process per (compile, mode); the table and the overhead.
# ---------------------------------------------------------------------------------------------------------

def run_mode(args: argparse.Namespace, mode: str, compile_on: int, timeout: float) -> dict:
    """One mode in its own process; `regent_ft` with a fresh Lighthouse (the orchestrator's defaults), since a
    Lighthouse remembers the committed step of replica_0 and a second session would start behind it."""
    if mode != "regent_ft":
        return _run_mode(args, mode, compile_on, "", timeout)
    from regent.ft.lighthouse import LighthouseServer
    from regent.orchestrate.config import LighthouseConfig

    lh = LighthouseConfig()  # what `regent train` starts
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=lh.min_replicas, join_timeout_ms=lh.join_timeout_ms,
                          quorum_tick_ms=lh.quorum_tick_ms, heartbeat_timeout_ms=lh.heartbeat_timeout_ms) as server:
        return _run_mode(args, mode, compile_on, server.address(), timeout)


def _run_mode(args: argparse.Namespace, mode: str, compile_on: int, lighthouse: str, timeout: float) -> dict:
    fd, result_path = tempfile.mkstemp(prefix=f"titan_ft_{mode}_c{compile_on}_", suffix=".json")
    os.close(fd)
    env = _common.worker_env(0)
    env.update(titan_env(args, compile_on))
    if args.dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--compile-on", str(compile_on),
               "--lighthouse", lighthouse, "--result", result_path, "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--attn", args.attn, "--lr", str(args.lr), "--backstop-every-s", str(args.backstop_every_s),
               "--out", args.out] + (["--dry-run"] if args.dry_run else [])
    print(f"=== {time.strftime('%H:%M:%S')} mode {mode} compile={compile_on}: " + " ".join(command), flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    code = _common.wait_workers([proc], timeout)
    record: dict = {}
    try:
        with open(result_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        pass
    os.unlink(result_path)
    record.update(mode=mode, compile=bool(compile_on), process_s=round(time.monotonic() - start, 1))
    if code != 0:
        record["status"] = "timeout" if code == 124 else f"failed rc={code}"
    record.setdefault("status", "no result")
    return record


def parent(args: argparse.Namespace) -> int:
    _common.setup_logging("titan_ft_overhead")
    began = time.monotonic()
    summaries = []
    for compile_on in _common.parse_list(args.compile, int):
        if args.budget_s and summaries and time.monotonic() - began > args.budget_s:
            print(f"skipping compile={compile_on}: {time.monotonic() - began:.0f} s of the {args.budget_s:.0f} s "
                  "budget used", flush=True)
            summaries.append({"compile": bool(compile_on), "status": "skipped (time budget)"})
            continue
        records = {}
        for mode in args.compiled_mode_list if compile_on else args.mode_list:
            timeout = args.timeout
            if args.deadline_s:
                timeout = min(timeout, args.deadline_s - (time.monotonic() - began))
            if timeout < 20:
                records[mode] = {"mode": mode, "compile": bool(compile_on), "status": "skipped (deadline)"}
                continue
            record = run_mode(args, mode, compile_on, timeout)
            records[mode] = record
            _common.append_result(args.out, {"bench": "titan_ft_overhead", **record})
        summaries.append(summarize(args, compile_on, records))
        _common.append_result(args.out, summaries[-1])
        print_table(summaries[-1:])
    print_table(summaries)
    return 0 if summaries and all(s.get("status") == "ok" for s in summaries) else 1


def summarize(args: argparse.Namespace, compile_on: int, records: dict[str, dict]) -> dict:
    summary: dict = {"bench": "titan_ft_overhead_summary", "compile": bool(compile_on),
                     "model": "tiny-dry-run" if args.dry_run else "1b (TorchTitan flavor regent1b)",
                     "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
                     "warmup": args.warmup, "attn": args.attn, "backstop_every_s": args.backstop_every_s,
                     "data": titan_speed.DATA_NOTE, "modes": {}}
    for mode, r in records.items():
        keep = ("status", "tokens_per_s_per_gpu", "step_s_mean", "step_s_median", "peak_allocated_gib",
                "peak_reserved_gib", "first_loss", "last_loss", "breakdown_ms", "quorums", "commits", "committed")
        summary["modes"][mode] = {k: r[k] for k in keep if k in r}
        for k in ("torchtitan", "torch", "device", "date_utc", "torch_shims", "hf_datasets"):
            if k in r:
                summary.setdefault(k, r[k])
    base = records.get("titan", {}).get("tokens_per_s_per_gpu")
    for mode in ("regent_ft", "regent"):
        rate = records.get(mode, {}).get("tokens_per_s_per_gpu")
        if base and rate:
            summary[f"overhead_{mode}_pct"] = round(100 * (1 - rate / base), 2)
    summary["status"] = "ok" if all(r.get("status") == "ok" for r in records.values()) else "error"
    return summary


def print_table(summaries: list[dict]) -> None:
    print("\nTorchTitan alone vs TorchTitan under Regent's FT (per-step, 1 replica), same run")
    print(f"{'compile':>7} {'mode':>10} {'status':>10} {'tok/s/gpu':>10} {'step ms':>8} {'median':>8} "
          f"{'alloc GiB':>9} {'resv GiB':>9} {'overhead':>9}")
    for s in summaries:
        for mode, r in s.get("modes", {}).items():
            def fmt(key: str, spec: str, scale: float = 1.0, r: dict = r) -> str:
                value = r.get(key)
                return format(value * scale, spec) if isinstance(value, (int, float)) else "-"

            over = s.get(f"overhead_{mode}_pct")
            print(f"{str(s['compile']):>7} {mode:>10} {r.get('status', '?'):>10} {fmt('tokens_per_s_per_gpu', ',.0f'):>10} "
                  f"{fmt('step_s_mean', '.1f', 1e3):>8} {fmt('step_s_median', '.1f', 1e3):>8} "
                  f"{fmt('peak_allocated_gib', '.2f'):>9} {fmt('peak_reserved_gib', '.2f'):>9} "
                  f"{(f'{over:+.2f}%' if over is not None else '-'):>9}")
            if r.get("breakdown_ms"):
                print(f"{'':>18} step breakdown (ms, mean): {r['breakdown_ms']}")
        if "modes" not in s:
            print(f"{str(s['compile']):>7} {'-':>10} {s.get('status')}")
    print("", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------------------

class StepClock:
    """Wall-clock at the end of each step, after a device synchronisation; the first `warmup` are untimed."""

    def __init__(self, device, warmup: int) -> None:
        self.device, self.warmup, self.ends = device, warmup, []

    def tick(self) -> None:
        _common.sync(self.device)
        self.ends.append(time.perf_counter())

    def figures(self, tokens_per_step: int) -> dict:
        timed = [b - a for a, b in zip(self.ends[self.warmup - 1:], self.ends[self.warmup:])]
        if not timed:
            return {"status": "no timed steps", "steps_run": len(self.ends)}
        total = sum(timed)
        return {"status": "ok", "steps_run": len(self.ends), "timed_steps": len(timed),
                "tokens_per_s_per_gpu": round(tokens_per_step * len(timed) / total, 1),
                "step_s_mean": total / len(timed), "step_s_median": statistics.median(timed),
                "step_s": [round(t, 4) for t in timed]}


def _memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}


def _prepare(args: argparse.Namespace) -> dict:
    """What both drives need before TorchTitan is imported: titan_speed's CPU/torch/datasets adjustments."""
    info = {"hf_datasets": titan_speed._ensure_hf_datasets(), "torch_shims": titan_speed._torch_compat_shims()}
    return info


def worker_titan(args: argparse.Namespace) -> dict:
    """TorchTitan alone, as titan_speed's worker runs it (ConfigManager, config.build(), Trainer.train())."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_common.free_port())})  # as torchrun would
    if args.dry_run:
        titan_speed._prepare_cpu_dry_run()
    info = _prepare(args)
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    titan_speed._install_extensions()
    init_logger()
    dump = tempfile.mkdtemp(prefix="titan_ft_titan_")
    config = ConfigManager().parse_args(["--module", TITAN_CONFIG.split(":")[0], "--config",
                                         TITAN_CONFIG.split(":")[1], *titan_cli(args), "--dump_folder", dump,
                                         "--hf_assets_path", dump])
    trainer = config.build()
    clock = StepClock(trainer.device, args.warmup)
    losses: list[float] = []
    inner_step = trainer.train_step

    def timed_step(data_iterator):
        out = inner_step(data_iterator)
        clock.tick()
        return out

    trainer.train_step = timed_step
    log = trainer.metrics_processor.log

    def keep_loss(step, global_avg_loss, *rest, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = keep_loss
    try:
        trainer.train()
        result = clock.figures(args.batch_size * args.seq_len)
        result.update(_memory(trainer.device))
    finally:
        trainer.close()
    result.update(info, torchtitan=torchtitan.__version__, torch=torch.__version__,
                  first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                  drive="torchtitan Trainer.train()")
    return result


def worker_regent(args: argparse.Namespace, ft: bool) -> dict:
    """TorchTitan's trainer through `--engine torchtitan`'s code: TrainingSession + titan_engine (+ Manager)."""
    info = _prepare(args)
    import torch

    from regent.orchestrate import titan_engine

    version = titan_engine.check_available()  # imports TorchTitan (on a CPU host: under the engine's cpu patch)
    titan_speed._install_extensions()  # the regent1b flavor and titan_speed's synthetic data, by name
    from regent.ft.config import FTConfig
    from regent.orchestrate.commands import TITAN_TRAINER
    from regent.orchestrate.config import RunConfig
    from regent.train.config import TrainConfig

    run_dir = tempfile.mkdtemp(prefix="titan_ft_regent_")
    options = {"titan.config": TITAN_CONFIG, "titan.args": shlex.join(titan_cli(args)), "data": "config",
               "attn": "config", "regent.steps": str(args.warmup + args.steps)}
    ft_cfg = FTConfig(mode="ddp", min_replica_size=1, quorum_timeout_s=600.0, timeout_s=120.0,
                      connect_timeout_s=60.0, lighthouse=args.lighthouse, backstop_every_s=args.backstop_every_s)
    cfg = RunConfig(replicas=1, procs_per_replica=1, steps=args.warmup + args.steps, run_dir=run_dir,
                    recovery="peer", trainer=TITAN_TRAINER, trainer_options=options,
                    train=TrainConfig(seed=0), ft=ft_cfg)
    events: list[tuple[str, dict]] = []
    if ft:
        from regent.orchestrate.session import TrainingSession

        session = TrainingSession(cfg, replica_index=0, rank=0, world_size=1, generation=0,
                                  lighthouse_addr=args.lighthouse, on_event=lambda k, d: events.append((k, d)))
        trainer, step = session.trainer, session.step
    else:
        from regent.orchestrate.session import build_user_trainer

        session = None
        trainer = build_user_trainer(cfg, rank=0, world_size=1, replica_index=0)
        step = trainer.train_step
    titan = trainer.user.titan
    device = titan.device
    clock = StepClock(device, args.warmup)
    phases = _PhaseTimer(trainer, session, device)
    records = []
    try:
        for i in range(args.warmup + args.steps):
            phases.timing = i >= args.warmup
            records.append(step())
            clock.tick()
            phases.end_step()
        result = clock.figures(args.batch_size * args.seq_len)
        result.update(_memory(device))
        result["breakdown_ms"] = phases.summary(result.get("step_s_mean"))
    finally:
        if session is not None:
            session.close()
        else:
            trainer.close()
    losses = [r.get("replica_loss", r.get("loss")) for r in records]
    result.update(info, torchtitan=version, torch=torch.__version__, first_loss=losses[0], last_loss=losses[-1],
                  committed=sum(bool(r.get("committed", True)) for r in records),
                  drive="TrainingSession(ft.mode=ddp) + titan_engine" if ft else "ExternalTrainer + titan_engine")
    if ft:
        result["quorums"] = sum(1 for k, _ in events if k == "quorum")
        result["commits"] = sum(1 for k, _ in events if k == "commit")
    return result


class _PhaseTimer:
    """Where a Regent step's time goes, measured without adding synchronisations: forward_backward ends with a
    loss read (synchronised), clipping with a norm read, the commit vote is host-side; the gradient hook's
    CUDA time comes from events around it (its host time only enqueues)."""

    def __init__(self, trainer, session, device) -> None:
        import torch

        self.timing, self.device = False, device
        self.sums: dict[str, float] = {}
        self.n = 0
        self.cuda = device.type == "cuda"
        self._events: list = []
        self._t = time.perf_counter()
        user = trainer.user
        fb = user.forward_backward

        def forward_backward(batch_index):
            self._mark("before_fb")
            out = fb(batch_index)
            self._add("forward_backward", "before_fb")
            return out

        user.forward_backward = forward_backward
        if session is not None:  # the step's rules (regent.ft.step.FaultTolerantStep), timed where they run
            rules = session.ft_step
            reduce, commit = rules.reduce_gradients, rules.should_commit

            def grad_reduce(grads):
                start = time.perf_counter()
                if self.cuda:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                reduce(grads)
                if self.cuda:
                    end.record()
                    self._events.append((begin, end))
                self._acc("grad_reduce_host", time.perf_counter() - start)
                self._mark("after_reduce")

            def should_commit():
                start = time.perf_counter()
                self._add("clip_and_reduce_wait", "after_reduce" if "after_reduce" in self._marks else "after_fb")
                decision = commit()
                self._acc("commit_vote", time.perf_counter() - start)
                return decision

            rules.reduce_gradients, rules.should_commit = grad_reduce, should_commit
        if session is not None:
            start_quorum = session.manager.start_quorum

            def quorum(*a, **k):
                start = time.perf_counter()
                out = start_quorum(*a, **k)
                self._acc("start_quorum", time.perf_counter() - start)
                return out

            session.manager.start_quorum = quorum
        self._marks: dict[str, float] = {}

    def _mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def _add(self, name: str, since: str) -> None:
        now = time.perf_counter()
        self._acc(name, now - self._marks.get(since, now))
        self._marks["after_fb" if name == "forward_backward" else name] = now

    def _acc(self, name: str, seconds: float) -> None:
        if self.timing:
            self.sums[name] = self.sums.get(name, 0.0) + seconds

    def end_step(self) -> None:
        if self.timing:
            self.n += 1
            for begin, end in self._events:
                self.sums["grad_reduce_cuda"] = self.sums.get("grad_reduce_cuda", 0.0) + begin.elapsed_time(end) / 1e3
        self._events.clear()
        self._marks.clear()

    def summary(self, step_s: float | None) -> dict:
        """Mean ms per timed step; `rest` = the step minus its host-timed parts (optimizer step, scheduler,
        zero_grad, the session's bookkeeping and the synchronisation at the end)."""
        if not self.n:
            return {}
        out = {k: round(1e3 * v / self.n, 2) for k, v in sorted(self.sums.items())}
        if step_s:
            host = sum(v for k, v in out.items() if k != "grad_reduce_cuda")
            out.update(step=round(1e3 * step_s, 2), rest=round(1e3 * step_s - host, 2))
        return out


def worker(args: argparse.Namespace) -> int:
    _common.setup_logging(f"titan_ft_overhead {args.worker}")
    for name, value in _common.SAFE_NCCL_ENV.items():
        os.environ[name] = value
    try:
        result = worker_titan(args) if args.worker == "titan" else worker_regent(args, ft=args.worker == "regent_ft")
    except Exception as err:  # noqa: BLE001 - reported in the result file
        import traceback

        traceback.print_exc()
        result = {"status": "error", "error": f"{type(err).__name__}: {err}"}
    result.update(_common.machine_info())
    result.update(batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup)
    with open(args.result, "w") as f:
        json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result.get("status") == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    sys.exit(main())
