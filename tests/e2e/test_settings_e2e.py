"""regent.settings: every environment variable declared once, parsed the same way, and documented in the
README from the declarations (issue 34): the cases that start processes (the others:
tests/unit/test_settings.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from regent import settings
from tests.unit.test_settings import SRC


def test_settings_import_no_torch():
    code = "import sys, regent.settings; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(SRC.parent)))


def test_module_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "regent.settings"], check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(SRC.parent))).stdout
    assert out == settings.markdown_table()
    for s in settings.ALL.values():
        assert f"`{s.name}`" in out

