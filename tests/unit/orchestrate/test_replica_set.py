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
