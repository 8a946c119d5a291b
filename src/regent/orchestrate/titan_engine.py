"""TorchTitan's own Trainer under `regent train`: `regent train --engine torchtitan --titan.config NAME`.

Each trainer process builds TorchTitan's `Trainer` from a TorchTitan config (its model from the model registry
and flavor, FSDP2 through its parallelize function, its loss, its optimizer and LR-scheduler containers, its
tokenizer and dataloader) and this module drives it through Regent's user-trainer protocol
(`regent.orchestrate.user_trainer`): `forward_backward(batch_index)` is TorchTitan's own forward, loss and
backward (`Trainer.forward_backward_step`, with its gradient accumulation); Regent does what TorchTitan's
`train()` loop would do around it (zero_grad, the commit vote, optimizer and scheduler steps, clipping to
`training.max_norm`), plus the cross-replica average, the Lighthouse and peer healing: `ExternalTrainer.train_step`
under the step's one owner, `regent.ft.step.FaultTolerantStep`, as for any user trainer. A healer receives the
model and optimizer state, the LR-scheduler container's state and the dataloader's `state_dict()`.

`--titan.config` names the TorchTitan config:
- a config function of TorchTitan's registry: `llama3_debugmodel` (module `llama3` from the prefix), or
  `MODULE:FUNCTION` as TorchTitan's own `--module MODULE --config FUNCTION` (a short model name or a
  dotted module of your own);
- a bare llama3 flavor (`debugmodel`, `8B`, ...): `llama3_debugmodel`'s job settings with that model;
- a `.toml` file with `config = "..."` (one of the above) and optionally `args = ["--training.seq_len",
  "256", ...]`.
`--titan.args "--training.seq_len 256 ..."` (a trainer option) adds TorchTitan CLI overrides, parsed by
TorchTitan's ConfigManager.

Data: `data=synthetic` (the default) swaps in a seeded random-token dataloader (batches drawn from a pool of
64 random sequences, so the loss goes down) and a tokenizer stand-in,
registered through TorchTitan's Configurable extension points, so nothing is downloaded; `data=config` keeps
the config's own (e.g. a Hugging Face dataset; it must be reachable). Either way the dataloader is sharded over
the ranks of every replica (replica r, batch rank k of K: shard r*K + k of R*K).

What is not supported (refused with a message): pipeline parallelism (several model parts), models whose
optimizer needs TorchTitan's post-build hooks (MoE load balancing), several optimizers per model.
TorchTitan's own checkpointer, validator and metric logging are switched off: Regent's healing, backstop and
metrics replace them under `regent train`.

On a CPU-only host TorchTitan (0.3.0) would pick device "cuda"; this module makes it see "cpu" while it is
imported, and gives `torch.cpu` the few memory-stat functions TorchTitan's metrics call (answering 0).
"""

from __future__ import annotations

import contextlib
import copy
import os
import shlex
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from regent.orchestrate.user_trainer import TrainerContext

INSTALL_HINT = ("pip install 'regent-ml[titan]' (TorchTitan 0.3.0 and its dependencies; on a host without CUDA "
                "TorchTitan also needs the `triton` package importable, e.g. pip install triton)")

_registered: dict[str, Any] = {}


class TitanUnavailable(ImportError):
    """TorchTitan (or a module it needs) cannot be imported here."""


def check_available() -> str:
    """TorchTitan's version if its trainer imports here; else TitanUnavailable saying why and how to install."""
    try:
        titan = _import_titan()
    except ImportError as exc:
        raise TitanUnavailable(f"--engine torchtitan needs TorchTitan, which does not import here ({exc}); "
                               f"{INSTALL_HINT}") from exc
    return titan.__version__


@contextlib.contextmanager
def _cpu_device_type() -> Iterator[None]:
    """TorchTitan reads the device type once, at import (`torchtitan.tools.utils`), and falls back to "cuda"
    when none is available. On a host without CUDA, let that read say "cpu"; restored afterwards."""
    import torch._utils as tu

    original = tu._get_available_device_type
    if not torch.cuda.is_available() and original() is None:
        tu._get_available_device_type = lambda: "cpu"
    try:
        yield
    finally:
        tu._get_available_device_type = original


def _cpu_memory_stats_stand_ins() -> None:
    """TorchTitan's DeviceMemoryMonitor calls these on its device module; torch.cpu lacks some. They answer
    "no figures" (0 bytes), which TorchTitan only logs."""
    import types

    stand_ins = {"get_device_name": lambda device=None: "cpu", "reset_peak_memory_stats": lambda device=None: None,
                 "empty_cache": lambda: None, "memory_stats": lambda device=None: {},
                 "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=2**40)}
    for name, fn in stand_ins.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _torch_compat() -> None:
    """TorchTitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims` (a 2026 torch API, absent from
    torch 2.11) unconditionally, but uses it only in its "spmd_types"/"full_dtensor" backends. The engine runs the
    classic "partial_dtensor" FSDP2 path (prepare_config), so where torch lacks it a placeholder is enough (the
    same one benchmarks/gpu/titan_speed.py used on an H200 with torch 2.11)."""
    import dataclasses

    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = dataclasses.make_dataclass(
            "DataParallelMeshDims", [("shard", object, None), ("replicate", object, None)])


def _import_titan() -> Any:
    _torch_compat()
    with _cpu_device_type():
        import torchtitan
        import torchtitan.trainer  # the components (and Hugging Face datasets) import now, under the patch
        from torchtitan.tools import utils

    if utils.device_type == "cuda" and not torch.cuda.is_available():
        raise ImportError("torchtitan was imported before regent.orchestrate.titan_engine and chose device "
                          "'cuda' on a host without CUDA; import it through this module")
    return torchtitan


# ---------------------------------------------------------------------------------------------------------
# TorchTitan extensions: a synthetic dataloader and tokenizer, and the cross-replica sharding of a dataloader
# ---------------------------------------------------------------------------------------------------------

def _extensions() -> dict[str, Any]:
    """Defined once TorchTitan is importable (they subclass its bases)."""
    if _registered:
        return _registered
    from dataclasses import dataclass

    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class SyntheticTokenizer(BaseTokenizer):
        """Stands in for a tokenizer: only the vocabulary size is used (no files are read)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("synthetic tokenizer: there is no text")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("synthetic tokenizer: there is no text")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticDataLoader(BaseDataLoader):
        """Batch k of shard s is a pure function of (seed, s, k): rows of a fixed pool of uniform random token
        sequences, the labels being the inputs shifted by one. Its state is the position, so a healer continues
        with its donor's batch."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048
            seed: int = 0
            positions: bool = False  # also send positions (masked attention builds its masks from them)
            pool: int = 64  # distinct sequences the batches are drawn from

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any = None,
                     seq_len: int, local_batch_size: int, **_: Any) -> None:
            self.config, self.shard, self.seq_len, self.batch = config, dp_rank, seq_len, local_batch_size
            self.position = 0
            # a fixed pool of random sequences (the same for every shard), so that the loss can go down
            g = torch.Generator().manual_seed(config.seed)
            self.pool = torch.randint(0, config.vocab_size, (config.pool, seq_len + 1), generator=g)

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                g = torch.Generator().manual_seed((self.config.seed * 1_000_003 + self.shard) * 1_000_003
                                                  + self.position)
                rows = self.pool[torch.randint(0, len(self.pool), (self.batch,), generator=g)]
                self.position += 1
                inputs = {"input": rows[:, :-1]}
                if self.config.positions:
                    inputs["positions"] = torch.arange(self.seq_len).expand(self.batch, -1)
                yield inputs, rows[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"position": self.position}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.position = int(state_dict["position"])

    class ReplicaShardedDataLoader(BaseDataLoader):
        """Builds `inner` with the data-parallel rank and size of the whole job (every replica's batch ranks),
        so that replicas train on different data; delegates everything else."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            inner: Any = None
            replica_index: int = 0
            num_replicas: int = 1

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> None:
            self.inner = config.inner.build(dp_world_size=dp_world_size * config.num_replicas,
                                            dp_rank=config.replica_index * dp_world_size + dp_rank, **kwargs)

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            return iter(self.inner)

        def state_dict(self) -> dict[str, Any]:
            return self.inner.state_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.inner.load_state_dict(state_dict)

    _registered.update(SyntheticTokenizer=SyntheticTokenizer, SyntheticDataLoader=SyntheticDataLoader,
                       ReplicaShardedDataLoader=ReplicaShardedDataLoader)
    return _registered


# ---------------------------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------------------------

def resolve_config(spec: str, args: list[str]) -> Any:
    """`--titan.config` (+ overrides) -> TorchTitan's Trainer.Config, through TorchTitan's ConfigManager."""
    from torchtitan.config import ConfigManager

    spec = spec.strip()
    if not spec:
        raise ValueError("--titan.config is empty: name a TorchTitan config (llama3_debugmodel, "
                         "MODULE:FUNCTION), a llama3 flavor (debugmodel) or a .toml file")
    if spec.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib

        try:
            with open(spec, "rb") as f:
                table = tomllib.load(f)
        except OSError as exc:
            raise ValueError(f"--titan.config {spec}: cannot read it ({exc})") from exc
        if "config" not in table:
            raise ValueError(f"--titan.config {spec}: the file needs config = \"llama3_debugmodel\" (or "
                             "MODULE:FUNCTION, or a flavor) and optionally args = [\"--training.seq_len\", \"256\"]")
        return resolve_config(str(table["config"]), [str(a) for a in table.get("args", [])] + args)
    flavor = None
    if ":" in spec:
        module, function = spec.split(":", 1)
    elif "_" in spec and not _is_llama3_flavor(spec):
        module, function = spec.split("_", 1)[0], spec
    else:
        if not _is_llama3_flavor(spec):
            raise ValueError(f"--titan.config {spec!r}: not a llama3 flavor of TorchTitan's registry "
                             f"({sorted(_llama3_flavors())}) nor a config name (llama3_debugmodel, MODULE:FUNCTION)")
        module, function, flavor = "llama3", "llama3_debugmodel", spec
    config = ConfigManager().parse_args(["--module", module, "--config", function, *args])
    if flavor is not None:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.models.common.config_utils import decoder_vocab_size
        from torchtitan.models.llama3 import model_registry

        config.model_spec = model_registry(flavor)
        vocab = decoder_vocab_size(config.model_spec)
        if isinstance(config.loss, ChunkedLossWrapper.Config):
            config.loss.loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab)
        else:
            config.loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    return config


def _llama3_flavors() -> list[str]:
    from torchtitan.models import llama3

    return list(getattr(llama3, "llama3_configs", {}))


def _is_llama3_flavor(name: str) -> bool:
    return name in _llama3_flavors()


def _explicit(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def flex_masks_supported() -> bool:
    """Whether this torch's FlexAttention builds the block masks TorchTitan 0.3.0 asks for: it passes
    `create_block_mask(..., separate_full_blocks=...)`, which torch 2.11 lacks (every step raised TypeError on
    an H200 with torch 2.11). Without it, `attn=auto` uses TorchTitan's causal SDPA, as on CPU."""
    import inspect

    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return False
    return "separate_full_blocks" in inspect.signature(create_block_mask).parameters


def chunked_loss_runs(torch_version: str) -> bool:
    """Whether TorchTitan's `ChunkedLossWrapper` trains under this torch's FSDP2. It runs lm_head (one FSDP
    unit with the final norm) outside the model's forward, with one backward per chunk; at the end of those
    backwards torch 2.11's FSDP2 reshards the unit and frees the unsharded norm weight that the decoder's
    final RMSNorm saved for backward, so the decoder's backward fails ("The tensor has a non-zero number of
    elements, but its data is not allocated yet", in `_fused_rms_norm_backward`; seen on an H200 with torch
    2.11, every start). torch 2.13 runs it. `torch_version` as `torch.__version__` ("2.11.0+cu130")."""
    import re

    numbers = [int(n) for n in re.findall(r"\d+", torch_version.split("+")[0])[:2]]
    return len(numbers) == 2 and tuple(numbers) >= (2, 13)


def prepare_config(config: Any, ctx: TrainerContext, args: list[str], data: str = "synthetic",
                   attn: str = "auto", ac: str = "config", loss: str = "auto") -> Any:
    """What Regent sets on the TorchTitan config: sharding over replicas, synthetic data unless asked
    otherwise, the same seed everywhere, one output folder per replica, and the parts Regent replaces off."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    ext = _extensions()
    masked_types = (FlexAttention.Config, VarlenAttention.Config)
    if attn == "auto":
        attn = "sdpa" if ctx.device.type == "cpu" or not flex_masks_supported() else "config"
    if attn == "sdpa":
        # TorchTitan's causal SDPA in place of its masked attention (FlexAttention has no backward on CPU). Its
        # trainer sends such a backend positions but no masks; over the synthetic data (one document per row)
        # causal is what block-causal masking computes.
        for _, _, parent, attr in list(config.model_spec.model.traverse(masked_types)):
            if parent is None:
                raise ValueError("attn=sdpa: the model config itself is an attention config")
            if isinstance(parent, list):
                parent[attr] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, attr, ScaledDotProductAttention.Config())
    elif attn != "config":
        raise ValueError(f"trainer option attn={attn!r}: use auto (default: sdpa on CPU or where this torch's "
                         "FlexAttention lacks what TorchTitan asks of it), sdpa or config")
    vocab = config.model_spec.model.vocab_size
    if data == "synthetic":
        config.tokenizer = ext["SyntheticTokenizer"].Config(vocab_size=vocab)
        masked = any(True for _ in config.model_spec.model.traverse(masked_types))
        config.dataloader = ext["SyntheticDataLoader"].Config(vocab_size=vocab, seed=ctx.seed, positions=masked)
    elif data != "config":
        raise ValueError(f"trainer option data={data!r}: use synthetic (default) or config")
    config.dataloader = ext["ReplicaShardedDataLoader"].Config(inner=config.dataloader,
                                                               replica_index=ctx.replica_index,
                                                               num_replicas=ctx.num_replicas)
    config.dump_folder = os.path.join(ctx.run_dir, "titan", f"replica_{ctx.replica_index}")
    if config.debug.seed is None:
        config.debug.seed = ctx.seed  # identical initial weights in every replica
    config.checkpoint = CheckpointManager.Config(enable=False)  # Regent heals from peers and keeps the backstop
    config.validator.enable = False
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    if not _explicit(args, "--parallelism.spmd_backend"):
        # TorchTitan 0.3.0's default "spmd_types" backend needs FSDP2 APIs newer than released torch builds
        # (fully_shard(dp_mesh_dims=...)); its classic DTensor FSDP2 path runs on them.
        config.parallelism.spmd_backend = "partial_dtensor"
    if ac == "off":  # `--trainer-opt ac=off`: no activation checkpointing, whatever the config says
        config.activation_checkpoint = None
    elif ac != "config":
        raise ValueError(f"trainer option ac={ac!r}: use config (default: the TorchTitan config's own) or off")
    from torchtitan.components.loss import ChunkedLossWrapper

    if loss == "auto":
        loss = "config" if chunked_loss_runs(torch.__version__) else "plain"
        if loss == "plain" and isinstance(config.loss, ChunkedLossWrapper.Config):
            import logging

            logging.getLogger(__name__).warning(
                "torch %s: TorchTitan's chunked loss does not train under this torch's FSDP2 (see "
                "chunked_loss_runs); using its inner loss on the full logits (same loss, more memory). "
                "--trainer-opt loss=config keeps the chunked one", torch.__version__)
    if loss == "plain":
        if isinstance(config.loss, ChunkedLossWrapper.Config):
            config.loss = config.loss.loss_fn  # the per-chunk loss on the whole sequence at once
    elif loss != "config":
        raise ValueError(f"trainer option loss={loss!r}: use auto (default: the config's loss, or its inner loss "
                         "where this torch cannot run TorchTitan's chunked loss), config or plain")
    if ctx.device.type == "cpu" and not _explicit(args, "--training.mixed_precision_param"):
        config.training.mixed_precision_param = "float32"
    return config


# ---------------------------------------------------------------------------------------------------------
# The trainer Regent drives
# ---------------------------------------------------------------------------------------------------------

class TitanTrainer:
    """TorchTitan's Trainer, seen through Regent's user-trainer protocol."""

    def __init__(self, ctx: TrainerContext) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        options = ctx.options
        spec = str(options.get("titan.config") or options.get("config") or "")
        args = shlex.split(str(options.get("titan.args") or options.get("args") or ""))
        data = str(options.get("data", "synthetic"))
        check_available()
        _cpu_memory_stats_stand_ins()
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils

        self._ignore_index = IGNORE_INDEX
        self._dist_utils = dist_utils
        os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
        if not dist.is_initialized():  # one process per replica: Regent starts no group, TorchTitan wants one
            from regent import platform

            dist.init_process_group(backend=platform.backend(), store=dist.HashStore(), rank=0, world_size=1)
        steps = options.get("regent.steps")
        if steps and not _explicit(args, "--training.steps"):  # `regent train --steps N`: TorchTitan's horizon
            args = [*args, "--training.steps", str(steps)]
        config = prepare_config(resolve_config(spec, args), ctx, args, data, str(options.get("attn", "auto")),
                                str(options.get("ac", "config")), str(options.get("loss", "auto")))
        spec_model = config.model_spec
        if spec_model.post_optimizer_build_fn is not None:
            raise NotImplementedError(f"{spec_model.name} {spec_model.flavor} needs TorchTitan's post-optimizer "
                                      "hooks (e.g. MoE load balancing), which --engine torchtitan does not run yet")
        self.titan = config.build()  # TorchTitan's Trainer: model, FSDP2, loss, optimizers, schedule, data
        t = self.titan
        if t.parallel_dims.pp_enabled or len(t.model_parts) != 1:
            raise NotImplementedError("--engine torchtitan runs one model part per rank (no pipeline parallelism)")
        if len(t.optimizers) != 1:
            raise NotImplementedError(f"--engine torchtitan drives one optimizer per model; this config builds "
                                      f"{len(t.optimizers)}")
        self.model = t.model_parts[0]
        self.optimizer = t.optimizers.optimizers[0]  # the container only loops over its optimizers
        self.lr_scheduler = t.lr_schedulers  # state {"last_epoch"}; steps every scheduler of the container
        # TorchTitan's loop stops at training.steps; a Regent run stops at its --steps or --duration. Past
        # TorchTitan's last step its schedules are not meant to be read (the linear decay turns negative), so
        # the LR stays at the value of its last step there.
        last = max(int(config.training.steps) - 1, 0)
        for scheduler in t.lr_schedulers.schedulers:
            scheduler.lr_lambdas = [_HoldAfter(fn, last) for fn in scheduler.lr_lambdas]
        self.grad_clip = float(config.training.max_norm or 0.0)
        self._iterator: Iterator[Any] | None = None
        self._drawn = 0  # micro-batches taken from the dataloader
        # The dataloader's state before micro-batch n, for the last few n. A donor's state can be read while its
        # step runs (between its draw and Regent counting the batch), so a healer receives the positions around
        # it and starts from the one Regent's batch index names.
        self._lock = threading.Lock()
        self._states: dict[int, Any] = {0: copy.deepcopy(t.dataloader.state_dict())}

    # -- one step ----------------------------------------------------------------------------------------
    def _next_batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if self._iterator is None:
            self._iterator = iter(self.titan.dataloader)
        try:
            batch = next(self._iterator)
        except StopIteration as exc:
            raise RuntimeError("TorchTitan's dataloader ran out of data") from exc
        with self._lock:
            self._drawn += 1
            self._states[self._drawn] = copy.deepcopy(self.titan.dataloader.state_dict())
            for n in [n for n in self._states if n < self._drawn - 2 * self.titan.gradient_accumulation_steps]:
                del self._states[n]
        return batch

    def forward_backward(self, batch_index: int) -> dict[str, Any]:
        t = self.titan
        accum = t.gradient_accumulation_steps
        want = batch_index * accum
        if want != self._drawn:  # healed: move the dataloader to the state before micro-batch `want`
            with self._lock:
                if want not in self._states:
                    raise RuntimeError(f"data position out of step: Regent asks for step batch {batch_index} "
                                       f"(micro-batch {want}); the dataloader states held are for micro-batches "
                                       f"{sorted(self._states)}")
                self.titan.dataloader.load_state_dict(copy.deepcopy(self._states[want]))
                self._iterator, self._drawn = None, want
        micro = [self._next_batch() for _ in range(accum)]
        local_valid = torch.tensor(0, dtype=torch.int64)
        for _, labels in micro:
            local_valid += (labels != self._ignore_index).sum()
        dims = t.parallel_dims
        batch_mesh = dims.get_mesh("batch") if dims.dp_enabled else None
        if batch_mesh is not None:
            global_valid = self._dist_utils.dist_sum_tensor(local_valid.to(t.device), batch_mesh)
        else:
            global_valid = local_valid.to(t.device)
        total = None
        for input_dict, labels in micro:
            input_dict = {k: v.to(t.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            loss = t.forward_backward_step(input_dict=input_dict, labels=labels.to(t.device),
                                           global_valid_tokens=global_valid).detach()
            total = loss if total is None else total + loss
        assert total is not None
        # The loss is this rank's token sum over the replica's valid tokens: the replica's mean is its sum.
        shown = self._dist_utils.dist_sum(total, batch_mesh) if batch_mesh is not None else float(total)
        return {"loss": total, "replica_loss": float(shown), "tokens": int(local_valid)}

    # -- state a healer needs besides model, optimizer and schedule ----------------------------------------
    def extra_state(self) -> dict[str, Any]:
        with self._lock:
            return {"dataloader_states": copy.deepcopy(self._states), "ntokens_seen": self.titan.ntokens_seen}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._states = {int(n): st for n, st in state["dataloader_states"].items()}
            self._drawn = -1  # the next forward_backward loads the state its batch index names
        self.titan.ntokens_seen = int(state.get("ntokens_seen", 0))

    def close(self) -> None:
        self.titan.close()


class _HoldAfter:
    """A LambdaLR factor that keeps its value of step `last` for every later step."""

    def __init__(self, fn: Any, last: int) -> None:
        self.fn, self.last, self.warned = fn, last, False

    def __call__(self, step: int) -> float:
        if step > self.last and not self.warned:
            self.warned = True
            import logging

            logging.getLogger(__name__).warning(
                "past TorchTitan's training.steps (%d): the learning rate stays at its last value; set "
                "--steps N (or --titan.args='--training.steps N') for TorchTitan's full schedule", self.last + 1)
        return self.fn(min(step, self.last))


def make_trainer(ctx: TrainerContext) -> TitanTrainer:
    return TitanTrainer(ctx)


def _main() -> int:  # pragma: no cover - a manual smoke run: python -m regent.orchestrate.titan_engine CONFIG
    import tempfile

    ctx = TrainerContext(rank=0, world_size=1, replica_index=0, num_replicas=1, device=torch.device("cpu"),
                         seed=0, run_dir=tempfile.mkdtemp(), options={"titan.config": sys.argv[1],
                                                                       "titan.args": " ".join(sys.argv[2:])})
    trainer = make_trainer(ctx)
    for i in range(3):
        trainer.optimizer.zero_grad()
        out = trainer.forward_backward(i)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        print(i, out)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())

