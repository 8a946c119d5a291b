"""GPU-only bug, tested on CPU: replicas sharing a host must get disjoint GPUs.

The spawner pins trainer g of a replica to GPU g of the spawning process's view. Every ReplicaActor process
saw all GPUs, so on a 2-GPU host both replicas of `--replicas 2 --procs-per-replica 1` ran on GPU 0, where
NCCL refuses to build their cross-replica group. `replica_gpu_env` narrows each replica's view first.
"""

from __future__ import annotations

from regent.orchestrate.replica import replica_gpu_env
from regent.platform import child_visibility_env


def test_each_replica_gets_its_own_slice_of_the_host_gpus() -> None:
    env = {"GPU_PLATFORM": "cuda"}
    assert replica_gpu_env(0, 1, env, device_count=2) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert replica_gpu_env(1, 1, env, device_count=2) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert replica_gpu_env(1, 2, env, device_count=8) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_trainers_are_pinned_inside_their_replicas_slice() -> None:
    env = {"GPU_PLATFORM": "cuda"}
    env.update(replica_gpu_env(1, 2, env, device_count=4))
    assert [child_visibility_env(g, env)["CUDA_VISIBLE_DEVICES"] for g in range(2)] == ["2", "3"]


def test_an_existing_visibility_list_is_sliced_not_replaced() -> None:
    env = {"GPU_PLATFORM": "cuda", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert replica_gpu_env(1, 2, env) == {"CUDA_VISIBLE_DEVICES": "6,7"}


def test_more_replicas_than_gpus_wrap_around() -> None:
    assert replica_gpu_env(2, 1, {"GPU_PLATFORM": "cuda"}, device_count=2) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_cpu_needs_no_pinning() -> None:
    assert replica_gpu_env(1, 2, {"GPU_PLATFORM": "cpu"}) == {}
