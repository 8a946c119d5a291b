"""What a replica reports reaches the run directory even while no controller is there.

Everything a ReplicaActor and its trainers report (events, metrics, state ballots) goes through the replica's
`ReportRelay`: written first to the replica's journal (`RUN_DIR/journal/replica-<i>.jsonl`, one line per item,
flushed per line), with a per-replica sequence number `rseq`, then forwarded to the controller while one is
attached. A controller that was killed loses nothing its replicas reported: a new one (`regent train --resume`)
reads the journal's tail after the last `rseq` it holds. The controller writes `rseq` into the events.jsonl and
metrics.jsonl lines, which is how it knows what it holds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from regent.orchestrate.events import JsonlWriter

logger = logging.getLogger(__name__)


def journal_path(journal_dir: str | Path, replica: int) -> Path:
    return Path(journal_dir) / f"replica-{replica}.jsonl"


def read_journal(path: str | Path, after: int = 0) -> Iterator[dict[str, Any]]:
    """The journal's items with `rseq > after`, in order. A torn last line (the process died while writing it)
    is skipped: its item was not forwarded either, so nothing is counted twice or half."""
    p = Path(path)
    if not p.exists():
        return
    with p.open(encoding="utf-8") as f:
        for line in f:
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s: a torn line skipped (its writer died while writing it)", p)
                continue
            if item.get("rseq", 0) > after:
                yield item


def end_torn_line(path: Path) -> None:
    """A file whose writer died mid-line ends without a newline: add it, so what is appended next is whole."""
    try:
        with open(path, "rb+") as f:
            if f.seek(0, 2) == 0:
                return
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        return


def last_rseq(path: str | Path) -> int:
    """The highest sequence number in a journal (0 for none): a respawned replica continues from it."""
    last = 0
    for item in read_journal(path):
        last = max(last, int(item["rseq"]))
    return last


class ReportRelay:
    """Journal first, then forward while attached (see the module docstring)."""

    def __init__(self, path: str | Path, controller: Any) -> None:
        self.path = Path(path)
        end_torn_line(self.path)  # a predecessor killed mid-line: the next item must start on its own line
        self.rseq = last_rseq(self.path)
        self._journal = JsonlWriter(self.path)
        self.controller = controller  # the controller's report Port
        self.attached = True
        self._journal_error = ""

    def put(self, kind: str, payload: dict[str, Any]) -> int:
        """Journal one item and forward it when a controller is attached; returns its sequence number."""
        self.rseq += 1
        try:
            self._journal.write({"rseq": self.rseq, "kind": kind, "payload": payload})
        except (OSError, TypeError, ValueError) as exc:
            # the item still goes to the controller; only a successor would miss it (said once per cause)
            if str(exc) != self._journal_error:
                self._journal_error = str(exc)
                logger.error("journal %s: cannot write item %d (%s); a resumed controller would miss it",
                             self.path, self.rseq, exc)
        if self.attached and self.controller is not None:
            self.controller.send((kind, payload, self.rseq))
        return self.rseq

    def detach(self, reason: str = "") -> None:
        """No controller to forward to: journal only (a send to a dead controller would be dropped silently)."""
        if self.attached:
            logger.warning("journal %s: controller gone (%s); reports are journaled only", self.path, reason)
        self.attached = False

    def attach(self, controller: Any, after: int) -> int:
        """A (new) controller holds everything up to `after`: forward the journal's items after it, then every new
        one. Returns how many items were resent."""
        self.controller = controller
        sent = 0
        for item in read_journal(self.path, after):
            controller.send((item["kind"], item["payload"], item["rseq"]))
            sent += 1
        self.attached = True
        return sent

    def close(self) -> None:
        self._journal.close()
