"""Stand-ins for the runtime's event loop in tests that drive runtime parts without processes."""

from __future__ import annotations


class FakeLoop:
    """Records `call_later` timers instead of running them: a test fires them when it chooses."""

    def __init__(self):
        self.timers = []

    def call_later(self, delay, fn, *args):
        self.timers.append((delay, fn, args))
