"""The test layout as code (tests/README.md): a file under tests/unit starts no process. Checked by reading each
file's syntax tree, so an end-to-end test put there fails this test before it runs."""

from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent
# Modules whose import means a process is started, and calls that start one (the actor runtime's procs, a
# Popen, the control-plane simulator's workers).
BANNED_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})
BANNED_CALLS = frozenset({"spawn_procs", "this_host", "Popen", "run_simulation"})


def _is_banned_module(name: str) -> bool:
    return name in BANNED_MODULES or name.split(".")[0] in {"subprocess", "multiprocessing"}


def process_starts(source: str) -> list[str]:
    """What in `source` starts (or imports the means to start) an OS process, as `line: what` strings.
    Also a Lighthouse with front ends (`frontends=N`, N not 0): each front end is a process."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_banned_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and _is_banned_module(node.module):
            found.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in BANNED_CALLS:
                found.append(f"{node.lineno}: {name}()")
            for kw in node.keywords:
                if kw.arg == "frontends" and not (isinstance(kw.value, ast.Constant) and not kw.value.value):
                    found.append(f"{node.lineno}: frontends=")
    return found


def test_unit_tests_start_no_process():
    files = sorted(UNIT.rglob("*.py"))
    assert len(files) > 40  # the walk found the unit tests
    bad = {str(f.relative_to(UNIT)): hits for f in files if (hits := process_starts(f.read_text()))}
    assert bad == {}, f"these start processes: move them (or their process cases) to tests/e2e: {bad}"


def test_the_rule_catches_each_way_of_starting_a_process():
    assert process_starts("import os\nx = os.getpid()\n") == []
    assert process_starts("import subprocess\n") == ["1: import subprocess"]
    assert process_starts("from multiprocessing import Process\n") == ["1: from multiprocessing import"]
    assert process_starts("import torch.multiprocessing as mp\n") == ["1: import torch.multiprocessing"]
    assert process_starts("pm = this_host().spawn_procs(per_host={'gpus': 1})\n") == [
        "1: spawn_procs()", "1: this_host()"]
    assert process_starts("p = sp.Popen(['ls'])\n") == ["1: Popen()"]
    assert process_starts("LighthouseServer(frontends=2)\nLighthouseServer(frontends=0)\n") == ["1: frontends="]
