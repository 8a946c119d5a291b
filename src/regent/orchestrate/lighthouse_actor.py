"""LighthouseActor: runs the Lighthouse in its own process and reports its address.

The process can be killed (the `lighthouse` chaos fault, or a real crash): the orchestrator then starts a new
LighthouseActor on the same bind address and state file, and the trainers' Lighthouse clients reconnect by
themselves (regent.ft.lighthouse_client retries while it is down).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from regent.actor import Actor, endpoint

logger = logging.getLogger(__name__)


class LighthouseActor(Actor):
    def __init__(self) -> None:
        self._server: Any = None

    @endpoint
    def start_lighthouse(self, bind: str, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int,
                         heartbeat_timeout_ms: int, state_file: str | None = None,
                         bind_retry_s: float = 0.0, expect_groups: list[str] | None = None,
                         expect_within_s: float = 60.0, frontends: int | None = None,
                         seed_committed: tuple[int, int] | None = None,
                         holder_grace_ms: int = 2000, late_member_ms: int = 0) -> dict[str, str]:
        """Start (once) and return the addresses. `state_file` keeps quorum ids increasing if the Lighthouse is
        started again for the same run. `bind_retry_s`: a fixed port may still be held for a moment by the
        Lighthouse that was just killed; keep trying to bind it that long. `expect_groups`: the replica groups the
        first quorum of a fresh run waits for (at most `expect_within_s`). `frontends`: serve gRPC from that many
        front-end processes (`regent.ft.frontends`; None: `$REGENT_LIGHTHOUSE_FRONTENDS`, default 0).
        `seed_committed`: the highest (manager step, lineage) the controller saw committed, `holder_grace_ms` how
        long a fast quorum waits for a just-healed replica, `late_member_ms` how long a late member of the last
        quorum is waited for (all three: see `LighthouseServer`)."""
        from regent.ft.lighthouse import LighthouseServer

        deadline = time.monotonic() + bind_retry_s
        while self._server is None:
            try:
                self._server = LighthouseServer(
                    bind=bind,
                    min_replicas=min_replicas,
                    join_timeout_ms=join_timeout_ms,
                    quorum_tick_ms=quorum_tick_ms,
                    heartbeat_timeout_ms=heartbeat_timeout_ms,
                    state_file=state_file,
                    expect_groups=expect_groups,
                    expect_within_s=expect_within_s,
                    frontends=frontends,
                    seed_committed=tuple(seed_committed) if seed_committed else None,
                    holder_grace_ms=holder_grace_ms,
                    late_member_ms=late_member_ms,
                )
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise
                logger.info("binding the Lighthouse to %s: %s; retrying", bind, exc)
                time.sleep(0.2)
        step, lineage = self._server.committed_watermark()
        return {"address": self._server.address(), "dashboard": self._server.dashboard_url(),
                "committed_step": step, "committed_lineage": lineage}

    @endpoint
    def pid(self) -> int:
        """This process's id: the `lighthouse` fault kills it from outside, as a crash would."""
        return os.getpid()

    @endpoint
    def forget_replicas(self, replica_ids: list[str]) -> list[str]:
        """These replicas' processes are dead: stop counting them healthy now (see `regent.ft.quorum`)."""
        return self._server.forget_replicas(replica_ids) if self._server is not None else []

    @endpoint
    def status(self) -> dict[str, Any]:
        return self._server.status() if self._server is not None else {}

    @endpoint
    def stop_lighthouse(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __cleanup__(self, exc: Exception | None) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
