"""When is a trainer hung? A rule that adapts to what the replica observes, instead of one fixed timeout.

Why: a fixed 15 s timeout stalls the surviving replicas 15 s for every hang (they wait for the hung one in
their quorum or collective until it is declared failed), while a short fixed timeout declares a slow but
healthy machine hung. The replica's own observations tell the two apart.

What is observed. A trainer answers `ping` on its actor's event loop while its training step runs in a worker
thread, so a healthy trainer answers within milliseconds, even mid-step. A process that is SIGSTOPped, or has
a thread that holds the GIL, does not answer at all. The ReplicaActor's watchdog keeps one ping in flight
(answered by every rank), sends the next `ping_every_s` after an answer, and asks `HangDetector.is_hung` how
long the one in flight has been unanswered.

The rule (knobs are `faults.*` fields, see FaultConfig):
- start-up: until the current generation has answered *ready* once (every rank built its model), the deadline
  is `startup_s` = max(90 s, 4 x hang_timeout): a cold process importing torch on a loaded machine may hold
  the GIL for many seconds.
- warming: ready, but no step taken yet by this generation (waiting for its quorum, healing, its first step):
  the deadline is the ceiling, `hang_timeout`. Nothing has been learned about this process's steps yet.
- steady: deadline = clamp(max(latency_k x p99(ping latency), step_k x median(step time)) + margin,
  floor, ceiling), over the last `window` answers (latencies are kept across generations: they describe the
  machine; the first, start-up answer of a generation is not counted). Fast answers give the floor (default
  4 s, against 15 s before); a slow machine (late answers, slow steps) gets proportionally more, never more
  than the ceiling.

Stragglers. A trainer paused for less than the deadline (a `straggler` fault: SIGSTOP for `straggler_s`, then
SIGCONT) answers late and is not declared hung; its late answer then counts as a slow answer, so the deadline
grows for a while. A pause longer than the deadline cannot be told apart from a hang and is declared one.
The default floor (4 s) is above the default straggler (3 s) on purpose: keep `hang_floor_s` above the longest
pause that should be tolerated.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HangRule:
    """The knobs of the rule (see the module docstring); `from_faults` reads them from a FaultConfig."""

    ceiling_s: float = 15.0
    floor_s: float = 4.0
    latency_k: float = 3.0
    step_k: float = 0.5
    margin_s: float = 1.0
    startup_s: float = 90.0
    window: int = 120

    @classmethod
    def from_faults(cls, faults: Any) -> HangRule:
        ceiling = float(faults.hang_timeout)
        return cls(
            ceiling_s=ceiling,
            floor_s=min(float(faults.hang_floor_s), ceiling),
            latency_k=float(faults.hang_latency_k),
            step_k=float(faults.hang_step_k),
            margin_s=float(faults.hang_margin_s),
            startup_s=max(90.0, 4 * ceiling),
        )


def p99(values: list[float] | deque[float]) -> float:
    """Nearest-rank 99th percentile (the largest value for fewer than 100 samples): one slow answer counts."""
    xs = sorted(values)
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


class HangDetector:
    """The rule's state for one replica: which phase its current generation is in, and recent observations."""

    def __init__(self, rule: HangRule) -> None:
        self.rule = rule
        self.latencies: deque[float] = deque(maxlen=rule.window)
        self.step_times: deque[float] = deque(maxlen=rule.window)
        self.generation: int | None = None
        self.phase = "startup"
        self._first_step: int | None = None  # the step this generation was at when it was first ready
        self._last_step: int | None = None
        self._last_step_at: float | None = None

    @property
    def ready(self) -> bool:
        """The current generation has answered with its model built."""
        return self.phase != "startup"

    def start_generation(self, generation: int) -> None:
        """A new generation of trainers: back to the start-up allowance (the machine's latencies are kept)."""
        if generation == self.generation:
            return
        self.generation = generation
        self.phase = "startup"
        self._first_step = self._last_step = self._last_step_at = None

    def on_answer(self, generation: int, latency_s: float, steps: list[int], now: float) -> None:
        """Every rank of `generation` answered a ping sent `latency_s` ago; `steps` are their steps (-1: not
        ready yet)."""
        if generation != self.generation:
            return  # an answer from a generation replaced since
        was_ready = self.ready
        if was_ready:
            self.latencies.append(max(0.0, latency_s))
        if not steps or min(steps) < 0:
            return
        step = max(steps)
        if not was_ready:
            self.phase, self._first_step = "warming", step
        elif self._first_step is not None and step > self._first_step:
            self.phase = "steady"
        first = self._first_step if self._first_step is not None else step
        if self._last_step is not None and self._last_step_at is not None and step > self._last_step > first:
            # seconds per step since the last advance seen; the gap before the first step (quorum, heal) is not
            # a step time, so it is skipped
            self.step_times.append((now - self._last_step_at) / (step - self._last_step))
        if step != self._last_step:
            self._last_step, self._last_step_at = step, now

    def deadline(self) -> float:
        """Seconds the ping in flight may stay unanswered before the trainer is declared hung."""
        r = self.rule
        if self.phase == "startup":
            return r.startup_s
        if self.phase == "warming" or not self.latencies:
            return r.ceiling_s
        estimate = r.latency_k * p99(self.latencies)
        if self.step_times:
            estimate = max(estimate, r.step_k * statistics.median(self.step_times))
        return min(r.ceiling_s, max(r.floor_s, estimate + r.margin_s))

    def is_hung(self, silent_s: float) -> bool:
        """The ping in flight has been unanswered for `silent_s` seconds: is that a hang?"""
        return silent_s > self.deadline()

    def explain(self) -> str:
        """The deadline and what it came from, for the failure message."""
        if self.phase == "startup":
            return f"start-up allowance {self.deadline():.1f}s"
        lat = f"p99 ping {p99(self.latencies) * 1000:.0f} ms" if self.latencies else "no pings yet"
        step = f", median step {statistics.median(self.step_times):.2f}s" if self.step_times else ""
        return f"deadline {self.deadline():.1f}s ({self.phase}; {lat}{step})"
