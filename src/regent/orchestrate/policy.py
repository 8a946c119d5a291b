"""The restart policy of one replica, as a small state machine with no I/O.

Restarts carry a generation number; a failure report from an older generation (a second dying rank of a mesh
that is already being replaced) is ignored. After K in-place restarts the next one asks the job layer for a fresh
allocation; after M attempts in total the replica gives up.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(str, Enum):
    IGNORE = "ignore"
    RESTART_IN_PLACE = "restart_in_place"
    REALLOCATE = "reallocate"
    GIVE_UP = "give_up"


@dataclass
class RestartPolicy:
    in_place_restarts: int = 3  # K
    max_attempts: int = 12  # M
    generation: int = 0
    attempts: int = 0
    in_place_since_allocation: int = 0
    restarting: bool = False
    gave_up: bool = False

    def on_failure(self, generation: int) -> Action:
        """Decide what to do about a failure reported by `generation`. Call `restart_finished` afterwards."""
        if self.gave_up or self.restarting or generation != self.generation:
            return Action.IGNORE
        if self.attempts >= self.max_attempts:
            self.gave_up = True
            return Action.GIVE_UP
        self.restarting = True
        self.attempts += 1
        if self.in_place_since_allocation >= self.in_place_restarts:
            self.in_place_since_allocation = 0
            return Action.REALLOCATE
        self.in_place_since_allocation += 1
        return Action.RESTART_IN_PLACE

    def restart_finished(self) -> int:
        """The new mesh is up: bump the generation and accept failures from it."""
        self.generation += 1
        self.restarting = False
        return self.generation
