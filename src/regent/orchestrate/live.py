"""The terminal view: steps and loss per replica, the current quorum, and an event feed (rich)."""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table


@dataclass
class ReplicaView:
    status: str = "starting"
    generation: int = 0
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    restarts: int = 0
    healthy_since: float | None = None


# At most this many replica rows in the terminal view and the plain progress line: at 12,800 replica groups a row
# each made one render ~7 s of controller CPU (rich lays out every row), four times a second
# (`benchmarks/controller_scale_bench.py`); the rows kept are the ones worth looking at (`rows_to_show`).
MAX_ROWS = 24
_ORDER = {"failed": 0, "restarting": 1, "healing": 2, "restarted": 3, "starting": 4, "gave up": 5, "ended failed": 6,
          "training": 7}


def rows_to_show(reps: dict[int, ReplicaView], limit: int = MAX_ROWS) -> list[int]:
    """The replicas the view shows, in replica order: all of them up to `limit`; past it, those not training
    first (failed, restarting, healing, ...), then the furthest behind (lowest step). O(N log limit)."""
    if len(reps) <= limit:
        return sorted(reps)
    import heapq

    picked = heapq.nsmallest(limit, reps.items(), key=lambda kv: (_ORDER.get(kv[1].status, 5), kv[1].step, kv[0]))
    return sorted(r for r, _ in picked)


def status_counts(reps: dict[int, ReplicaView]) -> dict[str, int]:
    """How many replicas are in each status, most common first."""
    counts = collections.Counter(rv.status for rv in reps.values())
    return dict(counts.most_common())


@dataclass
class RunView:
    """Everything the live view shows; updated from events and metrics, rendered by `render`."""

    replicas: int
    started: float = field(default_factory=time.time)
    quorum_id: int = 0
    participants: list[str] = field(default_factory=list)
    members: int = 0
    feed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=12))
    reps: dict[int, ReplicaView] = field(default_factory=dict)
    dashboard: str = ""
    group_failures: set = field(default_factory=set)  # (replica, group build) already shown
    # honest accounting, as summary.json counts it (roughly: DiLoCo's failed syncs are left to the summary)
    lineage_resets: int = 0
    steps_lost: int = 0
    max_stall: float = 0.0
    votes: int = 0  # state votes decided (orchestrate/vote.py)
    divergences: int = 0  # replicas found diverged by them
    _resets_seen: list = field(default_factory=list)  # [lost_step, time of its latest state_lost]
    _top: dict = field(default_factory=dict)  # replica -> highest step since its last reset
    _reset_pending: dict = field(default_factory=dict)  # replica -> its top when its state was lost
    _high: float | None = None  # highest committed progress seen, and when it was reached
    _high_at: float = 0.0

    def __post_init__(self) -> None:
        for r in range(self.replicas):
            self.reps.setdefault(r, ReplicaView())

    def on_metric(self, m: dict[str, Any]) -> None:
        rv = self.reps.get(m.get("replica"))
        if rv is None:
            return
        rv.step = m.get("step", rv.step)
        self._account(m)
        if m.get("participating", True):  # a healing step's loss is of the state before the heal
            rv.loss = m.get("loss", rv.loss)
        rv.tokens_per_s = m.get("tokens_per_s", rv.tokens_per_s)
        if rv.status in ("starting", "restarted", "healing"):
            rv.status = "training"
            rv.healthy_since = rv.healthy_since or time.time()

    def _account(self, m: dict[str, Any]) -> None:
        """Steps lost (uncommitted, and dropped by a lineage reset) and the longest stall, from one metric."""
        r, step = m.get("replica"), m.get("step")
        if not m.get("committed", True):
            self.steps_lost += 1
            return
        if step is not None:
            if r in self._reset_pending:
                self.steps_lost += max(0, self._reset_pending.pop(r) - (step - 1))
                self._top[r] = step
            else:
                self._top[r] = max(self._top.get(r, 0), step)
        v = m.get("manager_step", step)
        t = m.get("time", time.time())
        if v is not None and (self._high is None or v > self._high):
            if self._high is not None:
                self.max_stall = max(self.max_stall, t - self._high_at)
            self._high, self._high_at = v, t

    def stall_now(self) -> float:
        """The longest stall so far, counting the one in progress."""
        return max(self.max_stall, time.time() - self._high_at) if self._high is not None else 0.0

    def on_event(self, e: dict[str, Any]) -> str | None:
        """Update from one event; returns the feed line (None for events too frequent to show)."""
        kind = e["kind"]
        r = e.get("replica")
        rv = self.reps.get(r) if r is not None else None
        # a replica that gave up (or failed while the run stopped) stays so: events of its last incarnation
        # come from other actors and can arrive after the verdict (a restart_done after gave_up)
        ended = rv.status if rv is not None and rv.status in ("gave up", "ended failed") else None
        line = self._apply(e, kind, r, rv)
        if ended is not None:
            rv.status = ended
        if line:
            self.feed.append(f"{time.time() - self.started:6.1f}s  {line}")
        return line

    def _apply(self, e: dict[str, Any], kind: str, r: Any, rv: Any) -> str | None:
        line = None
        if kind == "quorum":
            q = e.get("quorum_id") or 0
            if q > self.quorum_id:
                self.quorum_id = q
                self.participants = list(e.get("participants") or [])
                # a compact quorum answer names no members, only how many (`members`)
                self.members = len(self.participants) or int(e.get("members") or 0)
                line = f"quorum {q} formed with {self.members} replicas"
        elif kind == "peer_abort":
            line = f"replica {r} dropped its collective with failed peer {e.get('peer', '?')}"
        elif kind == "group_failed" and (r, e.get("group")) not in self.group_failures:  # one line, not per rank
            self.group_failures.add((r, e.get("group")))
            line = f"replica {r} lost its group of quorum {e.get('quorum_id')}: {e.get('error', '')}"[:160]
        elif kind == "fault_injected":
            line = f"fault injected: {e.get('fault_kind')} into replica {r} rank {e.get('rank')}"
        elif kind == "failure_detected":
            if rv:
                rv.status, rv.healthy_since = "failed", None
            summary = (e.get("error") or "").strip().splitlines()
            line = f"failure detected on replica {r}: {summary[0] if summary else ''}"[:160]
        elif kind == "restart_started":
            if rv:
                rv.status = "restarting"
            line = f"replica {r} restarting in place ({e.get('action', 'restart')})"
        elif kind == "restart_done":
            if rv:
                rv.status, rv.generation, rv.restarts = "restarted", e.get("generation", 0), rv.restarts + 1
            line = f"replica {r} restarted (generation {e.get('generation')}, {e.get('seconds', 0):.1f}s)"
        elif kind == "heal_started":
            if rv:
                rv.status = "healing"
            line = f"replica {r} healing from replica {e.get('donor')}"
        elif kind == "heal_done":
            if rv:
                rv.status = "training"
                rv.healthy_since = time.time()
            mb = (e.get("bytes") or 0) / 1e6
            line = f"replica {r} healed from {e.get('donor')}: {mb:.1f} MB in {e.get('seconds', 0):.2f}s"
        elif kind == "state_lost":
            if r is not None:
                self._reset_pending[r] = self._top.get(r, 0)
            lost, now = e.get("lost_step"), e.get("time", time.time())
            same = [g for g in self._resets_seen if g[0] == lost and now - g[1] <= 30]
            if same:
                same[-1][1] = now
            else:
                self._resets_seen.append([lost, now])
                self.lineage_resets += 1
                restored = e.get("restored_step")
                line = (f"STATE LOST: no live replica held step {lost}; "
                        + ("the run stops (no backstop)" if e.get("fatal") or restored is None
                           else f"restarting every replica from step {restored} ({e.get('source')})"))
        elif kind == "early_heal_done":
            if rv:
                rv.status = "training"
            line = f"replica {r} pulled the committed state from {e.get('donor')} in {e.get('seconds', 0):.2f}s"
        elif kind == "backstop_saved":
            line = f"backstop checkpoint of step {e.get('manager_step')} saved in {e.get('seconds', 0):.1f}s"
        elif kind == "allocation":
            line = f"replica {r}: fresh allocation from the job layer ({e.get('job') or e.get('backend')})"
        elif kind == "allocation_lost":
            line = f"replica {r}: allocation lost: {e.get('reason')}"
        elif kind == "ended_failed":
            if rv:
                rv.status = "ended failed"
            line = f"replica {r} failed while the run was stopping; not restarted (the others hold the state)"
        elif kind == "gave_up":
            if rv:
                rv.status = "gave up"
            line = f"replica {r} gave up after {e.get('attempts')} attempts"
        elif kind == "state_vote":
            self.votes += 1
        elif kind == "state_diverged":
            self.divergences += len(e.get("replicas") or [])
            line = (f"STATE DIVERGED at committed step {e.get('manager_step')}: replica(s) {e.get('replicas')} "
                    + {"heal": ("differ from the majority at the end: healing from a finished peer" if e.get("final")
                                else "stopped, healing from the majority"),
                       "ended": "differ from the majority at the end: they end as failed"}.get(
                           e.get("action"), "and no majority: restoring the backstop"))
        elif kind == "bitflip_applied":
            line = f"bitflip in replica {r}: bit {e.get('bit')} of {e.get('tensor')}[{e.get('index')}]"
        return line

    def render(self) -> Group:
        t = Table(title=None, expand=False)
        for col in ("replica", "status", "gen", "step", "loss", "tok/s", "restarts"):
            t.add_column(col, justify="right" if col not in ("status",) else "left")
        shown = rows_to_show(self.reps)
        for r in shown:
            rv = self.reps[r]
            color = {"training": "green", "failed": "red", "restarting": "yellow", "healing": "cyan"}.get(rv.status, "")
            t.add_row(
                str(r),
                f"[{color}]{rv.status}[/]" if color else rv.status,
                str(rv.generation),
                str(rv.step),
                "-" if rv.loss is None else f"{rv.loss:.3f}",
                "-" if rv.tokens_per_s is None else f"{rv.tokens_per_s:,.0f}",
                str(rv.restarts),
            )
        head = (
            f"quorum [bold]{self.quorum_id}[/] with {self.members} replicas   "
            f"elapsed {time.time() - self.started:5.0f}s   dashboard {self.dashboard}\n"
            f"lineage resets {f'[bold red]{self.lineage_resets}[/]' if self.lineage_resets else 0}   "
            f"steps lost {self.steps_lost}   max stall {self.stall_now():.0f}s   state votes {self.votes}   "
            f"divergences {f'[bold red]{self.divergences}[/]' if self.divergences else 0}"
        )
        if len(shown) < len(self.reps):
            steps = sorted(rv.step for rv in self.reps.values())
            head += (f"\n{len(self.reps):,} replicas: " + ", ".join(f"{n:,} {k}" for k, n in status_counts(self.reps).items())
                     + f"   step min {steps[0]} / median {steps[len(steps) // 2]} / max {steps[-1]}"
                     + f"   (rows: the {len(shown)} not training or furthest behind)")
        feed = "\n".join(self.feed) or "(no events yet)"
        return Group(Panel(head, title="Regent"), t, Panel(feed, title="events"))


class LiveDisplay:
    """rich Live when stdout is a terminal, plain log lines otherwise (CI, pipes)."""

    def __init__(self, view: RunView, enabled: bool | None = None) -> None:
        self.view = view
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self.console = Console()
        self._live: Live | None = None
        self._last_plain = 0.0

    def __enter__(self) -> LiveDisplay:
        if self.enabled:
            self._live = Live(self.view.render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self.view.render())
            self._live.__exit__(*exc)

    def feed_line(self, line: str | None) -> None:
        if line and not self.enabled:
            print(f"[regent] {line}", flush=True)

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.view.render())
        elif time.time() - self._last_plain > 10:
            self._last_plain = time.time()
            v = self.view
            shown = rows_to_show(v.reps)
            parts = [f"r{r}:{v.reps[r].status}@{v.reps[r].step}"
                     + (f" loss {v.reps[r].loss:.3f}" if v.reps[r].loss else "") for r in shown]
            if len(shown) < len(v.reps):  # one line per 10 s must stay a line at 12,800 replicas
                parts.insert(0, f"{len(v.reps):,} replicas: "
                             + ", ".join(f"{n:,} {k}" for k, n in status_counts(v.reps).items()))
            print(f"[regent] quorum {v.quorum_id} | " + " | ".join(parts)
                  + f" | resets {v.lineage_resets}, steps lost {v.steps_lost}, max stall {v.stall_now():.0f}s, "
                  f"votes {v.votes}, divergences {v.divergences}",
                  flush=True)
