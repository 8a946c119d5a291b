"""A replica paused at a DiLoCo sync no longer holds up the others (`--lighthouse.late-member-ms`).

Replica 1's trainer is paused (SIGSTOP) for longer than a round. Once replicas 0 and 2 (a majority of the last
quorum) have waited `late_member_ms` for it, the Lighthouse issues their quorum without it and they commit the
sync. When replica 1 resumes and reaches its sync point, it finds the committed step past its own: it gives its
round up (`round_abandoned`, counted as lost), pulls the committed state from a holder (an early heal, with no
restart) and trains the rest of the round in progress. The run's checker holds (the ledger records the round's
samples of its shard as skipped), and the three replicas end identical.
"""

from __future__ import annotations

from tests.e2e.orchestrate.test_case_study_e2e import run_regent, write_schedule

# Two pauses, on different replicas, of about a round (30 inner steps, ~6 s here) each: a pause that lands inside
# a sync (a few percent of a round) holds the others in that collective, where no quorum can leave it out
PAUSES, PAUSE_S = [(12, 1), (24, 2)], 5


def test_a_replica_paused_at_a_sync_is_left_out_and_catches_up_without_a_restart(tmp_path):
    sched = write_schedule(tmp_path / "faults.jsonl", [(at, r, "straggler", 0) for at, r in PAUSES])
    run = run_regent(tmp_path / "run", "--replicas", "3", "--procs-per-replica", "1", "--duration", "36s",
                     "--faults-file", sched, "--faults.straggler-s", str(PAUSE_S),
                     # the pause must not be taken for a hang: it is a straggler, tolerated
                     "--faults.hang-floor-s", "10", "--faults.hang-timeout", "15",
                     "--ft.sync-every", "30", "--lighthouse.late-member-ms", "600")
    ev = run.events
    assert not [e for e in ev if e["kind"] in ("failure_detected", "restart_started", "state_lost")], \
        [(e["kind"], e.get("replica")) for e in ev]
    abandoned = [e for e in ev if e["kind"] == "round_abandoned"]
    assert abandoned, [(e["kind"], e.get("replica")) for e in ev if e["kind"] not in ("commit", "state_vote")]
    for gave_up in abandoned:
        r = gave_up["replica"]
        (paused,) = [e for e in ev if e["kind"] == "fault_injected" and e["replica"] == r]
        assert gave_up["inner_steps"] > 0 and gave_up["how"] == "early" and gave_up["time"] > paused["time"]
        # the others went on without it while it was paused: a quorum of two, and their commit
        other = min({0, 1, 2} - {r})
        without = [e for e in ev if e["kind"] == "quorum" and e["replica"] == other and e["members"] == 2
                   and paused["time"] < e["time"] < gave_up["time"]]
        commits = [e for e in ev if e["kind"] == "commit" and e["replica"] == other and e.get("committed")
                   and paused["time"] < e["time"] < paused["time"] + PAUSE_S]
        assert without and commits, [(round(e["time"] - paused["time"], 2), e["kind"], e.get("replica"),
                                      e.get("members")) for e in ev if e["kind"] in ("quorum", "commit")]
        # it caught up by an early heal from a holder, as the same incarnation, and trained in the round in progress
        heals = [e for e in ev if e["kind"] == "early_heal_done" and e["replica"] == r and e["time"] >= paused["time"]]
        assert heals and heals[0]["generation"] == gave_up["generation"], heals
        assert heals[0]["manager_step"] > gave_up["behind_at"]
        # ... and committed the next sync with the others (the other pause may have left its replica out of it)
        later = [e for e in ev if e["kind"] == "commit" and e["replica"] == r and e.get("committed")
                 and e["time"] > heals[0]["time"]]
        assert later and later[0]["participants"] >= 2 and later[0]["generation"] == gave_up["generation"], later[:1]
    s = run.summary
    assert s["steps_lost_uncommitted"] >= sum(e["inner_steps"] for e in abandoned)
    assert s["replicas_compared"] == 3 and s["replicas_consistent"] is True and s["lineage_resets"] == 0
