"""Lighthouse front ends (`regent.ft.frontends`): the pure pieces (link framing, heartbeat batching and merging),
then real processes and sockets: front ends serve heartbeats and quorums, a killed front end is replaced, a
killed owner takes its front ends with it. Behaviour only: waits poll with generous bounds, nothing asserts a
duration."""

from __future__ import annotations

import pytest

from regent.ft import frontends
from regent.ft.frontends import (
    K_BEATS,
    K_JOINS,
    apply_heartbeats,
    batch_beat,
    frame,
    split_frames,
)
from regent.ft.quorum import LighthouseState

# ---- pure ------------------------------------------------------------------------------------------------------


def test_link_frames_split_at_any_byte_boundary() -> None:
    stream = frame(K_BEATS, b'[["a",1.0]]') + frame(K_JOINS, b"x" * 5000) + frame(K_BEATS)
    for cut in range(len(stream) + 1):
        buffer = bytearray(stream[:cut])
        got = split_frames(buffer)
        buffer += stream[cut:]
        got += split_frames(buffer)
        assert got == [(K_BEATS, b'[["a",1.0]]'), (K_JOINS, b"x" * 5000), (K_BEATS, b"")]
        assert not buffer


def test_a_batch_keeps_the_newest_beat_and_the_newest_committed_report() -> None:
    pending: dict[str, list] = {}
    batch_beat(pending, "a:1", 1.0, None)
    batch_beat(pending, "a:1", 2.0, (7, 1, 0, 0))
    batch_beat(pending, "a:1", 3.0, None)  # a bare heartbeat must not drop the report
    batch_beat(pending, "b:1", 4.0, None)
    assert pending == {"a:1": ["a:1", 3.0, 7, 1, 0, 0], "b:1": ["b:1", 4.0]}


def test_batched_heartbeats_merge_into_the_liveness_table() -> None:
    state = LighthouseState()
    assert apply_heartbeats(state, [["a:1", 5.0], ["b:1", 6.0]], now=10.0) == {}
    assert state.heartbeats == {"a:1": 5.0, "b:1": 6.0}
    # out of order (another front end's older batch): never backwards; from the future: clamped to now
    apply_heartbeats(state, [["a:1", 4.0], ["b:1", 99.0]], now=11.0)
    assert state.heartbeats == {"a:1": 5.0, "b:1": 11.0}
    # a new incarnation of group a retires the old one, as a direct heartbeat does
    assert apply_heartbeats(state, [["a:2", 12.0]], now=12.0) == {"a:2": ["a:1"]}
    assert "a:1" not in state.heartbeats and state.heartbeats["a:2"] == 12.0


def test_lag_stats_bound_the_quantiles() -> None:
    stats = frontends.LagStats()
    for ms in [0.5] * 98 + [3.0, 40.0]:
        stats.add(ms / 1000)
    summary = stats.summary()
    assert summary["count"] == 100 and summary["p50_ms_le"] == 1 and summary["p99_ms_le"] == 5
    assert summary["max_ms"] == pytest.approx(40.0)


# ---- processes and sockets -------------------------------------------------------------------------------------
