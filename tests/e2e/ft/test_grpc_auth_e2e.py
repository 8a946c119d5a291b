"""Nobody gets into the control plane: every gRPC call to the Lighthouse (both server implementations) and to
a ManagerServer proves the job secret, or is refused with UNAUTHENTICATED before it changes anything; replays,
proofs for another method and stale proofs are refused; refusals are logged once per peer host; TLS (and
mutual TLS) round trips; without a secret, plain TorchFT-style clients work as before: the cases that start
processes (the others: tests/unit/ft/test_grpc_auth.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from regent.ft import rpc_security
from regent.ft.coordination import ManagerClient
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient
from regent.ft.manager import ManagerServer
from regent.ft.rpc_security import TLSFiles
from tests.unit.ft.test_grpc_auth import SECRET, _heartbeating, _raw_heartbeat


@pytest.fixture(autouse=True)
def _no_env_security(monkeypatch):
    """Each test says what it wants; nothing leaks in from the environment of the suite."""
    for name in ("REGENT_JOB_SECRET", "REGENT_JOB_SECRET_FILE", rpc_security.RPC_AUTH_ENV, rpc_security.TLS_CERT_ENV,
                 rpc_security.TLS_KEY_ENV, rpc_security.TLS_CA_ENV, rpc_security.TLS_SERVER_NAME_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A self-signed certificate (also its own CA) for 127.0.0.1 / localhost / 'regent', made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1",
                    "-subj", "/CN=regent-test",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:regent",
                    "-addext", "basicConstraints=critical,CA:TRUE"],
                   check=True, capture_output=True, timeout=30)
    return TLSFiles(str(d / "cert.pem"), str(d / "key.pem"), str(d / "cert.pem"))


def test_tls_round_trip_and_plaintext_refused(certs):
    lh = LighthouseServer(min_replicas=1, secret=SECRET, tls=certs)
    try:
        assert lh.address().startswith("https://") and lh.dashboard_url().startswith("https://")
        with LighthouseClient(lh.address(), connect_timeout=5, secret=SECRET, tls=certs) as client:
            client.heartbeat("tls")
            assert client.quorum("tls", timeout=5).quorum_id == 1
        # plaintext gRPC to a TLS port never gets an answer
        with pytest.raises(ConnectionError):
            LighthouseClient(lh.address(), connect_timeout=1, secret=SECRET, tls=TLSFiles()).heartbeat("p", timeout=1)
        # mutual TLS: a client that trusts the server but has no certificate of its own is refused
        with pytest.raises(ConnectionError):
            LighthouseClient(lh.address(), connect_timeout=1, secret=SECRET,
                             tls=TLSFiles(ca=certs.ca)).heartbeat("no-cert", timeout=1)
        assert _heartbeating(lh) == {"tls"}
        import ssl

        ctx = ssl.create_default_context(cafile=certs.ca)
        with urllib.request.urlopen(lh.dashboard_url() + "status.json", context=ctx, timeout=5) as response:
            assert json.loads(response.read())["quorum_id"] == 1
    finally:
        lh.shutdown()


def test_tls_manager_server_with_one_certificate_for_every_host(certs):
    """server_name: clients check every server's certificate against one name, whatever host they dial."""
    shared = TLSFiles(certs.cert, certs.key, certs.ca, server_name="regent")
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, secret=SECRET, tls=shared)
    mgr = ManagerServer(replica_id="t:1", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                        store_address="127.0.0.1:1", world_size=1, secret=SECRET, tls=shared)
    try:
        client = ManagerClient(mgr.address(), connect_timeout=5, secret=SECRET, tls=shared)
        assert client.should_commit(0, 0, True, timeout=5) is True
        client.close()
        deadline = time.monotonic() + 5
        while "t:1" not in _heartbeating(lh) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "t:1" in _heartbeating(lh)
    finally:
        mgr.shutdown()
        lh.shutdown()


def test_lighthouse_process_takes_the_secret_from_its_environment(tmp_path):
    """`regent lighthouse` as its own process, secret only in its environment (as `regent train` starts it)."""
    env = {**os.environ, "REGENT_JOB_SECRET": SECRET.hex(), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "regent.cli", "lighthouse", "--bind", f"127.0.0.1:{port}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = f"http://127.0.0.1:{port}"
        with LighthouseClient(address, connect_timeout=20, secret=SECRET, tls=TLSFiles()) as client:
            client.heartbeat("insider", timeout=20)
        err = _raw_heartbeat(address, "outsider")
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert SECRET.hex() not in out
    assert out.count("refused") == 1, out  # one warning for the outsider's host


def _free_port() -> int:
    """A port whose next one is free too (the Lighthouse's dashboard binds port + 1), outside the ephemeral range."""
    from regent.ports import free_port_pair

    return free_port_pair()
