"""Which accelerator we run on, and everything derived from it.

One module answers "cuda, rocm or cpu?" so the rest of Regent never branches on vendor names. ROCm builds of
torch expose the HIP device through the `torch.cuda` API (device type "cuda", backend "nccl" which is RCCL),
so most callers only need `device_type()` and `backend()`.

`child_visibility_env` is called by the actor runtime before it spawns a process and must not import torch
(importing torch costs seconds and may initialise a driver in the parent). It decides the platform from
`GPU_PLATFORM` or by reading torch's `version.py` as text.

There is no AMD hardware in this project's test environment: the ROCm paths are unit-tested by faking
`torch.version.hip`, and the visibility rules follow AMD's documentation (see `child_visibility_env`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from regent import settings

if TYPE_CHECKING:
    import torch

Platform = Literal["cuda", "rocm", "cpu"]
PLATFORMS: tuple[str, ...] = ("cuda", "rocm", "cpu")
PLATFORM_ENV = settings.GPU_PLATFORM.name
PEAK_FLOPS_ENV = settings.REGENT_PEAK_FLOPS.name

# Vendor datasheet dense (no sparsity) BF16 tensor throughput, FLOP/s. Order matters: the first substring
# that appears in the device name wins, so more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835e12),  # NVIDIA H100 NVL datasheet: 1,671 TF sparse -> 835 dense
    ("H100 PCIe", 756e12),  # H100 PCIe: 1,513 TF sparse -> 756 dense
    ("H100", 989e12),  # H100 SXM5: 1,979 TF sparse -> 989 dense
    ("H200", 989e12),  # H200 SXM: same Hopper tensor cores as H100 SXM
    ("MI355X", 2516.6e12),  # AMD Instinct MI355X: 2.5 PF dense FP16/BF16
    ("MI325X", 1307.4e12),  # AMD Instinct MI325X: 1,307.4 TF dense BF16
    ("MI300X", 1307.4e12),  # AMD Instinct MI300X: 1,307.4 TF dense BF16
)


def _override() -> Platform | None:
    return settings.GPU_PLATFORM.get()


def detect_platform() -> Platform:
    """Return "cuda", "rocm" or "cpu" for this process (`GPU_PLATFORM` overrides detection).

    A GPU build of torch on a machine without a usable GPU is "cpu": the question is where tensors will live.
    """
    forced = _override()
    if forced is not None:
        return forced
    import torch

    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "rocm"
    if getattr(torch.version, "cuda", None) and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def backend() -> str:
    """The torch.distributed backend: "nccl" on GPUs (RCCL on ROCm builds), "gloo" on CPU."""
    return "gloo" if detect_platform() == "cpu" else "nccl"


def device_type() -> str:
    """The torch device type: "cuda" on NVIDIA and on ROCm (HIP masquerades as cuda), else "cpu"."""
    return "cpu" if detect_platform() == "cpu" else "cuda"


def device_for_local_rank(local_rank: int) -> torch.device:
    """The device a process with this local rank should use.

    When the launcher pinned the process with `child_visibility_env`, only one GPU is visible and this is
    always device 0; otherwise local rank i uses GPU i (modulo the visible count).
    """
    import torch

    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if device_type() == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError(
            f"platform is {detect_platform()} but torch sees no GPU; check the device visibility variables "
            f"(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES) or set {PLATFORM_ENV}=cpu"
        )
    return torch.device("cuda", local_rank % count)


def peak_bf16_flops(device_name: str | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device, for MFU; None when unknown (CPU, unlisted GPU).

    `REGENT_PEAK_FLOPS` (a number, e.g. 989e12) overrides the table for any device.
    """
    override = settings.REGENT_PEAK_FLOPS.get()
    if override is not None:
        return override
    if device_name is None:
        if device_type() == "cpu":
            return None
        import torch

        device_name = torch.cuda.get_device_name()
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def memory_stats() -> dict[str, int]:
    """Peak allocated/reserved accelerator bytes since start (zeros on CPU, where torch does not track)."""
    if device_type() == "cpu":
        return {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0}
    import torch

    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }


# --- child process visibility (no torch import below this line) ---------------------------------------

_VERSION_FIELD = re.compile(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def torch_build_platform() -> Platform:
    """What torch was built for ("rocm", "cuda" or "cpu"), read from torch/version.py without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "cpu"
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_file.read_text()
    except OSError:
        return "cpu"
    return _platform_from_version_text(text)


def _platform_from_version_text(text: str) -> Platform:
    fields = {name: value for name, value in _VERSION_FIELD.findall(text)}
    if fields.get("hip", "None") not in ("None", "''", '""'):
        return "rocm"
    if fields.get("cuda", "None") not in ("None", "''", '""'):
        return "cuda"
    return "cpu"


def _visible_list(name: str, env: dict[str, str]) -> list[str] | None:
    value = env.get(name)
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def _pick(visible: list[str] | None, index: int, names: str) -> str:
    if visible is None:
        return str(index)
    if index >= len(visible):
        raise ValueError(
            f"GPU index {index} is out of range: the parent process only sees {len(visible)} GPU(s) through "
            f"{names}={','.join(visible)!r}; ask for fewer GPUs per host or widen {names}"
        )
    return visible[index]


def native_collectives_loaded() -> bool:
    """Whether this process may hold native communicators (NCCL, RCCL, Gloo): torch.distributed was imported.
    Destroying them at interpreter teardown is unsafe while an aborted collective still runs on one, so such
    processes leave with `os._exit` (`regent.actor._runtime.exit_gracefully`)."""
    import sys

    return "torch.distributed" in sys.modules


def child_visibility_env(gpu_index: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that make a child process see exactly GPU `gpu_index` of this process's GPUs.

    Index `gpu_index` counts the GPUs *this* process can see: an already-set visibility list is respected
    (CUDA_VISIBLE_DEVICES="4,5,6,7" and index 1 gives the child "5").

    NVIDIA: {"CUDA_VISIBLE_DEVICES": <id>}.

    ROCm: two filters apply in sequence. ROCR_VISIBLE_DEVICES is applied by the ROCr runtime and selects
    physical devices; HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES, which HIP also honours) is applied by
    HIP on top and indexes into what ROCr left visible. Setting both to the same index "i" double-filters:
    ROCr leaves one device (now numbered 0), and HIP then asks for device i of that one, which for i > 0
    leaves no GPU at all. The rule used here: resolve the parent's view to a physical id, pin it with
    ROCR_VISIBLE_DEVICES=<id>, and set HIP_VISIBLE_DEVICES="0" (the only device left). If the parent had
    CUDA_VISIBLE_DEVICES set, the child gets "0" there too so the inherited list cannot filter again.

    CPU: {}.
    """
    if gpu_index < 0:
        raise ValueError(f"gpu_index must be >= 0, got {gpu_index}")
    env = dict(os.environ if environ is None else environ)
    forced = settings.GPU_PLATFORM.get(env) or ""
    platform = forced or torch_build_platform()
    if platform == "cpu":
        return {}
    if platform == "cuda":
        return {"CUDA_VISIBLE_DEVICES": _pick(_visible_list("CUDA_VISIBLE_DEVICES", env), gpu_index,
                                              "CUDA_VISIBLE_DEVICES")}
    # rocm: physical ids after ROCr filtering, then HIP's (or CUDA's) index list on top of them.
    rocr = _visible_list("ROCR_VISIBLE_DEVICES", env)
    hip_name = "HIP_VISIBLE_DEVICES" if "HIP_VISIBLE_DEVICES" in env else "CUDA_VISIBLE_DEVICES"
    hip = _visible_list(hip_name, env)
    if hip is not None:
        hip_choice = _pick(hip, gpu_index, hip_name)
        if not hip_choice.isdigit():
            raise ValueError(f"{hip_name} entry {hip_choice!r} is not a device index; HIP expects integers")
        physical = _pick(rocr, int(hip_choice), "ROCR_VISIBLE_DEVICES")
    else:
        physical = _pick(rocr, gpu_index, "ROCR_VISIBLE_DEVICES")
    result = {"ROCR_VISIBLE_DEVICES": physical, "HIP_VISIBLE_DEVICES": "0"}
    if "CUDA_VISIBLE_DEVICES" in env:
        result["CUDA_VISIBLE_DEVICES"] = "0"
    return result
