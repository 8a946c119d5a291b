"""One summary of a torch.profiler Chrome trace, used for Regent's and TorchTitan's steps alike.

Both trainers' traces go through the same code, so their figures compare: device busy time (the union of kernel,
memcpy and memset intervals), the kernels with the most device time, device time by kind of kernel, and the CPU
ops and annotations with the most (inclusive) host time. Needs nothing but the standard library, so
`titan_speed.py` can use it without `regent` on the path.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")

# Kernel kinds by name fragment, first match wins (so a Triton kernel fused into the loss counts as loss). The
# 2026-12-02 records were made before "softmax" and "nll" were added: there the eager cross-entropy kernels
# (cunn_SoftMaxForward/Backward, nll_loss) count as "other".
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("loss (cross-entropy)", ("softmax", "nll", "cross_entropy", "logsumexp")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("optimizer + grad norm", ("adam", "multi_tensor_apply", "foreach")),
    ("nccl", ("nccl",)),
    ("triton (fused pointwise/norm)", ("triton",)),
    ("copy / cast / fill", ("copy", "memcpy", "memset", "cast", "fill")),
)


def kind_of(name: str) -> str:
    """The kind of a device kernel, from its name."""
    low = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in low for fragment in fragments):
            return kind
    return "other (eager elementwise, embedding, ...)"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: work overlapping on several streams counts once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The trace's complete ('X') events, from a .json or .json.gz Chrome trace."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def summarize_trace(path: str | Path, steps: int, top: int = 20) -> dict[str, Any]:
    """Per-step figures of a trace that covers `steps` training steps (milliseconds per step)."""
    events = load_events(path)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    per_step = 1000.0 * max(steps, 1)  # us in the trace -> ms per step
    by_name: dict[str, list[float]] = {}
    by_kind: dict[str, list[float]] = {}
    for e in device:
        name = str(e.get("name", "?"))
        for table, key in ((by_name, name), (by_kind, kind_of(name) if e["cat"] == "kernel" else "copy / cast / fill")):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += float(e["dur"])
            entry[1] += 1
    host_by_name: dict[str, float] = {}
    for e in host:
        name = str(e.get("name", "?"))
        host_by_name[name] = host_by_name.get(name, 0.0) + float(e["dur"])
    span = (max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)) if device else 0.0
    busy = busy_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device])
    return {
        "trace_steps": steps,
        "device_span_ms_per_step": span / per_step,
        "device_busy_ms_per_step": busy / per_step,
        "device_kernels_per_step": len(device) / max(steps, 1),
        "kernel_ms_per_step_by_kind": {k: round(v[0] / per_step, 3) for k, v in
                                       sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
        "kernel_calls_per_step_by_kind": {k: v[1] / max(steps, 1) for k, v in by_kind.items()},
        "top_kernels": [{"name": n[:160], "ms_per_step": round(v[0] / per_step, 3),
                         "calls_per_step": v[1] / max(steps, 1), "kind": kind_of(n)}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        "top_host_ops_inclusive": [{"name": n[:160], "ms_per_step": round(t / per_step, 3)}
                                   for n, t in sorted(host_by_name.items(), key=lambda kv: -kv[1])[:top]],
    }


def print_summary(label: str, summary: dict[str, Any]) -> None:
    """A few readable lines of a summary (the JSON record keeps everything)."""
    print(f"{label}: device busy {summary['device_busy_ms_per_step']:.1f} ms/step of a "
          f"{summary['device_span_ms_per_step']:.1f} ms span, {summary['device_kernels_per_step']:.0f} kernels/step",
          flush=True)
    for kind, ms in summary["kernel_ms_per_step_by_kind"].items():
        calls = summary["kernel_calls_per_step_by_kind"].get(kind, 0)
        print(f"    {ms:8.2f} ms  {calls:6.0f}x  {kind}", flush=True)
    for k in summary["top_kernels"][:12]:
        print(f"    {k['ms_per_step']:8.2f} ms  {k['calls_per_step']:6.0f}x  {k['name'][:110]}", flush=True)
