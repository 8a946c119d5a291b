"""SlurmJob's pure parts: the batch script, sbatch/squeue parsing, option validation."""

from __future__ import annotations

import pytest

from regent.jobs.base import JobError
from regent.jobs.slurm import (
    SlurmJob,
    SlurmScriptSpec,
    build_sbatch_script,
    parse_sbatch_output,
    parse_squeue_state,
)


def _spec(**kw) -> SlurmScriptSpec:
    base = dict(job_name="regent-abc", nodes=2, ntasks_per_node=1, job_dir="/shared/jobs/regent-abc",
                python="/opt/venv/bin/python")
    base.update(kw)
    return SlurmScriptSpec(**base)


def _directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_minimal_script_launches_one_worker_per_task() -> None:
    script = build_sbatch_script(_spec())
    assert script.startswith("#!/bin/bash\n")
    assert _directives(script) == [
        "--job-name=regent-abc", "--nodes=2", "--ntasks-per-node=1",
        "--output=/shared/jobs/regent-abc/slurm-%j.out", "--error=/shared/jobs/regent-abc/slurm-%j.out",
    ]
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    line = srun[0]
    assert line.startswith("srun --kill-on-bad-exit=1 /opt/venv/bin/python -c ")
    assert "from regent.jobs.base import launch_worker" in line
    assert "--address-dir /shared/jobs/regent-abc" in line
    assert "--rank-env SLURM_PROCID --local-rank-env SLURM_LOCALID" in line
    assert "--secret-file /shared/jobs/regent-abc/secret" in line
    assert "--port" not in line


def test_all_options_become_directives() -> None:
    script = build_sbatch_script(_spec(
        partition="gpu", time="02:00:00", account="proj", qos="high", gpus_per_host=8, cpus_per_task=96,
        mem="0", exclusive=True, sbatch_args=("--constraint=h100", "--reservation=r1"), port=29600,
        interface="ib0"))
    directives = _directives(script)
    for expected in ("--partition=gpu", "--time=02:00:00", "--account=proj", "--qos=high", "--gpus-per-node=8",
                     "--cpus-per-task=96", "--mem=0", "--exclusive", "--constraint=h100", "--reservation=r1"):
        assert expected in directives
    assert "--port 29600" in script
    assert "--interface ib0" in script
    assert "srun --kill-on-bad-exit=1 --cpus-per-task=96 " in script


def test_several_hosts_per_node_bind_gpus_per_task() -> None:
    directives = _directives(build_sbatch_script(_spec(nodes=1, ntasks_per_node=4, gpus_per_host=2)))
    assert "--gpus-per-task=2" in directives and not any(d.startswith("--gpus-per-node") for d in directives)


def test_env_venv_and_setup_are_quoted() -> None:
    script = build_sbatch_script(_spec(venv="/opt/my venv", env={"NCCL_DEBUG": "INFO", "X": "a b;c"},
                                       setup=("module load cuda",)))
    assert "source '/opt/my venv/bin/activate'" in script
    assert "export NCCL_DEBUG=INFO" in script
    assert "export X='a b;c'" in script
    assert script.index("module load cuda") < script.index("srun ")


def test_bad_options_fail_before_submission() -> None:
    with pytest.raises(ValueError, match="must be options starting with '-'"):
        build_sbatch_script(_spec(sbatch_args=("gpu",)))
    with pytest.raises(ValueError, match="not valid"):
        build_sbatch_script(_spec(env={"BAD-NAME": "1"}))
    with pytest.raises(ValueError, match="not a multiple of ntasks_per_node=2"):
        SlurmJob(3, ntasks_per_node=2, secret="ab12")
    with pytest.raises(ValueError, match="hosts must be a positive integer"):
        SlurmJob(0, secret="ab12")


def test_job_script_carries_no_secret(tmp_path) -> None:
    job = SlurmJob(2, secret="deadbeef0011", shared_dir=tmp_path, partition="debug")
    script = build_sbatch_script(job.spec)
    assert "deadbeef0011" not in script
    assert job.spec.job_dir == str(tmp_path / job.unique_name)
    assert job.spec.nodes == 2 and job.spec.ntasks_per_node == 1


@pytest.mark.parametrize("text,expected", [
    ("42\n", "42"), ("42;cluster-a\n", "42"), ("Submitted batch job 77\n", "77"),
    ("sbatch: warning: something\n123\n", "123"),
])
def test_parse_sbatch_output(text: str, expected: str) -> None:
    assert parse_sbatch_output(text) == expected


def test_parse_sbatch_output_without_id_is_an_error() -> None:
    with pytest.raises(JobError, match="could not find a job id"):
        parse_sbatch_output("sbatch: error: Batch job submission failed\n")


def test_parse_squeue_state() -> None:
    assert parse_squeue_state("PENDING|Resources\n") == ("PENDING", "Resources")
    assert parse_squeue_state("RUNNING|None") == ("RUNNING", "None")
    assert parse_squeue_state("") is None


def test_unstarted_job_is_not_alive_and_kill_is_idempotent(tmp_path) -> None:
    job = SlurmJob(1, secret="ab12", shared_dir=tmp_path)
    assert not job.is_alive()
    job.kill()
    job.kill()
    with pytest.raises(JobError, match="was killed; call renew"):
        job.start()
    with pytest.raises(JobError, match="was killed; call renew"):
        job.host_mesh()
