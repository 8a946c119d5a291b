"""Log records say which actor emitted them (`config.prefix_python_logs_with_actor`, Monarch's knob): inside an
actor its instance, in the client outside any actor `<root>`, in a proc or worker outside actors nothing."""

import contextvars
import logging

import pytest

import regent.actor  # noqa: F401 - importing the package installs the prefix for this (client) process
from regent.actor import config
from regent.actor._context import ROOT_LABEL, Instance, install_log_prefix, set_current
from regent.actor._shape import Extent, Point


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def log():
    logger = logging.getLogger("regent.test.log_prefix")
    logger.propagate = False
    keep = Keep()
    logger.addHandler(keep)
    yield logger, keep.messages
    logger.removeHandler(keep)


def test_the_client_outside_actors_is_root_and_the_knob_turns_it_off(log, monkeypatch):
    logger, seen = log
    logger.error("HUH %d", 1)
    logger.error("")  # an empty message stays empty (torch.compile's structured trace logs empty records)
    monkeypatch.setattr(config, "prefix_python_logs_with_actor", False)
    logger.error("plain")
    assert seen == ["[actor=<root>] HUH 1", "", "plain"]


def test_inside_an_actor_its_instance(log):
    logger, seen = log
    named = Instance("k1", "the_name", "mod.Named", Point(0, Extent(["f"], [2])), proc=None)

    def inside() -> None:
        set_current(named, named.rank)
        logger.error("HUH")

    contextvars.copy_context().run(inside)
    assert seen == ["[actor=<root>.<mod.Named the_name{'f': 0/2}>] HUH"]


def test_a_proc_or_worker_leaves_its_own_records_as_written(log):
    logger, seen = log
    install_log_prefix(None)
    try:
        logger.error("own")
    finally:
        install_log_prefix(ROOT_LABEL)
    logger.error("client")
    assert seen == ["own", "[actor=<root>] client"]
