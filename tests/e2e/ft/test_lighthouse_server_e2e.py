"""Regent's Lighthouse over real gRPC sockets: quorum formation, deadlines, the dashboard, the CLI, restarts:
the cases that start processes (the others: tests/unit/ft/test_lighthouse_server.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from regent.ft.lighthouse_client import LighthouseClient
from regent.ports import free_port_pair
from tests.unit.ft.test_lighthouse_server import (
    get_json,
    lighthouse,  # noqa: F401 - the fixture
    post,
)

REPO = Path(__file__).resolve().parents[3]


MANAGER_SCRIPT = r"""
import sys, os, grpc
from concurrent import futures
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.lighthouse_client import LighthouseClient

class Manager(torchft_pb2_grpc.ManagerServiceServicer):
    def Kill(self, request, context):
        sys.stderr.write("killed: " + request.msg + "\n"); sys.stderr.flush()
        os._exit(1)

server = grpc.server(futures.ThreadPoolExecutor(2))
torchft_pb2_grpc.add_ManagerServiceServicer_to_server(Manager(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
client = LighthouseClient(sys.argv[1])
q = client.quorum("victim:1", timeout=30, address=f"http://127.0.0.1:{port}")
print("joined", q.quorum_id, flush=True)
server.wait_for_termination()
"""


def test_dashboard_kill_calls_manager_kill(lighthouse, tmp_path):  # noqa: F811 - the fixture, imported
    """POST /replica/<id>/kill reaches the member's ManagerService.Kill over gRPC; that process exits."""
    server = lighthouse(min_replicas=1)
    script = tmp_path / "manager.py"
    script.write_text(MANAGER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), server.address()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "joined 1"
        code, body = post(server.dashboard_url() + "replica/victim:1/kill")
        assert code == 200, body
        assert body["killed"] == "victim:1"
        assert proc.wait(timeout=30) == 1
        assert "killed from the Lighthouse dashboard" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def start_cli_lighthouse(port: int, state_file: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "regent.cli", "lighthouse", "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
         "--join_timeout_ms", "60000", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "3000",
         "--state-file", str(state_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )
    seen = []
    while not (seen and seen[-1].startswith("Lighthouse dashboard:")):
        line = proc.stdout.readline()
        assert line, f"lighthouse exited early: {seen}"
        seen.append(line)
    assert any(line.startswith(f"Lighthouse gRPC:      http://127.0.0.1:{port}") for line in seen), seen
    # Drain the rest so the pipe never blocks the server.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc


def test_lighthouse_restart_on_same_address(tmp_path):
    """kill -9 the Lighthouse process, start a new one on the same port: clients reconnect, a quorum forms."""
    port = free_port_pair()
    state_file = tmp_path / "lighthouse.json"
    proc = start_cli_lighthouse(port, state_file)
    client_a = LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=60)
    client_b = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=60)
    try:
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(client_a.quorum, "a", 30, step=5)
            fb = pool.submit(client_b.quorum, "b", 30, step=5)
            assert fa.result().quorum_id == fb.result().quorum_id == 1

        # Like a Manager: a heartbeat loop shares client_a with the quorum calls and shrugs off failures.
        stop_beats = threading.Event()
        beat_errors: list[Exception] = []

        def beat() -> None:
            while not stop_beats.wait(0.1):
                try:
                    client_a.heartbeat("a", timeout=0.5)
                except (ConnectionError, TimeoutError) as err:
                    beat_errors.append(err)

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # While it is down, both replicas ask for the next quorum (and keep heartbeating).
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(client_a.quorum, "a", 60, step=6)
            fb = pool.submit(client_b.quorum, "b", 60, step=6)
            time.sleep(1.0)
            assert not fa.done() and not fb.done()
            proc = start_cli_lighthouse(port, state_file)
            qa, qb = fa.result(timeout=60), fb.result(timeout=60)
        # The restarted Lighthouse knows the last quorum from its state file: the same members keep its id (and
        # their process groups); members and steps come from the requests.
        assert qa.quorum_id == qb.quorum_id == 1
        assert qa.replica_ids() == ["a", "b"]
        assert [m.step for m in qa.participants] == [6, 6]
        # any change is a new id, after the saved one (never an id used before)
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(client_a.quorum, "a", 60, step=7)
            fb = pool.submit(client_b.quorum, "b", 60, step=7, commit_failures=1)
            assert fa.result(timeout=60).quorum_id == fb.result(timeout=60).quorum_id == 2
        stop_beats.set()
        beater.join(timeout=10)
        assert beat_errors, "heartbeats should have failed while the Lighthouse was down"
        assert all(isinstance(e, (ConnectionError, TimeoutError)) for e in beat_errors)
        client_a.heartbeat("a")
        status = get_json(f"http://127.0.0.1:{port + 1}/status.json")
        assert status["prev_quorum"]["participants"][0]["replica_id"] == "a"
    finally:
        proc.kill()
        proc.wait()
        client_a.close()
        client_b.close()


DOM_SHIM = r"""
const [url, scriptPath] = process.argv.slice(2);
class FakeNode { constructor(tag) { this.tag = tag; this.children = []; this.attrs = {}; this.textContent = "";
  this.value = ""; }
  append(...c) { this.children.push(...c); } setAttribute(k, v) { this.attrs[k] = v; }
  replaceChildren(...c) { this.children = c; } }
global.Node = FakeNode;
const els = {};
global.document = { getElementById: id => (els[id] ||= new FakeNode("div")), createElement: t => new FakeNode(t),
  createTextNode: t => Object.assign(new FakeNode("#text"), { textContent: t }), hidden: false,
  addEventListener: () => {} };
const realFetch = fetch;
global.fetch = (p, o) => realFetch(new URL(p, url), o);
global.setInterval = () => 0;
global.clearInterval = () => {};
const text = n => n.tag === "#text" ? n.textContent : (n.textContent || n.children.map(text).join(" "));
eval(require("fs").readFileSync(scriptPath, "utf8"));
setTimeout(() => { const out = {}; for (const k in els) out[k] = text(els[k]);
  for (const n of els.members.children) out["class:" + n.children[0].children[0].textContent] = n.attrs.class;
  console.log(JSON.stringify(out)); }, 1500);
"""


def test_dashboard_page_renders_live_status(lighthouse, tmp_path):  # noqa: F811 - the fixture, imported
    """Run the page's own script (in node, with a minimal DOM) against a live Lighthouse."""
    import re
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed")
    server = lighthouse(min_replicas=2)
    client = LighthouseClient(server.address())
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(client.quorum, "rep_0:aa", 20, address="http://127.0.0.1:1", step=10)
        fb = pool.submit(client.quorum, "rep_1:bb", 20, address="http://127.0.0.1:2", step=4)
        fa.result(), fb.result()
    with urllib.request.urlopen(server.dashboard_url(), timeout=10) as resp:
        page = resp.read().decode()
    (tmp_path / "page.js").write_text(re.search(r"<script>(.*)</script>", page, re.S).group(1))
    (tmp_path / "shim.js").write_text(DOM_SHIM)
    done = threading.Event()

    def keep_alive() -> None:  # on a loaded machine node can take longer than the heartbeat timeout to start
        while not done.wait(0.5):
            client.heartbeat("rep_0:aa")
            client.heartbeat("rep_1:bb")

    beating = threading.Thread(target=keep_alive, daemon=True)
    beating.start()
    try:
        out = subprocess.run([node, str(tmp_path / "shim.js"), server.dashboard_url(), str(tmp_path / "page.js")],
                             capture_output=True, text=True, timeout=60)
    finally:
        done.set()
        beating.join()
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert str(view["quorum_id"]) == "1"
    assert "need min_replicas 2" in view["reason"]
    assert "rep_0:aa" in view["members"] and "rep_1:bb" in view["members"]
    assert "recovering" in view["class:rep_1:bb"] and "recovering" not in view["class:rep_0:aa"]
    assert "rep_0:aa" in view["heartbeats"] and "yes" in view["heartbeats"]
    assert view["error"] == ""
    assert "members 2 (0 unhealthy, 1 recovering)" in view["counts"] and view["range"] == "1-2 of 2"
