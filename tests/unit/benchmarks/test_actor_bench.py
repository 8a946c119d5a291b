"""The actor benchmark's own logic (stats, targets, profile summaries) and one real Regent smoke run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


bench = load("actor_bench_under_test", REPO / "benchmarks" / "actor_bench.py")
measures = sys.modules["mesh_api_measures"]


def test_latency_stats_median_and_nearest_rank_p99():
    samples = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    stats = measures.latency_stats(samples)
    assert stats["median_ms"] == pytest.approx(50.5)
    assert stats["p99_ms"] == pytest.approx(99.0)
    assert stats["n"] == 100
    assert measures.latency_stats([0.002])["p99_ms"] == pytest.approx(2.0)


def test_rows_judge_targets_in_the_right_direction():
    rows = {r.key + "." + r.field: r for r in bench.ROWS}
    latency = rows["call_one.median_ms"]
    assert latency.met(0.2) is True and latency.met(0.3) is False
    rate = rows["pipelined.median"]
    assert rate.met(25_000) is True and rate.met(19_999) is False
    assert rows["call_one.p99_ms"].met(5.0) is None  # no target
    assert latency.met("error") is None and latency.met(None) is None
    assert latency.value({"call_one": {"error": "boom"}}) == "error"
    assert latency.value({"call_one": {"median_ms": 0.3}}) == 0.3
    assert latency.value(None) is None


def test_formatting():
    assert bench.fmt(0.376, "ms") == "0.376 ms"
    assert bench.fmt(2.5, "ms") == "2.50 ms"
    assert bench.fmt(3650.0, "calls/s") == "3.65k calls/s"
    assert bench.fmt(None, "ms") == "–"
    rows = {r.key + "." + r.field: r for r in bench.ROWS}
    assert bench.fmt_target(rows["call_one.median_ms"]) == "≤ 0.25 ms"
    assert bench.fmt_target(rows["broadcast.median"]) == "≥ 50k msg/s"


def test_summarize_collapsed_attributes_samples_to_the_innermost_process():
    text = "\n".join([
        'process 1:"python bench.py";main (bench.py:3);call (regent/actor/_mesh.py:10);dumps (p.py:5) 6',
        'process 1:"python bench.py";main (bench.py:3);call (regent/actor/_mesh.py:12) 2',
        'process 1:"python bench.py";<module> (bench.py:1);_find_and_load (<frozen>:1) 50',
        'process 1:"python bench.py";process 2:"python -m worker";loop (w.py:1);parse (t.py:9) 3',
        "garbage line",
    ])
    summary = bench.summarize_collapsed(text)
    assert set(summary) == {'"python bench.py"', '"python -m worker"'}
    parent = summary['"python bench.py"']
    assert parent["samples"] == 8  # imports are dropped
    assert parent["self"][0] == (75.0, "dumps (p.py)")
    assert (100.0, "call (regent/actor/_mesh.py)") in parent["inclusive"]  # lines folded together
    worker = summary['"python -m worker"']
    assert worker["samples"] == 3 and worker["self"] == [(100.0, "parse (t.py)")]
    assert "(3 samples)" in bench.format_summary(summary)


def test_unknown_measure_is_rejected():
    with pytest.raises(SystemExit):
        bench.main(["--runtimes", "regent", "--only", "nope"])


def test_fault_hook_records_instead_of_exiting():
    import types

    api = types.SimpleNamespace(unhandled_fault_hook=lambda failure: (_ for _ in ()).throw(SystemExit(1)))
    faults: list[str] = []
    measures.install_fault_hook(api, faults)
    api.unhandled_fault_hook("failure on mesh \"m\" at ranks [0]")
    assert faults == ['failure on mesh "m" at ranks [0]']
