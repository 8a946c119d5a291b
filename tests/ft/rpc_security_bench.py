"""What the control plane's secret, TLS and the transfer's checksums cost, and what hostile input does to each
port (run by hand: `python -m tests.ft.rpc_security_bench`; the numbers are in benchmarks/RESULTS.md).

Per call: sequential heartbeats from one `LighthouseClient` to a Lighthouse (lite and grpcio) without a secret,
with one, and with the secret over mutual TLS. Transfer: a 60 MB state over `StreamTransport` with the per-tensor
checksums and with them stubbed out (both ends sending zeros). Hostile: raw bytes, HTTP/1.1 and a TLS hello on the gRPC
port, unauthenticated and replayed calls; the Lighthouse must stay up and unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import zlib

import grpc
import torch

from regent.ft import rpc_security, transfer, wire
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient, normalize_address
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.rpc_security import AUTH_KEY, CallVerifier, TLSFiles, make_token

SECRET = bytes(range(32))
NO_TLS = TLSFiles()


def _certs(d: str) -> TLSFiles:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", f"{d}/key.pem", "-out", f"{d}/cert.pem", "-days", "1", "-subj", "/CN=bench",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:TRUE"],
                   check=True, capture_output=True)
    return TLSFiles(f"{d}/cert.pem", f"{d}/key.pem", f"{d}/cert.pem")


def per_call_us(server: str, secret: bytes, tls: TLSFiles, calls: int = 2000, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of one heartbeat (client and server together), microseconds."""
    lh = LighthouseServer(min_replicas=1, server=server, secret=secret, tls=tls)
    try:
        with LighthouseClient(lh.address(), connect_timeout=10, secret=secret, tls=tls) as client:
            for _ in range(200):
                client.heartbeat("warm")
            means = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(calls):
                    client.heartbeat("r")
                means.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(means)
    finally:
        lh.shutdown()


def primitives_us(n: int = 20000) -> dict[str, float]:
    method = "/torchft.LighthouseService/Heartbeat"
    t0 = time.perf_counter()
    tokens = [make_token(SECRET, method) for _ in range(n)]
    sign = (time.perf_counter() - t0) / n * 1e6
    v = CallVerifier(SECRET)
    t0 = time.perf_counter()
    for token in tokens:
        assert v.verify(method, token) is None
    check = (time.perf_counter() - t0) / n * 1e6
    return {"sign_us": round(sign, 2), "verify_us": round(check, 2)}


def transfer_s(mb: int = 60, checksum: bool = True, rounds: int = 5) -> float:
    state = {f"t{i}": torch.randn(mb * (1 << 20) // 4 // 12) for i in range(12)}
    real = wire.tensor_digest
    if not checksum:
        wire.tensor_digest = lambda view: bytes(wire.DIGEST_BYTES)
    donor = transfer.StreamTransport(num_chunks=4, timeout=60, secret=SECRET)
    healer = transfer.StreamTransport(num_chunks=4, timeout=60, secret=SECRET)
    try:
        into = {k: torch.empty_like(v) for k, v in state.items()}
        times = []
        for r in range(rounds + 1):
            donor.send_checkpoint([1], r, state, timeout=60)  # a new served state each round: crcs not cached
            t0 = time.perf_counter()
            healer.recv_checkpoint(0, donor.metadata(), r, timeout=60, into=into)
            times.append(time.perf_counter() - t0)
        assert all(torch.equal(into[k], state[k]) for k in state)
        return statistics.median(times[1:])
    finally:
        wire.tensor_digest = real
        donor.shutdown()
        healer.shutdown()


def checksum_only_s(fn: object, mb: int = 60, rounds: int = 5) -> float:
    data = memoryview(torch.randn(mb * (1 << 20) // 4).numpy().tobytes())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(data)  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hostile(server: str) -> dict[str, str]:
    """Throw what an outsider might at the gRPC port; report what came back and whether anything changed."""
    lh = LighthouseServer(min_replicas=1, server=server, secret=SECRET, tls=NO_TLS)
    out: dict[str, str] = {}
    host, port = normalize_address(lh.address()).rsplit(":", 1)
    try:
        for name, payload in (("raw bytes", os.urandom(4096)), ("HTTP/1.1 GET", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                              ("TLS ClientHello", bytes.fromhex("16030100a1010000 9d0303") + os.urandom(200))):
            with socket.create_connection((host, int(port)), timeout=3) as s:
                s.sendall(payload)
                try:
                    reply = s.recv(1 << 16)
                except OSError as err:
                    reply = f"{type(err).__name__}".encode()
            out[name] = f"connection answered {len(reply)} bytes then closed" if reply else "closed"
        with grpc.insecure_channel(f"{host}:{port}") as ch:
            stub = torchft_pb2_grpc.LighthouseServiceStub(ch)
            req = torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(replica_id="intruder"))
            for name, md in (("Quorum, no proof", None),
                             ("Quorum, wrong secret", [(AUTH_KEY, make_token(bytes(32), "/torchft.LighthouseService/Quorum"))])):
                try:
                    stub.Quorum(req, timeout=3, metadata=md)
                    out[name] = "ACCEPTED"
                except grpc.RpcError as err:
                    out[name] = err.code().name
            token = make_token(SECRET, "/torchft.LighthouseService/Heartbeat")
            hb = torchft_pb2.LighthouseHeartbeatRequest(replica_id="recorded")
            stub.Heartbeat(hb, timeout=3, metadata=[(AUTH_KEY, token)])
            try:
                stub.Heartbeat(torchft_pb2.LighthouseHeartbeatRequest(replica_id="replayed"), timeout=3,
                               metadata=[(AUTH_KEY, token)])
                out["Heartbeat, replayed proof"] = "ACCEPTED"
            except grpc.RpcError as err:
                out["Heartbeat, replayed proof"] = err.code().name
        status = lh.status()
        out["state after"] = (f"waiting={[w['replica_id'] for w in status['waiting']]} "
                              f"heartbeats={[h['replica_id'] for h in status['heartbeats']]} refused={lh.refused_calls}")
    finally:
        lh.shutdown()
    return out


def main() -> None:
    results: dict[str, object] = {"primitives": primitives_us()}
    d = tempfile.mkdtemp()
    try:
        tls = _certs(d) if shutil.which("openssl") else None
        for server in ("lite", "grpcio"):
            results[f"{server}_plain_us"] = round(per_call_us(server, b"", NO_TLS), 1)
            results[f"{server}_secret_us"] = round(per_call_us(server, SECRET, NO_TLS), 1)
            if tls is not None:
                results[f"{server}_secret_mtls_us"] = round(per_call_us(server, SECRET, tls), 1)
            results[f"{server}_hostile"] = hostile(server)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    results["crc32_60MB_s"] = round(checksum_only_s(zlib.crc32), 4)
    results["tensor_digest_60MB_s"] = round(checksum_only_s(wire.tensor_digest), 4)
    results["transfer_60MB_checksum_s"] = round(transfer_s(checksum=True), 4)
    results["transfer_60MB_no_checksum_s"] = round(transfer_s(checksum=False), 4)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    rpc_security.logger.setLevel("ERROR")
    main()
