"""regent.ft: fault tolerance across replica groups (usable from any launcher)."""
