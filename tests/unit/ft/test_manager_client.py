"""`ManagerClient` (TorchFT's `torchft.coordination.ManagerClient`) against a real ManagerServer over loopback:
it waits for a server that is not up yet, and an unreachable one is a TimeoutError after `connect_timeout`."""

from __future__ import annotations

import threading
import time

import pytest

from regent.ft.coordination import LighthouseServer, ManagerClient, ManagerServer
from regent.ft.rpc_security import TLSFiles
from regent.jobs.base import pick_free_port


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_unreachable_manager_is_a_timeout_after_connect_timeout():
    client = ManagerClient(f"127.0.0.1:{pick_free_port('127.0.0.1')}", connect_timeout=1.0, secret=b"", tls=TLSFiles())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not reachable within 1 s"):
        client.should_commit(0, 1, True, timeout=5)
    assert 0.9 <= time.monotonic() - t0 < 4
    client.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_client_waits_for_a_server_that_starts_later_and_closes_cleanly():
    lh = LighthouseServer(min_replicas=1, secret=b"", tls=TLSFiles())
    port = pick_free_port("127.0.0.1")
    servers: list[ManagerServer] = []

    def start_late() -> None:
        time.sleep(1.0)
        servers.append(ManagerServer("r", lh.address(), "127.0.0.1", store_address="127.0.0.1:1",
                                     bind=f"127.0.0.1:{port}", secret=b"", tls=TLSFiles()))

    starter = threading.Thread(target=start_late)
    starter.start()
    try:
        client = ManagerClient(f"127.0.0.1:{port}", connect_timeout=20, secret=b"", tls=TLSFiles())
        t0 = time.monotonic()
        assert client.should_commit(0, 7, True, timeout=5) is True
        assert time.monotonic() - t0 >= 0.5  # it did wait for the server
        client.close()  # right after a call: nothing left running that could fail on the closed channel
        time.sleep(0.5)
    finally:
        starter.join()
        for s in servers:
            s.shutdown()
        lh.shutdown()
