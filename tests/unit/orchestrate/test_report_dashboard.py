"""report.html reads like a dashboard (issue 32 item 6): the run checker's verdict first, key figures rounded and
with units, votes and divergences on the progress plot, and old summary.json files without the new keys."""

from __future__ import annotations

import html
import json
import re

from regent.orchestrate.invariants import check_run
from regent.orchestrate.report import _dict_text, _mark_state_votes, key_figures, write_report
from tests.unit.orchestrate.test_run_checker import Run, clean, ev

LONG_FLOAT = re.compile(r"\d\.\d{5,}")  # a figure dumped unrounded, e.g. 8.312522888183594


def body(page: str) -> str:
    return page.split("<body>", 1)[1].lstrip()


def key_block(page: str) -> str:
    return page.split('id="key-figures">', 1)[1].split("<h2>", 1)[0]


def test_clean_run_opens_with_holds_and_rounded_key_figures(tmp_path):
    """The verdict comes before the title; raw figures with long tails are rounded and carry units."""
    run = clean().write(tmp_path / "r", wall_seconds=8.312522888183594, max_stall_seconds=2.7182818284,
                        max_stall_at=1.41421356, time_below_n_seconds=0.123456789,
                        vulnerability_window_seconds={"p50": 3.0812345, "max": 5.5123456, "n": 8, "open": 0},
                        recovery_seconds={"p50": 4.00001234, "max": 6.25000001, "open": 1},
                        goodput=None, goodput_estimate=0.6123456789, steps_lost=12,
                        rollbacks=[{"time": 1712345678.123456, "at": 55.123456, "cause": "state_lost",
                                    "fatal": False, "lost_step": 50, "restored_step": 20, "replicas": [0, 1],
                                    "steps_lost": 60}])
    assert check_run(run) == []
    page = write_report(run).read_text()
    assert body(page).startswith('<div class="verdict holds" id="verdict"><strong>Run checker: holds')
    assert page.index('id="verdict"') < page.index("<h1>") < page.index("Key figures") < page.index("<h2>Progress")
    assert not LONG_FLOAT.search(page), LONG_FLOAT.findall(page)
    assert "8312522888183594" not in page and "{&quot;p50&quot;" not in page and '{"p50"' not in page
    keys = key_block(page)
    for text in ("300 steps", "8.31 s", "2.72 s, from 1.41 s after the first step", "0.12 s",
                 "p50 3.08 s, max 5.51 s (8 windows, 0 open)", "12 replica-steps", "3 of 3, at step 300",
                 html.escape("0.61 (ESTIMATE: this run's own pace, no --baseline)"), "time below 3 replicas",
                 "0 found, 0 healed"):
        assert text in keys, text
    assert "p50 4.00 s, max 6.25 s (1 open)" in page  # recovery_seconds in the accounting/summary table
    # lists are small tables, not JSON: the rollback at 55.12 s since the first step, its epoch time left out
    assert "<th>cause</th>" in page and "55.12 s" in page and "1712345678" not in page
    assert "dddddddddddd..." in page and "d" * 13 not in page  # digests shortened in the final_states table
    # the per-figure "how it was made" column stays
    assert "how it was made" in page and "lineage_resets" in page


def test_violations_are_listed_each_on_its_own_line(tmp_path):
    run = clean()
    run.finish(301.5, {0: (300, "d" * 64), 1: (300, "d" * 64), 2: (299, "e" * 64)})
    path = run.write(tmp_path / "r")
    violations = check_run(path)
    assert len(violations) >= 2
    page = write_report(path).read_text()
    assert body(page).startswith('<div class="verdict violated" id="verdict">')
    banner = body(page).split("</div>", 1)[0]
    assert f"{len(violations)} violations" in banner
    for v in violations:
        assert f"<li>{html.escape(v)}</li>" in banner
    assert "ended with different states" in banner and "ended at different steps" in banner


def test_votes_and_divergences_on_the_progress_plot(tmp_path):
    """Divergences are drawn as lines with one legend entry, votes as ticks with one; the figure is written."""
    run = clean()
    run.events[0]["vote_every"] = 10
    for step in range(10, 300, 10):
        run.events.append(ev("state_vote", step + 0.5, None, manager_step=step, voters=[0, 1, 2],
                             agreed=step not in (50, 120), diverged=[1] if step in (50, 120) else []))
    for t, step, reps, action in ((50.0, 49, [1], "heal"), (119.0, 118, [2], "heal")):
        run.events.append(ev("bitflip_applied", t, reps[0], manager_step=step, tensor="/model/w", bit=20))
        run.events.append(ev("state_diverged", t + 1.5, None, replicas=reps, manager_step=step + 1, action=action))
    path = run.write(tmp_path / "r")
    assert check_run(path) == []
    page = write_report(path).read_text()
    assert (path / "progress.png").stat().st_size > 1000
    keys = key_block(page)
    assert "29 (2 disagreeing)" in keys and "2 found, 2 healed" in keys and "bitflips injected" in keys

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _mark_state_votes(ax, run.events, t0=0.0)
    labels = [ln.get_label() for ln in ax.lines if not ln.get_label().startswith("_")]
    assert labels == ["state vote", "state diverged"]  # one legend entry each
    assert len(ax.lines) == 3  # one line of 29 ticks, then a line per divergence
    assert len(ax.lines[0].get_xdata()) == 29 and ax.lines[1].get_xdata()[0] == 51.5
    plt.close(fig)


def test_old_summary_without_the_new_keys(tmp_path):
    """A summary.json from before votes, windows and final comparisons: every missing figure shows n/a."""
    run = Run()
    for r in range(3):
        run.train(r, 1.0, 31.0, 0)
    run.finish(31.5)
    path = run.write(tmp_path / "r")
    old = json.loads((path / "summary.json").read_text())
    for k in ("replicas_compared", "final_step", "state_votes", "state_votes_disagreeing", "divergences",
              "divergences_healed", "bitflips_injected", "recoveries_open", "vulnerability_window_seconds",
              "goodput", "goodput_estimate", "goodput_is_estimate", "time_below_n_seconds"):
        old.pop(k, None)
    (path / "summary.json").write_text(json.dumps(old))
    page = write_report(path).read_text()
    figures = dict(key_figures(old))
    assert figures["state votes"] == figures["goodput"] == figures["vulnerability window"] == "n/a"
    assert figures["replicas compared at the end"] == "n/a" and figures["recoveries"] == "0 finished, n/a still open"
    assert "n/a" in key_block(page)
    assert not LONG_FLOAT.search(page), LONG_FLOAT.findall(page)
    # a window from before "open" was counted, and one with no windows at all
    assert _dict_text("vulnerability_window_seconds", {"p50": 0.36, "max": 0.49, "n": 5}) == \
        "p50 0.36 s, max 0.49 s (5 windows)"
    assert _dict_text("vulnerability_window_seconds", {"p50": None, "max": None, "n": 0, "open": 0}) == \
        "none (0 windows, 0 open)"


def test_global_committed_series_is_the_max_over_up_replicas_at_every_mark():
    """Against the plain definition (a max over the up replicas at each mark) on random runs with resets
    (a replica's step going down), failures and restarts, and a replica named None."""
    import math
    import random

    from regent.orchestrate.report import global_committed_series
    from regent.orchestrate.summary import DOWN_KINDS

    down = sorted(DOWN_KINDS)[0]
    for seed in range(20):
        rng = random.Random(seed)
        replicas = [None, 0, 1, 2, 3][: rng.randint(1, 5)]
        metrics, events, step = [], [], {r: 0 for r in replicas}
        for i in range(300):
            r = rng.choice(replicas)
            t = i * 0.5 + rng.choice([0.0, 0.25])
            if rng.random() < 0.1:
                events.append({"time": t, "kind": down, "replica": r})
            else:
                step[r] = max(0, step[r] + rng.choice([1, 1, 1, 2, -5]))  # -5: a lineage reset
                metrics.append({"time": t, "replica": r, "step": step[r], "committed": rng.random() > 0.1})
        xs, ys = global_committed_series(events, metrics)
        marks = sorted([(m["time"], 1, m["replica"], m["step"]) for m in metrics if m["committed"]]
                       + [(e["time"], 0, e["replica"], None) for e in events if e["replica"] is not None],
                       key=lambda x: (x[0], x[1]))  # a failure names its replica: one of None is not counted
        latest: dict = {}
        want = []
        for _, up, r, s in marks:
            if up:
                latest[r] = s
            else:
                latest.pop(r, None)
            want.append(max(latest.values()) if latest else math.nan)
        assert xs == [m[0] for m in marks]
        assert [("nan" if math.isnan(y) else y) for y in ys] == [("nan" if math.isnan(y) else y) for y in want]
