"""Bad input to `regent train` gets one clear line before anything launches, and the job secret never leaks.

Each refused case checks the whole contract: exit code 2, exactly one line on stderr, `regent train: error: `
then the problem and the fix, no traceback, and no run directory (nothing was launched). Most cases run the
CLI in-process (`regent.cli.main`); the ones about the world outside (a real file system, real sockets) also
run the real `regent train` command in a subprocess. The last test runs a short real training job with a
known secret and looks for it everywhere the run writes or shows.
"""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from regent.cli import main
from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.config import ConfigError
from regent.orchestrate.preflight import (
    check_bind_free,
    check_gpus,
    check_lighthouse_reachable,
    check_shared_gpus,
    cross_replica_gpu_clash,
)

PREFIX = "regent train: error: "
QUICK = ["--no-live", "--steps", "3", "--no-faults", "--replicas", "1", "--procs-per-replica", "1"]


def _one_line(err: str, run_dir: Path, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(PREFIX) and "Traceback" not in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert not run_dir.exists(), "a run directory was made: something launched"
    return line


def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], *fragments: str) -> str:
    """`regent train ARGV` in-process: exit code 2 and one line naming each fragment."""
    run_dir = tmp_path / "run"
    try:
        code = main(["train", "--run-dir", str(run_dir), *argv])
    except SystemExit as exc:  # argparse's own errors exit
        code = exc.code
    assert code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return _one_line(err, run_dir, *fragments)


# -- the configuration itself -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "toml, fragments",
    [
        ("[ft]\nsync_evry = 3\n", ("unknown key [ft] sync_evry", "did you mean [ft] sync_every?")),
        ("replicsa = 3\n", ("unknown key replicsa", "did you mean replicas?")),
        ("[train]\nsync_every = 3\n", ("unknown key [train] sync_every", "did you mean [ft] sync_every?")),
        ("[fx]\nsync_every = 3\n", ("unknown table [fx]", "did you mean [ft]?")),
        ("ft = 3\n", ("ft is a section, not an option",)),
    ],
)
def test_unknown_toml_key_names_the_closest(tmp_path, capsys, toml, fragments):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    refused(capsys, tmp_path, ["--config", str(path), *QUICK], f"config file {path}: ", *fragments)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--ft.sync-evry", "3"], ("unknown option --ft.sync-evry", "did you mean --ft.sync-every?")),
        (["--replcas", "2"], ("unknown option --replcas", "did you mean --replicas?")),
        (["--sync-every", "2"], ("unknown option --sync-every", "did you mean --ft.sync-every?")),
        (["--trian.lr", "1e-3"], ("unknown config section 'trian'", "did you mean --train.lr?")),
        (["--ft.zzz", "1"], ("unknown option --ft.zzz", "the keys of [ft] are", "sync_every")),
        (["--zzz", "1"], ("unknown option --zzz", "regent train --help")),
    ],
)
def test_unknown_flag_names_the_closest(tmp_path, capsys, argv, fragments):
    refused(capsys, tmp_path, [*QUICK, *argv], *fragments)


def test_argparse_errors_are_one_line_too(tmp_path, capsys):
    refused(capsys, tmp_path, [*QUICK, "--replicas", "many"], "argument --replicas: invalid int value",
            "regent train --help")
    refused(capsys, tmp_path, [*QUICK, "--duration", "3s"], "--duration: not allowed with argument --steps")


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--steps", "0"], ("--steps must be a positive number",)),
        (["--steps", "-3"], ("--steps must be a positive number",)),
        (["--duration", "0s"], ("--duration must be positive", "180s")),
        (["--replicas", "0"], ("--replicas must be at least 1",)),
        (["--procs-per-replica", "0"], ("--procs-per-replica must be at least 1",)),
        (["--fault-every", "0s"], ("--fault-every must be positive",)),
        (["--lighthouse.min-replicas", "0"], ("--lighthouse.min-replicas must be at least 1",)),
        (["--lighthouse.heartbeat-timeout-ms", "0"], ("--lighthouse.heartbeat-timeout-ms must be a positive",)),
        (["--faults.warmup", "-5"], ("--faults.warmup and --faults.holdoff must be zero or positive",)),
        (["--ft.sync-every", "0"], ("--ft.sync-every must be at least 1",)),
        (["--ft.sync-every", "3", "--ft.fragments", "2"], ("ft.sync_every=3 must be a multiple of ft.fragments=2",)),
    ],
)
def test_non_positive_sizes_and_durations(tmp_path, capsys, argv, fragments):
    args = [a for a in QUICK if a not in ("--steps", "3")] if "--duration" in argv else QUICK
    refused(capsys, tmp_path, [*args, *argv], *fragments)


def test_replicas_below_min_replicas(tmp_path, capsys):
    refused(capsys, tmp_path, [*QUICK, "--replicas", "2", "--lighthouse.min-replicas", "3"],
            "--replicas 2 is below --lighthouse.min-replicas 3", "pass --replicas 3 or more")
    refused(capsys, tmp_path, [*QUICK, "--replicas", "2", "--ft.min-replica-size", "3"],
            "--replicas 2 is below --ft.min-replica-size 3", "pass --replicas 3 or more")


# -- the machine: GPUs, files, ports, the Lighthouse -------------------------------------------------------------


@pytest.fixture
def gpu_env(monkeypatch):
    for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_more_procs_per_replica_than_gpus(tmp_path, capsys, gpu_env):
    gpu_env.setenv("GPU_PLATFORM", "cuda")
    gpu_env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    refused(capsys, tmp_path, [*QUICK, "--procs-per-replica", "4"],
            "--procs-per-replica 4 needs 4 GPUs per replica but this host has 2 visible (CUDA_VISIBLE_DEVICES=0,1)",
            "pass --procs-per-replica 2 or fewer")
    check_gpus(2)  # as many as there are: fine


def test_replicas_sharing_a_gpu_over_nccl_are_refused_and_gloo_lets_them(tmp_path, capsys, gpu_env):
    gpu_env.setenv("GPU_PLATFORM", "cuda")
    gpu_env.setenv("CUDA_VISIBLE_DEVICES", "0")
    two = [a if a != "1" or QUICK[i - 1] != "--replicas" else "2" for i, a in enumerate(QUICK)]
    refused(capsys, tmp_path, two, "--replicas 2 x --procs-per-replica 1 needs 2 GPUs for NCCL",
            "rank 0 of replicas 0 and 1 would share a GPU", "Pass --ft.backend gloo")
    check_shared_gpus(2, 1, "gloo")  # Gloo stages through host memory: sharing is allowed
    gpu_env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    check_shared_gpus(2, 1, None)  # a GPU each
    gpu_env.setenv("GPU_PLATFORM", "cpu")
    check_shared_gpus(8, 1, None)


def test_cross_replica_gpu_clash_follows_the_replica_gpu_layout():
    assert cross_replica_gpu_clash(2, 1, 2) is None
    assert cross_replica_gpu_clash(4, 2, 8) is None
    assert cross_replica_gpu_clash(3, 1, 2) == (0, 0, 2)  # replica 2 wraps onto GPU 0
    assert cross_replica_gpu_clash(2, 2, 2) == (0, 0, 1)
    # 2 replicas x 2 ranks on 3 GPUs: rank 0 on GPUs 0 and 2, rank 1 on GPUs 1 and 0: no group has a clash
    assert cross_replica_gpu_clash(2, 2, 3) is None
    assert cross_replica_gpu_clash(5, 1, 0) is None


def test_cpu_has_no_gpu_limit(gpu_env):
    gpu_env.setenv("GPU_PLATFORM", "cpu")
    check_gpus(64)


def test_missing_or_broken_tokenizer(tmp_path, capsys):
    refused(capsys, tmp_path, [*QUICK, "--train.tokenizer", str(tmp_path / "tok.json")],
            f"--train.tokenizer {tmp_path / 'tok.json'} does not exist", "pass a tokenizer.json file")
    pytest.importorskip("tokenizers")
    broken = tmp_path / "broken.json"
    broken.write_text("not json")
    refused(capsys, tmp_path, [*QUICK, "--train.tokenizer", str(broken)], "cannot be loaded",
            "Hugging Face tokenizer.json")


@pytest.fixture
def listening() -> socket.socket:
    """A real TCP listener on loopback that never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_lighthouse_dashboard_port_in_use():
    # a listener on port P+1 whose P is free (an ephemeral port's neighbour may be taken by another socket)
    for _ in range(50):
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        if _free(port - 1):
            break
        listening.close()
    else:
        pytest.fail("no listener port with a free neighbour in 50 tries")
    try:
        _check_dashboard_port_in_use(port)
    finally:
        listening.close()


def _check_dashboard_port_in_use(port: int) -> None:
    with pytest.raises(ConfigError, match=rf"port {port}, the dashboard's port \(gRPC port \+ 1\), is already"):
        check_bind_free(f"127.0.0.1:{port - 1}")
    check_bind_free("127.0.0.1:0")  # any free port: nothing to check


def test_lighthouse_bind_to_a_foreign_address():
    with pytest.raises(ConfigError, match="192.0.2.1 is not an address of this machine"):
        check_bind_free("192.0.2.1:29510")  # TEST-NET-1: never assigned to a host


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_lighthouse_address_that_does_not_speak_grpc(listening):
    port = listening.getsockname()[1]
    with pytest.raises(ConfigError, match="accepts connections but nothing answered gRPC"):
        check_lighthouse_reachable(f"127.0.0.1:{port}", timeout_s=1.0)


def test_lighthouse_address_that_is_a_plain_http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="unreachable"):
            check_lighthouse_reachable(f"127.0.0.1:{server.server_address[1]}", timeout_s=1.0)
    finally:
        server.shutdown()
        server.server_close()


def test_a_running_lighthouse_passes():
    from regent.ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        check_lighthouse_reachable(lighthouse.address(), timeout_s=5.0)
        status = lighthouse.status()
        assert status["heartbeats"] == [] and status["waiting"] == []  # the probe registered nothing
    finally:
        lighthouse.shutdown()


def test_lighthouse_that_refuses_the_runs_secret_is_refused_before_launch(monkeypatch):
    """The probe is signed as the trainers' calls will be: a Lighthouse started with another secret, or a run
    with none, fails here with the fix, not at every quorum after launch."""
    from regent.auth import SECRET_ENV, SECRET_FILE_ENV
    from regent.ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, secret=b"k" * 32)
    try:
        monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
        monkeypatch.setenv(SECRET_ENV, (b"k" * 32).hex())
        check_lighthouse_reachable(lighthouse.address(), timeout_s=5.0)  # the same secret: passes
        monkeypatch.setenv(SECRET_ENV, (b"w" * 32).hex())
        with pytest.raises(ConfigError, match="refused this run's calls .*UNAUTHENTICATED.*not the Lighthouse's"):
            check_lighthouse_reachable(lighthouse.address(), timeout_s=5.0)
        monkeypatch.delenv(SECRET_ENV)
        with pytest.raises(ConfigError, match="requires the job secret .*REGENT_JOB_SECRET_FILE"):
            check_lighthouse_reachable(lighthouse.address(), timeout_s=5.0)
        # --ft.rpc-auth false: the run will not sign, so the probe does not either
        monkeypatch.setenv(SECRET_ENV, (b"k" * 32).hex())
        with pytest.raises(ConfigError, match="requires the job secret"):
            check_lighthouse_reachable(lighthouse.address(), timeout_s=5.0, rpc_env={"REGENT_FT_RPC_AUTH": "0"})
        assert lighthouse.status()["heartbeats"] == []  # no probe registered anything
    finally:
        lighthouse.shutdown()


def test_parse_level_config_needs_no_machine(tmp_path):
    """parse_train_argv stays pure: an address nobody serves is only checked when the CLI is about to launch."""
    cfg = parse_train_argv(["--lighthouse.address", f"127.0.0.1:{_closed_port()}", "--no-faults",
                            "--run-dir", str(tmp_path / "r")])
    assert cfg.lighthouse.address


# -- secrets ---------------------------------------------------------------------------------------------------
