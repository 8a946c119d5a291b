"""What the control plane's secret, TLS and the transfer's checksums cost, and what hostile input does to each
port (run by hand: `python -m tests.support.rpc_security_bench`; the numbers are in benchmarks/RESULTS.md).

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


def per_call_us(configs: dict[str, tuple[str, bytes, TLSFiles]], calls: int = 1000,
                rounds: int = 9) -> dict[str, float]:
    """For each config (server kind, secret, TLS): the median over `rounds` of the mean time of one heartbeat
    (client and server together), microseconds. Rounds of the configs alternate, so a busy box slows all alike."""
    servers = {name: LighthouseServer(min_replicas=1, server=kind, secret=secret, tls=tls)
               for name, (kind, secret, tls) in configs.items()}
    clients = {name: LighthouseClient(servers[name].address(), connect_timeout=10, secret=configs[name][1],
                                      tls=configs[name][2]) for name in configs}
    try:
        for client in clients.values():
            for _ in range(200):
                client.heartbeat("warm")
        means: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(rounds):
            for name, client in clients.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    client.heartbeat("r")
                means[name].append((time.perf_counter() - t0) / calls * 1e6)
        return {name: round(statistics.median(m), 1) for name, m in means.items()}
    finally:
        for client in clients.values():
            client.close()
        for lh in servers.values():
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


def transfer_s(mb: int = 60, rounds: int = 9) -> dict[str, float]:
    """Median time of a 60 MB transfer with the checksums and with them stubbed out, rounds alternating."""
    state = {f"t{i}": torch.randn(mb * (1 << 20) // 4 // 12) for i in range(12)}
    real = wire.tensor_digest
    donor = transfer.StreamTransport(num_chunks=4, timeout=60, secret=SECRET)
    healer = transfer.StreamTransport(num_chunks=4, timeout=60, secret=SECRET)
    times: dict[str, list[float]] = {"checksum": [], "none": []}
    try:
        into = {k: torch.empty_like(v) for k, v in state.items()}
        for r in range(2 * rounds + 2):
            kind = "checksum" if r % 2 == 0 else "none"
            wire.tensor_digest = real if kind == "checksum" else (lambda view: bytes(wire.DIGEST_BYTES))
            donor.send_checkpoint([1], r, state, timeout=60)  # a new served state each round: nothing cached
            t0 = time.perf_counter()
            healer.recv_checkpoint(0, donor.metadata(), r, timeout=60, into=into)
            if r >= 2:
                times[kind].append(time.perf_counter() - t0)
        assert all(torch.equal(into[k], state[k]) for k in state)
        return {kind: round(statistics.median(t), 4) for kind, t in times.items()}
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
            configs = {"plain": (server, b"", NO_TLS), "secret": (server, SECRET, NO_TLS)}
            if tls is not None:
                configs["secret+mTLS"] = (server, SECRET, tls)
            results[f"{server}_per_call_us"] = per_call_us(configs)
            results[f"{server}_hostile"] = hostile(server)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    results["crc32_60MB_s"] = round(checksum_only_s(zlib.crc32), 4)
    results["tensor_digest_60MB_s"] = round(checksum_only_s(wire.tensor_digest), 4)
    results["transfer_60MB_s"] = transfer_s()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    rpc_security.logger.setLevel("ERROR")
    main()
