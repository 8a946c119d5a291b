"""What a replica asks the job layer for (orchestrate/allocation.py), the job options from the command line
and TOML, and the restart rule for an allocation that is gone. No scheduler needed."""

from __future__ import annotations

import pytest

from regent.orchestrate.allocation import DEFAULT_ALLOCATION_TIMEOUT_S, check_job_options, plan_allocation
from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.config import ConfigError, RunConfig, apply_toml
from regent.orchestrate.policy import Action, RestartPolicy, allocation_checked


def _plan(backend="slurm", opts=None, platform="", gpus=0, procs=2):
    asked = []

    def cluster(partition):
        asked.append(partition)
        return gpus

    plan = plan_allocation(backend, procs, opts or {}, platform_override=platform, cluster_gpus=cluster)
    return plan, asked


def test_slurm_on_a_cluster_without_gres_asks_for_no_gpus() -> None:
    plan, asked = _plan(opts={"partition": "debug"}, gpus=0)
    assert plan.gpus_per_host is None and plan.options == {"partition": "debug", "gpus_per_host": None}
    assert asked == ["debug"] and "no GPU GRES" in plan.gpus_reason


def test_slurm_on_a_gpu_cluster_asks_for_one_gpu_per_trainer() -> None:
    plan, _ = _plan(gpus=8, procs=4)
    assert plan.gpus_per_host == 4 and "8 GPU" in plan.gpus_reason


def test_slurm_when_sinfo_cannot_say_asks_for_none() -> None:
    plan, _ = _plan(gpus=None)
    assert plan.gpus_per_host is None and "gpus_per_node" in plan.gpus_reason


@pytest.mark.parametrize("value,expected", [(2, 2), ("2", 2), (0, None), ("0", None)])
def test_the_user_decides_when_told(value, expected) -> None:
    plan, asked = _plan(opts={"gpus_per_node": value}, gpus=8)
    assert plan.gpus_per_host == expected and asked == [] and "gpus_per_node" not in plan.options
    plan, _ = _plan(opts={"gpus_per_host": value}, gpus=0)
    assert plan.gpus_per_host == expected


def test_auto_and_bad_gpu_values() -> None:
    assert _plan(opts={"gpus_per_node": "auto"}, gpus=8)[0].gpus_per_host == 2
    with pytest.raises(ValueError, match="gpus_per_node='many'"):
        _plan(opts={"gpus_per_node": "many"})
    with pytest.raises(ValueError, match="0 \\(no GPUs\\) or more"):
        _plan(opts={"gpus_per_node": -1})


def test_gpu_platform_overrides_detection() -> None:
    assert _plan(platform="cpu", gpus=8)[0].gpus_per_host is None
    assert _plan(platform="cuda", gpus=0)[0].gpus_per_host == 2
    assert _plan("k8s", platform="cpu")[0].gpus_per_host is None
    assert _plan("k8s", platform="")[0].gpus_per_host == 2  # other backends: one GPU per trainer, as before


def test_allocation_timeout() -> None:
    assert _plan()[0].timeout_s == DEFAULT_ALLOCATION_TIMEOUT_S
    plan, _ = _plan(opts={"allocation_timeout": "2m", "qos": "high"})
    assert plan.timeout_s == 120 and "allocation_timeout" not in plan.options and plan.options["qos"] == "high"
    with pytest.raises(ValueError, match="allocation_timeout"):
        _plan(opts={"allocation_timeout": "soon"})


def test_job_options_from_the_command_line() -> None:
    cfg = parse_train_argv(["--job", "slurm", "--job.partition", "gpu", "--job.gpus-per-node", "4",
                            "--job.time=02:00:00", "--job.sbatch-args=--exclude=n1 --constraint=h100",
                            "--job.allocation-timeout", "15m"])
    assert cfg.job_options == {"partition": "gpu", "gpus_per_node": "4", "time": "02:00:00",
                               "sbatch_args": "--exclude=n1 --constraint=h100", "allocation_timeout": "15m"}
    from regent.jobs import coerce_job_options

    plan = plan_allocation("slurm", cfg.procs_per_replica, cfg.job_options)
    opts = coerce_job_options("slurm", plan.options)
    assert opts["gpus_per_host"] == 4 and opts["sbatch_args"] == ["--exclude=n1", "--constraint=h100"]
    assert plan.timeout_s == 900


def test_bad_job_options_fail_before_launch() -> None:
    with pytest.raises(ConfigError, match="unknown option 'partiton' for the slurm job backend.*partition"):
        parse_train_argv(["--job", "slurm", "--job.partiton", "gpu"])
    with pytest.raises(ConfigError, match="cpus_per_task='lots'"):
        parse_train_argv(["--job", "slurm", "--job.cpus-per-task", "lots"])
    with pytest.raises(ValueError, match="gpus_per_node"):
        check_job_options("slurm", 2, {"gpus_per_node": "x"})


def test_job_options_table_in_toml() -> None:
    cfg = RunConfig()
    apply_toml(cfg, {"job": "slurm", "job_options": {"partition": "gpu", "gpus_per_node": 8, "qos": "high"}})
    check_job_options(cfg.job, 8, cfg.job_options)
    assert cfg.job_options["gpus_per_node"] == 8


def test_a_lost_allocation_goes_straight_to_a_fresh_one() -> None:
    policy = RestartPolicy(in_place_restarts=3)
    policy.on_progress(0)
    action = policy.on_failure(0)
    assert action is Action.RESTART_IN_PLACE
    assert allocation_checked(action, None) is Action.RESTART_IN_PLACE
    assert allocation_checked(action, "SLURM job 7 ended in state CANCELLED") is Action.REALLOCATE
    assert allocation_checked(Action.REALLOCATE, None) is Action.REALLOCATE
    assert allocation_checked(Action.GIVE_UP, "gone") is Action.GIVE_UP
