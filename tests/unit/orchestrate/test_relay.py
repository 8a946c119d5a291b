"""The replica's journal (orchestrate/relay.py): numbered, complete across a detach, resent after a given rseq."""

from __future__ import annotations

from regent.orchestrate.relay import ReportRelay, journal_path, last_rseq, read_journal


class _Port:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, item: tuple) -> None:
        self.sent.append(item)


def test_items_are_journaled_numbered_and_forwarded_only_while_attached(tmp_path):
    path = journal_path(tmp_path / "journal", 2)
    old, new = _Port(), _Port()
    relay = ReportRelay(path, old)
    assert [relay.put("metric", {"step": s}) for s in (1, 2)] == [1, 2]
    relay.detach("controller gone")
    relay.put("event", {"kind": "failure_detected"})
    relay.put("metric", {"step": 3})
    assert [i[2] for i in old.sent] == [1, 2]  # nothing sent into the void
    assert relay.attach(new, after=1) == 3  # the successor held up to rseq 1
    relay.put("metric", {"step": 4})
    assert [(k, n) for k, _, n in new.sent] == [("metric", 2), ("event", 3), ("metric", 4), ("metric", 5)]
    assert [i["rseq"] for i in read_journal(path)] == [1, 2, 3, 4, 5]


def test_a_respawned_relay_continues_the_numbering_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "replica-0.jsonl"
    relay = ReportRelay(path, _Port())
    relay.put("metric", {"step": 1})
    relay.put("metric", {"step": 2})
    relay.close()
    with open(path, "a") as f:
        f.write('{"rseq": 3, "kind": "met')  # the process died while writing it
    assert last_rseq(path) == 2
    assert ReportRelay(path, _Port()).put("metric", {"step": 3}) == 3
    assert [i["payload"].get("step") for i in read_journal(path, after=1)] == [2, 3]
