"""Bad input to `regent train` gets one clear line before anything launches, and the job secret never leaks:
the cases that start processes (the others: tests/unit/orchestrate/test_bad_input.py)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.unit.orchestrate.test_bad_input import PREFIX, QUICK, _closed_port, _one_line, listening  # noqa: F401 - fixtures shared with the unit cases


def refused_by_cli(tmp_path: Path, argv: list[str], *fragments: str, env: dict[str, str] | None = None) -> str:
    """The real `regent train` command: exit code 2 within seconds, one line on stderr, nothing on stdout."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "regent.cli", "train", "--run-dir", str(run_dir), *argv],
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout == ""
    assert time.monotonic() - t0 < 60
    return _one_line(proc.stderr, run_dir, *fragments)


def test_bad_toml_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[ft\nsync_every = 3\n")
    refused_by_cli(tmp_path, ["--config", str(bad), *QUICK], f"config file {bad} is not valid TOML", "line 1")


def test_unknown_flag_from_the_real_command(tmp_path):
    refused_by_cli(tmp_path, [*QUICK, "--ft.sync-evry", "3"], "did you mean --ft.sync-every?")


def test_more_procs_per_replica_than_gpus_from_the_real_command(tmp_path):
    refused_by_cli(tmp_path, [*QUICK, "--procs-per-replica", "2"], "needs 2 GPUs per replica", "has 1 visible",
                   env={"GPU_PLATFORM": "cuda", "CUDA_VISIBLE_DEVICES": "0"})


def test_missing_data_path(tmp_path):
    refused_by_cli(tmp_path, [*QUICK, "--train.data", str(tmp_path / "nowhere" / "*.txt")],
                   "--train.data: data glob", "matched no files", "check the path")


def test_lighthouse_port_in_use(tmp_path, listening):  # noqa: F811 - the fixture, imported
    port = listening.getsockname()[1]
    refused_by_cli(tmp_path, [*QUICK, "--lighthouse.bind", f"127.0.0.1:{port}"],
                   f"--lighthouse.bind 127.0.0.1:{port}: port {port}, the Lighthouse's gRPC port, is already in use",
                   "127.0.0.1:0 picks a free one")


def test_unreachable_lighthouse(tmp_path):
    port = _closed_port()
    refused_by_cli(tmp_path, [*QUICK, "--lighthouse.address", f"http://127.0.0.1:{port}"],
                   f"Lighthouse at http://127.0.0.1:{port} unreachable after 3 s (Connection refused)",
                   "regent lighthouse", "drop --lighthouse.address")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["env", "file"])
def test_job_secret_never_leaks(tmp_path, source):
    """A short real run with a known secret: the secret is in no file of the run directory, not on stdout or
    stderr (actor logs at DEBUG), in no process's command line, and not on the Lighthouse dashboard."""
    secret = secrets.token_hex(32)
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", REGENT_LOG_LEVEL="DEBUG")
    env.pop("REGENT_JOB_SECRET", None)
    env.pop("REGENT_JOB_SECRET_FILE", None)
    if source == "env":
        env["REGENT_JOB_SECRET"] = secret
    else:
        secret_file = tmp_path / "secret"
        secret_file.write_text(secret + "\n")
        secret_file.chmod(0o600)
        env["REGENT_JOB_SECRET_FILE"] = str(secret_file)
    needles = [secret.encode(), secret.upper().encode(), bytes.fromhex(secret)]

    proc = subprocess.Popen(
        [sys.executable, "-m", "regent.cli", "train", *QUICK, "--model", "debug", "--ft.sync-every", "1",
         "--run-dir", str(run_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.extend(iter(s.readline, b"")), daemon=True)
               for s, b in ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    pages: list[bytes] = []
    leaked_cmdlines: list[str] = []
    saw_own_cmdline = False  # the scan works: it sees this run's command line
    deadline = time.monotonic() + 500
    while proc.poll() is None and time.monotonic() < deadline:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                raw = cmdline.read_bytes()
            except OSError:  # the process ended meanwhile
                continue
            saw_own_cmdline = saw_own_cmdline or str(run_dir).encode() in raw
            if any(n in raw for n in needles):
                leaked_cmdlines.append(raw.replace(b"\0", b" ").decode(errors="replace"))
        found = re.search(rb"dashboard (http://\S+)", b"".join(out))
        if found:
            for page in ("", "status.json"):
                try:
                    with urllib.request.urlopen(found.group(1).decode() + page, timeout=2) as resp:
                        pages.append(resp.read())
                except (urllib.error.URLError, OSError):  # the Lighthouse is not up yet, or already gone
                    pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    for r in readers:
        r.join(timeout=10)
    stdout, stderr = b"".join(out), b"".join(err)
    assert proc.returncode == 0, (stdout[-3000:], stderr[-3000:])
    assert b"done: 3 steps" in stdout

    assert saw_own_cmdline and not leaked_cmdlines, leaked_cmdlines
    assert any(b"quorum_id" in p for p in pages), "the dashboard's status was never read"
    for name, data in (("stdout", stdout), ("stderr", stderr), *((f"dashboard page {i}", p)
                                                                 for i, p in enumerate(pages))):
        assert not any(n in data for n in needles), f"the job secret appears in {name}"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"events.jsonl", "config.json", "summary.json", "metrics.jsonl"} <= {p.name for p in files}
    for path in files:
        data = path.read_bytes()
        assert not any(n in data for n in needles), f"the job secret appears in {path}"
