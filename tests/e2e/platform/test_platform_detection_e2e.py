"""Platform detection and derived settings: the cases that start processes (the others:
tests/unit/platform/test_platform_detection.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("GPU_PLATFORM", "REGENT_PEAK_FLOPS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                 "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def test_child_visibility_env_does_not_import_torch():
    code = ("import sys; from regent.platform import child_visibility_env; "
            "child_visibility_env(0); assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, GPU_PLATFORM="")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
