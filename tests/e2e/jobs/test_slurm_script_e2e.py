"""SlurmJob's pure parts: the batch script, sbatch/squeue parsing, option validation: the cases that start
processes (the others: tests/unit/jobs/test_slurm_script.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from regent.jobs.slurm import (
    build_sbatch_script,
)
from tests.unit.jobs.test_slurm_script import _spec


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_script_is_valid_bash() -> None:
    script = build_sbatch_script(_spec(env={"A": "x'y"}, venv="/v", partition="p", gpus_per_host=1))
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
