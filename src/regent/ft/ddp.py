"""TorchFT's `DistributedDataParallel`: a module whose gradients are averaged across replica groups through
the Manager while backward runs.

Built on `OverlappedAllreduce` (buckets launched as soon as their gradients are ready, in the same order on
every replica), not on torch's DDP: torch's DDP needs a process group fixed for its lifetime, while the
replicas here change with every quorum. A failed allreduce never raises; the step just does not commit
(`OptimizerWrapper.step` asks the group). Weights need no initial broadcast: at step 0 every replica but the
first heals from it (`Manager(init_sync=True)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from regent.ft.grad_sync import DEFAULT_BUCKET_BYTES, OverlappedAllreduce
from regent.ft.manager import Manager

# torch DDP arguments that TorchFT code passes and that change nothing here: gradients are always bucket
# views, unused parameters contribute zeros, the graph may change between steps, and buffers are not
# broadcast (TorchFT's DDP broadcasts them over a no-op group, so neither does it).
_HARMLESS = {"find_unused_parameters", "gradient_as_bucket_view", "static_graph", "broadcast_buffers"}


class DistributedDataParallel(nn.Module):
    """Wrap `module`; use it as the model. `bucket_cap_mb` sizes the allreduce buckets (default 100 MiB)."""

    def __init__(self, manager: Manager, module: nn.Module, bucket_cap_mb: float | None = None,
                 **torch_ddp_kwargs: Any) -> None:
        unknown = set(torch_ddp_kwargs) - _HARMLESS
        if unknown:
            raise TypeError(f"DistributedDataParallel: unsupported argument(s) {sorted(unknown)}; "
                            f"supported: manager, module, bucket_cap_mb, {sorted(_HARMLESS)}")
        super().__init__()
        self.module = module
        self.manager = manager
        bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)
        self._sync = OverlappedAllreduce(manager, module.parameters(), bucket_bytes=bucket_bytes,
                                         finish_after_backward=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside this block; the first backward after it averages them all."""
        before, self._sync.enabled = self._sync.enabled, False
        try:
            yield
        finally:
            self._sync.enabled = before
