"""Suite-wide setup: a token cache of the suite's own, so tests neither read nor fill the user's cache."""

from __future__ import annotations

import os
import shutil
import tempfile

_made: list[str] = []


def pytest_configure(config) -> None:
    if "REGENT_TOKEN_CACHE" not in os.environ:  # inherited by every process a test starts
        _made.append(tempfile.mkdtemp(prefix="regent-token-cache-"))
        os.environ["REGENT_TOKEN_CACHE"] = _made[-1]


def pytest_unconfigure(config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
