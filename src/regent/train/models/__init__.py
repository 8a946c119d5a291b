"""Model definitions (one readable file per family)."""
