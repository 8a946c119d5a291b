"""The resumable position of Regent's stateless loaders (`data.ShardedBatches`, `hf_stream.HFStreamBatches`)."""

from __future__ import annotations

import torch


class BatchPosition:
    """The whole resumable state of a stateless loader: how many batches were consumed, plus what must match for
    that count to mean the same batches (the data's fingerprint and the layout). Loaders provide `batch(n)`."""

    batches_consumed: int
    fingerprint: str
    seq_len: int
    batch_size: int
    num_shards: int

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.batch(self.batches_consumed)
        self.batches_consumed += 1
        return result

    def state_dict(self) -> dict:
        return {"batches_consumed": self.batches_consumed, "fingerprint": self.fingerprint,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "num_shards": self.num_shards}

    def check_compatible(self, state: dict) -> None:
        """Raise ValueError if `state` was produced by a loader over different data or a different layout."""
        for key in ("fingerprint", "seq_len", "batch_size", "num_shards"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data state mismatch: checkpoint has {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; resume with the same data, seq_len, batch_size and replica/rank layout"
                )

    def load_state_dict(self, state: dict) -> None:
        self.check_compatible(state)
        self.batches_consumed = int(state["batches_consumed"])
