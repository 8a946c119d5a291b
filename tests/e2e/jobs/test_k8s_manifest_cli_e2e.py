"""`regent k8s manifest`: every object it prints validates against the official Kubernetes 1.30 schemas
(`kubernetes-validate`, strict: unknown fields are errors), for CPU and GPU runs, in YAML and JSON; the job
secret never appears; bad input is refused with the flag and the fix: the cases that start processes (the
others: tests/unit/jobs/test_k8s_manifest_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from regent.jobs.base import SECRET_ENV
from tests.unit.jobs.test_k8s_manifest_cli import K8S_VERSION, _run, _validate, kubernetes_validate, yaml  # noqa: F401 - fixtures shared with the unit cases


def test_the_installed_command_prints_valid_yaml(tmp_path: Path) -> None:
    """Through a real process, as a user runs it (`regent k8s manifest ... | kubectl apply -f -`)."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.run([sys.executable, "-m", "regent.cli", "k8s", "manifest", "--image", "img:1",
                           "--gpus-per-pod", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    assert len(docs) == 4
    for doc in docs:
        _validate(doc)
    bad = subprocess.run([sys.executable, "-m", "regent.cli", "k8s", "manifest", "--image", "img:1",
                          "--gpu-resource", "nvidia.com/gpu", "--gpus-per-pod", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--gpu-resource needs --gpus-per-pod" in bad.stderr


def test_the_controller_job_validates_and_its_script_starts_resumes_or_ends(tmp_path, capsys) -> None:
    """`--controller-volume-claim`: a Job of one controller pod (restartPolicy OnFailure) with the run directory on
    the claim. Its script starts the run, resumes it once it was started, and ends a finished run successfully
    (a Job that retried a finished run would train it again)."""
    code, out, _ = _run(["--image", "reg/regent:1", "--name", "exp", "--controller-volume-claim", "exp-runs",
                         "--train-args", "--replicas 2 --steps 500", "-o", "json"], capsys)
    assert code == 0
    jobs = [o for o in json.loads(out)["items"] if o["metadata"]["name"] == "exp-controller"]
    assert len(jobs) == 1
    job = jobs[0]
    _validate(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "exp-runs"
    script = pod["containers"][0]["command"][2].replace("/runs/exp", str(tmp_path / "run"))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "regent").write_text('#!/bin/sh\necho "regent $*"\n')
    (fake / "regent").chmod(0o755)

    def sh() -> str:
        env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, check=True).stdout

    assert "train --job k8s --no-live --run-dir" in sh() and "--replicas 2 --steps 500" in sh()
    (tmp_path / "run" / "controller").mkdir(parents=True)
    (tmp_path / "run" / "controller" / "attach.json").write_text("{}")
    assert f"train --resume {tmp_path / 'run'} --takeover" in sh()
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert "finished" in sh() and "regent" not in sh()
    code, _, err = _run(["--image", "reg/regent:1", "--controller-volume-claim", "Bad_Name"], capsys)
    assert code == 2 and "--controller-volume-claim" in err
