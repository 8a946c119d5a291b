"""Speed anchor: TorchTitan's own Llama 3 trainer on Regent's `1b` shape; tokens/s per GPU, MFU, peak memory.

    python benchmarks/gpu/titan_speed.py --gpus 1 --batch-size 4,8
    python benchmarks/gpu/titan_speed.py --gpus 2 --batch-size 4
    python benchmarks/gpu/titan_speed.py --dry-run            # tiny model on CPU (gloo), checks the plumbing

Each local batch size is one `torchrun` launch (`python -m torch.distributed.run`, one process per GPU) of a
worker that does what `torchtitan.train.main` does: TorchTitan's ConfigManager parses the job config (from a
config function in this file plus CLI overrides), `config.build()` makes TorchTitan's Trainer, and
`Trainer.train()` runs its real training loop (FSDP2 over all ranks, also on 1 GPU, where it only installs the
mixed-precision policy: bf16 params, fp32 reduce; AdamW lr 3e-4; no activation checkpointing, no checkpoint
saving, no torch.compile unless `--compile 1`, no CUDA graphs unless `--cuda-graphs 1`; TorchTitan 0.3.0 turns
CUDA graphs on by default, Regent's trainer has none, so off is the like-for-like setting).

The model is a flavor `regent1b` registered at run time in TorchTitan's `llama3_configs`, shaped like Regent's
`1b` (src/regent/train/models/llama3.py): dim 2048, 16 layers, 32 heads, 8 KV heads, vocab 128256, SwiGLU
hidden 8192 (multiple_of 1024, ffn_dim_multiplier 1.5), RoPE theta 500000 with Llama 3.1 scaling, norm eps
1e-5, untied embedding and output (Regent's 1b does not tie them; TorchTitan's own 1B flavor does). Attention
is causal SDPA (`--attn sdpa`, what Regent uses) or TorchTitan's FlexAttention (`--attn flex`). QKV is
TorchTitan's fused projection. The loss is TorchTitan's `CrossEntropyLoss` on the full logits (`--loss ce`,
the default: fp32 cross-entropy over [B*L, vocab], what Regent's trainer computes) or its `ChunkedLossWrapper`
(`--loss chunked`: lm_head + loss in 8 sequence chunks, each with its own backward). The chunked loss needs
FSDP2 fixes that torch 2.11 lacks: it runs `fully_shard([norm, lm_head])` as one FSDP unit, drives lm_head
outside the model's forward, then calls `lm_head.reshard()`, which frees the unsharded RMSNorm weight that
the final norm saved for backward; torch 2.11's FSDP2 does not gather it again before the decoder's backward
(the per-chunk backwards already ran that group's pre-/post-backward and the root's end-of-backward
callback), so the first backward fails with "The tensor has a non-zero number of elements, but its data is
not allocated yet". torch 2.13 runs it; on older builds `--loss chunked` fails the same way.

Data are synthetic: uniform random token ids in [0, vocab) from a dataloader and tokenizer registered
through TorchTitan's Configurable extension points, so nothing is downloaded (fine for speed, meaningless for
loss). Figures are TorchTitan's own per-step log lines (tps = tokens/s per device, tflops, mfu against its
hard-coded peak, 989 TFLOP/s for H100/H200 SXM; memory = max reserved GiB since the previous log line),
parsed from rank 0: the first `--warmup` steps are dropped, tokens/s is total tokens over total time of the
rest (harmonic mean of the per-step tps), MFU likewise, memory the maximum. One JSON record per
(gpus, batch size) goes to `<out>/results.jsonl`.

Needs torchtitan importable (nothing is installed here): the carried wheels in `.whl/titan/` go to a
folder on PYTHONPATH, e.g. `pip install --no-index --no-deps --target /tmp/titan-site .whl/titan/*.whl`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The parent needs no `regent` import; `_common` (which needs src/ on PYTHONPATH) is used where it loads.
try:
    import _common
except ImportError:  # pragma: no cover - run without src/ on the path
    _common = None

SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in SAFE_NCCL_ENV.items():
    os.environ[_name] = _value

FLAVOR = "regent1b"
TINY_FLAVOR = "regent_tiny"
DATA_NOTE = "synthetic: uniform random token ids (no dataset, no tokenizer)"
ENV_FLAVOR, ENV_ATTN, ENV_DRY, ENV_GRAPHS, ENV_COMPILE, ENV_INFO, ENV_LOSS, ENV_PROFILE = (
    "TITAN_SPEED_FLAVOR", "TITAN_SPEED_ATTN", "TITAN_SPEED_DRY_RUN", "TITAN_SPEED_CUDA_GRAPHS",
    "TITAN_SPEED_COMPILE", "TITAN_SPEED_INFO", "TITAN_SPEED_LOSS", "TITAN_SPEED_PROFILE")
# --profile: TorchTitan's own profiler traces the last PROFILE_ACTIVE steps after PROFILE_WARMUP profiler warm-up
# steps; those steps are left out of the speed figures.
PROFILE_WARMUP, PROFILE_ACTIVE, PROFILE_FOLDER = 3, 2, "profile_traces"
STEP_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<mem>-?[\d.]+)GiB\((?P<mem_pct>-?[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RANK_PREFIX = re.compile(r"^\[(?:rank|default)(?P<rank>\d+)\]:")


# ---------------------------------------------------------------------------------------------------------
# Parent: one torchrun launch per batch size, parse rank 0's step lines, append results.
# ---------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--gpus", type=int, default=1, help="processes (one GPU each); 2 = FSDP over 2 GPUs")
    parser.add_argument("--batch-size", default="4", help="local batch size(s), comma-separated")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=15, help="TorchTitan training steps per launch")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    parser.add_argument("--compile", type=int, choices=(0, 1), default=0, help="TorchTitan's per-block compile")
    parser.add_argument("--cuda-graphs", type=int, choices=(0, 1), default=0,
                        help="TorchTitan's CUDA-graph capture of forward+backward (its 0.3.0 default is on)")
    parser.add_argument("--attn", choices=("sdpa", "flex"), default="sdpa")
    parser.add_argument("--loss", choices=("ce", "chunked"), default="ce",
                        help="TorchTitan's CrossEntropyLoss on full logits (like Regent) or its ChunkedLossWrapper "
                             "(needs torch >= 2.13's FSDP2, see the module docstring)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--profile", action="store_true",
                        help=f"trace the last {PROFILE_ACTIVE} steps with TorchTitan's profiler and summarize them "
                             "(benchmarks/gpu/_trace.py); those steps and the profiler's warm-up are not timed")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny flavor on CPU with gloo (checks the plumbing; figures are meaningless)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch before it is stopped")
    parser.add_argument("--out", default=_common.default_out() if _common else (os.environ.get("OUT")
                        or "runs/gpu-bench"), help="result folder (default $OUT or runs/gpu-bench)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if not args.worker and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.titan_args = rest
    if args.gpus < 1 or args.steps <= args.warmup or args.warmup < 0:
        parser.error("--gpus must be >= 1 and --steps > --warmup >= 0")
    if args.profile and args.steps - PROFILE_WARMUP - PROFILE_ACTIVE <= args.warmup:
        parser.error(f"--profile needs --steps > --warmup + {PROFILE_WARMUP + PROFILE_ACTIVE}")
    return args


def worker_command(args: argparse.Namespace, batch: int, dump: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc_per_node", str(args.gpus), "--role", "rank", "--tee", "3"]
    seq_len = 64 if args.dry_run else args.seq_len
    titan = ["--module", "__main__", "--config", "regent_speed_config",
             "--training.local_batch_size", str(batch), "--training.seq_len", str(seq_len),
             "--training.steps", str(args.steps), "--dump_folder", dump, "--hf_assets_path", dump]
    return [*launcher, str(Path(__file__).resolve()), "--worker", "--lr", str(args.lr), *titan]


def run_one(args: argparse.Namespace, batch: int) -> dict:
    dump = tempfile.mkdtemp(prefix=f"titan_speed_g{args.gpus}_b{batch}_")
    info_path = os.path.join(dump, "bench_info.json")
    env = dict(os.environ)
    env.update(SAFE_NCCL_ENV)
    env.update({ENV_FLAVOR: TINY_FLAVOR if args.dry_run else FLAVOR, ENV_ATTN: args.attn,
                ENV_DRY: "1" if args.dry_run else "0", ENV_GRAPHS: str(args.cuda_graphs),
                ENV_COMPILE: str(args.compile), ENV_INFO: info_path, ENV_LOSS: args.loss,
                ENV_PROFILE: str(args.steps if args.profile else 0),
                "PYTHONUNBUFFERED": "1"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if args.dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    command = worker_command(args, batch, dump)
    print("+ " + " ".join(command), flush=True)
    steps: dict[int, dict] = {}
    tail: list[str] = []
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    timer = threading.Timer(args.timeout, _stop_group, (proc,))
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = ANSI.sub("", raw.rstrip("\n"))
            print(line, flush=True)
            tail = (tail + [line])[-40:]
            prefix = RANK_PREFIX.match(line)
            if prefix and prefix.group("rank") != "0":
                continue
            match = STEP_LINE.search(line)
            if match:
                steps[int(match.group("step"))] = match.groupdict()
        code = proc.wait()
    finally:
        timer.cancel()
    timed_out = time.monotonic() - start >= args.timeout
    record = summarize(args, batch, steps)
    record["wall_s"] = round(time.monotonic() - start, 1)
    if os.path.exists(info_path):
        with open(info_path) as f:
            record.update(json.load(f))
    if args.profile:
        traces = sorted(Path(dump, PROFILE_FOLDER).glob("iteration_*/rank0_trace.json*"))
        if traces:
            import _trace

            record["profile"] = _trace.summarize_trace(traces[-1], PROFILE_ACTIVE)
            record["profile"]["trace_of"] = traces[-1].parent.name
            _trace.print_summary(f"torchtitan compile={args.compile} profile", record["profile"])
        else:
            record["profile"] = {"error": "no trace written"}
    if code != 0 or "tokens_per_s_per_gpu" not in record:
        oom = any("OutOfMemoryError" in line or "CUDA out of memory" in line for line in tail)
        record["status"] = "timeout" if timed_out else ("oom" if oom else f"failed rc={code}")
        record["log_tail"] = tail[-12:]
    return record


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        print("launch still running at its time limit; stopping it", file=sys.stderr, flush=True)
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass


def summarize(args: argparse.Namespace, batch: int, steps: dict[int, dict]) -> dict:
    record: dict = {"bench": "titan_speed", "model": "1b" if not args.dry_run else "tiny-dry-run",
                    "flavor": TINY_FLAVOR if args.dry_run else FLAVOR, "gpus": args.gpus, "batch_size": batch,
                    "seq_len": 64 if args.dry_run else args.seq_len, "compile": bool(args.compile),
                    "cuda_graphs": bool(args.cuda_graphs), "attn": args.attn,
                    "loss": "CrossEntropyLoss (full logits, fp32)" if args.loss == "ce" else "ChunkedLossWrapper",
                    "activation_checkpointing": False,
                    "mixed_precision": "bf16 params, fp32 reduce (FSDP2)", "optimizer": f"AdamW lr {args.lr}",
                    "steps": args.steps, "warmup": args.warmup, "data": DATA_NOTE, "dry_run": args.dry_run,
                    "profiled": args.profile,
                    "logged_steps": len(steps)}
    last_timed = args.steps - PROFILE_WARMUP - PROFILE_ACTIVE if args.profile else args.steps
    timed = [steps[s] for s in sorted(steps) if args.warmup < s <= last_timed]
    if not timed:
        return record
    tps = [float(s["tps"].replace(",", "")) for s in timed]
    mean_tps = len(tps) / sum(1.0 / t for t in tps) if all(tps) else 0.0
    mfus = [float(s["mfu"].rstrip("%")) for s in timed if s["mfu"] != "N/A"]
    tflops = [float(s["tflops"].replace(",", "")) for s in timed]
    last = steps[max(steps)]
    record.update(
        status="ok", timed_steps=len(timed), tokens_per_s_per_gpu=round(mean_tps, 1),
        tokens_per_s_total=round(mean_tps * args.gpus, 1),
        tokens_per_s_per_gpu_steps=tps,
        tflops_per_gpu=round(sum(tflops) / len(tflops) * mean_tps / (sum(tps) / len(tps)), 2) if tps else None,
        mfu_pct=round(sum(mfus) / len(mfus) * mean_tps / (sum(tps) / len(tps)), 2) if mfus else None,
        peak_mem_gib=max(float(s["mem"]) for s in steps.values()),
        peak_mem_pct=max(float(s["mem_pct"]) for s in steps.values()),
        peak_mem_kind="TorchTitan's logged max reserved",
        first_loss=float(steps[min(steps)]["loss"]), last_loss=float(last["loss"]),
    )
    return record


def parent(args: argparse.Namespace) -> int:
    records = []
    for batch in [int(b) for b in str(args.batch_size).split(",") if b.strip()]:
        record = run_one(args, batch)
        records.append(record)
        if _common is not None:
            _common.append_result(args.out, record)
        else:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with open(Path(args.out) / "results.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
            print("RESULT " + json.dumps(record), flush=True)
        if record.get("status") == "oom" and args.gpus > 1:
            break
    print_table(records)
    return 0 if records and all(r.get("status") == "ok" for r in records) else 1


def print_table(records: list[dict]) -> None:
    print(f"\nTorchTitan {records[0].get('torchtitan', '?') if records else '?'} speed anchor ({DATA_NOTE})")
    print(f"{'model':>12} {'gpus':>4} {'batch':>5} {'status':>10} {'tok/s/gpu':>11} {'tflops':>8} {'MFU %':>7} "
          f"{'peak GiB':>9}")
    def fmt(r: dict, key: str, spec: str) -> str:
        value = r.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    for r in records:
        print(f"{r['model']:>12} {r['gpus']:>4} {r['batch_size']:>5} {r.get('status', '?'):>10} "
              f"{fmt(r, 'tokens_per_s_per_gpu', ',.0f'):>11} {fmt(r, 'tflops_per_gpu', '.1f'):>8} "
              f"{fmt(r, 'mfu_pct', '.1f'):>7} {fmt(r, 'peak_mem_gib', '.1f'):>9}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Worker (one per rank, under torchrun): TorchTitan's config parsing, Trainer and training loop.
# ---------------------------------------------------------------------------------------------------------

def _ensure_hf_datasets() -> str:
    """TorchTitan's trainer imports Hugging Face `datasets` (for its own dataloaders, unused here).

    The carried wheel is used when it imports; if it does not (e.g. a version clash with the machine's
    pyarrow or huggingface_hub), a placeholder module stands in, since this benchmark never loads a dataset.
    """
    try:
        import datasets

        return getattr(datasets, "__version__", "?")
    except Exception as err:  # noqa: BLE001 - any import failure means: use the placeholder
        reason = f"{type(err).__name__}: {err}"

        def unavailable(*_args, **_kwargs):
            raise RuntimeError(f"Hugging Face datasets is not usable here ({reason}); titan_speed uses synthetic data")

        module = types.ModuleType("datasets")
        module.Dataset = type("Dataset", (), {})
        module.IterableDataset = type("IterableDataset", (), {})
        module.load_dataset = unavailable
        module.concatenate_datasets = unavailable
        distributed = types.ModuleType("datasets.distributed")
        distributed.split_dataset_by_node = unavailable
        module.distributed = distributed
        sys.modules["datasets"] = module
        sys.modules["datasets.distributed"] = distributed
        return f"placeholder ({reason})"


def _prepare_cpu_dry_run() -> None:
    """On a CPU-only host make TorchTitan pick device 'cpu' (and so gloo) instead of its 'cuda' fallback."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    # TorchTitan's memory monitor calls these on its device module; torch.cpu lacks some of them.
    stand_ins = {"set_device": lambda device: None, "get_device_name": lambda device=None: "cpu",
                 "reset_peak_memory_stats": lambda device=None: None,
                 "empty_cache": lambda: None, "memory_stats": lambda device=None: {},
                 "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=2**30)}
    for name, stand_in in stand_ins.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, stand_in)
    torch.cpu.current_device = lambda: 0  # TorchTitan passes it to barrier(device_ids=[...]), which wants an int


def _torch_compat_shims() -> list[str]:
    """Fill in torch APIs that TorchTitan 0.3.0 calls but released torch builds may lack; returns their names.

    `torch.distributed.set_timeout` (called by the Trainer after step 1) is a 2026 nightly rename of the
    long-standing private `distributed_c10d._set_pg_timeout`, absent from torch 2.11 and 2.13 builds.
    `torch.distributed.fsdp.DataParallelMeshDims` (2026) is imported unconditionally by TorchTitan but only
    used by its "spmd_types"/"full_dtensor" backends; this benchmark runs the classic "partial_dtensor" FSDP2
    path, so a placeholder is enough where torch lacks it.
    """
    import dataclasses

    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from torch.distributed import distributed_c10d

    shims = []
    if not hasattr(dist, "set_timeout") and hasattr(distributed_c10d, "_set_pg_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout
        shims.append("torch.distributed.set_timeout=_set_pg_timeout")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = dataclasses.make_dataclass(
            "DataParallelMeshDims", [("shard", object, None), ("replicate", object, None)])
        shims.append("torch.distributed.fsdp.DataParallelMeshDims placeholder")
    return shims


def _install_extensions() -> None:
    """Register the `regent1b`/`regent_tiny` flavors and the synthetic tokenizer/dataloader with TorchTitan.

    Defined at run time (TorchTitan must be imported first); the classes and the config function land in
    this module's globals, where TorchTitan's ConfigManager (`--module __main__`) finds the function.
    """
    import torch
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models import llama3 as titan_llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model

    def make_flavor(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab: int, multiple_of: int,
                    ffn_dim_multiplier: float | None):
        def flavor(attn_backend: str, tp_gemm_backend: str = "default") -> Llama3Model.Config:
            # "sdpa" is not one of TorchTitan's language-model backends: build with flex, then swap in its
            # causal ScaledDotProductAttention (the dataloader then sends no positions, so no masks are built).
            layers = titan_llama3._build_llama3_layers(
                fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=multiple_of,
                                                  ffn_dim_multiplier=ffn_dim_multiplier),
                rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
                attn_backend="flex" if attn_backend == "sdpa" else attn_backend, tp_gemm_backend=tp_gemm_backend)
            if attn_backend == "sdpa":
                for layer in layers:
                    layer.attention.inner_attention = ScaledDotProductAttention.Config()
            return Llama3Model.Config(
                dim=dim, vocab_size=vocab, enable_weight_tying=False,
                tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                                param_init=titan_llama3._EMBEDDING_INIT),
                norm=RMSNorm.Config(normalized_shape=dim, param_init=titan_llama3._NORM_INIT),
                lm_head=Linear.Config(in_features=dim, out_features=vocab,
                                      param_init=titan_llama3._output_linear_init(dim)),
                layers=layers)
        return flavor

    # Regent's "1b": dim 2048, 16 layers, 32 heads, 8 KV heads, vocab 128256, ffn multiple_of 1024 x 1.5
    # (= 8192 hidden), RoPE theta 500000 + Llama 3.1 scaling, RMSNorm eps 1e-5 (TorchTitan's default), untied.
    titan_llama3.llama3_configs[FLAVOR] = make_flavor(2048, 16, 32, 8, 128256, 1024, 1.5)
    titan_llama3.llama3_configs[TINY_FLAVOR] = make_flavor(64, 2, 4, 2, 512, 64, None)

    class SyntheticTokenizer(BaseTokenizer):
        """Stands in for a tokenizer: only its vocab size is used (no files are read)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 128256

        def __init__(self, config: Config, *, tokenizer_path: str | None = None):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("synthetic tokenizer: no text")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("synthetic tokenizer: no text")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class RandomTokens(IterableDataset):
        """An endless stream of (input, label) rows cycling through a small pool of random sequences."""

        def __init__(self, vocab: int, seq_len: int, batch: int, seed: int, positions: bool):
            generator = torch.Generator().manual_seed(seed)
            self.pool = torch.randint(0, vocab, (4 * batch, seq_len + 1), generator=generator)
            self.positions = torch.arange(seq_len) if positions else None

        def __iter__(self):
            i = 0
            while True:
                row = self.pool[i % len(self.pool)]
                i += 1
                inputs = {"input": row[:-1]}
                if self.positions is not None:
                    inputs["positions"] = self.positions
                yield inputs, row[1:]

    class SyntheticDataLoader(BaseDataLoader):
        """Batches of uniform random token ids, different per data-parallel rank."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 128256
            seed: int = 0
            emit_positions: bool = False

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer=None, seq_len: int,
                     local_batch_size: int, snapshot_every_n_steps: int | None = None, **kwargs):
            self.loader = torch.utils.data.DataLoader(
                RandomTokens(config.vocab_size, seq_len, local_batch_size, config.seed + dp_rank,
                             config.emit_positions), batch_size=local_batch_size, num_workers=0)

        def __iter__(self):
            return iter(self.loader)

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    globals().update(SyntheticTokenizer=SyntheticTokenizer, SyntheticDataLoader=SyntheticDataLoader)


def regent_speed_config():
    """TorchTitan job config (a `Trainer.Config`), found by ConfigManager as `--config regent_speed_config`."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry
    from torchtitan.tools.profiler import Profiler
    from torchtitan.trainer import Trainer

    profile_freq = int(os.environ.get(ENV_PROFILE, "0"))
    flavor, attn = os.environ.get(ENV_FLAVOR, FLAVOR), os.environ.get(ENV_ATTN, "sdpa")
    model_spec = model_registry(flavor, attn_backend=attn)
    model_spec.state_dict_adapter = None  # no HF checkpoint conversion (nothing is loaded or saved)
    vocab = model_spec.model.vocab_size
    loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    if os.environ.get(ENV_LOSS, "ce") == "chunked":  # needs torch >= 2.13's FSDP2 (see the module docstring)
        loss = ChunkedLossWrapper.Config(loss_fn=loss)
    return Trainer.Config(
        model_spec=model_spec,
        loss=loss,
        tokenizer=SyntheticTokenizer.Config(vocab_size=vocab),  # noqa: F821 - defined by _install_extensions
        dataloader=SyntheticDataLoader.Config(vocab_size=vocab, emit_positions=attn != "sdpa"),  # noqa: F821
        optimizer=default_adamw(lr=float(os.environ.get("TITAN_SPEED_LR", "3e-4"))),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=4, seq_len=2048, steps=15,
                                disable_cuda_graphs=os.environ.get(ENV_GRAPHS, "0") != "1",
                                mixed_precision_param="bfloat16", mixed_precision_reduce="float32"),
        # The classic FSDP2 path (fully_shard over the "fsdp" mesh); TorchTitan 0.3.0's default "spmd_types"
        # backend needs fully_shard(dp_mesh_dims=...) semantics that released torch builds reject.
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile=CompileConfig(enable=os.environ.get(ENV_COMPILE, "0") == "1"),
        activation_checkpoint=None,
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True, enable_tensorboard=False),
        profiler=Profiler.Config(enable_profiling=profile_freq > 0, profile_freq=max(profile_freq, 10),
                                 profiler_warmup=PROFILE_WARMUP, profiler_active=PROFILE_ACTIVE,
                                 save_traces_folder=PROFILE_FOLDER),
    )


def worker(args: argparse.Namespace) -> int:
    """What `torchtitan.train.main` does, plus a small info file from rank 0."""
    os.environ["TITAN_SPEED_LR"] = str(args.lr)
    if os.environ.get(ENV_DRY) == "1":
        _prepare_cpu_dry_run()
    hf_datasets = _ensure_hf_datasets()
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    shims = _torch_compat_shims()
    _install_extensions()
    init_logger()
    logger.info(f"titan_speed: torchtitan {torchtitan.__version__}, torch {torch.__version__}, "
                f"datasets {hf_datasets}, shims {shims}, loss {os.environ.get(ENV_LOSS, 'ce')}, data {DATA_NOTE}")
    config = ConfigManager().parse_args(args.titan_args)
    trainer = None
    try:
        trainer = config.build()
        trainer.train()
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and os.environ.get(ENV_INFO):
        info = _common.machine_info() if _common is not None else {"torch": torch.__version__}
        device = trainer.device
        info.update(torchtitan=torchtitan.__version__, torch=torch.__version__, hf_datasets=hf_datasets,
                    torch_shims=shims, flops_per_token=trainer.metrics_processor.num_flops_per_token,
                    num_params=sum(p.numel() for m in trainer.model_parts for p in m.parameters()),
                    titan_peak_flops=trainer.metrics_processor.gpu_peak_flops)
        if device.type == "cuda":
            info["max_allocated_gib_last_step"] = torch.cuda.max_memory_allocated(device) / 2**30
        from torch._dynamo.utils import counters

        info["dynamo"] = {"graph_breaks": sum(counters["graph_break"].values()),
                          "unique_graphs": counters["stats"].get("unique_graphs", 0),
                          "counters": {group: {str(k): v for k, v in values.items()}
                                       for group, values in counters.items() if values}}
        with open(os.environ[ENV_INFO], "w") as f:
            json.dump(info, f)
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    sys.exit(main())
