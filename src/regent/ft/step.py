"""One fault-tolerant training step: the one owner of its rules.

Every rule that makes a training step fault-tolerant lives here, in the order it must run:

    start()                  the quorum, beside the forward pass (per-step mode: joining, rebuilding the group and
                             healing overlap compute)
    micro_batch_plan(i)      a constant global batch: which replica-shards of batch i this replica covers
    reduce_gradients(grads)  after backward: gradients averaged across replicas (then the caller clips)
    should_commit()          the commit vote
    update(optimizer_step)   when the step commits: before the weights change, the state is locked against donor
                             reads, a committed state served live is withdrawn, the backstop's copy of it is
                             waited for; the optimizer step; then the lock is released, the new committed state
                             is published, and DiLoCo/LocalSGD count the inner step (their syncs, votes and
                             heals happen there)
    recover() / join_round() before the first step of a (re)started replica: early heal from a live holder or
                             the backstop; DiLoCo's join of the round in progress

Three kinds of caller drive the same object:
- Regent's trainers (`regent.train.Trainer`, `regent.orchestrate.user_trainer.ExternalTrainer`, which also runs
  the TorchTitan engine) take it as `train_step(ft)`; the session (`regent.orchestrate.session`) builds it once
  per trainer process and calls `start`, `recover` and `join_round`.
- TorchFT-style loops that call `optimizer.step()` themselves: `OptimizerWrapper` calls `start`,
  `should_commit` and `update`; `DiLoCo` and `LocalSGD` built without a driver call `hook(optimizer)`, the one
  place in Regent where optimizer step hooks are registered.

The rules are plain functions below (`update_plan`, `backstop_copies`, `coverage_plan`), tested without
processes; the class only executes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")

# What a step's update does before and after the optimizer changes the weights, by name (see `update_plan`).
ENTER, LOCK, WITHDRAW, WAIT_COPY = "enter", "lock_state", "withdraw_committed", "wait_backstop_copy"
UNLOCK, PUBLISH, SYNC, LEAVE = "unlock_state", "publish_committed", "count_inner_step", "leave"


class InnerStepSync(Protocol):
    """DiLoCo or LocalSGD: told of every inner optimizer step (where they sync, vote and heal)."""

    def after_inner_step(self) -> None: ...


def update_plan(*, serve_live: bool, wait_copy: bool, sync: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What runs before and after the optimizer step, in order.

    - `enter` first and `leave` last: a state taken or loaded in between is marked mid-step (a healer's step
      count and schedule are corrected by one when exactly one side was inside the update).
    - the lock before anything else: a donor never serves weights the optimizer is halfway through changing.
    - `serve_live` (per-step early heal): the committed state served in place is withdrawn before the weights
      change and published again once the new one is whole.
    - `wait_copy`: the backstop copies the full state beside forward and backward; the weights may change only
      once that copy is done.
    - `sync` (DiLoCo, LocalSGD) after the lock is released: a sync heals and is served from, so it must be able
      to read the state."""
    before = (ENTER, LOCK) + ((WITHDRAW,) if serve_live else ()) + ((WAIT_COPY,) if wait_copy else ())
    after = (UNLOCK,) + ((PUBLISH,) if serve_live else ()) + ((SYNC,) if sync else ()) + (LEAVE,)
    return before, after


def backstop_copies(*, sync: bool, early_heal: bool) -> str:
    """Which state the durable backstop copies, and so who waits for the copy.

    "committed": DiLoCo's committed state (global parameters, outer optimizer, schedule and data position at the
    sync) does not change for a whole round and is kept apart when early heal serves it: it is copied beside
    training and only the next change of it (the next outer step) waits. "full": in every other case the state
    is the training state itself, which the next optimizer step changes: that step waits for the copy."""
    return "committed" if sync and early_heal else "full"


Coverage = Callable[[int, int, int], tuple[list[int], float]]


def coverage_plan(index: int, *, participating: bool, rank: int | None, participants: int, replicas: int,
                  cover: Coverage) -> tuple[list[int], float] | None:
    """A constant global batch: `cover(index, rank, participants)` (the replica-shards of batch `index` this
    replica covers and their gradient factor; `regent.train.coverage`), or None (its own shard only) when it
    does not take part (healing: it contributes zeros) or the quorum is unusable (the step will not commit)."""
    if not participating or rank is None or not 1 <= participants <= replicas:
        return None
    return cover(index, rank, participants)


class FaultTolerantStep:
    """The rules of one fault-tolerant step, for one rank of one replica (see the module docstring).

    Args:
        manager: this rank's `Manager`.
        per_step: the quorum is started, gradients averaged and the commit voted at every step (DDP/HSDP-style).
            False with `sync` (DiLoCo, LocalSGD: they start quorums and vote at their syncs).
        sync: DiLoCo or LocalSGD, told of every inner step.
        overlapped: an `OverlappedAllreduce` that averages gradients while backward runs (its `finish` completes
            it); without one, `reduce_gradients` averages them in one flat allreduce after backward.
        serve_live: per-step early heal: `(state, load)` of the training state, served in place to restarted
            replicas between two optimizer steps (`Manager.serve_committed(live=True)`).
        backstop: a `Backstop` of this rank, or None.
        constant_batch: a constant global batch: (the configured replica count, what a quorum member covers;
            see `coverage_plan`), or None (every replica trains on its own shard)."""

    def __init__(self, manager: Any, *, per_step: bool, sync: InnerStepSync | None = None,
                 overlapped: Any = None, serve_live: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                 backstop: Any = None, early_heal: bool = False,
                 constant_batch: tuple[int, Coverage] | None = None) -> None:
        if per_step == (sync is not None):
            raise ValueError("FaultTolerantStep: per_step and sync exclude each other (one of them must be given)")
        self.manager = manager
        self.per_step = per_step
        self.sync = sync
        self.overlapped = overlapped
        self.early_heal = early_heal
        self.constant_batch = constant_batch
        self.in_step = False  # inside the update: the caller's step counter has not moved yet
        self.backstop = backstop
        self.backstop_copies = backstop_copies(sync=sync is not None, early_heal=early_heal)
        wait_copy = backstop is not None and self.backstop_copies == "full"
        if backstop is not None and not wait_copy:
            manager.before_committed_change(backstop.wait_copied)  # the next outer step waits for the copy
        if serve_live is not None:
            # Per-step early heal: the committed state is the training state between two optimizer steps. It is
            # served in place from the commit until the next optimizer step (most of a step: forward and
            # backward only read the weights), so a restarted replica copies it right after it is built instead
            # of waiting for the survivors' next quorum. Publishing costs a walk over the state's structure per
            # step, not a copy.
            manager.serve_committed(serve_live[0], serve_live[1], live=True)
        # looked up at each call, not bound now: what a caller (or a test injecting faults) sets on the manager
        # later is what runs
        actions: dict[str, Callable[[], Any]] = {
            ENTER: lambda: self._set_in_step(True), LEAVE: lambda: self._set_in_step(False),
            LOCK: lambda: self.manager.disallow_state_dict_read(),
            UNLOCK: lambda: self.manager.allow_state_dict_read(),
            WITHDRAW: lambda: self.manager.withdraw_committed(),
            PUBLISH: lambda: self.manager.publish_committed(),
            WAIT_COPY: lambda: backstop.wait_copied(),
            SYNC: lambda: sync.after_inner_step(),  # type: ignore[union-attr]
        }
        before, after = update_plan(serve_live=serve_live is not None, wait_copy=wait_copy, sync=sync is not None)
        self._before = [actions[name] for name in before]
        self._after = [actions[name] for name in after]

    def _set_in_step(self, value: bool) -> None:
        self.in_step = value

    # -- the step, in order --------------------------------------------------------------------------------
    def start(self) -> None:
        """Per-step mode: start this step's quorum (it runs beside the forward pass). DiLoCo starts its own."""
        if self.per_step:
            self.manager.start_quorum()

    def micro_batch_plan(self, index: int) -> tuple[list[int], float] | None:
        """A constant global batch: what this replica covers of batch `index` (`coverage_plan`); None otherwise.

        Per-step mode reads this step's quorum. DiLoCo reads the last quorum formed, the one of the sync that
        opened the round (every inner step of a round runs under it), and is told how many micro-batches the
        inner step covers: its pseudo-gradient is weighted by them."""
        if self.constant_batch is None:
            return None
        replicas, cover = self.constant_batch
        try:
            participating = self.manager.is_participating()
            rank, participants = self.manager.participating_rank(), self.manager.num_participants()
        except Exception as err:  # noqa: BLE001 - reported: this step (DiLoCo: this round's sync) will not commit
            self.manager.report_error(err)
            plan = None
        else:
            plan = coverage_plan(index, participating=participating, rank=rank, participants=participants,
                                 replicas=replicas, cover=cover)
        count = getattr(self.sync, "count_micro_batches", None)
        if callable(count):
            count(1 if plan is None else len(plan[0]))
        return plan

    def micro_batch_backward(self, last: bool) -> None:
        """A constant global batch's extra micro-batches: their gradients accumulate, and only the step's last
        backward hands buckets to the overlapped allreduce (which then carries the sum of them all)."""
        if self.overlapped is not None:
            self.overlapped.enabled = last

    def reduce_gradients(self, grads: Callable[[], list[torch.Tensor]]) -> None:
        """Per-step mode: average `grads()` (this rank's gradient tensors, the same list on every replica) across
        the replicas, in place. DiLoCo averages pseudo-gradients at its syncs instead."""
        if not self.per_step:
            return
        if self.overlapped is not None:
            self.overlapped.finish(grads())
            return
        tensors = grads()
        if not tensors:
            return
        flat = torch.cat([g.reshape(-1) for g in tensors])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in tensors:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def should_commit(self) -> bool:
        """Per-step mode: the commit vote (False drops the step on every rank of every participating replica).
        DiLoCo's inner steps always apply; its syncs vote."""
        return bool(self.manager.should_commit()) if self.per_step else True

    def update(self, optimizer_step: Callable[[], T]) -> T:
        """Change the weights: `optimizer_step()` between the rules of `update_plan`. If it raises, nothing after
        it runs: the state stays locked against donor reads, so a half-updated state is never served."""
        for action in self._before:
            action()
        result = optimizer_step()
        for action in self._after:
            action()
        return result

    # -- a (re)started replica, before its first step ------------------------------------------------------
    def recover(self) -> str:
        """Never train on from less than the run has committed: pull it from a live holder now (early heal), or
        restore the durable backstop when no holder is left (a counted lineage reset). Returns how
        (`Manager.recover_committed`)."""
        recover = getattr(self.sync, "recover", None)
        if callable(recover):
            return str(recover())
        how = self.manager.recover_committed()
        if self.early_heal and self.per_step:
            self.manager.publish_committed()  # what it holds now (pulled, restored or its own) can be served
        return how

    def join_round(self) -> bool:
        """DiLoCo: take part in the replicas' sync round right away (`DiLoCo.join_now`); returns whether a sync
        committed now. Per-step mode joins at the next step's quorum: False."""
        join_now = getattr(self.sync, "join_now", None)
        return bool(join_now()) if callable(join_now) else False

    # -- loops that call optimizer.step() themselves -------------------------------------------------------
    def hook(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Run the update's rules around every `optimizer.step()` of a loop that calls it itself (TorchFT-style
        DiLoCo and LocalSGD). Returns the function that removes the hooks."""
        handles = [optimizer.register_step_pre_hook(lambda *_: self._run(self._before)),
                   optimizer.register_step_post_hook(lambda *_: self._run(self._after))]

        def remove() -> None:
            for handle in handles:
                handle.remove()
            handles.clear()

        return remove

    @staticmethod
    def _run(actions: list[Callable[[], Any]]) -> None:
        for action in actions:
            action()
