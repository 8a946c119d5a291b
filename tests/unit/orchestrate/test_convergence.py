"""The convergence comparison (regent.orchestrate.convergence) on crafted run files: samples come from the ledger,
a step's loss is its global batch's, and a faulted curve is judged against the gap between two seeds."""

from __future__ import annotations

import math

from regent.orchestrate import convergence as conv
from regent.orchestrate.report import convergence_html
from regent.orchestrate.session import ledger_line

R, W, B = 3, 1, 4  # replicas, ranks per replica, sequences per micro-batch
SPAN = R * W * B


def line(step: int, replica: int, shards: list[int], participants: int = R, *, constant: bool = True) -> dict:
    out = ledger_line(step=step, batch=step - 1, replica=replica, generation=0, shards=shards,
                      participants=participants, replicas=R, ranks=W, batch_size=B, constant_batch=constant)
    out["time"] = float(step)
    return out


def test_samples_count_the_global_batch_less_recorded_skips():
    lines = [line(1, r, [r]) for r in range(R)]
    lines += [line(2, 0, [0, 2], 2), line(2, 1, [1], 2)]  # a survivor covers the dead replica's shard
    lines += [line(3, 0, [0], 2, constant=False), line(3, 1, [1], 2, constant=False)]  # shard 2 skipped, recorded
    lines += [line(4, 0, [0]), line(4, 1, [1])]  # replica 2 died before writing its line: still a full batch
    assert conv.samples_by_step(lines) == {1: SPAN, 2: 2 * SPAN, 3: 3 * SPAN - B, 4: 4 * SPAN - B}


def test_a_step_loss_is_its_global_batch_mean_counted_once():
    metrics = [
        {"step": 1, "loss": 3.0, "replica": 0, "generation": 0, "rank": 0, "micro_batches": 2},
        {"step": 1, "loss": 6.0, "replica": 1, "generation": 0, "rank": 0},
        {"step": 1, "loss": 6.0, "replica": 1, "generation": 0, "rank": 0},  # resent after a controller change
        {"step": 2, "loss": 9.0, "replica": 0, "generation": 0, "rank": 0, "committed": False},
        {"step": 2, "loss": 1.0, "replica": 1, "generation": 1, "rank": 0},
        {"step": 3, "replica": 0, "rank": 0},  # no loss
    ]
    assert conv.loss_by_step(metrics) == {1: (4.0, 3.0), 2: (1.0, 1.0)}
    ledger = [line(s, r, [r]) for s in (1, 2) for r in range(R)]
    # step 2's records cover one of its three micro-batches (the others' writers died): not a point of the curve
    assert conv.loss_curve(metrics, ledger) == [(float(SPAN), 4.0)]
    assert conv.incomplete_steps(metrics, ledger) == 1


def test_a_healing_replica_s_loss_is_not_a_participant_s():
    # step 1: replica 0 heals (it reports a committed step, on a batch replica 1 covers); 1 and 2 participate
    metrics = [{"step": 1, "loss": 9.0, "replica": 0, "generation": 1, "rank": 0},
               {"step": 1, "loss": 3.0, "replica": 1, "generation": 0, "rank": 0, "micro_batches": 2},
               {"step": 1, "loss": 6.0, "replica": 2, "generation": 0, "rank": 0}]
    ledger = [line(1, 1, [0, 2], 2), line(1, 2, [1], 2)]
    assert conv.participants(ledger) == {1: {1, 2}}
    assert conv.loss_curve(metrics, ledger) == [(float(SPAN), 4.0)]


def test_smoothing_is_a_trailing_mean_and_interpolation_stays_inside():
    curve = [(1.0, 4.0), (2.0, 2.0), (3.0, 0.0), (4.0, 2.0)]
    assert conv.smooth(curve, 1.5) == [(1.0, 4.0), (2.0, 3.0), (3.0, 1.0), (4.0, 1.0)]
    assert conv.value_at(curve, 2.5) == 1.0
    assert conv.value_at(curve, 0.5) is None and conv.value_at(curve, 4.5) is None


def test_fault_times_land_at_the_samples_consumed_when_they_struck():
    metrics = [{"step": s, "loss": 1.0, "time": 10.0 + s, "replica": 0, "rank": 0, "micro_batches": R}
               for s in (1, 2, 3)]
    ledger = [line(s, r, [r]) for s in (1, 2, 3) for r in range(R)]
    events = [{"kind": "fault_injected", "time": 12.5, "fault_kind": "kill"},
              {"kind": "fault_injected", "time": 5.0, "fault_kind": "hang"}, {"kind": "commit", "time": 12.0}]
    assert conv.fault_samples(events, metrics, ledger) == [(float(2 * SPAN), "kill"), (0.0, "hang")]


def decaying(seed_shift: float, n: int = 400) -> list[tuple[float, float]]:
    return [(float(i * SPAN), 2.0 + 4.0 * math.exp(-i / 80) + seed_shift * math.sin(i / 7)) for i in range(1, n)]


def test_a_faulted_curve_inside_the_seed_gap_is_within_noise_and_one_outside_is_not():
    a, b = decaying(0.05), decaying(-0.05)
    close = [(x, y + 0.01) for x, y in a]
    far = [(x, y + (0.5 if x > 200 * SPAN else 0.0)) for x, y in a]
    result = conv.compare(a, b, {"close": close, "far": far}, window=10 * SPAN, rows=6)
    assert len(result["rows"]) == 6
    assert all(r["close"]["within"] for r in result["rows"])
    assert not result["rows"][-1]["far"]["within"] and result["rows"][0]["far"]["within"]
    assert result["faulted"]["close"]["within_share"] == 1.0
    assert result["faulted"]["close"]["worst_gap_over_noise"] < 1.0
    assert 0.3 < result["faulted"]["far"]["within_share"] < 0.7
    assert result["faulted"]["far"]["worst_gap_over_noise"] > 2.0
    table = conv.markdown_table(result, ["close", "far"])
    assert table.count("\n") == 2 + 6 and "| NO |" in table


def test_the_comparison_covers_only_the_samples_every_run_reached():
    a, b = decaying(0.05), decaying(-0.05, n=100)
    result = conv.compare(a, b, {"f": decaying(0.05, n=300)}, window=5 * SPAN, rows=4)
    assert result["upto_samples"] == 99 * SPAN
    assert max(r["samples"] for r in result["rows"]) == 99 * SPAN


def test_the_report_shows_the_figure_and_table_only_when_the_benchmark_left_them(tmp_path):
    assert convergence_html(tmp_path) == ""
    a, b = decaying(0.05), decaying(-0.05)
    conv.plot_convergence({"A": a, "B": b, "faulted": a}, {"faulted": [(100.0, "kill")]}, tmp_path / conv.FIGURE,
                          window=10 * SPAN, reference="A", other_seed="B")
    (tmp_path / conv.TABLE).write_text("| samples | <x> |\n")
    page = convergence_html(tmp_path)
    assert 'src="convergence.png"' in page and "&lt;x&gt;" in page
    assert (tmp_path / conv.FIGURE).stat().st_size > 10_000
