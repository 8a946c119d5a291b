"""Peer state transfer trusts no peer: the TCP channel authenticates both ends with the job secret (replays
fail), and a state description is JSON for a closed set of types, bounded and checked before anything is
loaded: the cases that start processes (the others: tests/unit/ft/test_transfer_security.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from regent import auth
from regent.actor import Actor, endpoint
from regent.ft.transfer import StreamTransport, flatten_state
from tests.e2e.ft.test_committed_state_e2e import lighthouse  # noqa: F401 - the fixture
from tests.e2e.ft.test_committed_state_e2e import (
    test_restarted_replica_heals_early_from_a_live_holder as _early_heal_scenario,
)
from tests.unit.ft.test_transfer_security import (
    OTHER,
    SECRET,
    _snapshot,
    _state,
    _unchanged,
    pair,  # noqa: F401 - the fixture
)

_DONOR = textwrap.dedent("""
    import sys, time, torch
    from regent.ft.transfer import StreamTransport
    sys.path.insert(0, ".")
    from tests.unit.ft.test_transfer_security import _state
    donor = StreamTransport(timeout=10)  # secret from REGENT_JOB_SECRET
    donor.send_checkpoint([1], 7, _state(1), 10)
    print(donor.metadata(), flush=True)
    sys.stdin.read()
""")


def test_donor_in_another_process_serves_only_the_job(pair):  # noqa: F811 - the fixture, imported
    env = {**os.environ, "REGENT_JOB_SECRET": SECRET.hex(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _DONOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        into = _state(2)
        before = _snapshot(into)
        with pytest.raises(auth.AuthenticationError):
            pair(secret=OTHER).recv_checkpoint(0, address, 7, 10, into=into)
        assert _unchanged(into, before)
        got = pair(secret=SECRET).recv_checkpoint(0, address, 7, 10, into=into)
        assert all(torch.equal(a, b) for a, b in zip(flatten_state(got, 0)[1], flatten_state(_state(1), 0)[1]))
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def test_early_heal_between_processes_with_the_job_secret(lighthouse, tmp_path, monkeypatch):  # noqa: F811
    """The committed-state early heal (Manager.serve_committed, StreamTransport) between two replica
    processes that take the job secret from their environment, as `regent train`'s trainers do."""
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.hex())
    _early_heal_scenario(lighthouse, tmp_path)


class _SecretProbe(Actor):
    @endpoint
    def transfer_secret(self) -> bytes | None:
        t = StreamTransport()
        try:
            return t._secret
        finally:
            t.shutdown()


def test_processes_the_runtime_spawns_authenticate_transfers_with_its_secret():
    """Trainers run in processes the actor runtime spawns (`regent train`): their StreamTransport finds the
    job secret in the environment the runtime gives them."""
    from regent.actor import this_host
    from regent.actor._process import get_runtime

    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        probe = pm.spawn("probe", _SecretProbe)
        assert probe.transfer_secret.call_one().get(timeout=60) == get_runtime().secret
    finally:
        pm.stop().get(timeout=60)
