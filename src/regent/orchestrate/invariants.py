"""The run checker: what a finished run directory must satisfy. `regent check RUN_DIR` (or
`python -m regent.orchestrate.invariants RUN_DIR`).

A run can finish, print a goodput and still be wrong: committed training silently thrown away, replicas that
disagree, progress that stopped while the clock ran on, processes left behind, memory that only grows. These
checks read only the run directory (events.jsonl, metrics.jsonl, summary.json, config.json), so they apply to
any run, old or new, and to runs on machines we cannot log into.

They are strict on purpose, because every claim about a run rests on them:
- progress is checked per replica and generation, not on the maximum over replicas (two replicas going back
  while a third stays at the top is a loss), with zero tolerance on the committed step;
- a drop is excused only by a `state_lost` at that moment whose counted amount covers all of it;
- every replica that did not give up is compared at the end, all at one step, on their whole state;
- figures are measured to the end of training, not to the last metric record.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from regent.orchestrate.events import read_jsonl
from regent.orchestrate.summary import (
    checkpoint_restarts,
    progress_key,
    run_mode,
    state_lost_groups,
    training_end,
)
from regent.train.coverage import LEDGER_FILE

RSS_GROWTH_FACTOR = 2.0
RSS_GROWTH_MB = 200.0
# A state_lost is matched to a drop it falls inside of (between the replica's last record before the drop and its
# first after), with this much slack: events and metrics are stamped by different processes.
MATCH_SLACK_S = 2.0
# Committed progress that stood still for this long before the end of training (or 5x the run's median time
# between two raises of progress, whichever is longer) is a stall at the end: the run went on without training.
END_STALL_FLOOR_S = 60.0
END_STALL_FACTOR = 5.0
# A goodput measured against a fault-free run may not exceed 1 by more than rounding.
GOODPUT_EPS = 1e-9


def load_run(run_dir: str | Path, records: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                  dict[str, Any], dict[str, Any]]:
    """(events, metrics, summary, config) of a run directory; summary and config are {} when absent, events and
    metrics [] when `records` is False. ValueError when summary.json is not JSON."""
    run = Path(run_dir)
    events = list(read_jsonl(run / "events.jsonl")) if records else []
    metrics = list(read_jsonl(run / "metrics.jsonl")) if records else []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    if (run / "summary.json").exists():
        try:
            summary = json.loads((run / "summary.json").read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"summary.json is not valid JSON: {exc}") from exc
    if (run / "config.json").exists():
        try:
            config = json.loads((run / "config.json").read_text())
        except json.JSONDecodeError:
            config = {}  # an old or torn config: the checks that need it fall back to what events say
    return events, metrics, summary, config


def check_run(run_dir: str | Path, events: list[dict[str, Any]] | None = None,
              metrics: list[dict[str, Any]] | None = None) -> list[str]:
    """Every violation found in `run_dir`; empty when the run holds. `events` and `metrics`: those files'
    records when the caller has read them already (the end of a run: a large run's records are held once)."""
    try:
        read_events, read_metrics, summary, config = load_run(run_dir, records=events is None or metrics is None)
    except ValueError as exc:
        return [str(exc)]
    if events is None or metrics is None:
        events, metrics = read_events, read_metrics
    ledger = list(read_jsonl(Path(run_dir) / LEDGER_FILE))
    return check_records(events, metrics, summary, config) + check_ledger(ledger, events)


def check_records(events: list[dict[str, Any]], metrics: list[dict[str, Any]], summary: dict[str, Any],
                  config: dict[str, Any] | None = None) -> list[str]:
    config = config or {}
    return (check_progress(events, metrics, config) + check_reset_counts(events, summary)
            + check_final_states(summary, events, config) + check_end_stall(events, metrics)
            + check_figures(summary) + check_state_votes(events, config)
            + check_processes(summary) + check_memory(metrics))


# ---------------------------------------------------------------------------------------------------------
# Committed progress, per replica
# ---------------------------------------------------------------------------------------------------------

def replica_drops(records: list[dict[str, Any]], key: str, *, strict: bool,
                  across_generations: bool = False) -> list[dict[str, Any]]:
    """Every time one replica's committed progress went back (or, with `strict`, repeated a committed step
    within one generation; with `across_generations` too, in any later one): per replica, in time order, against
    the highest value that replica had reached.

    After a drop the replica's new level is the reference (a counted reset starts a new lineage)."""
    by_rep: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for m in records:
        if m.get(key) is not None and m.get("time") is not None and m.get("committed", True):
            by_rep[m.get("replica")].append(m)
    out: list[dict[str, Any]] = []
    for r, recs in sorted(by_rep.items(), key=lambda kv: str(kv[0])):
        recs.sort(key=lambda m: m["time"])
        level, last = recs[0][key], recs[0]
        for m in recs[1:]:
            v = m[key]
            same_gen = m.get("generation") == last.get("generation")
            if v < level or (strict and v == level and (same_gen or across_generations)):
                out.append({"replica": r, "from": level, "to": v, "t_before": last["time"], "t_after": m["time"],
                            "generation_before": last.get("generation"), "generation_after": m.get("generation"),
                            "repeat": v == level, "key": key})
                level = v
            else:
                level = max(level, v)
            last = m
    return out


def explain_drop(d: dict[str, Any], groups: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> str | None:
    """None when a counted reset covers all of drop `d`; else why not (one phrase)."""
    lo, hi = d["t_before"] - MATCH_SLACK_S, d["t_after"] + MATCH_SLACK_S
    if any(lo <= c["time"] <= hi for c in restarts):
        return None  # the checkpoint-restart baseline: a full restart, counted from metrics by the summary
    near = [g for g in groups if lo <= g["time"] <= hi and not g["fatal"]]
    if not near:
        return "no state_lost between its last record before and its first after"
    if d["key"] != "manager_step":
        return None  # an old run without manager steps: sizes cannot be compared with lost_step
    for g in near:
        lost, restored = g.get("lost_step"), g.get("restored_step")
        if lost is None or restored is None:
            return None  # an old state_lost without sizes: the time is all there is to match
        if d["from"] <= lost and d["to"] >= restored:
            return None
    sizes = ", ".join(f"{g.get('lost_step')} -> {g.get('restored_step')}" for g in near)
    return f"the state_lost there counts only {sizes}"


def check_progress(events: list[dict[str, Any]], metrics: list[dict[str, Any]],
                   config: dict[str, Any] | None = None) -> list[str]:
    """No replica's committed progress goes back, or (per-step mode) commits one step twice, unless a counted
    reset covers exactly that. Checked on metrics and, independently, on commit events."""
    groups = state_lost_groups(events)
    restarts = checkpoint_restarts(events)
    key = progress_key(metrics)
    mode = run_mode(events, config or {})
    t0 = min((m["time"] for m in metrics), default=min((e["time"] for e in events), default=0.0))
    commits = [{"time": e["time"], "replica": e.get("replica"), "generation": e.get("generation"),
                "committed": True, "manager_step": e["manager_step"]}
               for e in events if e["kind"] == "commit" and e.get("committed", True)
               and e.get("manager_step") is not None]
    out = []
    seen: set[tuple[Any, Any, Any]] = set()
    # A commit event is a step committed: a later incarnation of the same replica committing that manager step
    # again means the first one's state was lost (restored from an older backstop, or healed from peers that never
    # held it), which a counted reset must cover like any drop. Step records are not held to that: a restarted
    # trainer records steps of the state it healed to.
    for source, recs, k, strict, across in (
            ("metrics", metrics, key, key == "manager_step" and mode == "ddp", False),
            ("commit events", commits, "manager_step", True, True)):
        for d in replica_drops(recs, k, strict=strict, across_generations=across):
            why = explain_drop(d, groups, restarts)
            if why is None or (d["replica"], d["from"], d["to"]) in seen:
                continue
            seen.add((d["replica"], d["from"], d["to"]))
            what = (f"committed {d['key']} {d['to']} again" if d["repeat"] else
                    f"committed {d['key']} went back from {d['from']} to {d['to']}")
            out.append(f"replica {d['replica']} (generation {d['generation_before']} -> {d['generation_after']}): "
                       f"{what} {d['t_after'] - t0:.1f}s after the first step ({source}); {why}")
    return out


def check_reset_counts(events: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """summary.json counts every lineage reset the events record, also as a full restart."""
    if not summary:
        return []
    out = []
    n = len(state_lost_groups(events))
    if "lineage_resets" in summary and summary["lineage_resets"] != n:
        out.append(f"summary.json counts {summary['lineage_resets']} lineage resets; events.jsonl records {n}")
    if n and "full_restarts" in summary and (summary["full_restarts"] or 0) < n:
        out.append(f"summary.json counts {summary['full_restarts']} full restarts, fewer than the {n} lineage "
                   "resets (each is one)")
    return out


# ---------------------------------------------------------------------------------------------------------
# The final comparison
# ---------------------------------------------------------------------------------------------------------

def expected_finishers(events: list[dict[str, Any]], replicas: int) -> list[int]:
    """Replicas that must be compared at the end: all but those that gave up or failed after the stop."""
    out_of_it = {e.get("replica") for e in events if e["kind"] in ("gave_up", "ended_failed")}
    return [r for r in range(replicas) if r not in out_of_it]


def final_identity(state: dict[str, Any]) -> str | None:
    """What a replica's final state is compared by: its full-state digest over every rank, else (runs before
    the digest) rank 0's parameter hash."""
    return state.get("digest") or state.get("hash")


def check_final_states(summary: dict[str, Any], events: list[dict[str, Any]] | None = None,
                       config: dict[str, Any] | None = None) -> list[str]:
    """Every replica that did not give up ends at one common step with the same whole state."""
    events = events or []
    finals = [s for s in summary.get("final_states") or [] if isinstance(s, dict)]
    if summary.get("run_failed") or any(e["kind"] == "run_failed" for e in events):
        return []  # the run already failed, with its reason; there is no end state to compare
    replicas = summary.get("replicas") or (config or {}).get("replicas")
    by_rep = {s.get("replica"): s for s in finals}
    out = []
    if replicas and summary:
        missing = [r for r in expected_finishers(events, int(replicas))
                   if by_rep.get(r) is None or final_identity(by_rep[r]) is None or by_rep[r].get("step") is None]
        if missing:
            out.append(f"no final state of replica(s) {missing}: they did not give up, yet were left out of the "
                       "final comparison")
    have = {r: s for r, s in by_rep.items() if final_identity(s) is not None and s.get("step") is not None}
    steps = {s["step"] for s in have.values()}
    if len(steps) > 1:
        out.append("replicas ended at different steps: " + ", ".join(
            f"replica {r} at {s['step']}" for r, s in sorted(have.items(), key=lambda kv: str(kv[0]))))
    idents: dict[str, list[Any]] = defaultdict(list)
    for r, s in sorted(have.items(), key=lambda kv: str(kv[0])):
        idents[final_identity(s) or ""].append(r)
    if len(idents) > 1:
        out.append("replicas ended with different states: " + "; ".join(
            f"{h[:12]} on replicas {reps}" for h, reps in idents.items()))
    if "replicas_compared" in summary and have and summary["replicas_compared"] != len(have):
        out.append(f"summary.json says {summary['replicas_compared']} replicas were compared; final_states holds "
                   f"{len(have)}")
    return out


# ---------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------

def progress_raises(metrics: list[dict[str, Any]], key: str) -> list[float]:
    """Times at which the highest committed value over every replica went up."""
    high: float | None = None
    out = []
    for m in sorted((m for m in metrics if m.get("committed", True) and m.get(key) is not None
                     and m.get("time") is not None), key=lambda m: m["time"]):
        if high is None or m[key] > high:
            high = m[key]
            out.append(m["time"])
    return out


def check_end_stall(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[str]:
    """Committed progress must not stand still at the end of a run while the run goes on."""
    key = progress_key(metrics)
    raises = progress_raises(metrics, key)
    end = training_end(events, metrics)
    if len(raises) < 2 or end is None:
        return []
    gaps = [b - a for a, b in zip(raises, raises[1:])]
    bound = max(END_STALL_FLOOR_S, END_STALL_FACTOR * statistics.median(gaps))
    stall = end - raises[-1]
    if stall <= bound:
        return []
    return [f"committed progress stopped {stall:.0f}s before the end of training (last raise "
            f"{raises[-1] - raises[0]:.0f}s after the first step; allowed {bound:.0f}s): the run went on without "
            "training"]


def check_figures(summary: dict[str, Any]) -> list[str]:
    """Goodput is never above 1, and an estimate is never reported as a measurement."""
    out = []
    g = summary.get("goodput")
    if g is not None and g > 1.0 + GOODPUT_EPS:
        out.append(f"goodput {g:.4f} is above 1: the fault-free pace it was measured against is not this run's "
                   "(another config or machine load)")
    if g is not None and summary.get("goodput_is_estimate"):
        out.append("goodput is reported as a measurement but was estimated from this run's own pace "
                   "(goodput_is_estimate); report it as goodput_estimate or pass --baseline")
    return out


# ---------------------------------------------------------------------------------------------------------
# State votes and bitflips
# ---------------------------------------------------------------------------------------------------------

def vote_every(events: list[dict[str, Any]], config: dict[str, Any]) -> int | None:
    started = [e for e in events if e["kind"] == "run_started"]
    if started and started[-1].get("vote_every") is not None:
        return int(started[-1]["vote_every"]) or None
    k = ((config.get("ft") or {}) if isinstance(config.get("ft"), dict) else {}).get("vote_every")
    return int(k) if k else None


def _donor_index(donor: Any) -> int | None:
    head = str(donor or "").partition(":")[0]
    return int(head[8:]) if head.startswith("replica_") and head[8:].isdigit() else None


def flip_outcome(evs: list[dict[str, Any]], flip: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """Follow one bitflip through the run (events sorted by time): which replicas carry the flipped state. A
    heal copies it to the healer when the donor carries it (and clears it when the donor does not); a failure
    or give-up throws a carrier's state away. A backstop saved by a carrier carries it too: a restore of that
    step makes the restorer a carrier, a restore of another step clears it (a reset that keeps the replica's
    own state changes nothing). ("found", the state_diverged that names a carrier), or ("discarded", None) when
    no replica carries it at the end, or ("lost", None): carried to the end, never found."""
    carriers = {flip.get("replica")}
    saved_flipped: set[int] = set()  # backstop steps written by a carrier
    seen = False
    for e in evs:
        if e is flip:
            seen = True
            continue
        if not seen or e["time"] < flip["time"]:
            continue
        kind, x = e["kind"], e.get("replica")
        if kind == "state_diverged":
            if carriers & set(e.get("replicas") or []):
                return "found", e
            continue
        if x is None:
            continue
        if kind in ("heal_done", "early_heal_done"):
            if _donor_index(e.get("donor")) in carriers:
                carriers.add(x)
            else:
                carriers.discard(x)
        elif kind == "backstop_saved" and x in carriers and e.get("manager_step") is not None:
            saved_flipped.add(int(e["manager_step"]))
        elif kind == "state_lost" and e.get("cause") == "backstop_restore":
            if e.get("restored_step") in saved_flipped:
                carriers.add(x)
            else:
                carriers.discard(x)
        elif kind == "state_lost" and e.get("cause") in ("own_state", "no_holder"):
            pass  # it went on from what it held
        elif kind in ("failure_detected", "gave_up", "ended_failed", "state_lost"):
            carriers.discard(x)
    return ("lost", None) if carriers else ("discarded", None)


def check_state_votes(events: list[dict[str, Any]], config: dict[str, Any] | None = None) -> list[str]:
    """Every injected bitflip is found by a vote within K commits, or its state is thrown away first by every
    replica that carried it (a heal from a carrier carries it on: `flip_outcome`), and no divergence is found
    that no bitflip explains."""
    config = config or {}
    k = vote_every(events, config)
    evs = sorted(events, key=lambda e: e["time"])
    flips = [e for e in evs if e["kind"] == "bitflip_applied"]
    diverged = [e for e in evs if e["kind"] == "state_diverged"]
    out = []
    explained: set[int] = set()
    for f in flips:
        r, at = f.get("replica"), f.get("manager_step")
        what, d = flip_outcome(evs, f)
        if what == "found" and d is not None:
            explained.add(id(d))
            if k and at is not None and d.get("manager_step") is not None and d["manager_step"] - at > k:
                out.append(f"bitflip in replica {r} at committed step {at} was found only at step "
                           f"{d['manager_step']}, more than {k} commits later")
        elif what == "lost" and not any(e["kind"] == "run_failed" for e in evs):
            out.append(f"bitflip in replica {r} at committed step {at} ({f.get('tensor')}) was never found by a "
                       "state vote")
    for d in diverged:
        if id(d) not in explained:
            out.append(f"replica(s) {d.get('replicas')} diverged from the majority at committed step "
                       f"{d.get('manager_step')} with no injected bitflip: a bug or a faulty device changed "
                       "their state (it was healed)")
    return out


# ---------------------------------------------------------------------------------------------------------
# The sample ledger: every sample exactly once
# ---------------------------------------------------------------------------------------------------------

def effective_ledger(lines: list[dict[str, Any]], events: list[dict[str, Any]] | None = None
                     ) -> dict[int, list[dict[str, Any]]]:
    """Ledger lines by committed step: per (step, replica) the last one written (a step committed again after
    a counted reset or a checkpoint restart replaces the lost one). With `events`, a line of a step above the
    step a later `state_lost` restored is left out: that commit's lineage was lost (a counted reset, a
    checkpoint restart), so its samples count as trained only where the restored lineage trains them again
    (a restart whose step is not committed again with samples, e.g. a DiLoCo restart's first sync, would
    otherwise keep the lost round's line beside the round that retrains it)."""
    resets = [(float(e["time"]), int(e["restored_step"])) for e in events or ()
              if e.get("kind") == "state_lost" and e.get("restored_step") is not None and e.get("time") is not None]
    last: dict[tuple[Any, Any], dict[str, Any]] = {}
    for line in sorted((x for x in lines if x.get("step") is not None and x.get("samples") is not None),
                       key=lambda x: x.get("time") or 0.0):
        t = float(line.get("time") or 0.0)
        if any(t < at and int(line["step"]) > restored for at, restored in resets):
            continue
        last[(line["step"], line.get("replica"))] = line
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for (step, _), line in last.items():
        by_step[int(step)].append(line)
    return dict(sorted(by_step.items()))


def fragment_windows(by_step: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Streaming DiLoCo: each committed fragment sync (lines with `fragment`) and the window of global batches
    [lo, hi) it closes. A fragment's sync commits, on that fragment, the samples trained since its previous sync,
    so the window starts where the fragment's previous committed sync ended (0 for its first) and ends where
    the contributors' batches end. Per window: `skipped_whole`, its batches a sync of this fragment that did not
    commit dropped (recorded in `skipped_batches` by any line of the fragment), and `skipped_samples`, the
    samples of the rest no contributor covered: (replicas - the contributors' weight sum) replica-shards of
    each batch (a whole contributor weighs 1). `problem` names what makes a window unreadable."""
    dropped: dict[int, set[int]] = defaultdict(set)
    for ls in by_step.values():
        for x in ls:
            if "fragment" in x:
                dropped[int(x["fragment"])].update(n for lo, hi in x.get("skipped_batches") or []
                                                   for n in range(int(lo), int(hi)))
    prev: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    for step, ls in by_step.items():
        if not any("fragment" in x for x in ls):
            continue
        w: dict[str, Any] = {"step": step, "lines": ls, "problem": None}
        out.append(w)
        frags = {x.get("fragment") for x in ls}
        ends = {int((x.get("batches") or (0, 0))[1]) for x in ls}
        layout = {(x.get("replicas"), x.get("ranks"), x.get("batch_size")) for x in ls}
        if len(frags) != 1 or None in frags:
            w["problem"] = f"lines of different fragments {sorted(frags, key=str)}"
            continue
        if len(ends) != 1:
            w["problem"] = f"contributors ending at different global batches {sorted(ends)} (their data positions differ)"
            continue
        if len(layout) != 1 or None in next(iter(layout)):
            w["problem"] = f"replicas report different layouts {sorted(layout, key=str)}"
            continue
        f, hi = int(frags.pop()), ends.pop()
        lo = prev.get(f, 0)
        replicas, ranks, batch_size = (int(v) for v in layout.pop())
        w.update(fragment=f, lo=lo, hi=hi, span=replicas * ranks * batch_size, replicas=replicas, ranks=ranks,
                 batch_size=batch_size)
        if hi <= lo:
            w["problem"] = (f"its batches end at {hi}, not after the end of fragment {f}'s previous committed sync "
                            f"({lo}): the same batches committed twice on it")
            continue
        whole = {n for n in dropped[f] if lo <= n < hi}
        weight_sum = max(float(x.get("weight_sum") or 0.0) for x in ls)
        w["skipped_whole"] = whole
        w["skipped_samples"] = max(0, round((replicas - weight_sum) * (hi - lo - len(whole)))) * ranks * batch_size
        prev[f] = hi
    return out


def ledger_totals(lines: list[dict[str, Any]], events: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """Samples in committed steps, and samples recorded as skipped (shards no replica of the quorum covered; in
    DiLoCo also the rounds' samples no contributor covered, and whole global batches of rounds that did not
    commit and that no committed round consumed). Streaming DiLoCo counts per fragment (`fragment_windows`): a
    sample committed on all F fragments counts F times, and `fragments` says F."""
    consumed = skipped = 0
    rounds: dict[int, int] = {}  # DiLoCo: global batch -> samples in it
    whole: dict[int, int] = {}  # DiLoCo: global batch recorded as skipped whole -> samples in it
    by_step = effective_ledger(lines, events)
    windows = [w for w in fragment_windows(by_step) if w["problem"] is None]
    for w in windows:
        consumed += sum(hi - lo for line in w["lines"] for lo, hi in line["samples"])
        skipped += w["skipped_samples"] + len(w["skipped_whole"]) * w["span"]
    for ls in by_step.values():
        if any("fragment" in x for x in ls):
            continue
        consumed += sum(hi - lo for line in ls for lo, hi in line["samples"])
        first = ls[0]
        if "round" in first:
            skipped += max(int(x.get("skipped_samples") or 0) for x in ls)
            span = int(first.get("replicas") or 0) * int(first.get("ranks") or 1) * int(first.get("batch_size") or 0)
            rounds.update((n, span) for n in range(int(first["round"][0]), int(first["round"][1])))
            whole.update((n, span) for x in ls for lo, hi in x.get("skipped_batches") or [] for n in range(lo, hi))
            continue
        skipped += max(int(x.get("skipped") or 0) for x in ls) * int(first.get("ranks") or 1) * \
            int(first.get("batch_size") or 0)
    skipped += sum(span for n, span in whole.items() if n not in rounds)
    out = {"samples_committed": consumed, "samples_skipped": skipped}
    if windows:
        out["fragments"] = max(int(x.get("fragments") or 1) for w in windows for x in w["lines"])
    return out


# A participant's ledger line is written by itself just after its commit: one killed in between committed its
# samples (the commit is the quorum's) but wrote no line. Its failure is then recorded within this many seconds.
LOST_LINE_WINDOW_S = 30.0


def _lost_lines(ls: list[dict[str, Any]], failures: dict[Any, list[float]]) -> int:
    """How many of a commit's missing lines (fewer lines than participants) were lost with their writers: as many
    replicas without a line failed around that commit."""
    participants = max(int(x.get("participants") or 0) for x in ls)
    contributed = [x for x in ls if not x.get("sat_out")]  # Streaming DiLoCo: a sat-out replica's line is none
    unwritten = participants - len(contributed)
    if unwritten <= 0 or not failures:
        return 0
    t = max(float(x.get("time") or 0.0) for x in ls)
    present = {x.get("replica") for x in contributed}
    died = [r for r, ts in failures.items()
            if r not in present and any(t - LOST_LINE_WINDOW_S <= f <= t + LOST_LINE_WINDOW_S for f in ts)]
    return unwritten if len(died) >= unwritten else 0


def _check_step(step: int, ls: list[dict[str, Any]], failures: dict[Any, list[float]],
                owners: list[tuple[int, int, int, Any]], batches: dict[int, int]) -> list[str]:
    """Per-step mode: one committed step's lines cover its one global batch, less the shards recorded skipped."""
    out: list[str] = []
    ns = {x.get("batch") for x in ls}
    if len(ns) != 1:
        return [f"ledger: committed step {step} covers different global batches {sorted(ns, key=str)} on "
                "different replicas (their data positions differ)"]
    n = int(ns.pop())
    layout = {(x.get("replicas"), x.get("ranks"), x.get("batch_size")) for x in ls}
    if len(layout) != 1 or None in next(iter(layout)):
        return [f"ledger: committed step {step}: replicas report different layouts {sorted(layout, key=str)}"]
    replicas, ranks, batch_size = (int(v) for v in layout.pop())
    span = replicas * ranks * batch_size
    if n in batches:
        out.append(f"ledger: global batch {n} consumed by committed steps {batches[n]} and {step}")
    batches[n] = step
    covered = 0
    for x in ls:
        for lo, hi in x["samples"]:
            if not n * span <= lo < hi <= (n + 1) * span:
                out.append(f"ledger: committed step {step}, replica {x.get('replica')}: samples [{lo}, {hi}) "
                           f"lie outside its global batch {n} [{n * span}, {(n + 1) * span})")
            owners.append((lo, hi, step, x.get("replica")))
            covered += hi - lo
    recorded = max(int(x.get("skipped") or 0) for x in ls) * ranks * batch_size
    lost = _lost_lines(ls, failures)
    if lost:
        participants = max(int(x.get("participants") or 0) for x in ls)
        recorded += lost * -(-replicas // participants) * ranks * batch_size  # the most one participant covers
    if span - covered > recorded:
        out.append(f"ledger: committed step {step} (global batch {n}) left {span - covered - recorded} of its "
                   f"{span} samples unconsumed without a skip record (covered {covered}, recorded skipped "
                   f"{recorded}): a silent gap")
    return out


def _check_round(step: int, ls: list[dict[str, Any]], failures: dict[Any, list[float]],
                 owners: list[tuple[int, int, int, Any]], batches: dict[int, int], whole: set[int]) -> list[str]:
    """DiLoCo: one committed round's lines (each a contributor's inner steps since the last sync) cover the
    round's global batches, less the samples recorded skipped (`skipped_samples`: replicas that died in the round
    or joined it late); global batches of rounds that did not commit are recorded skipped whole
    (`skipped_batches`, collected into `whole`: ledgers written before such rounds were given back and trained
    again; today's leave it empty)."""
    out: list[str] = []
    rounds = {tuple(x.get("round") or ()) for x in ls}
    layout = {(x.get("replicas"), x.get("ranks"), x.get("batch_size")) for x in ls}
    if len(rounds) != 1 or len(next(iter(rounds))) != 2:
        return [f"ledger: committed round {step} covers different rounds {sorted(rounds, key=str)} on different "
                "replicas (their data positions differ)"]
    if len(layout) != 1 or None in next(iter(layout)):
        return [f"ledger: committed round {step}: replicas report different layouts {sorted(layout, key=str)}"]
    r0, r1 = (int(v) for v in rounds.pop())
    replicas, ranks, batch_size = (int(v) for v in layout.pop())
    span = replicas * ranks * batch_size
    clash = sorted({batches[n] for n in range(r0, r1) if n in batches})
    if clash:
        out.append(f"ledger: global batches of [{r0}, {r1}) consumed by committed steps {clash} and {step}")
    batches.update((n, step) for n in range(r0, r1))
    covered = _cover_lines(ls, step, r0, r1, span, owners, out, f"ledger: committed round {step}",
                           f"its round [{r0}, {r1})")
    for x in ls:
        whole.update(n for lo, hi in x.get("skipped_batches") or [] for n in range(int(lo), int(hi)))
    recorded = max(int(x.get("skipped_samples") or 0) for x in ls)
    lost = _lost_lines(ls, failures)
    if lost:
        contributors = max(int(x.get("participants") or 0) for x in ls)
        # the most one contributor covers: its share of the replica-shards, every inner step of the round
        recorded += lost * -(-replicas // contributors) * (r1 - r0) * ranks * batch_size
    total = (r1 - r0) * span
    if total - covered > recorded:
        out.append(f"ledger: committed round {step} (global batches [{r0}, {r1})) left {total - covered - recorded} "
                   f"of its {total} samples unconsumed without a skip record (covered {covered}, recorded skipped "
                   f"{recorded}): a silent gap")
    return out


def _cover_lines(ls: list[dict[str, Any]], step: int, lo: int, hi: int, span: int,
                 owners: list[tuple[int, int, int, Any]], out: list[str], what: str, window: str) -> int:
    """The samples a round's (or a fragment sync's) lines cover, each line's batches inside [lo, hi) and its
    samples inside its batches (else a violation in `out`, named by `what` and `window`); the samples go to
    `owners` for the overlap check."""
    covered = 0
    for x in ls:
        b0, b1 = (int(v) for v in x.get("batches") or (lo, hi))
        if not lo <= b0 < b1 <= hi:
            out.append(f"{what}, replica {x.get('replica')}: batches [{b0}, {b1}) lie outside {window}")
        for a, b in x["samples"]:
            if not b0 * span <= a < b <= b1 * span:
                out.append(f"{what}, replica {x.get('replica')}: samples [{a}, {b}) lie outside its batches "
                           f"[{b0}, {b1}) = [{b0 * span}, {b1 * span})")
            owners.append((a, b, step, x.get("replica")))
            covered += b - a
    return covered


def _check_fragment_sync(w: dict[str, Any], failures: dict[Any, list[float]],
                         owners: list[tuple[int, int, int, Any]]) -> list[str]:
    """Streaming DiLoCo: one committed fragment sync's lines (each a contributor's inner steps since its last
    sync of the fragment) cover the window `fragment_windows` gives it, less the samples recorded skipped."""
    step, ls = w["step"], w["lines"]
    if w["problem"] is not None:
        return [f"ledger: committed fragment sync {step}: {w['problem']}"]
    f, lo, hi, span = w["fragment"], w["lo"], w["hi"], w["span"]
    out: list[str] = []
    covered = _cover_lines(ls, step, lo, hi, span, owners, out, f"ledger: committed sync {step} of fragment {f}",
                           f"its window [{lo}, {hi}) (after the fragment's previous sync)")
    recorded = w["skipped_samples"] + len(w["skipped_whole"]) * span
    lost = _lost_lines(ls, failures)
    if lost:
        contributors = max(int(x.get("participants") or 0) for x in ls)
        recorded += lost * -(-w["replicas"] // contributors) * (hi - lo) * w["ranks"] * w["batch_size"]
    total = (hi - lo) * span
    if total - covered > recorded:
        out.append(f"ledger: committed sync {step} of fragment {f} (global batches [{lo}, {hi})) left "
                   f"{total - covered - recorded} of its {total} samples unconsumed on that fragment without a skip "
                   f"record (covered {covered}, recorded skipped {recorded}): a silent gap")
    return out


def _overlaps(owners: list[tuple[int, int, int, Any]], what: str = "") -> list[str]:
    """Every sample range that two committed lines both claim (`owners`: (lo, hi, step, replica))."""
    out = []
    reach: tuple[int, int, int, Any] | None = None  # the range seen so far that reaches furthest
    for cur in sorted(owners):
        if reach is not None and cur[0] < reach[1]:
            out.append(f"ledger: samples [{cur[0]}, {min(reach[1], cur[1])}) consumed twice{what}: committed step "
                       f"{reach[2]} (replica {reach[3]}) and committed step {cur[2]} (replica {cur[3]})")
        if reach is None or cur[1] > reach[1]:
            reach = cur
    return out


def check_ledger(lines: list[dict[str, Any]], events: list[dict[str, Any]] | None = None) -> list[str]:
    """Every sample of every global batch up to the last committed one was consumed exactly once in committed
    steps, or recorded as skipped: no sample in two committed steps (or twice in one), no batch with fewer
    samples than its lines cover plus the skips they record, no batch that no committed step covered. Per-step
    lines name one global batch each; DiLoCo's (`round` in the line) a round of them (`_check_round`).

    With `events`: a step that has fewer lines than participants, where as many of the replicas without a line
    failed around that commit (`failure_detected`), lost those lines with their writers, not the samples: the
    samples they covered (at most ceil(replicas / participants) shards each) are accepted as consumed.

    Streaming DiLoCo's lines (`fragment` in the line) are checked per fragment: every sample once in each
    fragment's committed syncs, or recorded skipped for it (`fragment_windows`, `_check_fragment_sync`)."""
    failures: dict[Any, list[float]] = defaultdict(list)
    for e in events or []:
        if e.get("kind") == "failure_detected" and e.get("replica") is not None and e.get("time") is not None:
            failures[e["replica"]].append(float(e["time"]))
    out: list[str] = []
    owners: list[tuple[int, int, int, Any]] = []  # (lo, hi, step, replica)
    batches: dict[int, int] = {}  # global batch -> the committed step that consumed it
    whole: set[int] = set()  # DiLoCo: global batches recorded skipped whole (their round did not commit)
    by_step = effective_ledger(lines, events)
    per_fragment: dict[Any, list[tuple[int, int, int, Any]]] = defaultdict(list)  # Streaming DiLoCo's owners
    for w in fragment_windows(by_step):
        out += _check_fragment_sync(w, failures, per_fragment[w.get("fragment")])
    for step, ls in by_step.items():
        if any("fragment" in x for x in ls):
            continue
        if any("round" in x for x in ls):
            out += _check_round(step, ls, failures, owners, batches, whole)
        else:
            out += _check_step(step, ls, failures, owners, batches)
    out += _overlaps(owners)
    for f, claimed in sorted(per_fragment.items(), key=lambda kv: str(kv[0])):
        out += _overlaps(claimed, f" on fragment {f}")
    if batches:
        missing = sorted(set(range(max(batches) + 1)) - set(batches) - whole)
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            out.append(f"ledger: global batch(es) {shown} ({len(missing)} in all) were consumed by no committed "
                       "step and recorded as skipped by none: a silent gap")
    return out


# ---------------------------------------------------------------------------------------------------------
# Processes and memory
# ---------------------------------------------------------------------------------------------------------

def check_processes(summary: dict[str, Any]) -> list[str]:
    """No process of the run outlives it."""
    out = []
    leaked = summary.get("leaked_pids")
    if leaked:
        out.append(f"leaked processes after the run: pids {leaked}")
    at_end = summary.get("processes_at_end")
    if at_end and (not isinstance(at_end, (list, tuple, dict)) or len(at_end) > 0):
        out.append(f"processes still running at the end of the run: {at_end}")
    return out


def check_memory(metrics: list[dict[str, Any]]) -> list[str]:
    """Resident memory that keeps growing over the run (per replica, from metrics' `rss_mb` when present):
    the median of the last quarter is more than twice, and 200 MB above, that of the second quarter."""
    by_rep: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for m in metrics:
        if m.get("rss_mb") is not None and m.get("time") is not None:
            by_rep[m.get("replica")].append((m["time"], float(m["rss_mb"])))
    out = []
    for r, pts in sorted(by_rep.items(), key=lambda kv: str(kv[0])):
        if len(pts) < 8:
            continue
        pts.sort()
        q = len(pts) // 4
        second = statistics.median(v for _, v in pts[q:2 * q])
        last = statistics.median(v for _, v in pts[len(pts) - q:])
        if last > RSS_GROWTH_FACTOR * second and last - second > RSS_GROWTH_MB:
            out.append(f"memory of replica {r} keeps growing: median RSS {second:.0f} MB in the second quarter "
                       f"of the run, {last:.0f} MB in the last")
    return out


def verdict_line(run: str | Path, violations: list[str]) -> str:
    """The one-line verdict `regent check` and `regent train` end with."""
    if not violations:
        return f"{run}: holds"
    return f"{run}: {len(violations)} violation(s); first: {violations[0]}"


def main(argv: list[str] | None = None) -> int:
    """Print one line per violation and exit 1, or one line "holds" and exit 0; 2 for a bad argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: regent check RUN_DIR", file=sys.stderr)
        return 2
    run = Path(args[0])
    if not (run / "events.jsonl").exists():
        print(f"{run} has no events.jsonl; is it a regent run directory?", file=sys.stderr)
        return 2
    violations = check_run(run)
    for v in violations:
        print(f"VIOLATION: {v}")
    if not violations:
        print(verdict_line(run, violations))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
