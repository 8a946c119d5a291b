"""A graceful `ProcMesh.stop()` ends a proc through the interpreter's own exit, as a Monarch proc does, so module
globals are torn down and their `__del__` runs; but a proc that imported torch.distributed (native communicators
an aborted collective may still use) leaves with `os._exit`, without teardown. Real procs."""

import os
import time

from regent.actor import this_host

TIMEOUT = 60

MODULE = '''
import os
from regent.actor import Actor, endpoint


class Finalized:
    def __init__(self, path):
        self.file = open(path, "w")  # opened now: at teardown `open` is gone

    def __del__(self):
        self.file.write("finalized")
        self.file.close()


KEPT = None  # a module global: collected only when the interpreter tears the module down


class Keeper(Actor):
    def __init__(self, path, with_collectives):
        global KEPT
        if with_collectives:
            import torch.distributed  # noqa: F401
        KEPT = Finalized(path)

    @endpoint
    def pid(self):
        return os.getpid()
'''


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_module_globals_del_runs_at_a_graceful_stop_unless_native_collectives_are_loaded(tmp_path, monkeypatch):
    (tmp_path / "teardown_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from teardown_mod import Keeper

    pm = this_host().spawn_procs(per_host={"gpus": 2})
    marks = [tmp_path / "plain", tmp_path / "torch"]
    plain = pm.slice(gpus=0).spawn("plain", Keeper, str(marks[0]), False)
    torch = pm.slice(gpus=1).spawn("torch", Keeper, str(marks[1]), True)
    pids = [plain.pid.call_one().get(timeout=TIMEOUT), torch.pid.call_one().get(timeout=TIMEOUT)]
    pm.stop().get(timeout=TIMEOUT)
    assert all(_gone(pid) for pid in pids)
    assert marks[0].read_text() == "finalized"
    assert marks[1].read_text() == ""  # os._exit: no teardown where a native communicator may exist
