"""The Lighthouse dashboard at fleet size: one page of each list with totals and counts (regent.ft.dashboard),
pure rules first, then a real Lighthouse with 1,024 heartbeating groups over real sockets."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from regent.ft.dashboard import MAX_PAGE, page_of, paged_status, parse_page
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient


def test_page_puts_attention_first_then_filters_and_slices():
    entries = [{"replica_id": f"r{i:03d}", "healthy": True} for i in range(10)]
    entries[7]["healthy"] = False
    entries[3]["recovering"] = True
    page, total = page_of(entries, 0, 3)
    assert total == 10
    assert [e["replica_id"] for e in page] == ["r007", "r003", "r000"]
    page, total = page_of(entries, 9, 5)
    assert total == 10 and [e["replica_id"] for e in page] == ["r009"]
    page, total = page_of(entries, 0, 50, query="r00")
    assert total == 10
    page, total = page_of(entries, 0, 50, query="r005")
    assert total == 1 and page[0]["replica_id"] == "r005"


def test_parse_page_defaults_and_refuses_bad_values_with_the_fix():
    assert parse_page({}) is None  # no paging parameter: the full snapshot, as before
    assert parse_page({"limit": ["10"]}) == (0, 10, "")
    assert parse_page({"q": ["replica_1"]}) == (0, 50, "replica_1")
    with pytest.raises(ValueError, match="whole number"):
        parse_page({"limit": ["ten"]})
    with pytest.raises(ValueError, match="out of range"):
        parse_page({"limit": [str(MAX_PAGE + 1)]})
    with pytest.raises(ValueError, match="out of range"):
        parse_page({"offset": ["-1"]})


def test_paged_status_counts_everything_and_keeps_the_rest():
    members = [{"replica_id": f"g{i}", "healthy": i != 2, "recovering": i == 4} for i in range(6)]
    status = {"quorum_id": 9, "prev_quorum": {"participants": members, "age_s": 1.0},
              "waiting": [], "heartbeats": [{"replica_id": f"g{i}", "healthy": i != 2} for i in range(6)]}
    out = paged_status(status, offset=0, limit=2)
    assert out["quorum_id"] == 9
    assert [m["replica_id"] for m in out["prev_quorum"]["participants"]] == ["g2", "g4"]
    assert out["page"]["totals"] == {"members": 6, "waiting": 0, "heartbeats": 6}
    assert out["page"]["counts"]["members_unhealthy"] == 1
    assert out["page"]["counts"]["members_recovering"] == 1
    assert out["page"]["counts"]["heartbeats_stale"] == 1
    assert len(status["prev_quorum"]["participants"]) == 6  # the snapshot itself is not cut


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_dashboard_pages_a_fleet_of_1024_groups():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000)
    try:
        addr = server.address()

        def beat(ids: range) -> None:
            client = LighthouseClient(addr, connect_timeout=30)
            for i in ids:
                client.heartbeat(f"group{i:04d}:x")

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(beat, [range(k, 1024, 4) for k in range(4)]))
        deadline = time.monotonic() + 30
        while len(server.status()["heartbeats"]) < 1024 and time.monotonic() < deadline:
            time.sleep(0.1)
        base = server.dashboard_url() + "status.json"
        code, full = _get(base)
        assert code == 200 and len(full["heartbeats"]) == 1024 and "page" not in full  # unchanged without paging
        code, page = _get(base + "?limit=50")
        assert code == 200
        assert len(page["heartbeats"]) == 50
        assert page["page"]["totals"]["heartbeats"] == 1024
        assert page["heartbeats"][0]["replica_id"] == "group0000:x"
        code, last = _get(base + "?limit=50&offset=1000")
        assert [h["replica_id"] for h in last["heartbeats"]][-1] == "group1023:x" and len(last["heartbeats"]) == 24
        code, found = _get(base + "?limit=50&q=group0512")
        assert found["page"]["matched"]["heartbeats"] == 1
        assert found["heartbeats"][0]["replica_id"] == "group0512:x"
        code, err = _get(base + "?limit=lots")
        assert code == 400 and "whole number" in err["error"]
        with urllib.request.urlopen(server.dashboard_url(), timeout=20) as resp:
            html = resp.read().decode()
        assert "limit=${PAGE}" in html  # the live page asks for one page, not the whole fleet
    finally:
        server.shutdown()
