"""LighthouseActor: runs the Lighthouse in its own process and reports its address."""

from __future__ import annotations

from typing import Any

from regent.actor import Actor, endpoint


class LighthouseActor(Actor):
    def __init__(self) -> None:
        self._server: Any = None

    @endpoint
    def start_lighthouse(self, bind: str, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int,
              heartbeat_timeout_ms: int, state_file: str | None = None) -> dict[str, str]:
        """Start (once) and return the addresses. `state_file` keeps quorum ids increasing if the Lighthouse is
        started again for the same run."""
        from regent.ft.lighthouse import LighthouseServer

        if self._server is None:
            self._server = LighthouseServer(
                bind=bind,
                min_replicas=min_replicas,
                join_timeout_ms=join_timeout_ms,
                quorum_tick_ms=quorum_tick_ms,
                heartbeat_timeout_ms=heartbeat_timeout_ms,
                state_file=state_file,
            )
        return {"address": self._server.address(), "dashboard": self._server.dashboard_url()}

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
