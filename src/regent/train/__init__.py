"""regent.train: the training engine (Llama 3, FSDP2, data, optimizer, checkpoints, metrics)."""
