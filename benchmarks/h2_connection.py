"""The candidate replacement of `grpc_lite._Connection`: the same server with the `h2` library's HTTP/2 state
machine, to measure what that costs per heartbeat (issue 34: replace `_Connection` with `h2` unless it costs more
than 20% CPU per heartbeat).

    .venv/bin/python benchmarks/scale_bench.py --only steady --groups 1024 --servers regent regent-h2 torchft

`scale_bench.py` starts `python benchmarks/h2_connection.py --serve PORT` for the `regent-h2` server: a Regent
Lighthouse (`regent.ft.lighthouse.LighthouseServer`, the same handlers, same authenticator) whose `grpc_lite.Server`
makes `H2Connection`s instead of `_Connection`s. Everything above the connection (dispatch to handlers, the
Lighthouse) is the same code, so the difference measured is the connection's.

What it does per call, like `_Connection`: decode the request headers (h2 + hpack), run the authenticator when set,
honour `grpc-timeout`, check the gRPC length prefix, run the handler (bytes or an awaitable), answer headers +
message + trailers under flow control, cancel the handler on RST_STREAM or a lost connection. What it leaves out
(it is a measurement, not a server to ship): the abuse limits of `grpc_lite.Limits` (h2 enforces the protocol,
not rates), the header decode cache and pre-encoded response headers (h2 encodes every block).
Needs `h2` (`pip install h2`); it is not a dependency of Regent.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from regent.ft import grpc_lite

RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
OK_TRAILERS = [(b"grpc-status", b"0")]
CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    # grpc_lite checks what it reads itself; h2's per-header validation is off to give h2 its best case.
    validate_inbound_headers=False, normalize_inbound_headers=False,
    validate_outbound_headers=False, normalize_outbound_headers=False,
)


class _Call:
    __slots__ = ("path", "headers", "deadline", "body", "task", "pending", "trailers")

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers
        self.path = b""
        self.deadline: float | None = None
        for name, value in headers:
            if name == b":path":
                self.path = value
            elif name == b"grpc-timeout":
                seconds = grpc_lite.parse_timeout(value)
                self.deadline = None if seconds is None else time.monotonic() + seconds
        self.body = bytearray()
        self.task: asyncio.Future | None = None
        self.pending = b""
        self.trailers: list[tuple[bytes, bytes]] = []


class H2Connection(asyncio.Protocol):
    """One client connection of a `grpc_lite.Server`, its HTTP/2 handled by `h2`."""

    def __init__(self, server: grpc_lite.Server) -> None:
        self._server = server
        self._h2 = h2.connection.H2Connection(CONFIG)
        self._calls: dict[int, _Call] = {}
        self._transport: asyncio.Transport | None = None
        self._peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if peer:
            self._peer = f"{peer[0]}:{peer[1]}"
        self._server._connections.add(self)  # type: ignore[arg-type]
        self._h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: grpc_lite.MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: grpc_lite.RECV_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: grpc_lite.MAX_HEADER_BLOCK,
        })
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(grpc_lite.RECV_WINDOW - grpc_lite.DEFAULT_WINDOW)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)  # type: ignore[arg-type]
        for call in self._calls.values():
            if call.task is not None:
                call.task.cancel()
        self._calls.clear()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError:  # h2 has queued the GOAWAY that says why: send it and close
            self._flush()
            if self._transport is not None:
                self._transport.close()
            return
        for event in events:
            kind = type(event)
            if kind is h2.events.RequestReceived:
                self._on_request(event.stream_id, event.headers)
            elif kind is h2.events.DataReceived:
                call = self._calls.get(event.stream_id)
                if call is not None:
                    call.body += event.data
                if event.flow_controlled_length:
                    self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif kind is h2.events.StreamEnded:
                call = self._calls.get(event.stream_id)
                if call is not None:
                    self._dispatch(event.stream_id, call)
            elif kind is h2.events.StreamReset:
                call = self._calls.pop(event.stream_id, None)
                if call is not None and call.task is not None:
                    call.task.cancel()
            elif kind is h2.events.WindowUpdated:
                self._send_pending()
        self._flush()

    def _on_request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        call = _Call(headers)
        self._calls[stream_id] = call
        authenticate = self._server.authenticate
        if authenticate is not None:
            refusal = authenticate(call.path, headers, self._peer)
            if refusal is not None:
                self._finish(stream_id, grpc_lite.StatusCode.UNAUTHENTICATED, refusal)

    def _dispatch(self, stream_id: int, call: _Call) -> None:
        handler = self._server._handlers.get(call.path)
        if handler is None:
            self._finish(stream_id, grpc_lite.StatusCode.UNIMPLEMENTED, "unknown method")
            return
        body = call.body
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5 or body[0]:
            self._finish(stream_id, grpc_lite.StatusCode.INVALID_ARGUMENT, "not one uncompressed gRPC message")
            return
        if call.deadline is not None and call.deadline <= time.monotonic():
            self._finish(stream_id, grpc_lite.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            return
        try:
            result = handler(bytes(body[5:]), call.deadline)
        except grpc_lite.RpcStatusError as err:
            self._finish(stream_id, err.code, err.message)
            return
        if isinstance(result, (bytes, bytearray)):
            self._respond(stream_id, bytes(result))
            return
        call.task = asyncio.ensure_future(result)
        call.task.add_done_callback(lambda task, sid=stream_id: self._task_done(sid, task))

    def _task_done(self, stream_id: int, task: asyncio.Future) -> None:
        if stream_id not in self._calls:
            return
        if task.cancelled():
            self._finish(stream_id, grpc_lite.StatusCode.CANCELLED, "cancelled")
        elif isinstance(task.exception(), grpc_lite.RpcStatusError):
            err = task.exception()
            self._finish(stream_id, err.code, err.message)  # type: ignore[union-attr]
        elif task.exception() is not None:
            self._finish(stream_id, grpc_lite.StatusCode.UNKNOWN, str(task.exception()))
        else:
            self._respond(stream_id, task.result())
        self._flush()

    def _finish(self, stream_id: int, code: grpc_lite.StatusCode, message: str) -> None:
        self._calls.pop(stream_id, None)
        headers = [*RESPONSE_HEADERS, (b"grpc-status", str(int(code)).encode())]
        if message:
            headers.append((b"grpc-message", grpc_lite.percent_encode(message)))
        try:
            self._h2.send_headers(stream_id, headers, end_stream=True)
        except h2.exceptions.StreamClosedError:  # the client reset it meanwhile: nobody to tell
            pass

    def _respond(self, stream_id: int, payload: bytes) -> None:
        call = self._calls.get(stream_id)
        if call is None:
            return
        self._h2.send_headers(stream_id, RESPONSE_HEADERS)
        call.pending = b"\x00" + len(payload).to_bytes(4, "big") + payload
        call.trailers = OK_TRAILERS
        self._send_pending()

    def _send_pending(self) -> None:
        """Send what flow control allows of each waiting response; a finished one gets its trailers."""
        for stream_id, call in list(self._calls.items()):
            if not call.trailers:
                continue
            while call.pending:
                size = min(len(call.pending), self._h2.local_flow_control_window(stream_id),
                           self._h2.max_outbound_frame_size)
                if size <= 0:
                    break
                self._h2.send_data(stream_id, call.pending[:size])
                call.pending = call.pending[size:]
            if not call.pending:
                self._h2.send_headers(stream_id, call.trailers, end_stream=True)
                del self._calls[stream_id]

    def shut_down(self) -> None:
        self._h2.close_connection()
        self._flush()
        if self._transport is not None:
            self._transport.close()


def serve(port: int) -> None:
    """A Lighthouse on 127.0.0.1:`port` whose gRPC connections are `H2Connection`s, until SIGTERM."""
    from regent.ft.lighthouse import LighthouseServer

    grpc_lite._Connection = H2Connection  # type: ignore[misc]  # Server.start makes `_Connection(self)` per client
    server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=60000)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", type=int, required=True, metavar="PORT")
    serve(parser.parse_args(argv).serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
