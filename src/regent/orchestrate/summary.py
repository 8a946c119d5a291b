"""Pure functions that turn events.jsonl and metrics.jsonl into summary.json figures."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any


def recovery_breakdowns(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per recovered failure: fault -> detect -> respawn -> quorum -> transfer -> first commit.

    A recovery starts at a `failure_detected` of replica r (backdated to the matching `fault_injected` when
    there is one) and ends at r's first `commit` from a newer generation. Stages that did not happen (no
    transfer when the replica was already current, say) are 0.
    """
    events = sorted(events, key=lambda e: e["time"])
    out: list[dict[str, Any]] = []
    last_fault: dict[int, tuple[float, str | None]] = {}
    open_rec: dict[int, dict[str, Any]] = {}
    for e in events:
        r = e.get("replica")
        kind = e["kind"]
        if r is None:
            continue
        if kind == "fault_injected":
            last_fault[r] = (e["time"], e.get("fault_kind"))
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
            elif kind == "heal_done" and newer and "t_heal" not in rec:
                rec["t_heal"] = e["time"]
                rec["donor"] = e.get("donor")
                rec["bytes"] = e.get("bytes")
            elif kind == "commit" and newer and e.get("committed", True):
                out.append(_close(rec, e["time"]))
                del open_rec[r]
            elif kind == "gave_up":
                del open_rec[r]
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
    }


def percentile(values: list[float], q: float) -> float | None:
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
) -> dict[str, Any]:
    recs = recovery_breakdowns(events)
    totals = [r["total"] for r in recs]
    committed = [m for m in metrics if m.get("committed", True)]
    losses = [m for m in sorted(metrics, key=lambda m: m["time"]) if m.get("loss") is not None]
    quorum_ids = [e["quorum_id"] for e in events if e.get("quorum_id") is not None]
    starts = [e["time"] for e in events if e["kind"] == "run_started"]
    ends = [e["time"] for e in events if e["kind"] == "run_finished"]
    # the training time: first to last step (start-up and the final stop are not training time)
    t0 = min(m["time"] for m in metrics) if metrics else (starts[0] if starts else 0.0)
    t1 = max(m["time"] for m in metrics) if metrics else (ends[-1] if ends else t0)
    rate = baseline_rate or healthy_step_rate(metrics, events)
    # replica-steps a fault-free run would have committed between the first and the last step
    expected = rate * replicas * max(t1 - t0, 1e-9) if rate else None
    committed_replica_steps = len(committed)
    final_losses = _final_losses(losses)
    return {
        "replicas": replicas,
        "recovery_mode": recovery_mode,
        "steps_committed": max((m["step"] for m in committed), default=0),
        "replica_steps_committed": committed_replica_steps,
        "faults_injected": sum(e["kind"] == "fault_injected" for e in events),
        "failures_detected": sum(e["kind"] == "failure_detected" for e in events),
        "recoveries": len(recs),
        "heals": sum(e["kind"] == "heal_done" for e in events),
        # one full restart restarts every replica: count the restarts, not the replicas restarted
        "full_restarts": len({e.get("generation") for e in events
                              if e["kind"] == "restart_done" and e.get("full_restart", False)}),
        "gave_up": sum(e["kind"] == "gave_up" for e in events),
        "max_quorum_id": max(quorum_ids, default=0),
        "initial_loss": losses[0]["loss"] if losses else None,
        "final_loss": (sum(final_losses) / len(final_losses)) if final_losses else None,
        "replicas_consistent": replicas_consistent,
        "wall_seconds": t1 - t0,
        "healthy_steps_per_second": rate,
        "goodput": (min(1.0, committed_replica_steps / expected) if expected else None),
        "recovery_seconds": {"p50": percentile(totals, 0.5), "max": max(totals) if totals else None},
        "recovery_breakdown": recs,
    }


def _final_losses(losses: list[dict[str, Any]], window: int = 5) -> list[float]:
    """Mean of the last few losses of each replica: one step's loss is noisy."""
    by_rep: dict[Any, list[float]] = defaultdict(list)
    for m in losses:
        by_rep[m.get("replica")].append(m["loss"])
    return [sum(v[-window:]) / len(v[-window:]) for v in by_rep.values() if v]
