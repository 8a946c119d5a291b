"""report.html with PNG figures, regenerated from a run directory by `regent report RUN_DIR`."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from regent.orchestrate.events import read_jsonl
from regent.orchestrate.summary import recovery_breakdowns

FAULT_COLORS = {
    "kill": "tab:red",
    "exception": "tab:orange",
    "segfault": "tab:purple",
    "exit": "tab:brown",
    "comm": "tab:blue",
    "hang": "tab:gray",
    "node": "black",
}


def active_replicas_series(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, participants) at each new quorum id, the article's Figure 6."""
    seen: dict[int, tuple[float, int]] = {}
    for e in events:
        if e["kind"] == "quorum" and e.get("quorum_id") is not None:
            q = e["quorum_id"]
            n = len(e.get("participants") or [])
            if q not in seen or e["time"] < seen[q][0]:
                seen[q] = (e["time"], n)
    return sorted(seen.values())


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_active_replicas(events: list[dict[str, Any]], replicas: int | None, out: Path) -> None:
    plt = _plt()
    series = active_replicas_series(events)
    t0 = min((e["time"] for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    if series:
        xs = [t - t0 for t, _ in series]
        ys = [n for _, n in series]
        end = max(e["time"] for e in events) - t0
        ax.step(xs + [end], ys + [ys[-1]], where="post", color="tab:green", lw=2)
    for e in events:
        if e["kind"] == "fault_injected":
            ax.axvline(e["time"] - t0, color=FAULT_COLORS.get(e.get("fault_kind"), "red"), ls=":", lw=1)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("replicas in quorum")
    if replicas:
        ax.set_ylim(0, replicas + 0.5)
    ax.set_title("Active replicas over time (dotted: injected faults)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_loss(metrics: list[dict[str, Any]], events: list[dict[str, Any]], out: Path,
              baseline: list[dict[str, Any]] | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    by_rep: dict[Any, list[tuple[int, float]]] = defaultdict(list)
    for m in metrics:
        if m.get("loss") is not None and m.get("committed", True):
            by_rep[m.get("replica")].append((m["step"], m["loss"]))
    for r, pts in sorted(by_rep.items(), key=lambda kv: str(kv[0])):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, alpha=0.8, label=f"replica {r}")
    if baseline:
        bpts = sorted((m["step"], m["loss"]) for m in baseline if m.get("loss") is not None)
        if bpts:
            ax.plot([p[0] for p in bpts], [p[1] for p in bpts], color="black", lw=1.5, ls="--",
                    label="fault-free baseline")
    for e in events:
        if e["kind"] == "failure_detected" and e.get("step") is not None:
            ax.axvline(e["step"], color="red", alpha=0.25, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss (red lines: failures detected)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


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


def write_report(run_dir: str | Path, baseline: str | Path | None = None) -> Path:
    run = Path(run_dir)
    if not (run / "events.jsonl").exists():
        raise FileNotFoundError(f"{run} has no events.jsonl; is it a regent run directory?")
    events = list(read_jsonl(run / "events.jsonl"))
    metrics = list(read_jsonl(run / "metrics.jsonl"))
    summary: dict[str, Any] = {}
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
    if baseline is None:
        baseline = summary.get("baseline")
    base_metrics = list(read_jsonl(Path(baseline) / "metrics.jsonl")) if baseline else None
    recs = recovery_breakdowns(events)
    plot_active_replicas(events, summary.get("replicas"), run / "active_replicas.png")
    plot_loss(metrics, events, run / "loss.png", base_metrics)
    plot_quorum_ids(events, run / "quorum_ids.png")
    plot_recovery(recs, run / "recovery.png")
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v) if not isinstance(v, str) else v)}</td></tr>"
        for k, v in summary.items()
        if k != "recovery_breakdown"
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
td pre{{white-space:pre-wrap;margin:0;max-height:8em;overflow:auto}}</style></head><body>
<h1>Regent run: {html.escape(run.name)}</h1>
<h2>Summary</h2><table>{rows}</table>
<h2>Active replicas</h2><img src="active_replicas.png">
<h2>Loss</h2><img src="loss.png">
<h2>Quorum id</h2><img src="quorum_ids.png">
<h2>Recovery time</h2><img src="recovery.png">
<h2>Events</h2><table><tr><th>t (s)</th><th>kind</th><th>replica</th><th>gen</th><th>quorum</th><th>step</th>
<th>details</th></tr>{feed}</table></body></html>"""
    out = run / "report.html"
    out.write_text(page)
    return out


def _details(e: dict[str, Any]) -> str:
    skip = {"time", "kind", "replica", "generation", "quorum_id", "step"}
    d = {k: v for k, v in e.items() if k not in skip}
    tb = d.pop("traceback", None)
    s = json.dumps(d, default=str)
    if tb:
        s += "\n" + str(tb)[-1500:]
    return s
