"""Which recorded replica mesh serves which replica at `--resume` (orchestrate/replica_set.py): pure reading of
controller/attach.json's `replicas` record."""

from __future__ import annotations

from regent.orchestrate.replica_set import adoption_plan, recorded_proc_refs


def _ref(name: str) -> dict:
    return {"name": name, "rank_procs": [f"{name}-p"], "os_pids": {f"{name}-p": 1}}


def test_a_run_without_respawns_adopts_its_one_mesh_for_every_replica() -> None:
    record = {"procs": _ref("first"), "actor": _ref("first-actors")}
    assert adoption_plan(record, 3) == [(record["procs"], record["actor"], {0: 0, 1: 1, 2: 2})]
    assert recorded_proc_refs(record) == [record["procs"]]


def test_a_respawned_replica_is_served_by_its_newest_mesh_only() -> None:
    record = {"procs": _ref("first"), "actor": _ref("first-actors"),
              "respawned": {"1": {"procs": _ref("r1"), "actor": _ref("r1-actors"), "rank": 0},
                            "2": {"procs": _ref("r2"), "actor": _ref("r2-actors")}}}
    plan = adoption_plan(record, 3)
    assert plan == [(record["procs"], record["actor"], {0: 0}),
                    (_ref("r1"), _ref("r1-actors"), {1: 0}),
                    (_ref("r2"), _ref("r2-actors"), {2: 0})]
    assert [r["name"] for r in recorded_proc_refs(record)] == ["first", "r1", "r2"]


def test_every_replica_respawned_leaves_the_first_mesh_out() -> None:
    record = {"procs": _ref("first"), "actor": _ref("first-actors"),
              "respawned": {"0": {"procs": _ref("r0"), "actor": _ref("r0-actors"), "rank": 0}}}
    assert adoption_plan(record, 1) == [(_ref("r0"), _ref("r0-actors"), {0: 0})]


class _Mesh:
    """Stands for an actor mesh: `ReplicaSet` only slices it and compares it by identity."""

    def slice(self, **_: int) -> _Mesh:
        return _Mesh()


def test_a_failure_report_is_mapped_to_the_replicas_its_ranks_serve() -> None:
    from regent.orchestrate.replica_set import ReplicaSet

    first, respawned, stranger = _Mesh(), _Mesh(), _Mesh()
    rs = ReplicaSet.spawned(object(), first, 3)
    assert rs.replicas_of(first, [1]) == [1] and rs.replicas_of(first, [0, 2]) == [0, 2]
    rs.drop(1)  # replica 1's ReplicaActor died: a second report of its rank names nobody
    assert rs.replicas_of(first, [1]) == [] and 1 not in rs
    rs.add(object(), respawned, {1: 0}, size=1)  # its new one, on a mesh of its own
    assert rs.replicas_of(respawned, [0]) == [1] and rs.replicas_of(first, [0]) == [0]
    assert rs.replicas_of(stranger, [0]) == []  # a mesh that is not a replica's (the Lighthouse's)


def test_a_replica_actor_that_keeps_dying_without_a_step_gives_up() -> None:
    from regent.orchestrate.policy import supervisor_respawn

    again, streak = supervisor_respawn(0, step_now=40, step_at_last_respawn=None, limit=3)
    assert again and streak == 1
    again, streak = supervisor_respawn(streak, step_now=55, step_at_last_respawn=40, limit=3)  # it trained: anew
    assert again and streak == 1
    again, streak = supervisor_respawn(streak, step_now=55, step_at_last_respawn=55, limit=3)
    assert again and streak == 2
    again, streak = supervisor_respawn(streak, step_now=55, step_at_last_respawn=55, limit=3)
    assert not again and streak == 3
