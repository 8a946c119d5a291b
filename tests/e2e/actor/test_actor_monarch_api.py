"""Monarch's remaining public names (issue 18), with real processes and sockets:

- `spawn_procs(bootstrap_command=...)` starts each proc with that argv (a wrapper script that then execs
  Regent's command, a per-Point function); `default_bootstrap_cmd()` is Regent's own, `.with_env` adds env;
- `HostMesh.with_python_executable(path)` makes procs run under that interpreter (and the procs they spawn
  from their own `this_host()`); `is_fake_in_process`,
  `stream_logs`;
- a graceful `ProcMesh.stop()` runs the procs' atexit handlers and `weakref.finalize` callbacks;
- `ProcMesh.logging_option`: stream_to_client on/off, the procs' root logger level, aggregation windows;
- `enable_transport`: "tcp" makes the client and its procs reachable by this host's name, "tcp://H:P" fixes
  the client's listener; it must come before the runtime starts;
- `run_worker_loop_forever` (exported) serves Monarch's alias form `DIAL@BIND`, and `attach_to_workers`
  dials alias addresses and awaits `Future[str]` addresses.
"""

import logging
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from regent.actor import (
    Actor,
    BootstrapCommand,
    ChannelTransport,
    attach_to_workers,
    current_rank,
    default_bootstrap_cmd,
    enable_transport,
    endpoint,
    run_worker_loop_forever,
    this_host,
    this_proc,
)
from regent.actor._process import get_runtime
from regent.actor._transport import split_address

TIMEOUT = 60


class Probe(Actor):
    @endpoint
    def info(self) -> dict:
        return {"pid": os.getpid(), "ppid": os.getppid(), "executable": sys.executable,
                "rank": current_rank().rank, "env": {k: v for k, v in os.environ.items() if k.startswith("T_")}}

    @endpoint
    def spawned_info(self) -> dict:
        """`info` of a proc this proc spawns from its own `this_host()`."""
        pm = this_host().spawn_procs(per_host={"gpus": 1})
        try:
            return pm.spawn("inner", Probe).info.call_one().get(timeout=TIMEOUT)
        finally:
            pm.stop().get(timeout=TIMEOUT)

    @endpoint
    def say(self, text: str, err: bool = False) -> None:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)

    @endpoint
    def log(self, info: str, warning: str) -> int:
        logging.getLogger("probe").info(info)
        logging.getLogger("probe").warning(warning)
        return logging.getLogger().level


# ------------------------------------------------------------------------------------ bootstrap commands
def test_default_bootstrap_cmd_is_regents_and_with_env_reaches_the_proc():
    cmd = default_bootstrap_cmd()
    assert cmd.program == sys.executable and cmd.arg0 is None
    assert cmd.args == ["-m", "regent.actor._proc_main"] and cmd.env == {}
    assert cmd.with_env({"T_FROM_CMD": "1"}).env == {"T_FROM_CMD": "1"} and cmd.env == {}
    pm = this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command=cmd.with_env({"T_FROM_CMD": "1"}))
    try:
        info = pm.spawn("p", Probe).info.call_one().get(timeout=TIMEOUT)
        assert info["env"] == {"T_FROM_CMD": "1"}
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_wrapper_bootstrap_command_starts_every_proc(tmp_path):
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text('#!/bin/sh\necho $$ >> "$T_MARKS"\nexport T_WRAPPED=yes\nexec "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    marks = tmp_path / "marks"

    def command(point) -> BootstrapCommand:  # one per proc, from its Point in the new mesh
        regent = default_bootstrap_cmd()
        return BootstrapCommand(program=str(wrapper), args=[regent.program, *regent.args],
                                env={"T_MARKS": str(marks), "T_POINT": str(point.rank)})

    pm = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap_command=command)
    try:
        infos = pm.spawn("p", Probe).info.call().get(timeout=TIMEOUT).values()
    finally:
        pm.stop().get(timeout=TIMEOUT)
    # the wrapper ran once per proc, and exec'd the proc in its own process (same pid)
    assert sorted(int(x) for x in marks.read_text().split()) == sorted(i["pid"] for i in infos)
    assert [(i["env"]["T_WRAPPED"], i["env"]["T_POINT"]) for i in infos] == [("yes", "0"), ("yes", "1")]
    with pytest.raises(TypeError, match="bootstrap_command"):
        this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command=42)


def test_with_python_executable_runs_procs_under_that_interpreter(tmp_path):
    python = tmp_path / "bin" / "python3"
    python.parent.mkdir()
    python.symlink_to(os.path.realpath(sys.executable))  # the base interpreter, outside this venv
    host = this_host()
    assert host.is_fake_in_process is False and host.stream_logs is True
    other = host.with_python_executable(str(python))
    assert other.is_fake_in_process is False and other.region == host.region
    # the base interpreter does not see the venv's packages: the documented way is to pass PYTHONPATH
    pm = other.spawn_procs(per_host={"gpus": 1}, env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        info = pm.spawn("p", Probe).info.call_one().get(timeout=TIMEOUT)
        assert info["executable"] == str(python) and info["ppid"] == os.getpid()
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_procs_of_a_python_executable_spawn_their_own_procs_under_it(tmp_path):
    """As Monarch's host mesh keeps its bootstrap command, a proc's own `this_host()` spawns under the interpreter
    the proc was given: a wrapper that stamps its pid runs again for the proc's child (not inherited env)."""
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text(f'#!/bin/sh\nexport T_WRAPPER_PID=$$\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    pm = this_host().with_python_executable(str(wrapper)).spawn_procs(per_host={"gpus": 1})
    try:
        probe = pm.spawn("p", Probe)
        info = probe.info.call_one().get(timeout=TIMEOUT)
        inner = probe.spawned_info.call_one().get(timeout=TIMEOUT)
    finally:
        pm.stop().get(timeout=TIMEOUT)
    assert info["env"]["T_WRAPPER_PID"] == str(info["pid"])  # the wrapper exec'd the proc
    assert inner["env"]["T_WRAPPER_PID"] == str(inner["pid"]) and inner["ppid"] == info["pid"]
    plain = this_host().spawn_procs(per_host={"gpus": 1}, env={"T_WRAPPER_PID": ""})
    try:  # a proc of a plain host mesh spawns with Regent's default command
        assert plain.spawn("p", Probe).spawned_info.call_one().get(timeout=TIMEOUT)["env"]["T_WRAPPER_PID"] == ""
    finally:
        plain.stop().get(timeout=TIMEOUT)


# ------------------------------------------------------------------------------------ graceful stop
EXIT_HOOKS = '''
import atexit, os, weakref
from regent.actor import Actor, endpoint

MARK = os.environ.get("T_EXIT_MARK")

def _write(suffix):
    with open(MARK + suffix, "w") as f:
        f.write(str(os.getpid()))

class _Resource:
    pass

if MARK:  # only in the procs (the test process imports this module too, to pickle the class)
    atexit.register(_write, ".atexit")
    RESOURCE = _Resource()
    weakref.finalize(RESOURCE, _write, ".finalize")

class Hooked(Actor):
    @endpoint
    def pid(self):
        return os.getpid()
'''


def test_graceful_stop_runs_atexit_handlers_and_finalizers(tmp_path, monkeypatch):
    (tmp_path / "exit_hooks_mod.py").write_text(EXIT_HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from exit_hooks_mod import Hooked

    mark = str(tmp_path / "mark")
    pm = this_host().spawn_procs(per_host={"gpus": 1}, env={"T_EXIT_MARK": mark})
    pid = pm.spawn("hooked", Hooked).pid.call_one().get(timeout=TIMEOUT)
    assert not os.path.exists(mark + ".atexit")
    pm.stop().get(timeout=TIMEOUT)
    for suffix in (".atexit", ".finalize"):
        with open(mark + suffix) as f:
            assert f.read() == str(pid)


# ------------------------------------------------------------------------------------ logging_option
def _wait_output(capsys, seen: list, needle: str, count: int = 1, timeout: float = 30.0) -> str:
    """Everything the client printed so far, once `needle` is in it `count` times (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        out, err = capsys.readouterr()
        seen.append(out + err)
        text = "".join(seen)
        if text.count(needle) >= count or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_logging_option_controls_forwarding_level_and_aggregation(capsys):
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    seen: list[str] = []
    try:
        p = pm.spawn("p", Probe)
        p.say.call("streamed-by-default").get(timeout=TIMEOUT)
        assert _wait_output(capsys, seen, "streamed-by-default", count=2).count("streamed-by-default") == 2

        pm.logging_option(stream_to_client=False).get(timeout=TIMEOUT)
        p.say.call("dropped-line").get(timeout=TIMEOUT)
        p.say.call("dropped-err-line", err=True).get(timeout=TIMEOUT)
        # printed before this call: still under stream_to_client=False
        pm.logging_option(stream_to_client=True).get(timeout=TIMEOUT)
        p.say.call("after-line").get(timeout=TIMEOUT)
        text = _wait_output(capsys, seen, "after-line")
        assert text.count("after-line") >= 1 and "dropped-line" not in text and "dropped-err-line" not in text

        # level: the procs' root logger
        pm.logging_option(stream_to_client=True, level=logging.INFO).get(timeout=TIMEOUT)
        assert p.log.call("info-one", "warn-one").get(timeout=TIMEOUT).values() == [logging.INFO] * 2
        assert "info-one" in _wait_output(capsys, seen, "info-one")
        pm.logging_option(stream_to_client=True, level=logging.ERROR).get(timeout=TIMEOUT)
        assert p.log.call("info-two", "warn-two").get(timeout=TIMEOUT).values() == [logging.ERROR] * 2
        p.say.call("level-end", err=True).get(timeout=TIMEOUT)  # same stream as the log records
        text = _wait_output(capsys, seen, "level-end")
        assert "warn-one" in text and "info-two" not in text and "warn-two" not in text

        # aggregation: the same line from both procs is printed once, with its count
        pm.logging_option(stream_to_client=True, aggregate_window_sec=2).get(timeout=TIMEOUT)
        p.say.call("same-line").get(timeout=TIMEOUT)
        text = _wait_output(capsys, seen, "[2 similar log lines] same-line")
        assert "[2 similar log lines] same-line" in text and text.count("same-line") == 1

        with pytest.raises(ValueError, match="stream_to_client"):
            pm.logging_option(stream_to_client=False, aggregate_window_sec=1)
        with pytest.raises(ValueError, match="level"):
            pm.logging_option(stream_to_client=True, level=300)
    finally:
        pm.stop().get(timeout=TIMEOUT)


# ------------------------------------------------------------------------------------ workers and addresses
def test_worker_address_forms():
    assert split_address("tcp://h:1") == ("tcp://h:1", "tcp://h:1")
    assert split_address("tcp://fqdn:4444@tcp://0.0.0.0:4444") == ("tcp://fqdn:4444", "tcp://0.0.0.0:4444")
    assert split_address("service<x>@tcp://fqdn:4@tcp://0.0.0.0:4") == ("tcp://fqdn:4", "tcp://0.0.0.0:4")
    assert split_address("w0@ipc:///tmp/w.sock") == ("ipc:///tmp/w.sock", "ipc:///tmp/w.sock")
    for bad in ("nonsense", "a@b@tcp://h:1", "tcp://h:1@nonsense", "tcp://h:1@tcp://h:2@tcp://h:3"):
        with pytest.raises(ValueError):
            split_address(bad)
    with pytest.raises(ValueError):
        attach_to_workers(["nonsense"])
    with pytest.raises(NotImplementedError, match="TLS"):
        attach_to_workers(["tcp://127.0.0.1:1"], ca="/etc/ca.pem")
    with pytest.raises(NotImplementedError, match="TLS"):
        run_worker_loop_forever(address="tcp://127.0.0.1:0", ca="/etc/ca.pem")


class AddressBook(Actor):
    def __init__(self, address: str):
        self.address = address

    @endpoint
    def lookup(self) -> str:
        return self.address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER = textwrap.dedent('''
    import sys
    from regent.actor import run_worker_loop_forever
    run_worker_loop_forever(address=sys.argv[1], ca="trust_all_connections")
''')


def test_attach_to_workers_dials_alias_addresses_and_awaits_futures():
    rt = get_runtime()
    port = _free_port()
    alias = f"tcp://localhost:{port}@tcp://127.0.0.1:{port}"  # be known as localhost, listen on 127.0.0.1
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env["REGENT_JOB_SECRET"] = rt.secret.hex()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, alias], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().split()[-1] == f"tcp://localhost:{port}"
        book = this_proc().spawn("book", AddressBook, alias)
        address = book.lookup.call_one()  # a Future[str]
        hosts = attach_to_workers(workers=[address, f"worker0@{alias}"], name="aliased")
        assert hosts.initialized.get(timeout=TIMEOUT) is True
        # the worker starts its procs with the bootstrap command the controller gave
        pm = hosts.spawn_procs(per_host={"gpus": 1},
                               bootstrap_command=default_bootstrap_cmd().with_env({"T_REMOTE": "1"}))
        infos = pm.spawn("p", Probe).info.call().get(timeout=TIMEOUT).values()
        assert [i["ppid"] for i in infos] == [worker.pid, worker.pid]
        assert [i["env"] for i in infos] == [{"T_REMOTE": "1"}] * 2
        # the procs the worker started advertise the dial name, not the bound interface
        assert all(rt.directory[pid]["tcp"].startswith("tcp://localhost:") for pid in pm._state.proc_ids)
        pm.stop().get(timeout=TIMEOUT)
        hosts.shutdown().get(timeout=TIMEOUT)
        assert worker.wait(TIMEOUT) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


# ------------------------------------------------------------------------------------ enable_transport
CLIENT = textwrap.dedent('''
    import socket, sys
    from regent.actor import enable_transport, this_host
    from regent.actor._process import get_runtime
    from test_actor_monarch_api import Probe

    enable_transport(sys.argv[1])
    rt = get_runtime()
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    pm.spawn("p", Probe).info.call_one().get(timeout=60)  # the proc is up and answers
    proc_tcp = rt.directory[pm._state.proc_ids[0]]["tcp"]
    for address in (rt.info["tcp"], proc_tcp):  # dial both over TCP: they answer with Regent's hello
        host, port = address[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            assert s.recv(4) == b"RGNT", address
    try:
        enable_transport("ipc")
    except RuntimeError as exc:
        print("late:", exc)
    print("client", rt.info["tcp"])
    print("proc", proc_tcp)
    pm.stop().get(timeout=60)
''')


def test_enable_transport_chooses_where_the_client_and_its_procs_listen(tmp_path):
    with pytest.raises(NotImplementedError, match="TLS"):
        enable_transport("metatls-hostname")
    with pytest.raises(ValueError, match="unknown transport"):
        enable_transport("carrier-pigeon")
    get_runtime()
    with pytest.raises(RuntimeError, match="before any other calls"):
        enable_transport(ChannelTransport.Unix)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    port = _free_port()
    for transport, client, proc in (("tcp", f"tcp://{socket.gethostname()}:", f"tcp://{socket.gethostname()}:"),
                                    (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:")):
        run = subprocess.run([sys.executable, "-c", CLIENT, transport], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT)
        assert run.returncode == 0, run.stderr
        lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
        assert "before any other calls" in lines["late:"]
        assert lines["client"].startswith(client) and lines["proc"].startswith(proc), run.stdout
