"""Where the output of procs on a worker goes (Monarch's `stream_logs`): a mesh from `attach_to_workers` starts
with `stream_logs` False, and what its procs print appears on the worker's own stdout, prefixed with the proc,
not on the client; `logging_option(stream_to_client=True)` brings the lines after it to the client instead.
`attach_to_workers(..., stream_logs=True)` streams from the start. Real processes: a worker and its procs."""

import os
import subprocess
import sys
import textwrap
import threading
import time

from regent.actor import Actor, attach_to_workers, endpoint
from regent.actor._process import get_runtime

TIMEOUT = 60

WORKER = textwrap.dedent('''
    from regent.actor import run_worker_loop_forever
    run_worker_loop_forever(address="tcp://127.0.0.1:0", ca="trust_all_connections")
''')


class Printer(Actor):
    @endpoint
    def say(self, text: str) -> None:
        print(text, flush=True)


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_output_stays_on_the_worker_until_streamed_to_the_client(capfd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env["REGENT_JOB_SECRET"] = get_runtime().secret.hex()
    worker = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        address = worker.stdout.readline().split()[-1]
        on_worker: list[str] = []
        threading.Thread(target=lambda: on_worker.extend(iter(worker.stdout.readline, "")), daemon=True).start()
        hosts = attach_to_workers([address], name="quiet")
        assert hosts.stream_logs is False
        pm = hosts.spawn_procs(per_host={"gpus": 1}, name="printers")
        printer = pm.spawn("printer", Printer)

        printer.say.call_one("said while not streamed").get(timeout=TIMEOUT)
        _wait_for(lambda: any("said while not streamed" in line for line in on_worker), "the worker's line")
        line = next(line for line in on_worker if "said while not streamed" in line)
        assert line.startswith("[printers hosts=0,gpus=0] "), line

        pm.logging_option(stream_to_client=True).get(timeout=TIMEOUT)
        printer.say.call_one("said while streamed").get(timeout=TIMEOUT)
        on_client: list[str] = []
        _wait_for(lambda: on_client.append(capfd.readouterr().out) or "said while streamed" in "".join(on_client),
                  "the client's line")
        client_text = "".join(on_client)
        assert "said while not streamed" not in client_text
        assert not any("said while streamed" in line for line in on_worker)

        assert attach_to_workers([address], name="loud", stream_logs=True).stream_logs is True
        pm.stop().get(timeout=TIMEOUT)
        hosts.shutdown().get(timeout=TIMEOUT)
        assert worker.wait(TIMEOUT) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
