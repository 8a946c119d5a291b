"""One line per run of benchmarks/gpu/heal_one_gpu.sh: did the killed replica heal from its peer, and do the
replicas agree at the end (from the run directory's summary.json and events.jsonl)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def digest(run: Path) -> str:
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError) as err:
        return f"{run.name}: no summary ({err})"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    heals = [e for e in events if e["kind"] == "heal_done"]
    keys = ("steps_committed", "replicas_consistent", "full_restarts", "lineage_resets", "steps_lost",
            "invariant_violations", "initial_loss", "final_loss", "wall_seconds")
    picked = {k: summary.get(k) for k in keys if k in summary}
    heal = [{k: h.get(k) for k in ("replica", "donor", "step", "bytes", "seconds", "transport") if k in h}
            for h in heals]
    # early pulls of the live committed state (per-step: the donor holds it until the transfer ends) and the
    # attempts that missed (the donor inside its optimizer step, or moved on)
    early = [{k: e.get(k) for k in ("replica", "donor", "manager_step", "bytes", "seconds") if k in e}
             for e in events if e["kind"] == "early_heal_done"]
    missed = [e.get("errors") for e in events if e["kind"] == "recover_failed"]
    return (f"{run.name}: {json.dumps(picked)} faults={kinds.get('fault_injected', 0)} "
            f"failures={kinds.get('failure_detected', 0)} heals={json.dumps(heal)} early={json.dumps(early)} "
            f"early_missed={len(missed)} {json.dumps(missed[:3])}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(digest(Path(arg)))
