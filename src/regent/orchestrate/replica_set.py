"""The controller's handle on its replicas: one ReplicaActor per replica index, whichever mesh it runs on.

Why: a fresh run spawns every replica in one proc mesh, but a replica whose process died while no controller was
attached is respawned by `regent train --resume` on a mesh of its own, beside the adopted survivors (whose mesh
keeps the dead rank). Callers address a replica by index as on the mesh (`slice(replicas=r)`) or all of them
(`call_all`); `reference()` records every mesh for a successor (controller/attach.json), and `adoption_plan` reads
that record back. A ReplicaSet pickles to its per-replica handles only: what a replica needs to tell its peers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Segment:
    """One proc mesh of ReplicaActors and the replicas it serves (replica index -> rank in the mesh)."""

    procs: Any
    actors: Any
    ranks: dict[int, int]
    size: int  # the mesh's ranks: when every one serves a replica, a call goes to the mesh at once
    first: bool = False  # the run's mesh of every replica (replica r at rank r), as a fresh run spawns it


@dataclass
class ReplicaSet:
    handles: dict[int, Any]  # replica index -> a one-rank ActorMesh of its ReplicaActor
    segments: list[Segment] = field(default_factory=list)

    @classmethod
    def spawned(cls, procs: Any, actors: Any, replicas: int) -> ReplicaSet:
        """The replicas of one mesh spawned with `per_host={"replicas": N}` (replica r at rank r)."""
        seg = Segment(procs, actors, {r: r for r in range(replicas)}, replicas, first=True)
        return cls({r: actors.slice(replicas=r) for r in range(replicas)}, [seg])

    def add(self, procs: Any, actors: Any, ranks: dict[int, int], size: int, first: bool = False) -> None:
        """A mesh (spawned with `per_host={"replicas": size}`) that serves `ranks` (replica -> rank), in place of
        whatever served them before."""
        for seg in self.segments:
            for r in ranks:
                seg.ranks.pop(r, None)
        self.segments.append(Segment(procs, actors, dict(ranks), size, first))
        for r, rank in ranks.items():
            self.handles[r] = actors.slice(replicas=rank)

    def drop(self, replica: int) -> None:
        """Replica `replica` has no live ReplicaActor (its process died); `add` gives it one again."""
        self.handles.pop(replica, None)
        for seg in self.segments:
            seg.ranks.pop(replica, None)

    def replicas_of(self, actors: Any, ranks: list[int]) -> list[int]:
        """The replicas that ranks `ranks` of the actor mesh `actors` serve (a failure report names a mesh and its
        ranks): none when `actors` is not one of this set's meshes, or those ranks serve no replica any more."""
        out: list[int] = []
        for seg in list(self.segments):  # copies: a runtime thread asks while the loop may drop a replica
            if seg.actors is actors:
                out += [r for r, rank in list(seg.ranks.items()) if rank in ranks]
        return sorted(out)

    def slice(self, *, replicas: int) -> Any:
        """Replica `replicas`'s ReplicaActor (as `mesh.slice(replicas=r)` on the mesh of a fresh run)."""
        try:
            return self.handles[replicas]
        except KeyError:
            raise ValueError(f"no replica {replicas} in this set (replicas {sorted(self.handles)})") from None

    def __contains__(self, replica: int) -> bool:
        return replica in self.handles

    def proc_meshes(self) -> list[Any]:
        return [seg.procs for seg in self.segments]

    async def call_all(self, endpoint: str, *args: Any) -> list[Any]:
        """`endpoint(*args)` on every replica; the replies in replica order. Like a mesh's `call`, the first
        failure is raised once every call has ended. A mesh whose ranks all serve replicas gets one call."""
        calls: dict[int, Any] = {}
        whole: list[tuple[Segment, Any]] = []
        for seg in self.segments:
            if seg.ranks and len(seg.ranks) == seg.size:
                whole.append((seg, _awaitable(getattr(seg.actors, endpoint).call(*args))))
            else:
                for r in seg.ranks:
                    calls[r] = _awaitable(getattr(self.handles[r], endpoint).call_one(*args))
        results = await asyncio.gather(*[w for _, w in whole], *calls.values(), return_exceptions=True)
        replies: dict[int, Any] = {}
        errors = [x for x in results if isinstance(x, BaseException)]
        if errors:
            raise errors[0]
        for (seg, _), values in zip(whole, results[:len(whole)]):
            by_rank = list(values.values()) if hasattr(values, "values") else list(values)
            for r, rank in seg.ranks.items():
                replies[r] = by_rank[rank]
        replies.update(zip(calls, results[len(whole):]))
        return [replies[r] for r in sorted(replies)]

    def reference(self) -> dict[str, Any]:
        """For controller/attach.json: the run's first replica mesh (`procs`, `actor`, as before respawns were
        possible; left out once none of its procs is adopted) and, under `respawned`, the mesh of each replica
        respawned since (replica index -> refs)."""
        out: dict[str, Any] = {}
        for seg in self.segments:
            if seg.first:
                out.update(procs=seg.procs.reference(), actor=seg.actors.reference())
        respawned = {str(r): {"procs": seg.procs.reference(), "actor": seg.actors.reference(), "rank": rank}
                     for seg in self.segments if not seg.first for r, rank in seg.ranks.items()}
        if respawned:
            out["respawned"] = respawned
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReplicaSet, (dict(self.handles),))


async def _awaitable(x: Any) -> Any:
    return await x if hasattr(x, "__await__") else x


def adoption_plan(record: dict[str, Any], replicas: int) -> list[tuple[dict[str, Any], dict[str, Any], dict[int, int]]]:
    """What to adopt for a run's replicas from its attach.json `replicas` record: (proc mesh ref, actor mesh ref,
    replica -> rank) per mesh, the first mesh first; a respawned replica is served by its newest mesh only. A
    mesh that serves no replica any more is left out (its procs are gone or were stopped)."""
    respawned = {int(r): v for r, v in (record.get("respawned") or {}).items() if 0 <= int(r) < replicas}
    out = []
    base = {r: r for r in range(replicas) if r not in respawned}
    if base:
        out.append((record["procs"], record["actor"], base))
    for r, refs in sorted(respawned.items()):
        out.append((refs["procs"], refs["actor"], {r: int(refs.get("rank", 0))}))
    return out


def recorded_proc_refs(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every proc mesh reference of a `replicas` record (the first mesh and each respawned one)."""
    refs = [record.get("procs")] + [v.get("procs") for v in (record.get("respawned") or {}).values()]
    return [r for r in refs if isinstance(r, dict)]
