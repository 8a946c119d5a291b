"""`ManagerClient` (TorchFT's `torchft.coordination.ManagerClient`) against a real ManagerServer over loopback:
it waits for a server that is not up yet, and an unreachable one is a TimeoutError after `connect_timeout`; the
server's gRPC status codes as a plain grpcio client sees them."""

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


def test_manager_server_answers_with_grpc_status_codes():
    """The ManagerServer on `grpc_lite`, called by a plain grpcio client: each refusal keeps its gRPC status, and a
    call waiting for the group's other ranks ends with CANCELLED when the server shuts down."""
    import grpc

    from regent.ft.proto import torchft_pb2, torchft_pb2_grpc

    lh = LighthouseServer(min_replicas=1, secret=b"", tls=TLSFiles())
    mgr = ManagerServer("r", lh.address(), "127.0.0.1", store_address="127.0.0.1:1", world_size=2,
                        secret=b"", tls=TLSFiles())
    try:
        with grpc.insecure_channel(mgr.address()) as channel:
            stub = torchft_pb2_grpc.ManagerServiceStub(channel)
            cases = {
                "no deadline": (lambda: stub.Quorum(torchft_pb2.ManagerQuorumRequest(group_rank=0)),
                                grpc.StatusCode.INVALID_ARGUMENT, "missing timeout"),
                "not a request": (lambda: channel.unary_unary("/torchft.ManagerService/ShouldCommit")(
                    b"\xff\xff\xff", timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "bad request"),
                "no metadata": (lambda: stub.CheckpointMetadata(torchft_pb2.CheckpointMetadataRequest(rank=3),
                                                                timeout=5), grpc.StatusCode.NOT_FOUND, "rank 3"),
                "no such method": (lambda: channel.unary_unary("/torchft.ManagerService/Nope")(b"", timeout=5),
                                   grpc.StatusCode.UNIMPLEMENTED, "unknown method"),
                "deadline": (lambda: stub.Quorum(torchft_pb2.ManagerQuorumRequest(group_rank=0), timeout=0.5),
                             grpc.StatusCode.DEADLINE_EXCEEDED, ""),  # rank 1 never asks
            }
            for what, (call, code, detail) in cases.items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == code, what
                assert detail in (info.value.details() or ""), what
            # group rank 1 votes; rank 0 never comes: the shutdown ends the wait
            waiting = stub.ShouldCommit.future(torchft_pb2.ShouldCommitRequest(group_rank=1, step=1,
                                                                                should_commit=True), timeout=30)
            time.sleep(0.3)
            t0 = time.monotonic()
            mgr.shutdown()
            with pytest.raises(grpc.RpcError) as info:
                waiting.result(timeout=10)
            assert info.value.code() == grpc.StatusCode.CANCELLED and "shut down" in info.value.details()
            assert time.monotonic() - t0 < 3
    finally:
        mgr.shutdown()
        lh.shutdown()


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
