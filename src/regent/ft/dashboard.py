"""The Lighthouse dashboard's view of a big fleet: counts of everything, one page of each list.

A 1,024-member quorum rendered in full every second is a 1,024-card page that no one can read and that costs
the browser and the Lighthouse a full snapshot each time. `status.json?limit=N` returns the totals and
counts the page needs to show health at a glance, and only `limit` entries of each list, the ones that need
attention first (unhealthy, then recovering), optionally filtered by a substring of the replica id. Without
paging parameters `status.json` stays the full snapshot (scripts and tests read it whole).
"""

from __future__ import annotations

from typing import Any

DEFAULT_PAGE = 50
MAX_PAGE = 1000


def _attention(entry: dict[str, Any]) -> int:
    """Sort key: unhealthy first, then recovering, then the rest."""
    if entry.get("healthy") is False:
        return 0
    if entry.get("recovering"):
        return 1
    return 2


def page_of(entries: list[dict[str, Any]], offset: int, limit: int, query: str = "") -> tuple[list[dict[str, Any]], int]:
    """(`limit` entries from `offset` of those whose replica id contains `query`, attention first; how many
    matched)."""
    matched = [e for e in entries if query in str(e.get("replica_id", ""))] if query else list(entries)
    matched.sort(key=lambda e: (_attention(e), str(e.get("replica_id", ""))))
    return matched[offset:offset + limit], len(matched)


def parse_page(params: dict[str, list[str]]) -> tuple[int, int, str] | None:
    """(offset, limit, query) from a query string's parameters, or None when none of them is given (the full
    snapshot). Raises ValueError with the fix for a bad value."""
    if not any(k in params for k in ("offset", "limit", "q")):
        return None

    def number(name: str, default: int, low: int, high: int) -> int:
        raw = params.get(name, [str(default)])[-1]
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a whole number; use e.g. ?{name}={default}") from None
        if not low <= value <= high:
            raise ValueError(f"{name}={value} is out of range; use {low}..{high}")
        return value

    offset = number("offset", 0, 0, 10**9)
    limit = number("limit", DEFAULT_PAGE, 1, MAX_PAGE)
    query = params.get("q", [""])[-1][:256]
    return offset, limit, query


def paged_status(status: dict[str, Any], offset: int = 0, limit: int = DEFAULT_PAGE, query: str = "") -> dict[str, Any]:
    """`status` (the Lighthouse's full snapshot) cut to one page of each list, with totals and counts."""
    out = dict(status)
    prev = status.get("prev_quorum")
    members = prev["participants"] if prev else []
    waiting = status.get("waiting", [])
    heartbeats = status.get("heartbeats", [])
    totals = {"members": len(members), "waiting": len(waiting), "heartbeats": len(heartbeats)}
    counts = {
        "members_unhealthy": sum(m.get("healthy") is False for m in members),
        "members_recovering": sum(bool(m.get("recovering")) for m in members),
        "waiting_unhealthy": sum(w.get("healthy") is False for w in waiting),
        "heartbeats_stale": sum(not h.get("healthy", True) for h in heartbeats),
    }
    matched = {}
    if prev:
        out["prev_quorum"] = dict(prev)
        out["prev_quorum"]["participants"], matched["members"] = page_of(members, offset, limit, query)
    out["waiting"], matched["waiting"] = page_of(waiting, offset, limit, query)
    out["heartbeats"], matched["heartbeats"] = page_of(heartbeats, offset, limit, query)
    out["page"] = {"offset": offset, "limit": limit, "query": query, "totals": totals, "matched": matched,
                   "counts": counts}
    return out
