"""`Port`: the sending end of a channel (and of an explicit-port endpoint's reply), picklable to any process.

In the actor layer, below meshes: a cell gives one to an endpoint that asked for its response port.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

from regent.actor._context import current_rank
from regent.actor._errors import ActorError, SupervisionError, format_remote_traceback
from regent.actor._messages import ReplyMsg, encode
from regent.actor._pickle import dumps
from regent.actor._process import get_runtime
from regent.actor._runtime import ERROR, OK, learn_addresses

logger = logging.getLogger("regent.actor")
R = TypeVar("R")


class Port(Generic[R]):
    """The sending end of a channel. `send` is in order and fire-and-forget; picklable (pass it to actors)."""

    def __init__(self, proc_id: str, port_id: int, index: int | None = None) -> None:
        self._proc_id = proc_id
        self._port_id = port_id
        self._index = index

    @property
    def return_undeliverable(self) -> bool:
        return True

    def _index_now(self) -> int:
        if self._index is not None:
            return self._index
        try:
            return current_rank().rank
        except Exception as exc:  # noqa: BLE001 - reported; a send must not fail for want of a rank
            logger.warning("port %s: the sender's rank is unknown (%s); sending as rank 0", self._port_id, exc)
            return 0

    def send(self, obj: R) -> None:
        body, buffers = dumps(obj)
        self._emit(OK, body, buffers)

    def exception(self, exc: BaseException) -> None:
        if isinstance(exc, (ActorError, SupervisionError)):
            payload = (exc, str(exc), "")
        else:
            payload = (exc, "An exception was sent to a port.", format_remote_traceback(exc))
        body, buffers = dumps(payload)
        self._emit(ERROR, body, buffers)

    def _emit(self, status: int, body: Any, buffers: list) -> None:
        rt = get_runtime()
        env = encode(ReplyMsg(self._port_id, self._index_now(), status))
        rt.run_on_loop(rt.send_raw, self._proc_id, env, body, buffers)

    def __reduce__(self):
        rt = get_runtime()
        return (_rebuild_port, (self._proc_id, self._port_id, self._index, rt.directory.get(self._proc_id),
                                rt.info))

    def __repr__(self) -> str:
        return f"<Port {self._proc_id}:{self._port_id}>"


def _rebuild_port(proc_id: str, port_id: int, index: int | None, info: dict | None,
                  referrer: dict | None = None) -> Port:
    learn_addresses(get_runtime(), {proc_id: info}, referrer, "Port")
    return Port(proc_id, port_id, index)


class DroppingPort:
    """The port of an explicit-port endpoint called without a reply (broadcast): sends go nowhere."""

    def send(self, obj: Any) -> None:
        pass

    def exception(self, exc: BaseException) -> None:
        raise exc
