"""Monarch anchor: the shared Monarch-API measures against `monarch.actor`; prints one JSON object on stdout.

Run with the benchmark venv (Monarch must never be installed into .venv):
    .venv-bench/bin/python benchmarks/anchors/monarch_bench.py [--quick]
Create that venv with:
    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 torchmonarch ray torchft-nightly
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mesh_api_measures import log, run_measures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter run (smoke test)")
    parser.add_argument("--only", default="", help="comma-separated measures (default: all)")
    args = parser.parse_args()
    only = {m for m in args.only.split(",") if m} or None
    import torch

    torch.set_num_threads(1)
    try:
        import monarch.actor as api
    except ImportError as exc:
        raise SystemExit(f"monarch is not importable ({exc}); create the bench venv: python3 -m venv .venv-bench"
                         " && .venv-bench/bin/pip install torch==2.13.0 torchmonarch ray torchft-nightly") from exc
    version = metadata.version("torchmonarch")
    log(f"monarch {version}")
    results = run_measures(api, quick=args.quick, only=only)
    out = {"runtime": "monarch", "version": version, "results": results}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    # Monarch's Rust runtime can keep the process alive after main returns; leave without waiting on it.
    os._exit(0)


if __name__ == "__main__":
    main()
