"""LocalSGD, DiLoCo and Streaming DiLoCo on top of the Manager.

Replicas train independently for `sync_every` inner steps and then synchronise, so the cross-replica
network is used once per `sync_every` steps instead of every step.

- `LocalSGD`: average the parameters themselves.
- `DiLoCo` (arXiv 2311.08105): average the *pseudo-gradient* `last_global - local` and apply it with an
  outer optimizer (SGD with Nesterov momentum by default) to the last global parameters.
- Streaming DiLoCo (arXiv 2501.18512) is `DiLoCo` with several fragments: one fragment syncs every
  `sync_every / len(fragments)` inner steps; its allreduce starts `fragment_sync_delay` steps before it is
  applied (overlapping communication with compute); the result is mixed with the local parameters by
  `fragment_update_alpha` (0 = take the global parameters).

Fault tolerance: the last global parameters and the outer optimizer state of every fragment are registered
with the Manager (`register_state_dict_fn`), so a replica that heals receives them, outer momentum
included. The Manager step counts successful fragment syncs; every replica picks fragment
`step % len(fragments)`, so a failed sync (no commit) rolls the fragment back to its last global
parameters and the same fragment is retried at the next sync. Plain DiLoCo (one fragment) then also gives the
round's inner steps back to the caller (`steps_given_back`, `on_round_failed`): its data position goes back to
the round's first batch and the round is trained again, so every sample counts once, in a committed round.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from regent import settings
from regent.contiguous import contiguous_copy
from regent.ft.grad_sync import plan_buckets
from regent.ft.manager import Manager
from regent.ft.step import FaultTolerantStep
from regent.ft.transfer import local_view

logger = logging.getLogger(__name__)

# `rejoin_left_behind`: besides at its sync point, a replica asks whether the run committed past it every this many
# inner steps (the same steps on every rank of it: they agree through the group store). A replica paused for
# seconds resumes into a round the others already closed without it; asking only at its sync point, it trained the
# rest of a lost round first (4.6 s in a test), and then often arrived just as the others' next sync formed.
LEFT_BEHIND_CHECK_STEPS = 4
# A replica that joins a round in progress skips this many more inner steps than the holders are estimated to
# have taken, to reach the round's sync before their quorum forms (DiLoCo.join_now).
ARRIVE_EARLY_STEPS = 2

DEFAULT_BUCKET_CAP_MB = 32.0  # with use_bucketization and no bucket_cap_mb


def contributor_step(step_sum: float, whole: float, part_step_sum: float, part: float) -> int | None:
    """The step a sit-out lines up with after a sync (its round's end), from the sync's averaged sums: the step of
    the contributors that took the whole round, else that of those that joined it mid-way (they end it at the same
    step), else None (nobody trained: nothing to line up with)."""
    if whole > 0:
        return round(step_sum / whole)
    if part > 0:
        return round(part_step_sum / part)
    return None


def pseudo_gradient_weight(*, trained: int | None, full: int, micro_batches: int, steps: int) -> float:
    """What a replica's pseudo-gradient counts for in the sync's weighted average: the share of a whole round's
    inner steps it took (`trained` of `full` after joining mid-round; None: the whole round) times the
    replica-shard micro-batches it covered per inner step (`micro_batches` over its `steps` inner steps since the
    last sync: 1 each without a constant global batch, more while it covers missing replicas' shards). The sum of
    the contributors' weights is then the replica-shards of the round they covered (`regent.train.coverage`)."""
    share = 1.0 if trained is None else max(trained, 1) / full
    return share * (micro_batches / steps if steps > 0 else 1.0)


def steps_given_back(*, committed: bool, fragments: int, local_steps: int) -> int:
    """The inner steps a replica gives back when a sync ends: all of the round's (`local_steps`, those since the
    last sync, a mid-round joiner's skipped ones included) when the sync of plain DiLoCo's one fragment did not
    commit, else none.

    Plain DiLoCo: a sync that did not commit put the parameters back to the last global ones, so the round's
    samples had no effect; its data position (and step count and schedule, which move with it) goes back to the
    round's first batch and the round is trained again, as per-step mode gives a discarded step's batch back.
    Every replica of that sync does the same, so their positions stay equal. Streaming DiLoCo (several
    fragments) gives nothing back: only the failed fragment lost the samples' effect, the others keep it and
    commit it at their own syncs; training those samples again would count them twice there (the session
    records them as skipped for that fragment instead)."""
    return local_steps if not committed and fragments == 1 else 0


def fragment_bounds(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """Split parameters of `sizes` elements (in registration order) into `n` contiguous, non-empty groups
    [lo, hi) of about equal elements: Streaming DiLoCo's fragments of a model that names none (each syncs the
    same share of the bytes)."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"{n} fragments of {len(sizes)} parameters: need 1 <= fragments <= parameters")
    total = sum(sizes)
    bounds, lo, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left = n - len(bounds) - 1  # groups still to open after the one being filled
        # close the group once it holds its share, or when every parameter left must open a group of its own
        if left > 0 and (acc * n >= total * (len(bounds) + 1) or len(sizes) - (i + 1) == left):
            bounds.append((lo, i + 1))
            lo = i + 1
    bounds.append((lo, len(sizes)))
    return bounds


class _ParameterGroup(nn.Module):
    """Some parameters of a model, registered under their dotted names made flat (the same Parameter objects,
    so the fragment's sync changes the model's)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def model_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """`model` as `n` Streaming DiLoCo fragments (`fragment_bounds`); [model] itself for one."""
    if n == 1:
        return [model]
    named = list(model.named_parameters())
    return [_ParameterGroup(named[lo:hi]) for lo, hi in fragment_bounds([p.numel() for _, p in named], n)]


class LocalSGD:
    """Average the model parameters across replicas every `sync_every` optimizer steps.

    Use as a context manager around the training loop; it hooks `optimizer.step()` (through a
    `FaultTolerantStep`, the owner of a step's rules), unless `hook_optimizer=False`: then the caller's
    `FaultTolerantStep(manager, sync=this)` drives it.
    """

    def __init__(self, manager: Manager, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 *, hook_optimizer: bool = True):
        if sync_every < 1:
            raise ValueError(f"sync_every={sync_every}: must be >= 1")
        self._manager = manager
        self._model = model
        self._sync_every = sync_every
        self._local_step = 0
        self._unhook = (FaultTolerantStep(manager, per_step=False, sync=self).hook(optimizer) if hook_optimizer
                        else lambda: None)

    def __enter__(self) -> LocalSGD:
        return self

    def __exit__(self, *exc: object) -> None:
        self._unhook()

    def after_inner_step(self) -> None:
        """Count one inner step; average the parameters at the end of a round."""
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> bool:
        """Average parameters now; returns whether the sync committed (if not, local params are kept)."""
        self._local_step = 0
        self._manager.start_quorum()
        params = [p for p in self._model.parameters()]
        averaged = [p.detach().clone() for p in params]
        futures = [self._manager.allreduce(a) for a in averaged]
        for f in futures:
            f.wait()
        if not self._manager.should_commit():
            return False
        with torch.no_grad():
            for p, a in zip(params, averaged):
                p.copy_(a)
        return True


def _shard_like_params(optimizer: torch.optim.Optimizer) -> None:
    """After a load: state a peer sent as this rank's local shards (plain tensors) becomes DTensors laid out as
    their parameters are (FSDP2), as the optimizer would have made them itself. A no-op for plain parameters."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not hasattr(p, "device_mesh"):
                continue
            from torch.distributed.tensor import DTensor

            state = optimizer.state.get(p, {})
            local_shape = p.to_local().shape
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local_shape:
                    state[key] = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())


class _Fragment:
    """One model fragment: its last global parameters, its outer optimizer, its in-flight allreduce."""

    def __init__(
        self,
        manager: Manager,
        index: int,
        module: nn.Module,
        outer_optimizer: torch.optim.Optimizer,
        backup_device: torch.device | None,
        alpha: float,
        pin_memory: bool = True,
        bucket_bytes: int = 0,
    ) -> None:
        self.index = index
        self.bucket_bytes = bucket_bytes  # 0: one allreduce per parameter
        self.module = module
        self.outer = outer_optimizer
        self.alpha = alpha
        self._manager = manager
        self.params = dict(module.named_parameters())
        self.backup_device = backup_device
        # The last global parameters, in one buffer per device and dtype: a heal sends them as a few messages.
        backup = contiguous_copy(list(self.params.values()), backup_device)
        if pin_memory and torch.cuda.is_available() and all(t.device.type == "cpu" for t in backup):
            backup = contiguous_copy([t.pin_memory() for t in backup], torch.device("cpu"))  # faster copies to GPU
        self.original: dict[str, torch.Tensor] = dict(zip(self.params, backup))
        self._pseudo: dict[str, torch.Tensor] = {}
        self._futures: list[torch.futures.Future] = []
        self._weight: torch.Tensor | None = None
        self._local: dict[str, torch.Tensor] = {}  # local parameters of the sync in flight (for a retry)
        self.contributor_step: int | None = None
        # of the last committed sync: the sum of the contributors' weights, how many contributed (weight > 0)
        self.weight_sum = 0.0
        self.contributors = 0
        self.loaded = False  # a peer's state was loaded (a heal): its pseudo-gradient would be the donor's
        self.keep_local = False
        # TorchFT's key: a checkpoint of TorchFT's DiLoCo state loads here, and code reading it finds it
        manager.register_state_dict_fn(f"StreamingDiLoCoFragment_{index}", self.load_state_dict, self.state_dict)

    def state_dict(self) -> dict[str, Any]:
        return {"outer_optimizer": self.outer.state_dict(), "original_parameters": self.original}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = True
        with torch.no_grad():
            for name, t in state["original_parameters"].items():
                # a peer sends this rank's local shards (plain tensors); under FSDP2 the backup is a DTensor
                dst, src = local_view(self.original[name]), local_view(t)
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        self.outer.load_state_dict(state["outer_optimizer"])
        _shard_like_params(self.outer)

    def save_global(self) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                self.original[name].copy_(p.detach())

    def prepare_sync(self, sit_out: bool = False, retry: bool = False, round_step: int = 0,
                     weight: float = 1.0, whole_round: bool | None = None, in_phase: bool = False) -> None:
        """Pseudo-gradient = last global - local; launch its average (asynchronously).

        `sit_out`: this replica has no local steps of its own in this round (it has just healed or joined): it
        contributes zeros with weight 0, so the average is over the replicas that trained (a plain average
        would shrink everyone's update by the sit-outs' share). `weight` (> 0): the samples this replica's
        pseudo-gradient covers, in units of one replica's whole round (below 1: it joined mid-round and took
        only the inner steps left; above 1: with a constant global batch it covered missing replicas' shards,
        `pseudo_gradient_weight`); the average is weighted by it. `retry`: the previous attempt of this sync
        failed; start again from the local parameters it had. `round_step`: the caller's step count at this
        sync; the value of the replicas that took the whole round (`whole_round`; None: weight 1) is reported
        back (`contributor_step`) so that a sit-out can line up with them (it did not take the round's
        steps). `in_phase`: sitting out with a step count that is the run's all the same (Streaming DiLoCo, a
        replica inside its first window of this fragment since it joined): it reports its step too, or a
        replica joining at this sync would find no step to line up with when every other member sits out."""
        if not sit_out and not weight > 0.0:
            raise ValueError(f"weight={weight}: must be > 0")
        with torch.no_grad():
            if retry and self._local:
                for name, p in self.params.items():
                    p.copy_(self._local[name])
            if self.keep_local or self.alpha > 0:
                self._local = {name: p.detach().clone() for name, p in self.params.items()}
            if sit_out:
                self._pseudo = {name: torch.zeros_like(p.detach()) for name, p in self.params.items()}
            else:
                self._pseudo = {
                    name: self.original[name].to(p.device) - p.detach() for name, p in self.params.items()
                }
                if weight != 1.0:
                    for t in self._pseudo.values():
                        t.mul_(weight)
            device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
            w = 0.0 if sit_out else weight
            whole = in_phase or ((w == 1.0) if whole_round is None else (whole_round and not sit_out))
            full = 1.0 if whole else 0.0
            # a contributor that took only part of the round (joined mid-round) ends it at the same step as the
            # whole-round ones: its step is the fallback a sit-out lines up with when nobody took the whole round
            part = 1.0 if w > 0.0 and not whole else 0.0
            self._weight = torch.tensor([w, full * round_step, full, 1.0 if w > 0.0 else 0.0, part * round_step, part],
                                        dtype=torch.float64, device=device)
        if self.bucket_bytes:
            self._futures = self._allreduce_bucketed(list(self._pseudo.values()))
        else:
            self._futures = [self._manager.allreduce(t) for t in self._pseudo.values()]
        self._futures.append(self._manager.allreduce(self._weight))

    def _allreduce_bucketed(self, tensors: list[torch.Tensor]) -> list[torch.futures.Future]:
        """Average `tensors` in flat buckets of about `bucket_bytes` (fewer, larger collectives); each future
        copies its bucket's averages back into the tensors."""
        plan = plan_buckets([(t.numel() * t.element_size(), t.dtype, t.device) for t in tensors], self.bucket_bytes)
        futures = []
        for indices in plan:
            members = [tensors[i] for i in indices]
            flat = torch.cat([t.reshape(-1) for t in members])

            def unpack(f: torch.futures.Future, members: list[torch.Tensor] = members,
                       flat: torch.Tensor = flat) -> None:
                f.value()
                offset = 0
                for t in members:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

            futures.append(self._manager.allreduce(flat).then(unpack))
        return futures

    def perform_sync(self) -> bool:
        """Wait for the average, restore the global params, vote, and (on commit) take the outer step."""
        for f in self._futures:
            f.wait()
        self._futures = []
        committed_weight, step_sum, full, contributed, part_step_sum, part = (
            self._weight.tolist() if self._weight is not None else (1.0, 0.0, 0.0, 1.0, 0.0, 0.0))
        # Seen in a soak: a mid-round joiner was a sync's only contributor and two healed replicas sat it out; with
        # no whole-round step to line up with they kept their healed position, a round behind, and the next round's
        # replicas read different data.
        self.contributor_step = contributor_step(step_sum, full, part_step_sum, part)
        with torch.no_grad():
            # The local parameters mixed back in (alpha > 0) are the current ones, as in TorchFT: with a sync
            # delay they include the local steps taken while the average was in flight.
            local = ({name: p.detach().clone() for name, p in self.params.items()} if self.alpha > 0
                     else self._local)
            for name, p in self.params.items():
                p.copy_(self.original[name])
        committed = self._manager.should_commit()
        if committed:
            members = self._manager.num_participants()  # what the allreduce divided by (the vote passed: known)
            self.weight_sum, self.contributors = committed_weight * members, round(contributed * members)
            self._manager.withdraw_committed()  # the committed state is about to change: stop serving it
            self._manager.disallow_state_dict_read()
            try:
                # The mean over contributors weighted by the samples each covered, not over everyone (sit-outs
                # sent zeros with weight 0; each pseudo-gradient came multiplied by its weight). A round
                # nobody trained in (every member sat it out: a healed replica left alone, the initial sync)
                # has nothing to average: no outer step, or the momentum alone would move the parameters of
                # these members and not of the replicas that synced the round before (the same committed
                # state would then have two values).
                if committed_weight > 0.0:
                    scale = 1.0 / committed_weight
                    for name, p in self.params.items():
                        if scale != 1.0:
                            self._pseudo[name].mul_(scale)
                        p.grad = self._pseudo[name]
                    self.outer.step()
                self.save_global()
                if self.alpha > 0:
                    with torch.no_grad():
                        for name, p in self.params.items():
                            p.lerp_(local[name], self.alpha)
            finally:
                self._manager.allow_state_dict_read()
            self._local = {}
        else:
            logger.warning(
                "fragment %d sync did not commit: back at the last global parameters", self.index,
            )
        self.outer.zero_grad(set_to_none=True)
        for p in self.params.values():
            p.grad = None
        self._pseudo = {}
        self._weight = None
        return committed

    def drop_local(self) -> None:
        self._local = {}


class DiLoCo:
    """DiLoCo / Streaming DiLoCo. Use as a context manager around the inner training loop.

    Args:
        manager: must use `use_async_quorum=False` (the heal must land before the pseudo-gradient is taken).
        model_fragments: modules whose parameters are synced together (one = plain DiLoCo).
        inner_optimizer: the local optimizer; its `step()` drives the schedule through the hooks of a
            `FaultTolerantStep` (the owner of a step's rules), unless `hook_optimizer=False`: then the caller's
            `FaultTolerantStep(manager, sync=this)` drives it (`after_inner_step`).
        outer_optimizer: one optimizer, or one per fragment, over the fragments' parameters
            (typically `SGD(lr=0.7, momentum=0.9, nesterov=True)`).
        sync_every: inner steps between two syncs of the same fragment.
        backup_device / pin_memory: where the last global parameters live (default: beside the parameters);
            pinned when on the CPU with a GPU present.
        use_bucketization / bucket_cap_mb: average the pseudo-gradients in flat buckets of about bucket_cap_mb
            (default 32) instead of one allreduce per parameter (env TORCHFT_USE_BUCKETIZATION=True turns it on).
        should_quantize: TorchFT's FP8 allreduce; not implemented (True raises).
        fragment_sync_delay: start a fragment's allreduce this many inner steps before applying it.
        fragment_update_alpha: 0 = take the new global params; >0 mixes in the local ones.
        sync_retries / early_heal (Regent, keyword-only): retry a failed sync with the survivors; serve the
            committed state to restarted replicas between syncs (`Manager.serve_committed`).
        committed_extra / load_committed_extra (keyword-only): what else a restarted replica needs of the
            committed state, taken at the commit (a trainer's step, schedule and data position), and how to apply
            it (early heal).
        round_step / on_contributor_step (keyword-only): the caller's step count at a sync, and what to do when a
            sit-out replica learns the contributors' (it sat out their local steps; its schedule must not fall a
            round behind).
        join_mid_round (keyword-only): a restarted replica may join the round in progress (`join_now`); False
            (a constant global batch: the round's members cover its shard for the whole round) makes it sit the
            round out and join at its sync.
        exactly_once (keyword-only): Streaming DiLoCo, a replica that heals or joins a run in progress restarts
            every fragment from its global parameters and sits out each fragment's next sync
            (`_restart_fragments`), so that the sample ledger can prove each sample once per fragment. Off by
            default: TorchFT's Streaming DiLoCo keeps the donor's live parameters, and TorchFT-style users (and
            TorchFT's own tests) get its numbers; `regent train` turns it on.
        on_round_failed (keyword-only): plain DiLoCo, a sync that did not commit: called (inside the optimizer
            step of the round's last inner step) with the inner steps to give back (`steps_given_back`): the
            caller moves its step count, schedule and data position back to the round's first batch, and the
            round is trained again.
        rejoin_left_behind (keyword-only): plain DiLoCo with early heal and a Lighthouse that leaves late members
            out of a sync (`late_member_ms`): at each sync point, first ask whether the run committed past this
            replica without it; if so, give up the round (`round_abandoned`), pull the committed state from a
            holder and join the round in progress (`rejoin_if_left_behind`).
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        *,
        sync_retries: int = 0,
        early_heal: bool = False,
        hook_optimizer: bool = True,
        committed_extra: Callable[[], dict[str, Any]] = dict,
        load_committed_extra: Callable[[dict[str, Any]], None] = lambda extra: None,
        round_step: Callable[[], int] = lambda: 0,
        on_contributor_step: Callable[[int], None] = lambda step: None,
        join_mid_round: bool = True,
        on_round_failed: Callable[[int], None] = lambda steps: None,
        exactly_once: bool = False,
        rejoin_left_behind: bool = False,
    ) -> None:
        if should_quantize:
            raise NotImplementedError("DiLoCo(should_quantize=True): quantized allreduce is not implemented in "
                                      "Regent; pass should_quantize=False")
        if settings.TORCHFT_USE_BUCKETIZATION.get():
            use_bucketization = True  # TorchFT's switch, honoured the same way
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb}: must be > 0")
        if manager.use_async_quorum:
            raise ValueError("DiLoCo needs Manager(use_async_quorum=False): healing must finish before syncing")
        n = len(model_fragments)
        if n < 1:
            raise ValueError("DiLoCo needs at least one model fragment")
        if sync_every < n or sync_every % n:
            raise ValueError(f"sync_every={sync_every} must be a multiple of the number of fragments ({n})")
        self._period = sync_every // n
        if not 0 <= fragment_sync_delay < self._period:
            raise ValueError(
                f"fragment_sync_delay={fragment_sync_delay} must be in [0, sync_every/fragments={self._period})"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha={fragment_update_alpha} must be in [0, 1]")
        outers = outer_optimizer if isinstance(outer_optimizer, list) else [outer_optimizer] * n
        if len(outers) != n:
            raise ValueError(f"got {len(outers)} outer optimizers for {n} fragments; pass one or one per fragment")
        self._manager = manager
        self._delay = fragment_sync_delay
        bucket_bytes = int((bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * 1024 * 1024) if use_bucketization else 0
        self.fragments = [
            _Fragment(manager, i, m, outers[i], backup_device, fragment_update_alpha, pin_memory, bucket_bytes)
            for i, m in enumerate(model_fragments)
        ]
        self._local_step = 0
        self._pending: _Fragment | None = None
        self._sit_out = False
        # Streaming DiLoCo: per fragment, whether this replica has trained since that fragment's last sync (its
        # pseudo-gradient of it is a whole window of its own); a replica that joined a run in progress sits out
        # each fragment's next sync until it is (`_restart_fragments`). The sync in flight sits out (`_pending_sit`)
        self._whole = [True] * n
        self._pending_sit = False
        # Joining mid-round (`join_now`): inner steps taken since this replica joined, until its fragments carry
        # a whole round of their own (None: they do); what its pseudo-gradients are weighted by until then
        self._trained: int | None = None
        self._pending_weight = 1.0
        self._pending_whole = True
        self.join_mid_round = join_mid_round
        # Replica-shard micro-batches covered in the inner steps since the last sync (a constant global batch:
        # `count_micro_batches`), and those steps: what the next pseudo-gradient is weighted by
        self._round_micro = 0
        self._round_steps = 0
        self._step_micro = 1
        self._round_info: dict[str, Any] | None = None  # a holder's round clock, from an early heal
        self._joins = 0  # join_now calls: each rank-agreed decision gets a key of its own
        self._step_s: float | None = None  # inner-step seconds (moving average, syncs left out)
        self._step_t: float | None = None
        self.joined_mid_round: dict[str, Any] | None = None  # how the last join went (for the caller's events)
        self.sync_retries = sync_retries
        for fragment in self.fragments:
            fragment.keep_local = sync_retries > 0 and self._delay == 0
        self.last_sync: dict[str, Any] = {}
        self.retried_syncs = 0
        self.committed_extra = committed_extra
        self.load_committed_extra = load_committed_extra
        self.round_step = round_step
        self.on_contributor_step = on_contributor_step
        self.on_round_failed = on_round_failed
        self.exactly_once = exactly_once
        self.rejoin_left_behind = rejoin_left_behind
        self.rounds_abandoned = 0
        self._unhook = (FaultTolerantStep(manager, per_step=False, sync=self).hook(inner_optimizer) if hook_optimizer
                        else lambda: None)
        if early_heal:
            manager.serve_committed(self._committed_state, self._load_committed)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self._unhook()

    @property
    def local_step(self) -> int:
        return self._local_step

    def _committed_state(self) -> dict[str, Any]:
        """The committed state as served and backed up. "round" is not state but this holder's round clock at
        the commit (when, and how long an inner step takes): a replica healed from it estimates how far the
        round has gone and takes the inner steps left (`join_now`). Replicas never agree on it: keep it out of
        votes."""
        return {"fragments": {str(f.index): f.state_dict() for f in self.fragments}, "extra": self.committed_extra(),
                "round": {"at": time.time(), "step_s": self._step_s if self._step_s is not None else -1.0}}

    def _load_committed(self, state: dict[str, Any]) -> None:
        """A holder's committed state: the global parameters become this replica's parameters."""
        with torch.no_grad():
            for f in self.fragments:
                f.load_state_dict(state["fragments"][str(f.index)])
                for name, p in f.params.items():
                    p.copy_(f.original[name])
        self.load_committed_extra(state["extra"])
        self._round_info = dict(state.get("round") or {})

    def recover(self) -> str:
        """Before the first sync of a restarted replica: get the committed state now (see
        `Manager.recover_committed`); the replica then joins the round in progress (`join_now`)."""
        how = self._manager.recover_committed()
        if how != "early":
            self._round_info = None  # a backstop's round clock is long stale: no mid-round join from it
        if how in ("early", "restored"):
            self._manager.publish_committed()  # it holds the committed state: it can serve it too
        return how

    def _sync(self, fragment: _Fragment) -> bool:
        """Perform `fragment`'s sync; if it fails (say a replica died in it), re-form the quorum at once and
        retry with the survivors rather than rolling everyone back to the last global parameters."""
        committed = fragment.perform_sync()
        attempt = 0
        while not committed and attempt < self.sync_retries and fragment.keep_local and fragment._local:
            attempt += 1
            self.retried_syncs += 1
            logger.warning("fragment %d sync failed; retrying with the replicas still alive (%d/%d)",
                           fragment.index, attempt, self.sync_retries)
            self._manager.start_quorum()
            fragment.prepare_sync(sit_out=self._pending_sit, retry=True, round_step=self.round_step(),
                                  weight=self._pending_weight if not self._pending_sit else 1.0,
                                  whole_round=self._pending_whole, in_phase=self._pending_sit and not self._sit_out)
            committed = fragment.perform_sync()
        fragment.drop_local()
        if committed and self._sit_out and fragment.contributor_step is not None:
            self.on_contributor_step(fragment.contributor_step)
        self._sit_out = False  # from here on it has local steps of its own (after a failure too: rolled back)
        if committed:
            self._manager.publish_committed()
        return committed

    def round_position_estimate(self, now: float | None = None) -> int | None:
        """After an early heal: how many inner steps the holders have taken since their last commit, estimated
        from the holder's round clock (None when there is none: no early heal, or no step timed yet)."""
        info, self._round_info = self._round_info, None
        if not info or float(info.get("step_s", -1.0)) <= 0.0:
            return None
        elapsed = max(0.0, (time.time() if now is None else now) - float(info["at"]))
        # rounded up: arriving at the sync a step early costs this replica one step of waiting; a step late,
        # every other replica waits for it
        return math.ceil(elapsed / float(info["step_s"]))

    def join_now(self) -> bool:
        """Take part in the replicas' current sync round right away (a replica that has just started).

        After an early heal (`recover` pulled the committed state from a holder) this replica joins the round
        in progress: it takes the inner steps left in it (its step count and data position move past the ones
        the holders took, `on_contributor_step`), syncs with everyone at the round's end, and its
        pseudo-gradient counts by the share of the round it covered (`prepare_sync(weight=)`). Sitting the
        round out cost a third of a 3-replica run's compute per fault; joining costs a few steps of waiting
        when the estimate of how far the round has gone is off (`round_position_estimate`).

        Otherwise (no holder: the run's start, or a backstop restore; or the round is nearly over) the quorum
        heals it from a donor at the others' next sync point and it joins that allreduce with nothing of its own
        (a sit-out), so from there its local steps run in phase with theirs. At the very start of training this
        is the initial weight sync (a no-op outer step). Returns whether a sync committed now."""
        taken = self.round_position_estimate()
        agree = getattr(self._manager, "group_agree", None)
        if callable(agree):
            # Every rank of this replica must take the same path (join mid-round at the same inner step, or sit
            # out): each rank's estimate reads its own clock, and two ranks that chose differently waited for each
            # other in different collectives until something killed the replica (a 33 s stall at load 10).
            self._joins += 1
            estimate = taken
            taken = agree(f"regent/diloco/join/{self._joins}", lambda: {"taken": estimate})["taken"]
        if taken is not None:
            # Aim to reach the round's end ARRIVE_EARLY_STEPS before the holders: their quorum there forms the
            # moment its previous members are all back (the fast quorum), so a joiner arriving a moment after them
            # waits in its quorum for the whole next round (seen in a demo at load 15: it missed the run's last
            # sync by 0.1 s). Arriving early costs it those steps of waiting, and they are not in its weight.
            taken += ARRIVE_EARLY_STEPS
        self.joined_mid_round = None
        self._round_micro = self._round_steps = 0
        if self.join_mid_round and taken is not None and taken + 2 <= self._period - self._delay:
            # at least two steps of its own before the allreduce starts, or sitting out costs less
            self.on_contributor_step(self.round_step() + taken)
            self._local_step = taken
            if len(self.fragments) > 1 and self.exactly_once:
                self._restart_fragments()  # Streaming DiLoCo: it sits out each fragment's next sync instead
            else:
                self._trained = 0
            self._sit_out = False
            self._step_t = None
            self.joined_mid_round = {"round_position": taken, "period": self._period}
            return False
        self._manager.start_quorum()
        if len(self.fragments) > 1 and self.exactly_once and (self._manager.current_step() > 0 or self.round_step() > 0):
            # Streaming DiLoCo, joining a run in progress: every fragment's window began before this replica
            # joined (at the run's very start, nothing trained yet, every replica starts every window together)
            self._restart_fragments()
        self._sit_out = True  # no local steps of its own yet: it contributes nothing to this round's average
        self._pending = self.fragments[self._manager.current_step() % len(self.fragments)]
        self._pending.prepare_sync(sit_out=True, round_step=self.round_step())
        self._whole[self._pending.index] = True  # the fragment's next window starts at this sync
        self._pending_weight = 0.0
        self._pending_sit = True
        self._local_step = self._period - self._delay
        if self._local_step < self._period:
            return False  # the allreduce is in flight; it is applied after `fragment_sync_delay` steps
        fragment, self._pending = self._pending, None
        self._local_step = 0
        committed = self._sync(fragment)
        self.last_sync = self._sync_record(fragment, committed)
        return committed

    def _sync_record(self, fragment: _Fragment, committed: bool, given_back: int = 0) -> dict[str, Any]:
        """What the caller learns of a sync: whether it committed, this replica's weight in it (0: it sat out),
        the sum of the contributors' weights and their number (the sample ledger's skip record), and the inner
        steps given back to be trained again (`steps_given_back`)."""
        return {"fragment": fragment.index, "fragments": len(self.fragments), "committed": committed,
                "step": self._manager.current_step(), "weight": self._pending_weight,
                "weight_sum": fragment.weight_sum, "contributors": fragment.contributors, "given_back": given_back}

    def _restart_fragments(self) -> None:
        """Streaming DiLoCo, healed in a quorum or joining a run in progress: the model's parameters are (or may
        be) its donor's live ones, whose local progress on every fragment would come back in this replica's next
        pseudo-gradients (the donor's samples counted twice on each fragment). Every fragment starts again from
        its global parameters (just received), and this replica sits out each fragment's next sync: its window
        of it began before this replica joined, and how long ago only the replicas that saw it begin know (a
        failed sync of another fragment makes windows longer than `sync_every`), so no share of a window could
        weigh its part exactly. Its samples of those partial windows are recorded as skipped (the contributors'
        weights sum to less), and from each fragment's next window on it contributes whole, weight 1."""
        with torch.no_grad():
            for f in self.fragments:
                for name, p in f.params.items():
                    p.copy_(f.original[name])
        self._whole = [False] * len(self.fragments)
        self._trained = None

    def rejoin_if_left_behind(self) -> bool:
        """At this replica's sync point, before its quorum: when the others went on without it (it came late, a
        paused or slow host, and the Lighthouse left it out: `regent.ft.quorum.late_members`), its quorum would
        only form at their next sync, where it would heal and sit that round out too. Instead it gives up its
        round now (its pseudo-gradient belongs to a sync that committed without it; the round's samples of its
        shard were recorded as skipped there), pulls the committed state from a holder (`recover`: the early heal
        of a restarted replica) and joins the round in progress (`join_now`). Asked at the sync point and every
        `LEFT_BEHIND_CHECK_STEPS` inner steps. Returns whether it did; plain
        DiLoCo only (Streaming DiLoCo's fragments, and a sync delay, keep the quorum's heal)."""
        if (not self.rejoin_left_behind or len(self.fragments) > 1 or self._delay or self._sit_out
                or self._manager.current_step() == 0):
            return False
        left_behind = getattr(self._manager, "left_behind", None)
        if not callable(left_behind) or not left_behind():
            return False
        trained, behind_at = self._local_step, self._manager.current_step()
        self._manager.withdraw_committed()  # its committed state is about to change
        how = self.recover()
        if how == "none":
            self._manager.publish_committed()
            logger.warning("left behind at committed step %d, and the committed state could not be pulled now: "
                           "the next quorum heals this replica", behind_at)
            return False
        self.rounds_abandoned += 1
        self._manager.report_event("round_abandoned", inner_steps=trained, behind_at=behind_at, how=how,
                                   manager_step=self._manager.current_step())
        self.join_now()
        if self.joined_mid_round is not None:
            self._manager.report_event("round_joined", manager_step=self._manager.current_step(),
                                       **self.joined_mid_round)
        return True

    def count_micro_batches(self, n: int) -> None:
        """A constant global batch: the inner step in progress covers `n` replica-shard micro-batches (its own and
        missing replicas'); its pseudo-gradient is weighted by them (`pseudo_gradient_weight`)."""
        self._step_micro = max(1, int(n))

    def _weight_now(self) -> float:
        """What this replica's next pseudo-gradient counts for: the share of a full round its fragments cover, by
        the micro-batches its inner steps covered (`pseudo_gradient_weight`)."""
        full = self._period * len(self.fragments)  # a fragment's local steps between two of its syncs
        if self._trained is not None and self._trained >= full:
            self._trained = None
        micro, steps, self._round_micro, self._round_steps = self._round_micro, self._round_steps, 0, 0
        return pseudo_gradient_weight(trained=self._trained, full=full, micro_batches=micro, steps=steps)

    def after_inner_step(self) -> None:
        """Count one inner step (timing it for the round clock); start a fragment's allreduce and apply it at
        their points of the round."""
        now = time.monotonic()
        if self._step_t is not None:
            dt = now - self._step_t
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self._step_t = now
        self._local_step += 1
        self._round_micro += self._step_micro
        self._round_steps += 1
        self._step_micro = 1
        if self._trained is not None:
            self._trained += 1
        at_sync = self._local_step == self._period - self._delay
        if (self.rejoin_left_behind and (at_sync or (self._local_step % LEFT_BEHIND_CHECK_STEPS == 0
                                                     and self._local_step < self._period - self._delay))
                and self.rejoin_if_left_behind()):
            return  # left out of a sync (it came late): caught up from a holder, in the round in progress
        if at_sync:
            for f in self.fragments:
                f.loaded = False
            self._manager.start_quorum()
            if any(f.loaded for f in self.fragments):
                # Healed in this quorum: its parameters are now its donor's, and so would be its pseudo-gradient
                # (counting the donor's samples twice). It sits this sync out, as a restarted replica does.
                self._sit_out = True
                if len(self.fragments) > 1 and self.exactly_once:
                    self._restart_fragments()
            # Chosen after the quorum: a healer has just loaded the donor's step, so everyone agrees.
            self._pending = self.fragments[self._manager.current_step() % len(self.fragments)]
            weight = self._weight_now()  # resets the round's counts, sitting out or not
            self._pending_whole = self._trained is None
            # sits out: just healed (`_sit_out`), or (Streaming DiLoCo) joined inside this fragment's window
            sit = self._sit_out or not self._whole[self._pending.index]
            self._pending_sit = sit
            self._pending_weight = 0.0 if sit else weight
            self._pending.prepare_sync(sit_out=sit, round_step=self.round_step(),
                                       weight=self._pending_weight if not sit else 1.0,
                                       whole_round=self._pending_whole, in_phase=sit and not self._sit_out)
            self._whole[self._pending.index] = True  # the fragment's next window starts at this sync
            self._step_t = None  # the quorum's wait is no inner step
        if self._local_step >= self._period:
            fragment, self._pending = self._pending, None
            steps, self._local_step = self._local_step, 0
            if fragment is None:
                return
            committed = self._sync(fragment)
            back = steps_given_back(committed=committed, fragments=len(self.fragments), local_steps=steps)
            if back:
                self._trained = None  # trained again from the round's first batch: a whole round of its own
                self.on_round_failed(back)
            self.last_sync = self._sync_record(fragment, committed, given_back=back)
