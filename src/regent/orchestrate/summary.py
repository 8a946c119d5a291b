"""Pure functions that turn events.jsonl and metrics.jsonl into summary.json figures."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

# Fault kinds after which a replica may train on without failing: `comm` (its replicated group is aborted and
# rebuilt at the next quorum) and `straggler` (a pause shorter than the hang deadline is tolerated). A sync this
# long after the fault needed every rank of the replica, so the fault was over by then.
ABSORBABLE_FAULTS = frozenset({"comm", "straggler"})
ABSORBED_AFTER_S = 1.0


def recovery_breakdowns(events: list[dict[str, Any]], open_out: list[dict[str, Any]] | None = None
                        ) -> list[dict[str, Any]]:
    """One record per recovered failure: fault -> detect -> respawn -> quorum -> transfer -> first commit.

    A recovery starts at a `failure_detected` of replica r (backdated to the matching `fault_injected` when
    there is one) and ends at r's first `commit` from a newer generation. Stages that did not happen (no
    transfer when the replica was already current, say) are 0. Recoveries that never finished (the replica
    gave up, or the run ended first) are appended to `open_out` with their fault and detection times.

    A fault of a kind that need not fail its replica (`ABSORBABLE_FAULTS`) is forgotten once that replica commits
    a sync `ABSORBED_AFTER_S` after it: it was absorbed. Kept, it was paired with the replica's next failure of
    any cause (a soak paired a `comm` fault with a failure 72 s later, a "recovery" of 80.8 s).
    """
    events = sorted(events, key=lambda e: e["time"])
    out: list[dict[str, Any]] = []
    last_fault: dict[int, tuple[float, str | None]] = {}
    open_rec: dict[int, dict[str, Any]] = {}
    for e in events:
        r = e.get("replica")
        kind = e["kind"]
        if kind == "fault_injected" and r is None:
            # a correlated fault names its replicas and when each was hit; without this, their failures were
            # paired with an older fault of theirs that had caused none (a 61.7 s "detect" in a soak)
            offsets = e.get("offsets") or [0.0] * len(e.get("replicas") or [])
            for hit, offset in zip(e.get("replicas") or [], offsets):
                last_fault[hit] = (e["time"] + offset, e.get("fault_kind"))
            continue
        if r is None:
            continue
        if kind == "fault_injected":
            last_fault[r] = (e["time"], e.get("fault_kind"))
        elif (kind == "commit" and e.get("committed") and r in last_fault and r not in open_rec
              and last_fault[r][1] in ABSORBABLE_FAULTS and e["time"] >= last_fault[r][0] + ABSORBED_AFTER_S):
            del last_fault[r]  # the replica synced again (every rank of it voted): that fault failed nothing
        elif kind == "failure_detected" and r not in open_rec:
            t_fault, fault_kind = last_fault.pop(r, (e["time"], None))
            open_rec[r] = {
                "replica": r,
                "fault_kind": fault_kind,
                "t_fault": t_fault,
                "t_detect": e["time"],
                "failed_generation": e.get("generation"),
            }
        elif r in open_rec:
            rec = open_rec[r]
            gen = e.get("generation")
            newer = gen is not None and rec["failed_generation"] is not None and gen > rec["failed_generation"]
            if kind == "restart_done" and "t_respawn" not in rec:
                rec["t_respawn"] = e["time"]
                rec["warm_spare"] = e.get("warm_spare")
            elif kind == "quorum" and newer and "t_quorum" not in rec:
                rec["t_quorum"] = e["time"]
            elif kind == "early_heal_done" and newer and "t_held" not in rec:
                rec["t_held"] = e["time"]
            elif kind == "round_joined" and newer and "t_training" not in rec:
                rec["t_training"] = e["time"]
            elif kind == "heal_done" and newer and "t_heal" not in rec:
                rec["t_heal"] = e["time"]
                rec.setdefault("t_held", e["time"])
                rec["donor"] = e.get("donor")
                rec["bytes"] = e.get("bytes")
            elif kind == "commit" and newer and e.get("committed", True):
                out.append(_close(rec, e["time"]))
                del open_rec[r]
            elif kind in ("gave_up", "ended_failed"):
                if open_out is not None:
                    open_out.append({**rec, "ended": kind, "t_end": e["time"]})
                del open_rec[r]
    if open_out is not None:
        open_out.extend({**rec, "ended": None} for rec in open_rec.values())
    return out


def _close(rec: dict[str, Any], t_commit: float) -> dict[str, Any]:
    t_detect = rec["t_detect"]
    t_respawn = rec.get("t_respawn", t_detect)
    t_quorum = rec.get("t_quorum", t_respawn)
    t_heal = rec.get("t_heal", t_quorum)
    return {
        "replica": rec["replica"],
        "fault_kind": rec.get("fault_kind"),
        "donor": rec.get("donor"),
        "bytes": rec.get("bytes"),
        "warm_spare": rec.get("warm_spare"),
        "detect": max(0.0, t_detect - rec["t_fault"]),
        "respawn": max(0.0, t_respawn - t_detect),
        "rejoin_quorum": max(0.0, t_quorum - t_respawn),
        "transfer": max(0.0, t_heal - t_quorum),
        "first_commit": max(0.0, t_commit - t_heal),
        "total": max(0.0, t_commit - rec["t_fault"]),
        "t_fault": rec["t_fault"],
        # when it held the committed state again by a pull (DiLoCo's global state holds until the next sync)
        "held": max(0.0, min(rec.get("t_held", t_commit), t_commit) - rec["t_fault"]),
        # when it trained again in a way that counts: DiLoCo's mid-round join (its work commits at the round's
        # end), else its first commit
        "training": max(0.0, min(rec.get("t_training", t_commit), t_commit) - rec["t_fault"]),
    }


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile; None for no values (a run without recoveries has no p50)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def healthy_step_rate(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> float | None:
    """Committed steps per second of one replica while no fault was open: the fault-free pace."""
    faults = sorted(e["time"] for e in events if e["kind"] in ("fault_injected", "failure_detected"))
    first_fault = faults[0] if faults else float("inf")
    per_replica: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for m in metrics:
        if m.get("committed", True) and m.get("replica") is not None and m["time"] < first_fault:
            per_replica[m["replica"]].append((m["time"], m["step"]))
    rates = []
    for pts in per_replica.values():
        pts.sort()
        # skip the first points: they include compile/warm-up time
        pts = pts[len(pts) // 5 :] if len(pts) > 10 else pts
        if len(pts) >= 3 and pts[-1][0] > pts[0][0]:
            rates.append((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]))
    return statistics.median(rates) if rates else None


def compute_summary(
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    *,
    replicas: int,
    replicas_consistent: bool | None,
    baseline_rate: float | None = None,
    recovery_mode: str = "peer",
    baseline_dir: str | None = None,
    hang_bound_s: float = 15.0,
    final_states: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """summary.json: the run's figures; `how` says in one sentence how each accounting figure was made.

    Every figure runs to the end of training (`training_end`), not to the last metric record: a run whose
    progress stopped while its clock ran on must show it."""
    open_recs: list[dict[str, Any]] = []
    recs = recovery_breakdowns(events, open_recs)
    committed = [m for m in metrics if m.get("committed", True)]
    losses = [m for m in sorted(metrics, key=lambda m: m["time"]) if trained_loss(m)]
    quorum_ids = [e["quorum_id"] for e in events if e.get("quorum_id") is not None]
    starts = [e["time"] for e in events if e["kind"] == "run_started"]
    # the training time: first step to the end of training (start-up is not training time)
    t0 = min(m["time"] for m in metrics) if metrics else (starts[0] if starts else 0.0)
    t1 = training_end(events, metrics)
    t1 = t0 if t1 is None else max(t0, t1)
    if baseline_rate:
        rate: float | None = baseline_rate
        basis = f"baseline run {baseline_dir}: {baseline_rate:.4g} steps/s" if baseline_dir else \
            f"baseline run: {baseline_rate:.4g} steps/s"
    else:
        rate = healthy_step_rate(metrics, events)
        basis = (f"ESTIMATE from this run's pace before its first fault (all of it if none): {rate:.4g} steps/s "
                 "(pass --baseline DIR for a measured fault-free pace)") if rate else \
            "no fault-free pace: too few steps before the first fault and no --baseline run"
    acct = accounting(events, metrics, replicas=replicas, rate=rate, rate_basis=basis, t0=t0, t1=t1,
                      hang_bound_s=hang_bound_s)
    if not baseline_rate:  # an estimate is never reported as a measurement
        acct["goodput_estimate"] = acct.pop("goodput")
        acct["goodput"] = None
    final_losses = _final_losses(losses)
    # unfinished recoveries count too: their time so far (to the end of training) is a lower bound
    open_totals = [max(0.0, (o.get("t_end") or t1) - o["t_fault"]) for o in open_recs]
    totals = [r["total"] for r in recs]
    compared = [s for s in (final_states or []) if isinstance(s, dict)
                and (s.get("digest") or s.get("hash")) and s.get("step") is not None]
    votes = [e for e in events if e["kind"] == "state_vote"]
    diverged = [e for e in events if e["kind"] == "state_diverged"]
    ended_diverged = [e for e in events
                      if e["kind"] == "ended_failed" and str(e.get("error") or "").startswith("state diverged")]
    out = {
        "replicas": replicas,
        "recovery_mode": recovery_mode,
        "steps_committed": max((m["step"] for m in committed), default=0),
        "replica_steps_committed": len(committed),
        "faults_injected": sum(e["kind"] == "fault_injected" for e in events),
        "failures_detected": sum(e["kind"] == "failure_detected" for e in events),
        "recoveries": len(recs),
        "recoveries_open": len(open_recs),
        "heals": sum(e["kind"] == "heal_done" for e in events),
        "gave_up": sum(e["kind"] == "gave_up" for e in events),
        "ended_failed": sorted({e["replica"] for e in events if e["kind"] == "ended_failed"}),
        "max_quorum_id": max(quorum_ids, default=0),
        "initial_loss": losses[0]["loss"] if losses else None,
        "final_loss": (sum(final_losses) / len(final_losses)) if final_losses else None,
        "replicas_consistent": replicas_consistent,
        "replicas_compared": len(compared),
        "final_step": compared[0]["step"] if compared and len({s["step"] for s in compared}) == 1 else None,
        "state_votes": len(votes),
        "state_votes_disagreeing": sum(not e.get("agreed", True) for e in votes),
        "divergences": sum(len(e.get("replicas") or []) for e in diverged),
        # a heal at the end (a flip after the last vote) that did not give the majority's state ends that replica
        # as failed instead: not healed
        "divergences_healed": sum(len(e.get("replicas") or []) for e in diverged if e.get("action") == "heal")
        - len(ended_diverged),
        # no majority (two replicas that differ): every voter stopped, the backstop restored (a counted state_lost)
        "divergences_restored": sum(len(e.get("replicas") or []) for e in diverged if e.get("action") == "backstop"),
        # found by the final comparison (a flip after the last vote) and not healed there: those replicas ended
        # as failed, left out of the comparison (runs before the final heal recorded action "ended")
        "divergences_ended": len(ended_diverged)
        + sum(len(e.get("replicas") or []) for e in diverged if e.get("action") == "ended"),
        "bitflips_injected": sum(e["kind"] == "bitflip_applied" for e in events),
        # the controller was lost and `regent train --resume` took over: how often, how long nothing supervised
        # (the replicas trained on meanwhile: that time is in every figure), and how (re-attached or backstop)
        "controller_restarts": len(ctl := [e for e in events if e["kind"] == "controller_restarted"]),
        "controller_down_seconds": sum(float(e.get("down_s") or 0.0) for e in ctl),
        "controller_restart_modes": [e.get("mode") for e in ctl],
        # the cost of a constant global batch (ft.constant_batch): micro-batches the survivors of a smaller quorum
        # ran for the missing replicas (from each replica's step records)
        "extra_micro_batches": sum(int(m.get("extra_micro_batches") or 0) for m in committed),
        "steps_with_extra_micro_batches": sum(bool(m.get("extra_micro_batches")) for m in committed),
        "wall_seconds": t1 - t0,
        "healthy_steps_per_second": rate,
        "goodput_is_estimate": not baseline_rate,
        **acct,
        "recovery_seconds": {"p50": percentile(totals, 0.5), "max": max(totals + open_totals, default=None),
                             "open": len(open_totals)},
        # fault -> training again (DiLoCo: a mid-round join, `round_joined`; otherwise the first commit)
        "back_to_training_seconds": {"p50": percentile([r["training"] for r in recs], 0.5),
                                     "max": max([r["training"] for r in recs] + open_totals, default=None)},
        "rounds_joined": sum(e["kind"] == "round_joined" for e in events),
        # of those, joiners whose first commit was not the holders' next sync (they sat out a round: see below)
        "rounds_joined_missed_sync": len(missed_first_syncs(events)),
        # Lighthouse outages (each `lighthouse_restarted`) and the steps the replicas committed through them by
        # keeping their last quorum (ft.quorum_reuse): distinct (quorum, step) pairs of the `quorum_reused` events
        "lighthouse_restarts": sum(e["kind"] == "lighthouse_restarted" for e in events),
        "steps_without_lighthouse": len({(e.get("quorum_id"), e.get("step")) for e in events
                                         if e["kind"] == "quorum_reused"}),
        # replicas that missed the run's last sync and were healed to the final state (run._collect_final_states)
        "left_behind_at_end": sorted({e["replica"] for e in events if e["kind"] == "left_behind"}),
        "recovery_breakdown": recs,
    }
    if isinstance(out.get("how"), dict):
        out["how"]["controller_restarts"] = (
            "Count of controller_restarted events: `regent train --resume` took over a run whose controller was "
            "lost; controller_down_seconds sums their down_s (from the last line the lost controller wrote to "
            "the takeover; the replicas trained on meanwhile, so that time is in every other figure).")
        out["how"]["rounds_joined_missed_sync"] = (
            "round_joined events (a healed replica joined the DiLoCo round in progress at manager step m) whose "
            "replica's first commit after it was above m + 1: it missed the holders' sync and sat a round out.")
        out["how"]["recovery_seconds"] = (
            "Per failure_detected, from its replica's last fault_injected (else from the detection) to that "
            "replica's first commit in a newer generation; a comm or straggler fault after which the replica "
            f"synced again {ABSORBED_AFTER_S:g} s or more later caused no failure and is paired with none.")
    return out


def missed_first_syncs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mid-round joiners (`round_joined` at manager step m: a restarted replica that copied the committed state
    and trained its way to the holders' sync) whose first commit was not that sync's (m + 1): they arrived after
    its quorum formed, waited out a round while the holders alone held step m + 1, and were healed again. One
    record each: replica, generation, when it joined and the manager step of its first commit. Joiners that never
    committed (died first, or the run ended) are not judged."""
    commits: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    joins = []
    for e in events:
        if e["kind"] == "round_joined":
            joins.append(e)
        elif (e["kind"] == "commit" and e.get("committed") and e.get("group_rank", 0) == 0
              and e.get("manager_step") is not None):
            commits.setdefault((e.get("replica"), e.get("generation")), []).append(e)
    out = []
    for j in joins:
        after = [c for c in commits.get((j.get("replica"), j.get("generation")), []) if c["time"] >= j["time"]]
        if not after or j.get("manager_step") is None:
            continue
        first = min(after, key=lambda c: c["time"])  # events.jsonl is in arrival order, nearly but not always time
        if int(first["manager_step"]) > int(j["manager_step"]) + 1:
            out.append({"replica": j.get("replica"), "generation": j.get("generation"), "time": j["time"],
                        "joined_at": j["manager_step"], "first_commit": first["manager_step"]})
    return out


def run_mode(events: list[dict[str, Any]], config: dict[str, Any] | None = None) -> str | None:
    """The run's ft mode ("ddp" per-step, "diloco"), from run_started or config.json; None if unknown."""
    modes = [e.get("mode") for e in events if e["kind"] == "run_started" and e.get("mode")]
    if modes:
        return modes[-1]
    ft = (config or {}).get("ft")
    return ft.get("mode") if isinstance(ft, dict) else None


def training_end(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> float | None:
    """When training ended: the controller's `training_stopped` (every replica reached the stop step or the
    run was cut), else `run_finished`, else (a run killed without either) its last metric record."""
    for kind in ("training_stopped", "run_finished"):
        times = [e["time"] for e in events if e["kind"] == kind]
        if times:
            return max(times)
    return max((m["time"] for m in metrics), default=None)


def trained_loss(m: dict[str, Any]) -> bool:
    """Whether record `m`'s loss is training's: a committed step in which this replica's gradient counted. A
    replica healing in a step (`participating: False`) commits it too, with a loss of the state it held before
    the heal; counted, every recovery would draw a spike in the curve and could set the final loss."""
    return m.get("loss") is not None and m.get("committed", True) and m.get("participating", True)


def _final_losses(losses: list[dict[str, Any]], window: int = 5) -> list[float]:
    """Mean of the last few losses of each replica: one step's loss is noisy."""
    by_rep: dict[Any, list[float]] = defaultdict(list)
    for m in losses:
        by_rep[m.get("replica")].append(m["loss"])
    return [sum(v[-window:]) / len(v[-window:]) for v in by_rep.values() if v]


# ---------------------------------------------------------------------------------------------------------
# Honest accounting (the item 7): what was lost, when progress stood still, and how goodput was made.
# ---------------------------------------------------------------------------------------------------------

RESET_GROUP_S = 30.0  # state_lost events of one lineage reset (one per restoring replica) arrive within this
RESET_MATCH_S = 60.0  # a drop in progress is explained by a state_lost (or full restart) this close to it
DOWN_KINDS = ("failure_detected", "gave_up", "restart_started")


def progress_key(metrics: list[dict[str, Any]]) -> str:
    """`manager_step` (committed syncs) when metrics carry it, else the trainer step.

    The manager step moves only at commits; in DiLoCo the trainer step keeps counting through a failed sync
    (whose local steps are rolled back), so it overstates committed progress.
    """
    return "manager_step" if any(m.get("manager_step") is not None for m in metrics) else "step"


def _committed(metrics: list[dict[str, Any]], key: str = "step") -> list[dict[str, Any]]:
    return sorted((m for m in metrics if m.get("committed", True) and m.get(key) is not None
                   and m.get("time") is not None), key=lambda m: m["time"])


def state_lost_groups(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per lineage reset: every restoring replica emits a `state_lost`, one reset is one group."""
    groups: list[dict[str, Any]] = []
    for e in sorted((e for e in events if e["kind"] == "state_lost"), key=lambda e: e["time"]):
        for g in reversed(groups):
            if g["lost_step"] == e.get("lost_step") and e["time"] - g["last"] <= RESET_GROUP_S:
                break
        else:
            g = {"time": e["time"], "last": e["time"], "lost_step": e.get("lost_step"), "restored_step": None,
                 "source": None, "reason": e.get("reason"), "fatal": False, "replicas": []}
            groups.append(g)
        g["last"] = e["time"]
        g["fatal"] = g["fatal"] or bool(e.get("fatal"))
        if e.get("restored_step") is not None:
            g["restored_step"] = max(g["restored_step"] or 0, e["restored_step"])
            g["source"] = g["source"] or e.get("source")
        if e.get("replica") is not None and e["replica"] not in g["replicas"]:
            g["replicas"].append(e["replica"])
    return groups


def checkpoint_restarts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checkpoint-restart baseline's full restarts: one per new generation, from when it began."""
    by_gen: dict[Any, float] = {}
    for e in events:
        if e["kind"] == "restart_done" and e.get("full_restart", False):
            began = e["time"] - float(e.get("seconds") or 0.0)
            by_gen[e.get("generation")] = min(by_gen.get(e.get("generation"), began), began)
    return [{"time": t, "generation": g} for g, t in sorted(by_gen.items(), key=lambda kv: kv[1])]


def sync_round(events: list[dict[str, Any]]) -> int:
    """Trainer steps between two committed syncs of one replica (the median): 1 in ddp, H in DiLoCo."""
    last: dict[Any, int] = {}
    gaps: list[int] = []
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] == "commit" and e.get("committed", True) and e.get("step") is not None:
            key = (e.get("replica"), e.get("generation"))
            if key in last and e["step"] > last[key]:
                gaps.append(e["step"] - last[key])
            last[key] = e["step"]
    return max(1, int(statistics.median(gaps))) if gaps else 1


def progress_drops(
    metrics: list[dict[str, Any]],
    *,
    key: str | None = None,
    tolerance: int = 1,
    min_records: int | None = None,
) -> list[dict[str, Any]]:
    """Times the global committed progress went backwards, from metrics alone.

    A drop is `min_records` committed records in a row (by time, every replica's) that are all more than
    `tolerance` below the highest value seen so far. One replica restarting from 0 is no drop: the others'
    records, still at the top, break the run. After a drop the new, lower lineage becomes the reference.
    """
    key = key or progress_key(metrics)
    recs = _committed(metrics, key)
    if min_records is None:
        min_records = max(3, len({m.get("replica") for m in recs}))
    drops: list[dict[str, Any]] = []
    high: float | None = None
    run: list[dict[str, Any]] = []
    for m in recs:
        v = m[key]
        if high is None:
            high = v
        elif v < high - tolerance:
            run.append(m)
            if len(run) >= min_records:
                drops.append({"time": run[0]["time"], "from": high, "to": min(r[key] for r in run),
                              "key": key})
                high, run = max(r[key] for r in run), []
        else:
            run = []
            high = max(high, v)
    return drops


def _rollback_losses(
    committed: list[dict[str, Any]], times: list[float], fatal: list[bool]
) -> list[dict[Any, tuple[int, int]]]:
    """For each rollback (sorted times): replica -> (highest trainer step before it, step it went on from)."""
    by_rep: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for m in committed:
        by_rep[m.get("replica")].append(m)
    out: list[dict[Any, tuple[int, int]]] = []
    for i, t in enumerate(times):
        prev = times[i - 1] if i else float("-inf")
        nxt = times[i + 1] if i + 1 < len(times) else float("inf")
        per: dict[Any, tuple[int, int]] = {}
        for r, ms in by_rep.items():
            before = [m["step"] for m in ms if prev <= m["time"] < t]
            after = [m["step"] for m in ms if t <= m["time"] < nxt]
            if before and after:
                per[r] = (max(before), max(0, after[0] - 1))  # a record's step counts the step it just took
            elif before and fatal[i]:
                per[r] = (max(before), 0)  # nothing to go on from: the run stopped with its state gone
        out.append(per)
    return out


def failed_sync_windows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DiLoCo: each failed sync rolls its replica back to the last global parameters, losing the local
    steps since that replica's previous sync (of the same generation; none before its first).

    Plain DiLoCo gives a failed round back (its step count goes back to the round's first step) and trains it
    again: a failed sync at a step no later than the previous failed one's trained the same round again, and
    lost the steps since the same sync as that one.

    A live replica that a quorum left out (late for the sync) gives its round up (`round_abandoned`): its
    inner steps since its previous sync are lost the same way."""
    prev: dict[Any, int] = {}
    anchor: dict[Any, tuple[int, int]] = {}  # (step lost from, step of the last failed sync) since the last commit
    out = []
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] == "round_abandoned":
            out.append({"time": e["time"], "replica": e.get("replica"), "step": e.get("step") or 0,
                        "lost": int(e.get("inner_steps") or 0)})
            continue
        if e["kind"] != "commit" or e.get("step") is None:
            continue
        key = (e.get("replica"), e.get("generation"))
        if not e.get("committed", True) and key in prev:
            base = prev[key]
            if key in anchor and e["step"] <= anchor[key][1]:
                base = anchor[key][0]  # the round given back and trained again
            anchor[key] = (base, e["step"])
            out.append({"time": e["time"], "replica": e.get("replica"), "step": e["step"],
                        "lost": max(0, e["step"] - base)})
        elif e.get("committed", True):
            anchor.pop(key, None)
        prev[key] = e["step"]
    return out


def committing_replicas_series(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]], hang_bound_s: float | None = None,
    t_end: float | None = None,
) -> list[tuple[float, int]]:
    """(time, replicas committing) at each change: a replica is active from a committed step until its next
    failure_detected, gave_up or restart_started event. With `hang_bound_s`, a replica that writes no record
    for longer than that counts as down for the whole silence (to `t_end` after its last record)."""
    recs = _committed(metrics)
    marks = [(m["time"], 1, m.get("replica")) for m in recs]
    marks += [(e["time"], 0, e.get("replica")) for e in events
              if e["kind"] in DOWN_KINDS and e.get("replica") is not None]
    if hang_bound_s is not None:
        last: dict[Any, float] = {}
        for m in recs:
            r = m.get("replica")
            if r in last and m["time"] - last[r] > hang_bound_s:
                marks.append((last[r], 0, r))
            last[r] = m["time"]
        if t_end is not None:
            marks += [(t, 0, r) for r, t in last.items() if t_end - t > hang_bound_s]
    active: set[Any] = set()
    series: list[tuple[float, int]] = []
    for t, up, r in sorted(marks, key=lambda x: (x[0], -x[1])):
        (active.add if up else active.discard)(r)
        if not series or series[-1][1] != len(active):
            series.append((t, len(active)))
    return series


def time_below(series: list[tuple[float, int]], n: int, t0: float, t1: float) -> float:
    """Seconds within [t0, t1] during which the step series `series` was below n."""
    if not series:
        return max(0.0, t1 - t0) if n > 0 else 0.0
    total = 0.0
    for i, (t, count) in enumerate(series):
        end = series[i + 1][0] if i + 1 < len(series) else t1
        lo, hi = max(t, t0), min(end, t1)
        if count < n and hi > lo:
            total += hi - lo
    if series[0][0] > t0:  # nobody committing yet
        total += min(series[0][0], t1) - t0
    return total


def vulnerability_windows(events: list[dict[str, Any]], t_end: float, diloco: bool) -> tuple[list[float], int]:
    """(closed windows, open windows): per failure, seconds from the fault (its detection at the latest) until
    the replica holds the current committed state again; a window still open at `t_end` counts to it.

    Per-step mode ends a window at the replica's first commit of a newer generation: an early pull may already
    be a step stale when it lands. DiLoCo ends it at the first pull (early heal or heal) of the committed
    global state, which holds until the next sync, or at the first commit if that comes first."""
    open_recs: list[dict[str, Any]] = []
    recs = recovery_breakdowns(events, open_recs)
    closed = [r["held"] if diloco else r["total"] for r in recs]
    # a DiLoCo replica that pulled the global state and failed again (or the run ended) before it committed
    closed += [o["t_held"] - o["t_fault"] for o in open_recs if diloco and o.get("t_held") is not None]
    open_w = [max(0.0, (o.get("t_end") or t_end) - o["t_fault"]) for o in open_recs
              if o.get("ended") != "gave_up" and not (diloco and o.get("t_held") is not None)]
    return closed + open_w, len(open_w)


def max_stall(metrics: list[dict[str, Any]], key: str, t_end: float | None = None
              ) -> tuple[float | None, float | None]:
    """(longest time the global committed progress stayed at or below a level it had reached, its start),
    counting the time from the last raise to `t_end` too."""
    recs = _committed(metrics, key)
    if not recs:
        return None, None
    high, since = recs[0][key], recs[0]["time"]
    best, at = 0.0, since
    for m in recs[1:]:
        if m[key] > high:
            if m["time"] - since > best:
                best, at = m["time"] - since, since
            high, since = m[key], m["time"]
    end = max(recs[-1]["time"], t_end if t_end is not None else recs[-1]["time"])
    if end - since > best:
        best, at = end - since, since
    return best, at


def accounting(
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    *,
    replicas: int,
    rate: float | None,
    rate_basis: str,
    t0: float,
    t1: float,
    hang_bound_s: float | None = None,
) -> dict[str, Any]:
    """The honest-accounting figures of summary.json, each with a one-sentence `how`."""
    key = progress_key(metrics)
    committed = _committed(metrics)
    tol = 1 if key == "manager_step" else sync_round(events)
    groups = state_lost_groups(events)
    ckpts = checkpoint_restarts(events)
    explained = [g["time"] for g in groups] + [c["time"] for c in ckpts]
    undetected = [d for d in progress_drops(metrics, key=key, tolerance=tol)
                  if not any(abs(d["time"] - t) <= RESET_MATCH_S for t in explained)]
    rollbacks = sorted(
        [{"time": g["time"], "cause": "state_lost", "fatal": g["fatal"], "lost_step": g["lost_step"],
          "restored_step": g["restored_step"], "replicas": g["replicas"]} for g in groups]
        + [{"time": c["time"], "cause": "checkpoint_restart", "fatal": False} for c in ckpts]
        + [{"time": d["time"], "cause": "undetected_reset", "fatal": False, "from": d["from"], "to": d["to"]}
           for d in undetected],
        key=lambda r: r["time"],
    )
    losses = _rollback_losses(committed, [r["time"] for r in rollbacks], [r["fatal"] for r in rollbacks])
    for rb, per in zip(rollbacks, losses):
        rb["steps_lost"] = sum(max(0, hi - lo) for hi, lo in per.values())
        rb["at"] = rb["time"] - t0
    reset_lost = sum(rb["steps_lost"] for rb in rollbacks)

    uncommitted_records = sum(1 for m in metrics if not m.get("committed", True))
    modes = [e.get("mode") for e in events if e["kind"] == "run_started" and e.get("mode")]
    diloco = modes[-1] == "diloco" if modes else uncommitted_records == 0
    window_lost = 0
    if diloco:
        for w in failed_sync_windows(events):
            lost = w["lost"]
            # steps a later rollback threw away anyway are counted there, not twice
            nxt = next((i for i, rb in enumerate(rollbacks) if rb["time"] > w["time"]), None)
            if nxt is not None and w["replica"] in losses[nxt]:
                went_on_from = losses[nxt][w["replica"]][1]
                lost -= max(0, w["step"] - max(w["step"] - lost, went_on_from))
            window_lost += max(0, lost)
    uncommitted = uncommitted_records + window_lost

    last_rb = rollbacks[-1]["time"] if rollbacks else float("-inf")
    final_step = max((m["step"] for m in committed if m["time"] > last_rb), default=0)
    useful = max(0, min(len(committed) - window_lost - reset_lost, final_step * replicas))
    expected = rate * replicas * max(t1 - t0, 1e-9) if rate else None
    stall, stall_at = max_stall(metrics, key, t_end=t1)
    series = committing_replicas_series(events, metrics, hang_bound_s, t_end=t1)
    vw, vw_open = vulnerability_windows(events, t1, diloco)
    n_ckpt = len(ckpts)
    return {
        "steps_lost": uncommitted + reset_lost,
        "steps_lost_uncommitted": uncommitted,
        "steps_lost_reset": reset_lost,
        "lineage_resets": len(groups),
        "lineage_resets_fatal": sum(g["fatal"] for g in groups),
        "lineage_resets_undetected": len(undetected),
        "full_restarts": n_ckpt + len(groups),
        "full_restart_causes": [{"time": rb["at"], "cause": rb["cause"]} for rb in rollbacks
                                if rb["cause"] != "undetected_reset"],
        "rollbacks": rollbacks,
        "global_committed_step": final_step,
        "progress_key": key,
        "replica_steps_useful": useful,
        "max_stall_seconds": stall,
        "max_stall_at": None if stall_at is None else stall_at - t0,
        "time_below_n_seconds": time_below(series, replicas, t0, t1) if metrics else None,
        "vulnerability_window_seconds": {"p50": percentile(vw, 0.5), "max": max(vw) if vw else None,
                                         "n": len(vw), "open": vw_open},
        "early_heals": sum(e["kind"] == "early_heal_done" for e in events),
        "rounds_abandoned": {"rounds": sum(e["kind"] == "round_abandoned" for e in events),
                             "inner_steps": sum(int(e.get("inner_steps") or 0) for e in events
                                                if e["kind"] == "round_abandoned")},
        "copies_checked": {"checked": sum(e["kind"] == "copy_checked" for e in events),
                           "verified": sum(e["kind"] == "copy_checked" and bool(e.get("verified")) for e in events)},
        "backstop_saves": sum(e["kind"] == "backstop_saved" for e in events),
        "goodput": max(0.0, useful / expected) if expected else None,
        "goodput_basis": rate_basis,
        "how": {
            "steps_lost": "steps_lost_uncommitted + steps_lost_reset: replica-steps trained and then thrown away.",
            "steps_lost_uncommitted": (
                "Metric records with committed false (ddp), plus in DiLoCo the local steps of each failed sync "
                "(trainer step at the failed commit minus at that replica's previous sync; a round given back and "
                "failed again: minus at its sync before that round), and the inner steps of each round a replica "
                "left out of its sync gave up (round_abandoned), less any a later rollback already counts."),
            "steps_lost_reset": (
                "For every rollback of all replicas (lineage reset, checkpoint restart, undetected drop): per "
                "replica, its highest trainer step before it minus the step it went on from (all of it when "
                "a fatal reset stopped the run)."),
            "lineage_resets": f"Groups of state_lost events with the same lost_step within {RESET_GROUP_S:.0f} s "
                              "of each other (one event per restoring replica).",
            "lineage_resets_undetected": (
                f"Drops of the global committed {key} found in metrics alone (a few records in a row, from "
                f"every replica, more than {tol} below the highest so far) with no state_lost or full restart "
                f"within {RESET_MATCH_S:.0f} s."),
            "full_restarts": "Checkpoint-restart baseline restarts (restart_done with full_restart, one per "
                             "generation) plus lineage resets.",
            "gave_up": "Count of gave_up events: replicas whose supervisor stopped restarting them.",
            "ended_failed": ("Replicas that failed after the run decided to stop: not restarted (their peers hold "
                             "the committed state) and left out of replicas_consistent."),
            "full_restart_causes": "One entry per full restart: seconds since the first step and its cause.",
            "global_committed_step": "Highest committed trainer step after the last rollback.",
            "replica_steps_useful": (
                "Committed step records, less failed-sync and rollback losses, capped at "
                "global_committed_step x replicas."),
            "max_stall_seconds": (
                f"Longest time between two records that raised the global committed {key} above its highest "
                "value so far, or from the last one to the end of training (after a reset the stall lasts "
                "until the lost progress is made up); "
                "max_stall_at is when it began, seconds since the first step."),
            "time_below_n_seconds": (
                f"Time between the first step and the end of training with fewer than {replicas} replicas "
                "committing (a replica counts from a committed step until its next failure_detected, gave_up or "
                "restart_started, and as down through any silence longer than the hang bound)."),
            "vulnerability_window_seconds": (
                "Per failure, from the fault (its detection at the latest) until the replica holds the current "
                "committed state: its first commit of a newer generation in per-step mode, its first pull of the "
                "global state (or commit) in DiLoCo; windows still open at the end count to the end (open)."),
            "max_stall_at": "When the longest stall began, seconds since the first step.",
            "lineage_resets_fatal": "Lineage resets with fatal set: no backstop checkpoint, the run stopped.",
            "rollbacks": "Every rollback of all replicas with its time, cause and the replica-steps it threw away.",
            "rounds_abandoned": (
                "round_abandoned events (DiLoCo, `--lighthouse.late-member-ms`): live replicas a sync's quorum left "
                "out because they came late, which gave their round up and pulled the committed state; their "
                "inner steps are counted in steps_lost_uncommitted."),
            "early_heals": "Count of early_heal_done events: restarted replicas that pulled the committed state "
                           "from a live holder before the next sync.",
            "copies_checked": (
                "copy_checked events (DiLoCo: an early heal to a step with no vote, checked against the other "
                "live replicas' digests of that step), and how many were verified (at least two holders agreed "
                "with the copy): a verified copy is a witness in the next vote."),
            "backstop_saves": "Count of backstop_saved events: durable checkpoints that finished.",
            "goodput": (
                "replica_steps_useful / (fault-free steps/s per replica x replicas x seconds from the first "
                "to the end of training), not clamped (above 1 means the pace is not this run's); without a "
                f"--baseline run it is goodput_estimate and goodput is null; pace: {rate_basis}."),
        },
    }
