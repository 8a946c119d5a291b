#!/bin/sh
# Create or refresh the project virtualenv. Idempotent.
# - If the system python already imports torch (a GPU machine), reuse it via
#   --system-site-packages instead of downloading another build.
# - Otherwise install the CPU build torch==2.13.0.
set -eu
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "[bootstrap] system torch found: creating $VENV with --system-site-packages"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    echo "[bootstrap] creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[bootstrap] installing torch==2.13.0 (CPU build)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi

echo "[bootstrap] installing regent-ml (editable) with test extras"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
