"""TorchFT's `OptimizerWrapper`: the per-step fault-tolerance rules of a training loop, kept in the optimizer.

A per-step (DDP/HSDP-style) loop needs three things in a fixed order at every step: start the quorum before
the forward pass (so joining, rebuilding the group and healing overlap compute), let the group vote before
the weights change (a step that saw an error, or too few replicas, is dropped on every rank of the replica),
and never let a donor read the weights while the optimizer is halfway through changing them. The wrapper
ties them to the two calls every loop already makes:

    optimizer.zero_grad()   # -> manager.start_quorum()
    loss.backward()         # (DistributedDataParallel averages the gradients meanwhile)
    optimizer.step()        # -> manager.should_commit(); the inner step runs only if the vote passed

The rules themselves are `FaultTolerantStep`'s (`regent.ft.step`), the one owner of a step's rules that Regent's
own trainers use too; this class only maps the optimizer's two calls onto it.
"""

from __future__ import annotations

from typing import Any

import torch

from regent.ft.manager import Manager
from regent.ft.step import FaultTolerantStep


class OptimizerWrapper(torch.optim.Optimizer):
    """Wrap `optim` so that `zero_grad` starts the quorum and `step` commits only what the group agreed on.

    An `Optimizer` subclass, so learning-rate schedulers and checkpoint code accept it; its parameter groups
    and state are the wrapped optimizer's own (it keeps no state of its own)."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        # Deliberately no super().__init__: every attribute below delegates to the wrapped optimizer.
        self.manager = manager
        self.optim = optim
        self.ft_step = FaultTolerantStep(manager, per_step=True)

    # what schedulers and checkpoints read
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum (it runs beside the forward pass), then clear the gradients."""
        self.ft_step.start()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        """Vote; step the wrapped optimizer only if every rank of every participating replica is fine.
        Returns the inner step's result, or None when the step was dropped."""
        if closure is not None:
            raise ValueError("OptimizerWrapper.step: closures are not supported (the vote must come after the "
                             "gradients exist); compute the loss before calling step()")
        if not self.ft_step.should_commit():
            return None
        return self.ft_step.update(self.optim.step)  # a healer never receives half-updated weights

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"
