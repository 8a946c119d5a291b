"""Platform detection and derived settings. There is no AMD hardware here: ROCm is faked via torch.version.hip."""

from __future__ import annotations

import pytest
import torch

from regent import platform


def fake_build(monkeypatch, *, cuda: str | None, hip: str | None, available: bool) -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_detects_cpu_on_this_machine():
    assert platform.detect_platform() == "cpu"
    assert platform.backend() == "gloo"
    assert platform.device_type() == "cpu"
    assert platform.device_for_local_rank(3) == torch.device("cpu")
    assert platform.memory_stats() == {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0}
    assert platform.peak_bf16_flops() is None


def test_detects_rocm_from_hip_build(monkeypatch):
    fake_build(monkeypatch, cuda=None, hip="6.2.41133", available=True)
    assert platform.detect_platform() == "rocm"
    assert platform.backend() == "nccl"  # RCCL answers to the nccl backend on ROCm builds
    assert platform.device_type() == "cuda"  # HIP devices use torch's cuda device type


def test_detects_cuda(monkeypatch):
    fake_build(monkeypatch, cuda="12.8", hip=None, available=True)
    assert platform.detect_platform() == "cuda"
    assert platform.backend() == "nccl"
    assert platform.device_type() == "cuda"


def test_gpu_build_without_gpu_is_cpu(monkeypatch):
    fake_build(monkeypatch, cuda="12.8", hip=None, available=False)
    assert platform.detect_platform() == "cpu"
    fake_build(monkeypatch, cuda=None, hip="6.2", available=False)
    assert platform.detect_platform() == "cpu"


@pytest.mark.parametrize("value,expected", [("cuda", "cuda"), ("rocm", "rocm"), ("cpu", "cpu"), (" ROCm ", "rocm")])
def test_override(monkeypatch, value, expected):
    fake_build(monkeypatch, cuda="12.8", hip=None, available=True)
    monkeypatch.setenv("GPU_PLATFORM", value)
    assert platform.detect_platform() == expected


def test_bad_override_names_allowed_values(monkeypatch):
    monkeypatch.setenv("GPU_PLATFORM", "tpu")
    with pytest.raises(ValueError, match="cuda, rocm, cpu"):
        platform.detect_platform()
    with pytest.raises(ValueError, match="GPU_PLATFORM"):
        platform.child_visibility_env(0)


def test_version_text_parsing():
    parse = platform._platform_from_version_text
    assert parse("cuda: Optional[str] = None\nhip: Optional[str] = None\n") == "cpu"
    assert parse("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n") == "cuda"
    assert parse("cuda: Optional[str] = None\nhip: Optional[str] = '6.2.41133-dd7f95766'\n") == "rocm"
    assert parse("cuda = None\nhip = '6.0'\n") == "rocm"  # older untyped form
    assert platform.torch_build_platform() == ("cuda" if torch.version.cuda else "cpu")


def test_visibility_cpu_and_cuda():
    assert platform.child_visibility_env(1, {"GPU_PLATFORM": "cpu"}) == {}
    assert platform.child_visibility_env(3, {"GPU_PLATFORM": "cuda"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    parent = {"GPU_PLATFORM": "cuda", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert platform.child_visibility_env(1, parent) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ValueError, match="only sees 4 GPU"):
        platform.child_visibility_env(4, parent)
    with pytest.raises(ValueError, match=">= 0"):
        platform.child_visibility_env(-1, parent)


def test_visibility_rocm_pins_physical_device_once():
    # Plain host: ROCr selects the physical GPU, HIP then sees exactly one device, index 0.
    assert platform.child_visibility_env(2, {"GPU_PLATFORM": "rocm"}) == {
        "ROCR_VISIBLE_DEVICES": "2", "HIP_VISIBLE_DEVICES": "0"}
    # Parent restricted by ROCr: index into its list.
    parent = {"GPU_PLATFORM": "rocm", "ROCR_VISIBLE_DEVICES": "4,5,6,7"}
    assert platform.child_visibility_env(1, parent) == {"ROCR_VISIBLE_DEVICES": "5", "HIP_VISIBLE_DEVICES": "0"}
    # Parent restricted by both: HIP indexes into what ROCr left visible.
    parent = {"GPU_PLATFORM": "rocm", "ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "2,3"}
    assert platform.child_visibility_env(0, parent) == {"ROCR_VISIBLE_DEVICES": "6", "HIP_VISIBLE_DEVICES": "0"}
    # CUDA_VISIBLE_DEVICES is honoured by HIP too; the child gets "0" there so the list cannot filter twice.
    parent = {"GPU_PLATFORM": "rocm", "CUDA_VISIBLE_DEVICES": "1,3"}
    assert platform.child_visibility_env(1, parent) == {
        "ROCR_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(ValueError, match="out of range"):
        platform.child_visibility_env(2, {"GPU_PLATFORM": "rocm", "ROCR_VISIBLE_DEVICES": "0,1"})


def test_visibility_uses_torch_build_when_not_forced(monkeypatch):
    monkeypatch.setattr(platform, "torch_build_platform", lambda: "rocm")
    assert platform.child_visibility_env(1, {}) == {"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}
    monkeypatch.setattr(platform, "torch_build_platform", lambda: "cuda")
    assert platform.child_visibility_env(1, {}) == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("name,flops", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
    ("AMD Instinct MI300X", 1307.4e12), ("AMD Instinct MI325X", 1307.4e12), ("AMD Instinct MI355X", 2516.6e12),
])
def test_peak_flops_table(name, flops):
    assert platform.peak_bf16_flops(name) == flops


def test_peak_flops_unknown_and_override(monkeypatch):
    assert platform.peak_bf16_flops("Some Future GPU") is None
    monkeypatch.setenv("REGENT_PEAK_FLOPS", "1.5e15")
    assert platform.peak_bf16_flops("NVIDIA H100") == 1.5e15
    monkeypatch.setenv("REGENT_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="REGENT_PEAK_FLOPS"):
        platform.peak_bf16_flops("NVIDIA H100")
