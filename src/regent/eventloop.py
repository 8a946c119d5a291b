"""The one way Regent makes an asyncio event loop (no torch, no actors: shared by `regent.actor`'s runtime and
`regent.ft`'s Lighthouse).

uvloop when it is installed (the `fast` extra): it shortens every socket hop through the loop, which is most of
an actor message's and a Lighthouse heartbeat's cost. `REGENT_NO_UVLOOP=1` forces the default asyncio loop, to
rule uvloop out when a loop misbehaves or to measure what it buys.
"""

from __future__ import annotations

import asyncio

from regent import settings

NO_UVLOOP_ENV = settings.REGENT_NO_UVLOOP.name


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed and `$REGENT_NO_UVLOOP` is not set, else the default asyncio loop."""
    if not settings.REGENT_NO_UVLOOP.get():
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
