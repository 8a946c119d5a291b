"""regent.actor: single-controller actor runtime with a Monarch-compatible API."""
