"""ProcessJob follows the Job contract that the orchestrator uses for fresh allocations."""

from __future__ import annotations

from regent.actor import Actor, endpoint
from regent.jobs import make_job


class Echo(Actor):
    @endpoint
    def pid(self) -> int:
        import os

        return os.getpid()


def test_process_job_contract_and_renew():
    job = make_job("local", 1, name="contract-test", gpus_per_host=2)
    try:
        job.start()
        addrs = job.worker_addresses(timeout=30)
        assert len(addrs) == 1 and addrs[0].startswith("tcp://127.0.0.1:")
        assert job.is_alive()
        procs = job.host_mesh().spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("echo", Echo).pid.call_one().get(timeout=60) > 0
        procs.stop().get(timeout=30)
        fresh = job.renew()
        try:
            assert not job.is_alive()
            assert fresh.is_alive() and fresh.worker_addresses() != addrs
        finally:
            fresh.kill()
    finally:
        job.kill()
    assert not job.is_alive()
