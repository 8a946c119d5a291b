"""The controller at scale (issue 37, item 4): the bounded views that replaced per-replica rows and plot lines,
and a small run of `benchmarks/controller_scale_bench.py` through the real orchestrator code paths (counts, not
time: its speed is the benchmark's to measure)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from regent.orchestrate.live import MAX_ROWS, ReplicaView, RunView, rows_to_show, status_counts
from regent.orchestrate.report import spread

REPO = Path(__file__).resolve().parents[3]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_rows_to_show_keeps_every_replica_when_few_and_the_interesting_ones_when_many() -> None:
    few = {r: ReplicaView(status="training", step=10) for r in range(MAX_ROWS)}
    assert rows_to_show(few) == list(range(MAX_ROWS))
    many = {r: ReplicaView(status="training", step=100 + r % 7) for r in range(10_000)}
    many[9_000] = ReplicaView(status="failed", step=100)
    many[42] = ReplicaView(status="healing", step=3)
    many[5] = ReplicaView(status="restarting", step=99)
    shown = rows_to_show(many, limit=6)
    assert len(shown) == 6 and shown == sorted(shown)
    assert {9_000, 42, 5} <= set(shown)  # not training: first, whatever their step
    rest = [r for r in shown if many[r].status == "training"]
    assert all(many[r].step == 100 for r in rest)  # then the furthest behind
    assert status_counts(many) == {"training": 9_997, "failed": 1, "healing": 1, "restarting": 1}


def test_the_rendered_view_is_bounded_and_counts_every_replica() -> None:
    from rich.console import Console

    view = RunView(replicas=2_000)
    view.reps[7].status = "failed"
    console = Console(record=True, width=200)
    console.print(view.render())
    text = console.export_text()
    assert "2,000 replicas: 1,999 starting, 1 failed" in text
    assert text.count("starting") <= MAX_ROWS + 1


def test_spread_is_min_median_max_per_x_and_buckets_times() -> None:
    points = {0: [(1, 5.0), (2, 4.0)], 1: [(1, 3.0), (2, 6.0)], 2: [(1, 4.0)]}
    assert spread(points) == ([1, 2], [3.0, 4.0], [4.0, 6.0], [5.0, 6.0])
    timed = {r: [(10.0 + r * 0.01, float(r)), (20.0 + r * 0.01, float(r + 1))] for r in range(5)}
    xs, lo, mid, hi = spread(timed, buckets=2)
    assert len(xs) == 2 and lo == [0.0, 1.0] and hi == [4.0, 5.0] and mid == [2.0, 3.0]


def test_a_small_controller_load_goes_through_the_real_code_paths(tmp_path: Path) -> None:
    bench = load("controller_scale_bench_under_test", REPO / "benchmarks" / "controller_scale_bench.py")
    row = bench.run_controller_load(groups=40, steps=4, faults_per_step=0.5, render=True, summary=True,
                                    run_dir=str(tmp_path))
    # 2 faults (one per 2 steps), each 5 events plus a quorum event from every group
    assert row["counts"]["metric"] == 160 and row["counts"]["event_commit"] == 160
    assert row["counts"]["event_fault"] == 10 and row["counts"]["event_quorum"] == 80
    assert row["lines"] == {"events.jsonl": 160 + 10 + 80, "metrics.jsonl": 160}
    assert row["summary_steps_committed"] == 4
    assert (tmp_path / "run" / "report.html").exists() and (tmp_path / "run" / "summary.json").exists()
    assert set(row["us_per"]) == {"metric", "event_commit", "event_fault", "event_quorum", "tick", "render"}
