"""`Rules`: the trainer's side of a fault-tolerant step (`regent.train.trainer.StepRules`) answering as a test
says, so that a Trainer's step can be checked alone: what the cross-replica reduction does to the gradients, the
commit vote, the replica-shards to cover. The real rules are `regent.ft.step.FaultTolerantStep`'s (tested with
processes in tests/ft and tests/orchestrate)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Rules:
    def __init__(self, reduce: Callable[[list], Any] | None = None, commit: bool | Callable[[], bool] = True,
                 plan: Callable[[int], Any] | None = None) -> None:
        self.reduce, self.commit, self.plan = reduce, commit, plan
        self.backwards: list[bool] = []  # micro_batch_backward's `last`, in order

    def micro_batch_plan(self, index: int) -> Any:
        return self.plan(index) if self.plan is not None else None

    def micro_batch_backward(self, last: bool) -> None:
        self.backwards.append(last)

    def reduce_gradients(self, grads: Callable[[], list]) -> None:
        if self.reduce is not None:
            self.reduce(grads())

    def should_commit(self) -> bool:
        return bool(self.commit()) if callable(self.commit) else self.commit

    def update(self, optimizer_step: Callable[[], Any]) -> Any:
        return optimizer_step()
