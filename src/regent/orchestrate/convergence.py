"""Convergence with faults: loss against samples consumed, compared with the run-to-run noise of fault-free runs.

The claim under test (issue 36): with a constant global batch and every sample consumed exactly once, a run with
faults follows the fault-free loss curve. "Follows" needs a yardstick, so two fault-free runs with different
seeds give one: at each sample count, the largest gap between their smoothed losses nearby is the noise band, and
a faulted run (seeded like the first) is within noise where its gap to that run is no larger.

Everything here is pure and reads only what a run directory holds (metrics.jsonl, ledger.jsonl, events.jsonl);
`benchmarks/convergence_bench.py` launches the runs, and `report.py` shows the figure a run directory carries.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from pathlib import Path
from typing import Any

from regent.orchestrate.invariants import effective_ledger
from regent.orchestrate.summary import trained_loss

Curve = list[tuple[float, float]]  # (samples consumed, loss), by increasing samples

FIGURE = "convergence.png"  # in a run directory: report.html shows it when present
TABLE = "convergence.md"
GAP_FLOOR = 1e-10  # where the figure's log axis draws a gap of exactly 0


def samples_by_step(ledger: list[dict[str, Any]]) -> dict[int, int]:
    """Committed step -> samples consumed up to and including it, from the sample ledger.

    A step consumes its global batch (replicas x ranks x batch_size sequences) less the samples its lines record
    as skipped; counting the batch rather than the lines' ranges keeps a step whose writer died before writing
    its line (the checker accepts that) at its true size."""
    out, total = {}, 0
    for step, lines in effective_ledger(ledger).items():
        first = lines[0]
        ranks, batch_size = int(first.get("ranks") or 1), int(first.get("batch_size") or 0)
        span = int(first.get("replicas") or 0) * ranks * batch_size
        skipped = max(int(x.get("skipped") or 0) for x in lines) * ranks * batch_size
        total += max(span - skipped, 0)
        out[step] = total
    return out


def loss_by_step(metrics: list[dict[str, Any]],
                 participants: dict[int, set[Any]] | None = None) -> dict[int, tuple[float, float]]:
    """Committed step -> (the loss over what its records cover, the micro-batches they cover): the mean of the
    committed records' losses, each weighted by the micro-batches it averaged (a survivor covering missing
    replicas' shards reports one loss over several). A record resent after a controller change is counted once.

    With `participants` (step -> replicas, from the ledger), only theirs: a replica healing in that step reports
    a committed step too, but its loss is of a batch a participant covered, and its gradient was not counted."""
    seen: set[tuple[Any, ...]] = set()
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for m in metrics:
        if m.get("step") is None or not trained_loss(m):
            continue
        if participants is not None and m.get("replica") not in participants.get(int(m["step"]), ()):
            continue
        key = (m.get("replica"), m.get("generation"), m.get("rank"), m["step"])
        if key in seen:
            continue
        seen.add(key)
        w = float(m.get("micro_batches") or 1)
        acc = sums[int(m["step"])]
        acc[0] += w * float(m["loss"])
        acc[1] += w
    return {s: (a / w, w) for s, (a, w) in sorted(sums.items()) if w > 0}


def loss_curve(metrics: list[dict[str, Any]], ledger: list[dict[str, Any]]) -> Curve:
    """(samples consumed, loss) at every committed step whose loss records cover its whole global batch.

    A replica killed just after a commit may never report that step's loss: the mean of the others is the loss of
    part of the batch, not a point of the curve (`incomplete_steps` counts those left out)."""
    samples, shards = samples_by_step(ledger), shards_by_step(ledger)
    return [(float(samples[s]), loss) for s, (loss, covered) in loss_by_step(metrics, participants(ledger)).items()
            if s in samples and covered >= shards[s]]


def participants(ledger: list[dict[str, Any]]) -> dict[int, set[Any]]:
    """Committed step -> the replicas whose ledger lines say they trained on its global batch."""
    return {step: {x.get("replica") for x in lines} for step, lines in effective_ledger(ledger).items()}


def shards_by_step(ledger: list[dict[str, Any]]) -> dict[int, int]:
    """Committed step -> the micro-batches of its global batch that were trained on (replicas x ranks, less
    recorded skips): what its loss records must cover."""
    out = {}
    for step, lines in effective_ledger(ledger).items():
        ranks = int(lines[0].get("ranks") or 1)
        skipped = max(int(x.get("skipped") or 0) for x in lines)
        out[step] = (int(lines[0].get("replicas") or 0) - skipped) * ranks
    return out


def incomplete_steps(metrics: list[dict[str, Any]], ledger: list[dict[str, Any]]) -> int:
    """Committed steps whose loss records cover only part of the global batch (left out of the curve)."""
    shards = shards_by_step(ledger)
    return sum(1 for s, (_, covered) in loss_by_step(metrics, participants(ledger)).items()
               if s in shards and covered < shards[s])


def step_times(metrics: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, highest committed step reached by then), by time: places a wall-clock event on the step axis."""
    pts = sorted((float(m["time"]), int(m["step"])) for m in metrics
                 if m.get("time") is not None and m.get("step") is not None and m.get("committed", True))
    out, high = [], 0
    for t, s in pts:
        high = max(high, s)
        out.append((t, high))
    return out


def fault_samples(events: list[dict[str, Any]], metrics: list[dict[str, Any]],
                  ledger: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """(samples consumed when it struck, kind) of every injected fault: the fault times on the samples axis."""
    times = step_times(metrics)
    samples = samples_by_step(ledger)
    keys = [t for t, _ in times]
    out = []
    for e in events:
        if e.get("kind") != "fault_injected" or e.get("time") is None:
            continue
        i = bisect.bisect_right(keys, float(e["time"]))
        step = times[i - 1][1] if i else 0
        done = [v for s, v in samples.items() if s <= step]
        out.append((float(done[-1]) if done else 0.0, str(e.get("fault_kind") or "fault")))
    return out


def smooth(curve: Curve, window: float) -> Curve:
    """The trailing mean over the last `window` samples at each point: per-batch loss is too noisy to compare
    point by point."""
    xs = [x for x, _ in curve]
    prefix = [0.0]
    for _, y in curve:
        prefix.append(prefix[-1] + y)
    out = []
    for i, (x, _) in enumerate(curve):
        j = bisect.bisect_right(xs, x - window)
        j = min(j, i)
        out.append((x, (prefix[i + 1] - prefix[j]) / (i + 1 - j)))
    return out


def value_at(curve: Curve, x: float) -> float | None:
    """Linear interpolation of `curve` at `x`; None outside its range."""
    if not curve or x < curve[0][0] or x > curve[-1][0]:
        return None
    i = bisect.bisect_left([p[0] for p in curve], x)
    if curve[i][0] == x or i == 0:
        return curve[i][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def noise_band(a: Curve, b: Curve, grid: list[float], window: float) -> list[float]:
    """At each grid point x: the largest |a - b| of the two smoothed fault-free curves over [x - window, x + window]
    (grid points inside it): how far two runs that differ only in their seed drift apart around there."""
    gaps = []
    for x in grid:
        va, vb = value_at(a, x), value_at(b, x)
        gaps.append(abs(va - vb) if va is not None and vb is not None else None)
    out = []
    for x in grid:
        near = [g for y, g in zip(grid, gaps) if g is not None and abs(y - x) <= window]
        out.append(max(near) if near else float("nan"))
    return out


def common_grid(curves: list[Curve], points: int) -> list[float]:
    """`points` sample counts evenly spread over the range every curve covers."""
    lo = max(c[0][0] for c in curves)
    hi = min(c[-1][0] for c in curves)
    if points < 2 or hi <= lo:
        return [hi] if hi >= lo else []
    return [lo + (hi - lo) * i / (points - 1) for i in range(points)]


def compare(reference: Curve, other_seed: Curve, faulted: dict[str, Curve], *, window: float,
            rows: int = 8, dense: int = 200) -> dict[str, Any]:
    """The convergence verdict on smoothed curves: a table at `rows` sample counts (losses, the noise band, each
    faulted run's gap to the reference run, within noise or not), and over a `dense` grid the share of sample
    counts where each faulted run is within noise and its worst gap/noise ratio.

    `reference` is the fault-free run with the faulted runs' seed, `other_seed` the fault-free one with another."""
    sa, sb = smooth(reference, window), smooth(other_seed, window)
    sf = {name: smooth(c, window) for name, c in faulted.items()}
    curves = [sa, sb, *sf.values()]
    if any(not c for c in curves):
        raise ValueError("a run has no committed step with both a loss and a ledger line: nothing to compare")
    out: dict[str, Any] = {"window_samples": window, "upto_samples": min(c[-1][0] for c in curves), "rows": [],
                           "faulted": {}}
    for n, grid in (("rows", common_grid(curves, rows + 1)[1:]), ("dense", common_grid(curves, dense))):
        noise = noise_band(sa, sb, grid, window)
        stats: dict[str, list[float]] = {name: [] for name in sf}
        gaps: dict[str, list[float]] = {name: [] for name in sf}
        for x, band in zip(grid, noise):
            ref = value_at(sa, x)
            row: dict[str, Any] = {"samples": round(x), "loss_a": ref, "loss_b": value_at(sb, x), "noise": band}
            for name, c in sf.items():
                v = value_at(c, x)
                gap = abs(v - ref) if v is not None and ref is not None else None
                within = gap is not None and gap <= band
                row[name] = {"loss": v, "gap": gap, "within": within}
                if gap is not None:
                    gaps[name].append(gap)
                if gap is not None and band == band:  # not NaN
                    stats[name].append(gap / band if band > 0 else (0.0 if gap == 0 else float("inf")))
            if n == "rows":
                out["rows"].append(row)
        if n == "dense":
            for name, ratios in stats.items():
                out["faulted"][name] = {
                    "within_share": sum(r <= 1.0 for r in ratios) / len(ratios) if ratios else None,
                    "worst_gap_over_noise": max(ratios) if ratios else None,
                    "mean_gap_over_noise": sum(ratios) / len(ratios) if ratios else None,
                    "max_gap": max(gaps[name]) if gaps[name] else None}
    return out


def markdown_table(result: dict[str, Any], names: list[str]) -> str:
    """The comparison's rows as a Markdown table (RESULTS.md, convergence.md)."""
    head = "| samples | loss seed A | loss seed B | noise band |" + "".join(
        f" {n} loss | {n} gap | within |" for n in names)
    rule = "|" + "---|" * (4 + 3 * len(names))
    lines = [head, rule]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}"

    def gap(v: Any) -> str:  # float-level gaps (a faulted run replays the same batches) need more than 4 places
        return f"{v:.1e}" if v is not None and 0 < v < 5e-4 else f(v)

    for r in result["rows"]:
        cells = [str(r["samples"]), f(r["loss_a"]), f(r["loss_b"]), f(r["noise"])]
        for n in names:
            c = r[n]
            cells += [f(c["loss"]), gap(c["gap"]), "yes" if c["within"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_convergence(curves: dict[str, Curve], faults: dict[str, list[tuple[float, str]]], out: Path, *,
                     window: float, reference: str, other_seed: str, title: str = "") -> None:
    """Smoothed loss against samples for every run on one axis, the noise band drawn around the reference run,
    and each faulted run's faults as ticks in its colour; below, each faulted run's gap to the reference run
    against the noise band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smoothed = {n: smooth(c, window) for n, c in curves.items()}
    grid = common_grid(list(smoothed.values()), 300)
    noise = noise_band(smoothed[reference], smoothed[other_seed], grid, window)
    ref = [value_at(smoothed[reference], x) for x in grid]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6.4), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    ax.fill_between(grid, [r - n for r, n in zip(ref, noise)], [r + n for r, n in zip(ref, noise)],
                    color="0.85", label=f"noise band ({reference} \u00b1 seed gap)")
    colors = {reference: "black", other_seed: "0.45"}
    palette = iter(["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange"])
    for name, c in smoothed.items():
        color = colors.get(name) or next(palette)
        colors[name] = color
        ls = "--" if name == other_seed else "-"
        lw = 2.6 if name == reference else 1.1  # the faulted runs ride on the reference: keep it visible below
        ax.plot([p[0] for p in c], [p[1] for p in c], color=color, lw=lw, ls=ls, label=name)
    for i, (name, marks) in enumerate(faults.items()):
        ys = (0.02 + 0.05 * i, 0.06 + 0.05 * i)
        for x, _ in marks:
            ax.axvline(x, ymin=ys[0], ymax=ys[1], color=colors.get(name, "red"), lw=1.2)
        if marks:
            ax.plot([], [], color=colors.get(name, "red"), lw=1.2, label=f"{name}: its {len(marks)} faults")
    ax.set_ylabel(f"loss (trailing mean, {window:g} samples)")
    ax.set_title("Loss against samples consumed (ticks at the bottom: injected faults)"
                 + (f"\n{title}" if title else ""), fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    ax2.plot(grid, noise, color="0.5", lw=1.4, label="noise band (seed A vs seed B)")
    for name, c in smoothed.items():
        if name in (reference, other_seed):
            continue
        gaps = [abs(v - r) if v is not None and r is not None else None
                for v, r in zip((value_at(c, x) for x in grid), ref)]
        ax2.plot(grid, [max(g, GAP_FLOOR) if g is not None else float("nan") for g in gaps], color=colors[name],
                 lw=1.1, label=f"|{name} - {reference}|")
    ax2.set_yscale("log")  # a replayed run's gap is float rounding, orders of magnitude under the band
    ax2.set_xlabel("samples consumed (sequences, from the sample ledger)")
    ax2.set_ylabel(f"loss gap (log; 0 drawn at {GAP_FLOOR:g})")
    ax2.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
