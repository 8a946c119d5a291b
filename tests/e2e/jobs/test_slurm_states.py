"""SlurmJob's error messages, without a cluster: scheduler state -> cause and fix, PENDING past the timeout,
a node that disappears, GPUs asked of a cluster without GRES. The SLURM commands are faked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from regent.jobs.base import JobError, JobFailedError, JobTimeoutError
from regent.jobs.slurm import (
    SlurmJob,
    bad_nodes,
    explain_pending,
    explain_state,
    parse_gres_gpus,
    parse_node_states,
)


@pytest.mark.parametrize("state,words", [
    ("FAILED", ["FAILED", "exited with an error", "job log"]),
    ("TIMEOUT", ["TIMEOUT", "time limit", "--job.time"]),
    ("PREEMPTED", ["PREEMPTED", "preempted", "fresh allocation", "--job.qos"]),
    ("NODE_FAIL", ["NODE_FAIL", "node", "--exclude"]),
    ("CANCELLED", ["CANCELLED", "scancel"]),
    ("OUT_OF_MEMORY", ["OUT_OF_MEMORY", "--job.mem"]),
    ("SOMETHING_NEW", ["SOMETHING_NEW", "will not run workers again", "job log"]),
])
def test_every_end_state_names_cause_and_fix(state: str, words: list[str]) -> None:
    text = explain_state(state, "None")
    for word in words:
        assert word in text, text
    assert "reason" not in text  # "None" is no reason


def test_end_state_keeps_a_real_reason() -> None:
    assert "(reason: NodeDown)" in explain_state("NODE_FAIL", "NodeDown")


@pytest.mark.parametrize("reason,words", [
    ("Resources", ["no free nodes", "raise the timeout", "--job.partition"]),
    ("Priority", ["higher priority", "--job.qos"]),
    ("ReqNodeNotAvail, UnavailableNodes:n1", ["down, drained or reserved", "sinfo -R"]),
    ("QOSMaxGRESPerUser", ["limit of the QOS", "--job.qos"]),
    ("AssocGrpGRES", ["limit of the QOS or account"]),
    ("PartitionTimeLimit", ["--job.time"]),
    ("Whatever", ["scontrol show job"]),
])
def test_pending_reasons_say_what_to_do(reason: str, words: list[str]) -> None:
    text = explain_pending(reason)
    for word in words:
        assert word in text, text


@pytest.mark.parametrize("text,gpus", [
    ("(null)\n", 0), ("", 0), ("gpu:8\n", 8), ("gpu:a100:4(S:0-1)\n", 4), ("gpu:2,shard:4\n(null)\n", 2),
    ("shard:4\n", 0), ("gpu:h100:8,gpu:a100:4\n", 8), ("gpu\n", 1),
])
def test_parse_gres_gpus(text: str, gpus: int) -> None:
    assert parse_gres_gpus(text) == gpus


def test_node_states_and_the_bad_ones() -> None:
    states = parse_node_states("n1|idle\nn2|down*\nn3|mixed\nn4|allocated*\nn5|drained\nn6|fail\n")
    assert states["n2"] == "down*"
    assert bad_nodes(states) == ["n2", "n4", "n6"]  # a drained node still runs its jobs


class FakeSlurm:
    """Stands in for run_command: answers sbatch, squeue and sinfo from a few settable values."""

    def __init__(self) -> None:
        self.state = "PENDING|Resources"
        self.gres = "(null)"
        self.nodes = "vm"
        self.node_state = "mixed"
        self.sbatch_error = ""
        self.calls: list[list[str]] = []

    def __call__(self, args, *, timeout=60.0, check=True, env=None):
        args = list(args)
        self.calls.append(args)
        out, err, rc = "", "", 0
        if args[0] == "sbatch":
            out, err, rc = ("", self.sbatch_error, 1) if self.sbatch_error else ("42\n", "", 0)
        elif args[0] == "squeue":
            out = self.nodes if args[-1] == "%N" else self.state
        elif args[0] == "sinfo":
            out = f"{self.nodes}|{self.node_state}\n" if "%N|%T" in args else f"{self.gres}\n"
        elif args[0] == "scancel":
            pass
        if check and rc:
            raise JobError(f"`{' '.join(args)}` failed with exit code {rc}: {err}")
        return subprocess.CompletedProcess(args, rc, out, err)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    f = FakeSlurm()
    monkeypatch.setattr("regent.jobs.slurm.run_command", f)
    return f


def _job(tmp_path: Path, **kw) -> SlurmJob:
    job = SlurmJob(1, secret="ab12", shared_dir=tmp_path, **kw)
    job.kill_on_exit = False
    return job


def test_pending_past_the_timeout_names_the_reason_and_the_fix(tmp_path: Path, fake: FakeSlurm) -> None:
    job = _job(tmp_path)
    job.start()
    with pytest.raises(JobTimeoutError, match=r"still PENDING \(reason: Resources\).*no free nodes.*raise the "
                                              r"timeout"):
        job.worker_addresses(timeout=0.3)


@pytest.mark.parametrize("state", ["FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL"])
def test_an_ended_allocation_fails_at_once_with_cause_and_fix(tmp_path: Path, fake: FakeSlurm, state: str) -> None:
    job = _job(tmp_path)
    job.start()
    fake.state = f"{state}|None"
    with pytest.raises(JobFailedError, match=rf"SLURM job 42 .*ended in state {state}: .*slurm-42\.out"):
        job.worker_addresses(timeout=30)
    assert not job.is_alive()
    problem = job.problem()
    assert problem and f"ended in state {state}" in problem and explain_state(state).split(": ", 1)[1] in problem


def test_a_node_that_disappears_is_named(tmp_path: Path, fake: FakeSlurm) -> None:
    job = _job(tmp_path)
    job.start()
    fake.state = "RUNNING|None"
    assert job.problem() is None and job.is_alive()
    fake.node_state = "mixed*"  # not responding
    problem = job.problem()
    assert problem and "node(s) vm are down or not responding" in problem and "--exclude=vm" in problem
    assert not job.is_alive()
    fake.state, fake.nodes = "", ""  # forgotten by squeue
    assert "no longer known to squeue" in job.problem()


def test_gpus_are_refused_before_sbatch_on_a_cluster_without_gres(tmp_path: Path, fake: FakeSlurm) -> None:
    job = _job(tmp_path, gpus_per_host=2, partition="cpu")
    with pytest.raises(JobError, match=r"asks for 2 GPU\(s\).*no node of partition cpu advertises GPU GRES.*"
                                       r"--job.gpus-per-node 0"):
        job.start()
    assert not any(c[0] == "sbatch" for c in fake.calls)
    fake.gres = "gpu:8"
    job2 = _job(tmp_path, gpus_per_host=2, partition="gpu")
    job2.start()
    assert job2.job_id == "42"
    assert "#SBATCH --gpus-per-node=2" in (job2.job_dir / "job.sbatch").read_text()


def test_no_gpu_request_never_asks_for_gres(tmp_path: Path, fake: FakeSlurm) -> None:
    job = _job(tmp_path)
    job.start()
    assert "gpus" not in (job.job_dir / "job.sbatch").read_text()
    assert not any(c[0] == "sinfo" for c in fake.calls)


def test_sbatch_gres_rejection_says_how_to_fix_it(tmp_path: Path, fake: FakeSlurm) -> None:
    fake.gres = "gpu:1"  # sinfo says yes, but sbatch still refuses (e.g. another partition's nodes)
    fake.sbatch_error = "sbatch: error: Invalid generic resource (gres) specification"
    job = _job(tmp_path, gpus_per_host=4)
    with pytest.raises(JobError, match=r"Invalid generic resource.*asked for 4 GPU\(s\).*--job.gpus-per-node 0"):
        job.start()


def test_an_allocation_seen_completing_is_reported_with_the_state_it_ends_in(
        tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    """scancel first shows COMPLETING (SLURM stopping the job's processes), then CANCELLED: the report waits for
    the state that says why (seen in a full test run: "ended in state COMPLETING", which tells the user nothing).
    A job still completing after the wait is reported as such, with where to find its final state."""
    import threading

    job = _job(tmp_path)
    job.start()
    fake.state = "COMPLETING|None"
    threading.Timer(0.8, lambda: setattr(fake, "state", "CANCELLED|None")).start()
    problem = job.problem()
    assert problem and "ended in state CANCELLED" in problem and "scancel" in problem, problem
    monkeypatch.setattr("regent.jobs.slurm.COMPLETING_WAIT_S", 1.0)
    fake.state = "COMPLETING|None"
    problem = job.problem()
    assert problem and "ended in state COMPLETING" in problem and "sacct -j" in problem, problem
