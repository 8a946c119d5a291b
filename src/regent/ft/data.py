"""TorchFT's `DistributedSampler`: one shard of the data per (replica group, group rank).

The shard index is `group_rank + num_replicas * replica_rank` over `num_replicas * num_replica_groups` shards,
fixed at start: when a replica group is down its shard is simply not trained on meanwhile (the others do not
re-shard and so never see one sample twice in an epoch)."""

from __future__ import annotations

from typing import Any

import torch.utils.data


class DistributedSampler(torch.utils.data.distributed.DistributedSampler):
    """`torch.utils.data.DistributedSampler` over all ranks of all replica groups.

    Args:
        dataset: the dataset.
        replica_rank: this replica group's index (0 .. num_replica_groups - 1).
        num_replica_groups: how many replica groups the data is split over.
        group_rank / num_replicas: this rank inside its group, and the group's size (default: env RANK /
            WORLD_SIZE, else 0 / 1).
        other keyword arguments (shuffle, seed, drop_last) go to torch's sampler.
    """

    def __init__(self, dataset: Any, replica_rank: int, num_replica_groups: int, group_rank: int | None = None,
                 num_replicas: int | None = None, **kwargs: Any) -> None:
        import os

        group_rank = int(os.environ.get("RANK", 0)) if group_rank is None else group_rank
        num_replicas = int(os.environ.get("WORLD_SIZE", 1)) if num_replicas is None else num_replicas
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(f"replica_rank={replica_rank} must be in [0, num_replica_groups={num_replica_groups})")
        if not 0 <= group_rank < num_replicas:
            raise ValueError(f"group_rank={group_rank} must be in [0, num_replicas={num_replicas})")
        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.num_replicas_per_group = num_replicas
        super().__init__(dataset, num_replicas=num_replicas * num_replica_groups,
                         rank=group_rank + num_replicas * replica_rank, **kwargs)
