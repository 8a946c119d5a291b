"""The directory of the actors that live in this process (`Runtime.actors`)."""

from __future__ import annotations

from typing import Any


class ActorDirectory:
    """Which actors live in this process, by key (`mesh_id/rank`): the running ones (their `Cell`), why each
    gone one is gone, and messages that arrived for an actor whose spawn message has not come yet.

    It exists so that one object owns that state: the message handlers, the cells (when they fail or stop)
    and supervision (finding the owner of a failed mesh) ask it, instead of each reaching into dicts of the
    runtime. Loop thread only, like the rest of the runtime's state; it holds no timers itself (whoever holds
    a message decides when to give up on it, `ProcHandlers.expire_unknown`)."""

    def __init__(self) -> None:
        self._cells: dict[str, Any] = {}  # key -> Cell, while it runs
        self._dead: dict[str, str] = {}  # key -> why it failed or stopped (kept: late messages get this answer)
        self._waiting: dict[str, list[tuple]] = {}  # key -> messages for an actor not spawned here yet

    def get(self, key: str) -> Any | None:
        """The running actor `key`, or None."""
        return self._cells.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._cells

    def __len__(self) -> int:
        return len(self._cells)

    def running(self) -> list[Any]:
        """Every running actor of this process (a copy: stopping them changes the directory)."""
        return list(self._cells.values())

    def add(self, key: str, cell: Any) -> list[tuple]:
        """Record the actor `key` as running; returns the messages that waited for it, in arrival order, for
        the caller to post to it."""
        self._cells[key] = cell
        return self._waiting.pop(key, [])

    def remove(self, key: str) -> None:
        """The actor `key` no longer runs here (it failed or stopped; `mark_dead` says why)."""
        self._cells.pop(key, None)

    def mark_dead(self, key: str, why: str) -> None:
        """Remember why the actor `key` is gone: messages that come for it later are answered with `why`."""
        self._dead[key] = why

    def why_dead(self, key: str) -> str | None:
        """Why the actor `key` is gone, or None if it never failed or stopped here."""
        return self._dead.get(key)

    def hold(self, key: str, item: tuple) -> bool:
        """Keep a message for the actor `key`, not spawned here yet (its spawn message may come by another
        sender's connection). True for the first message held for `key`: the caller then bounds the wait."""
        waiting = self._waiting.setdefault(key, [])
        waiting.append(item)
        return len(waiting) == 1

    def take_held(self, key: str) -> list[tuple]:
        """The messages held for `key`, in arrival order, no longer held."""
        return self._waiting.pop(key, [])
