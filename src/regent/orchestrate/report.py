"""report.html with PNG figures, regenerated from a run directory by `regent report RUN_DIR`."""

from __future__ import annotations

import bisect
import heapq
import html
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from regent.orchestrate.events import read_jsonl
from regent.orchestrate.invariants import check_run
from regent.orchestrate.summary import (
    DOWN_KINDS,
    committing_replicas_series,
    compute_summary,
    healthy_step_rate,
    recovery_breakdowns,
    state_lost_groups,
    trained_loss,
)

FAULT_COLORS = {
    "kill": "tab:red",
    "exception": "tab:orange",
    "segfault": "tab:purple",
    "exit": "tab:brown",
    "comm": "tab:blue",
    "hang": "tab:gray",
    "node": "tab:cyan",  # black is for lost state
}


def active_replicas_series(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, participants) at each new quorum id, the article's Figure 6."""
    seen: dict[int, tuple[float, int]] = {}
    for e in events:
        if e["kind"] == "quorum" and e.get("quorum_id") is not None:
            q = e["quorum_id"]
            n = len(e.get("participants") or []) or int(e.get("members") or 0)  # compact answers: a count
            if q not in seen or e["time"] < seen[q][0]:
                seen[q] = (e["time"], n)
    return sorted(seen.values())


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_active_replicas(events: list[dict[str, Any]], replicas: int | None, out: Path,
                         metrics: list[dict[str, Any]] | None = None) -> None:
    """Replicas in the quorum, and (with metrics) replicas committing, as time_below_n_seconds counts them."""
    plt = _plt()
    series = active_replicas_series(events)
    t0 = min((e["time"] for e in events), default=0.0)
    end = max((e["time"] for e in events), default=t0) - t0
    fig, ax = plt.subplots(figsize=(8, 3.2))
    if series:
        xs = [t - t0 for t, _ in series]
        ys = [n for _, n in series]
        ax.step(xs + [end], ys + [ys[-1]], where="post", color="tab:green", lw=2, label="in quorum")
    committing = committing_replicas_series(events, metrics) if metrics else []
    if committing:
        xs = [t - t0 for t, _ in committing]
        ys = [n for _, n in committing]
        ax.step(xs + [end], ys + [ys[-1]], where="post", color="tab:olive", lw=1, ls="--", label="committing")
    if series or committing:
        ax.legend(fontsize=7, loc="lower right")
    for e in events:
        if e["kind"] == "fault_injected":
            ax.axvline(e["time"] - t0, color=FAULT_COLORS.get(e.get("fault_kind"), "red"), ls=":", lw=1)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("replicas")
    if replicas:
        ax.set_ylim(0, replicas + 0.5)
    ax.set_title("Active replicas over time (dotted: injected faults)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# Past this many replicas the plots draw the spread over replicas (min, median, max per x) instead of a line and a
# legend entry each: at 640 replica groups the legends alone took tens of seconds of the end-of-run report
# (`benchmarks/controller_scale_bench.py`), and 12,800 lines say nothing a band does not.
MAX_REPLICA_LINES = 16


def spread(points: dict[Any, list[tuple[float, float]]], buckets: int = 0
           ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, min, median, max of y over the replicas at x) from each replica's (x, y) points: what the plots draw
    when there are too many replicas for a line each. `buckets` > 0: x (a time, which differs per replica) is
    first floored to one of that many equal bins. O(points log points)."""
    by_x: dict[float, list[float]] = defaultdict(list)
    x0, width = 0.0, 0.0
    if buckets > 0:
        all_x = [x for pts in points.values() for x, _ in pts]
        if all_x:
            x0 = min(all_x)
            width = (max(all_x) - x0) / buckets
    for pts in points.values():
        for x, y in pts:
            if width > 0:  # the last x closes the last bin rather than opening one of its own
                x = x0 + min(math.floor((x - x0) / width), buckets - 1) * width
            by_x[x].append(y)
    xs = sorted(by_x)
    lo, mid, hi = [], [], []
    for x in xs:
        ys = sorted(by_x[x])
        lo.append(ys[0])
        mid.append(ys[len(ys) // 2])
        hi.append(ys[-1])
    return xs, lo, mid, hi


def _plot_replicas(ax: Any, points: dict[Any, list[tuple[float, float]]], what: str, buckets: int = 0,
                   **line: Any) -> None:
    """A line per replica (few), or the spread over them (many: `MAX_REPLICA_LINES`)."""
    if len(points) <= MAX_REPLICA_LINES:
        for r, pts in sorted(points.items(), key=lambda kv: str(kv[0])):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"replica {r}", **line)
        return
    xs, lo, mid, hi = spread(points, buckets)
    ax.fill_between(xs, lo, hi, color="tab:gray", alpha=0.3, lw=0, label=f"{what}: min-max over {len(points):,} replicas")
    ax.plot(xs, mid, color="tab:gray", lw=1, label=f"{what}: median replica")


def plot_loss(metrics: list[dict[str, Any]], events: list[dict[str, Any]], out: Path,
              baseline: list[dict[str, Any]] | None = None) -> None:
    """Loss per replica by step, with the faults and lineage resets drawn where they happened."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    by_rep: dict[Any, list[tuple[int, float]]] = defaultdict(list)
    for m in metrics:
        if trained_loss(m):
            by_rep[m.get("replica")].append((m["step"], m["loss"]))
    _plot_replicas(ax, by_rep, "loss", lw=1, alpha=0.8)
    if baseline:
        bpts = sorted((m["step"], m["loss"]) for m in baseline if m.get("loss") is not None)
        if bpts:
            ax.plot([p[0] for p in bpts], [p[1] for p in bpts], color="black", lw=1.5, ls="--",
                    label="fault-free baseline")
    _mark_faults(ax, events, step_of=_step_at_time(metrics))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss (vertical lines: faults by kind; black: state lost)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _step_at_time(metrics: list[dict[str, Any]]) -> Any:
    """t -> the highest step any replica had reached by time t: places events without a step on a step axis."""
    pts = sorted((m["time"], m["step"]) for m in metrics if m.get("step") is not None and m.get("time") is not None)
    times, top, high = [], [], 0
    for t, step in pts:
        high = max(high, step)
        times.append(t)
        top.append(high)

    def at(t: float) -> int | None:
        i = bisect.bisect_right(times, t)
        return top[i - 1] if i else (top[0] if top else None)

    return at


def _mark_faults(ax: Any, events: list[dict[str, Any]], *, step_of: Any = None, t0: float | None = None) -> None:
    """Vertical lines for injected faults (coloured by kind), failures no injected fault explains (red) and
    lineage resets (black); one legend entry per kind. x is the step (`step_of`) or seconds since `t0`."""
    def x(e: dict[str, Any]) -> float | None:
        if t0 is not None:
            return e["time"] - t0
        return e["step"] if e.get("step") is not None else step_of(e["time"])

    labelled: set[str] = set()

    def line(pos: float | None, label: str, **kw: Any) -> None:
        if pos is None:
            return
        ax.axvline(pos, label=None if label in labelled else label, **kw)
        labelled.add(label)

    injected: dict[Any, float] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] == "fault_injected":
            injected[e.get("replica")] = e["time"]
            kind = e.get("fault_kind") or "fault"
            line(x(e), f"fault: {kind}", color=FAULT_COLORS.get(kind, "red"), ls=":", lw=1.2, alpha=0.8)
        elif e["kind"] == "failure_detected" and e["time"] - injected.get(e.get("replica"), -1e18) > 120:
            line(x(e), "failure (not injected)", color="red", ls="--", lw=1, alpha=0.6)
    for g in state_lost_groups(events):
        line(x({"time": g["time"]}), "state lost (lineage reset)", color="black", lw=1.8)


def _mark_state_votes(ax: Any, events: list[dict[str, Any]], *, t0: float) -> None:
    """State votes as small ticks along the bottom (one legend entry, "state vote") and divergences as thick
    magenta lines (one legend entry, "state diverged") labelled with who diverged and what was done: a vote
    that found replicas apart is the moment the run's state was wrong, so it must stand out among the faults."""
    votes = sorted(e["time"] - t0 for e in events if e["kind"] == "state_vote" and e.get("time") is not None)
    if votes:
        ax.plot(votes, [0.02] * len(votes), transform=ax.get_xaxis_transform(), marker="|", ms=8, mew=1.0,
                ls="", color="dimgray", label="state vote")
    diverged = sorted((e for e in events if e["kind"] == "state_diverged" and e.get("time") is not None),
                      key=lambda e: e["time"])
    for i, e in enumerate(diverged):
        x = e["time"] - t0
        ax.axvline(x, color="magenta", lw=2.2, alpha=0.85, label=None if i else "state diverged")
        who = ", ".join(str(r) for r in e.get("replicas") or []) or "?"
        ax.annotate(f"diverged r{who} ({e.get('action') or '?'})", (x, 0.3), xycoords=("data", "axes fraction"),
                    xytext=(3, 0), textcoords="offset points", rotation=90, fontsize=7, va="bottom", ha="left",
                    color="darkmagenta")


def plot_progress(events: list[dict[str, Any]], metrics: list[dict[str, Any]], out: Path,
                  summary: dict[str, Any] | None = None) -> None:
    """Global committed step over time: what the run really kept, with faults and lineage resets marked."""
    plt = _plt()
    t0 = min((e["time"] for e in events), default=min((m["time"] for m in metrics), default=0.0))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    per_rep: dict[Any, list[tuple[float, int]]] = defaultdict(list)
    for m in metrics:
        if m.get("committed", True) and m.get("step") is not None:
            per_rep[m.get("replica")].append((m["time"] - t0, m["step"]))
    _plot_replicas(ax, per_rep, "step", buckets=400, lw=0.8, alpha=0.35)
    xs, ys = global_committed_series(events, metrics)
    if xs:
        ax.plot([t - t0 for t in xs], ys, color="tab:blue", lw=2, label="global committed step")
    undetected = [rb["time"] for rb in (summary or {}).get("rollbacks") or [] if rb.get("cause") == "undetected_reset"]
    for i, t in enumerate(undetected):  # on the global line where it resumed (the drop may be in manager steps)
        y = next((y for x, y in zip(xs, ys) if x >= t and y == y), 0)
        ax.plot([t - t0], [y], marker="x", color="red", ms=10, ls="", label=None if i else "UNDETECTED reset")
    _mark_faults(ax, events, t0=t0)
    _mark_state_votes(ax, events, t0=t0)
    for g in state_lost_groups(events):
        text = f"state lost {g['lost_step']}->{g['restored_step']}" + (" (fatal)" if g["fatal"] else "")
        ax.annotate(text, (g["time"] - t0, 0.5), xycoords=("data", "axes fraction"), xytext=(3, 0),
                    textcoords="offset points", rotation=90, fontsize=7, va="center", ha="left")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("committed trainer step")
    ax.set_title("Progress: global committed step (max over live replicas)")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def global_committed_series(events: list[dict[str, Any]], metrics: list[dict[str, Any]]
                            ) -> tuple[list[float], list[float]]:
    """(times, steps): the max committed trainer step over replicas that are up, at each record and event
    that changes it; a replica stops counting at its failure_detected/gave_up/restart_started, so a
    lineage reset shows as a drop. NaN while no replica is up (a gap in the line)."""
    marks = [(m["time"], 1, m.get("replica"), m["step"]) for m in metrics
             if m.get("committed", True) and m.get("step") is not None and m.get("time") is not None]
    marks += [(e["time"], 0, e.get("replica"), None) for e in events
              if e["kind"] in DOWN_KINDS and e.get("replica") is not None]
    # The max over up replicas at each mark, with a max-heap whose stale entries (a replica since gone down or at
    # another step) are dropped when they reach the top: O(log N) a mark. A max over all replicas at every mark
    # was O(N) a mark, O(steps x N^2) in all: 20 s of a 12,800-group run's end-of-run summary.
    latest: dict[Any, int] = {}
    heap: list[tuple[int, int, Any]] = []  # (-step, push order, replica): replicas need not be comparable
    xs: list[float] = []
    ys: list[float] = []
    for order, (t, up, r, step) in enumerate(sorted(marks, key=lambda x: (x[0], x[1]))):
        if up:
            latest[r] = step
            heapq.heappush(heap, (-step, order, r))
        else:
            latest.pop(r, None)
        while heap and latest.get(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)
        xs.append(t)
        ys.append(-heap[0][0] if heap else float("nan"))
    return xs, ys


def plot_quorum_ids(events: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    pts = sorted((e["time"], e["quorum_id"]) for e in events if e["kind"] == "quorum" and e.get("quorum_id"))
    t0 = min((e["time"] for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(8, 2.8))
    if pts:
        ax.step([t - t0 for t, _ in pts], [q for _, q in pts], where="post", color="tab:blue")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("quorum id")
    ax.set_title("Quorum id over time")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


STAGES = ("detect", "respawn", "rejoin_quorum", "transfer", "first_commit")


def plot_recovery(recs: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    if recs:
        left = [0.0] * len(recs)
        labels = [f"r{r['replica']} {r.get('fault_kind') or ''}" for r in recs]
        for stage in STAGES:
            vals = [r[stage] for r in recs]
            ax.barh(range(len(recs)), vals, left=left, label=stage)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_yticks(range(len(recs)), labels, fontsize=7)
        ax.legend(fontsize=7, ncol=5, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no recoveries in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds from fault to first committed step")
    ax.set_title("Recovery time, broken down")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_report(run_dir: str | Path, baseline: str | Path | None = None, *,
                 events: list[dict[str, Any]] | None = None, metrics: list[dict[str, Any]] | None = None,
                 violations: list[str] | None = None) -> Path:
    """report.html and its figures, from the run directory alone (so old runs can be re-reported). The end of a
    run passes the records and the checker's verdict it already has: a large run's records are held once."""
    run = Path(run_dir)
    if not (run / "events.jsonl").exists():
        raise FileNotFoundError(f"{run} has no events.jsonl; is it a regent run directory?")
    if events is None or metrics is None:
        events = list(read_jsonl(run / "events.jsonl"))
        metrics = list(read_jsonl(run / "metrics.jsonl"))
    summary: dict[str, Any] = {}
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
    if baseline is None:
        baseline = summary.get("baseline")
    base_metrics = list(read_jsonl(Path(baseline) / "metrics.jsonl")) if baseline else None
    if "how" not in summary and summary.get("replicas"):
        # a run from before the accounting figures: compute them for the page (summary.json stays as it is)
        rate = healthy_step_rate(base_metrics, list(read_jsonl(Path(baseline) / "events.jsonl"))) \
            if base_metrics else None
        fresh = compute_summary(events, metrics, replicas=summary["replicas"], replicas_consistent=None,
                                baseline_rate=rate, baseline_dir=str(baseline) if rate else None)
        summary.update({k: v for k, v in fresh.items() if k not in summary or k in fresh["how"] or k == "how"})
    recs = recovery_breakdowns(events)
    plot_progress(events, metrics, run / "progress.png", summary)
    plot_active_replicas(events, summary.get("replicas"), run / "active_replicas.png", metrics)
    plot_loss(metrics, events, run / "loss.png", base_metrics)
    plot_quorum_ids(events, run / "quorum_ids.png")
    plot_recovery(recs, run / "recovery.png")
    if violations is None:
        try:
            violations = check_run(run, events, metrics)
        except Exception as exc:  # noqa: BLE001 - shown on the page: a report must still come out of a broken run
            violations = [f"the run checker itself failed: {exc!r}"]
    how = summary.get("how") or {}
    accounting = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{_figure_html(k, summary)}</td><td>{html.escape(str(text))}</td></tr>"
        for k, text in how.items()
    )
    if "goodput_basis" in summary:
        accounting += f"<tr><th>goodput_basis</th><td colspan=2>{_figure_html('goodput_basis', summary)}</td></tr>"
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{_figure_html(k, summary)}</td></tr>"
        for k in summary
        if k not in ("recovery_breakdown", "how", "goodput_basis") and k not in how
    )
    cards = "".join(
        f'<div class="card"><div class="label">{html.escape(label)}</div><div class="value">{html.escape(value)}'
        "</div></div>"
        for label, value in key_figures(summary)
    )
    feed = "".join(
        f"<tr><td>{e['time'] - events[0]['time']:.1f}</td><td>{html.escape(e['kind'])}</td>"
        f"<td>{e.get('replica', '')}</td><td>{e.get('generation', '')}</td><td>{e.get('quorum_id', '')}</td>"
        f"<td>{e.get('step', '')}</td><td>{html.escape(_details(e))}</td></tr>"
        for e in events
        if e["kind"] != "commit"
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Regent run {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}}img{{max-width:100%}}
td pre{{white-space:pre-wrap;margin:0;max-height:8em;overflow:auto}}
.verdict{{margin:12px 0;padding:10px 14px;border-radius:6px;color:#fff;font-size:15px}}
.verdict.holds{{background:#2e7d32}}.verdict.violated{{background:#c62828}}
.verdict ul{{margin:6px 0 0 0;padding-left:20px;font-size:13px}}.verdict li{{margin:2px 0}}
.cards{{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:8px}}
.card{{border:1px solid #ccc;border-radius:6px;padding:6px 10px}}
.card .label{{font-size:11px;color:#555}}.card .value{{font-size:15px;font-weight:bold}}
table.inner td,table.inner th{{font-size:11px;padding:1px 4px}}</style></head><body>
{verdict_html(violations)}
<h1>Regent run: {html.escape(run.name)}</h1>
<h2>Key figures</h2><div class="cards" id="key-figures">{cards}</div>
<h2>Progress</h2><img src="progress.png">
<h2>Accounting</h2><table><tr><th>figure</th><th>value</th><th>how it was made</th></tr>{accounting}</table>
<h2>Summary</h2><table>{rows}</table>
<h2>Active replicas</h2><img src="active_replicas.png">
<h2>Loss</h2><img src="loss.png">{convergence_html(run)}
<h2>Quorum id</h2><img src="quorum_ids.png">
<h2>Recovery time</h2><img src="recovery.png">
<h2>Events</h2><table><tr><th>t (s)</th><th>kind</th><th>replica</th><th>gen</th><th>quorum</th><th>step</th>
<th>details</th></tr>{feed}</table></body></html>"""
    out = run / "report.html"
    out.write_text(page)
    return out


def convergence_html(run: Path) -> str:
    """The convergence benchmark's figure and table, when benchmarks/convergence_bench.py left them in this run
    directory (regent.orchestrate.convergence): this run's loss against fault-free runs' at equal samples."""
    from regent.orchestrate.convergence import FIGURE, TABLE

    if not (run / FIGURE).exists():
        return ""
    table = (run / TABLE).read_text() if (run / TABLE).exists() else ""
    return (f'<h2>Convergence against fault-free runs</h2><img src="{FIGURE}">'
            f"<pre>{html.escape(table)}</pre>")


def verdict_html(violations: list[str]) -> str:
    """The run checker's verdict, first on the page: every other figure means something only if the run holds."""
    if not violations:
        return '<div class="verdict holds" id="verdict"><strong>Run checker: holds</strong></div>'
    items = "".join(f"<li>{html.escape(v)}</li>" for v in violations)
    return (f'<div class="verdict violated" id="verdict"><strong>Run checker: {len(violations)} '
            f"violation{'s' if len(violations) != 1 else ''}</strong><ul>{items}</ul></div>")


# ---------------------------------------------------------------------------------------------------------
# Figures as a reader wants them: rounded, with units, nested values as short text or small tables. summary.json
# keeps the raw values; this is only how the page shows them. A key an older run lacks shows "n/a".
# ---------------------------------------------------------------------------------------------------------

NA = "n/a"
ESTIMATE_NOTE = "(ESTIMATE: this run's own pace, no --baseline)"
COUNT_KEYS = ("n", "open", "count", "ranks", "replica", "replicas", "step", "steps", "manager_step")
HEX = re.compile(r"[0-9a-fA-F]{32,}")


def key_figures(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) of the figures a reader looks for first; any a summary.json lacks is "n/a"."""
    def n(key: str, unit: str = "") -> str:
        v = s.get(key)
        return NA if v is None else f"{_fmt(key, v)}{' ' + unit if unit else ''}"

    recoveries = n("recoveries")
    if s.get("recoveries") is not None:
        recoveries = f"{recoveries} finished, {n('recoveries_open')} still open"
    compared = n("replicas_compared")
    if s.get("replicas_compared") is not None:
        compared = f"{compared} of {n('replicas')}"
        if s.get("final_step") is not None:
            compared += f", at step {s['final_step']}"
        elif s["replicas_compared"]:
            compared += ", not at one common step"
    votes = n("state_votes")
    if s.get("state_votes_disagreeing"):
        votes += f" ({s['state_votes_disagreeing']} disagreeing)"
    divergences = n("divergences")
    if s.get("divergences") is not None:
        divergences = f"{divergences} found, {n('divergences_healed')} healed"
    resets = n("lineage_resets")
    extra = [f"{s[k]} {word}" for k, word in (("lineage_resets_undetected", "UNDETECTED"),
                                                ("lineage_resets_fatal", "fatal")) if s.get(k)]
    if s.get("lineage_resets") is not None and extra:
        resets += f" ({', '.join(extra)})"
    stall = n("max_stall_seconds")
    if s.get("max_stall_seconds") is not None and s.get("max_stall_at") is not None:
        stall += f", from {_seconds(s['max_stall_at'])} after the first step"
    return [
        ("steps committed", n("steps_committed", "steps")),
        ("faults injected", n("faults_injected")),
        ("failures detected", n("failures_detected")),
        ("recoveries", recoveries),
        ("replicas compared at the end", compared),
        ("state votes", votes),
        ("divergences", divergences),
        ("bitflips injected", n("bitflips_injected")),
        ("controller restarts (--resume)", f"{s.get('controller_restarts') or 0}"
         + (f", {s.get('controller_down_seconds', 0):.0f} s without one ({', '.join(s.get('controller_restart_modes') or [])})"
            if s.get("controller_restarts") else "")),
        ("lineage resets", resets),
        ("steps lost", n("steps_lost", "replica-steps")),
        ("max stall of the committed step", stall),
        (f"time below {s.get('replicas') or 'N'} replicas", n("time_below_n_seconds")),
        ("vulnerability window", n("vulnerability_window_seconds")),
        ("goodput", goodput_text(s)),
        ("training time", n("wall_seconds")),
    ]


def goodput_text(s: dict[str, Any]) -> str:
    """Goodput to two places; an estimate from the run's own pace is marked as one, never passed off as measured."""
    g, est = s.get("goodput"), s.get("goodput_estimate")
    if isinstance(g, (int, float)) and not isinstance(g, bool):
        return f"{g:.2f}" + (f" {ESTIMATE_NOTE}" if s.get("goodput_is_estimate") else "")
    if isinstance(est, (int, float)) and not isinstance(est, bool):
        return f"{est:.2f} {ESTIMATE_NOTE}"
    return NA


def _figure_html(key: str, s: dict[str, Any]) -> str:
    """One summary figure as HTML: goodput with its estimate, lists of records as a small table, text lines."""
    if key == "goodput":
        return html.escape(goodput_text(s))
    return _value_html(key, s.get(key))


def _value_html(key: str, v: Any) -> str:
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, dict) for x in v):
        return _table_html(key, list(v))
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
        return "<br>".join(html.escape(_fmt(key, x)) for x in v)
    if key == "check" and isinstance(v, dict):
        bad = v.get("violations") or []
        return "holds" if v.get("holds") and not bad else html.escape(f"{len(bad)} violation(s), listed at the top")
    return html.escape(_fmt(key, v))


def _table_html(key: str, rows: list[dict[str, Any]], limit: int = 50) -> str:
    """A list of records (rollbacks, final states) as a small table, one column per field."""
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    if "at" in cols and "time" in cols:
        cols.remove("time")  # "at" is the same moment as seconds since the first step; "time" is the epoch
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c, r.get(c)) if c in r else '')}</td>" for c in cols)
                   + "</tr>" for r in rows[:limit])
    more = f"<tr><td colspan={len(cols)}>... {len(rows) - limit} more</td></tr>" if len(rows) > limit else ""
    return f'<table class="inner"><tr>{head}</tr>{body}{more}</table>'


def _is_seconds(key: str) -> bool:
    return key in ("seconds", "time", "at", "t") or key.endswith(("_seconds", "_at", "_s"))


def _fmt(key: str, v: Any) -> str:
    """`v` as short text, its unit from the name of its figure `key` (seconds for *_seconds, *_at, time)."""
    if v is None:
        return NA
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v} s" if _is_seconds(key) else str(v)
    if isinstance(v, float):
        if _is_seconds(key):
            return _seconds(v)
        if key.endswith("per_second"):
            return f"{_num(v)} steps/s"
        if key.startswith("goodput"):
            return f"{v:.2f}"
        return _num(v)
    if isinstance(v, str):
        return v[:12] + "..." if HEX.fullmatch(v) else v
    if isinstance(v, dict):
        return _dict_text(key, v)
    if isinstance(v, (list, tuple)):
        if not v:
            return "none"
        sep = "; " if any(isinstance(x, (dict, list, tuple)) for x in v) else ", "
        return sep.join(_fmt(key, x) for x in v)
    return str(v)


def _dict_text(key: str, d: dict[str, Any]) -> str:
    """A nested figure as one line: a window of seconds reads "p50 3.08 s, max 5.51 s (8 windows, 0 open)"."""
    if _is_seconds(key) and set(d) <= {"p50", "max", "min", "mean", "n", "open"}:
        stats = ", ".join(f"{k} {_seconds(d[k])}" for k in ("p50", "mean", "min", "max")
                          if isinstance(d.get(k), (int, float)))
        noun = "windows" if "window" in key else "in all"
        counts = ([f"{d['n']} {noun}"] if d.get("n") is not None else []) + \
            ([f"{d['open']} open"] if d.get("open") is not None else [])
        return (stats or "none") + (f" ({', '.join(counts)})" if counts else "")
    if not d:
        return "none"
    seconds = _is_seconds(key)
    return ", ".join(f"{k} {_fmt('seconds' if seconds and k not in COUNT_KEYS else str(k), v)}"
                     for k, v in d.items())


def _seconds(v: float) -> str:
    """Seconds to two places under 100 s, fewer above; minutes or hours alongside long spans."""
    if not math.isfinite(v):
        return f"{v} s"
    a = abs(v)
    text = f"{v:.2f} s" if a < 100 else f"{v:.1f} s" if a < 1000 else f"{v:.0f} s"
    if a >= 7200:
        text += f" ({v / 3600:.1f} h)"
    elif a >= 120:
        text += f" ({v / 60:.1f} min)"
    return text


def _num(v: float) -> str:
    """A plain number with three significant digits (never a long tail of decimals)."""
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if v == int(v) and a < 1e15:
        return str(int(v))
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 0.01:
        return f"{v:.3g}"
    return f"{v:.2e}"


def _round_floats(x: Any) -> Any:
    """Floats in an event's fields to three decimals (four under 1), so the event feed stays readable."""
    if isinstance(x, float):
        return (round(x, 3) if abs(x) >= 1 else round(x, 4)) if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round_floats(v) for v in x]
    return x


def _details(e: dict[str, Any]) -> str:
    skip = {"time", "kind", "replica", "generation", "quorum_id", "step"}
    d = {k: _round_floats(v) for k, v in e.items() if k not in skip}
    tb = d.pop("traceback", None)
    s = json.dumps(d, default=str)
    if tb:
        s += "\n" + str(tb)[-1500:]
    return s
