"""A time limit on a request's headers: uvicorn's HTTP protocols with a timer from a request's first byte
(or the connection's opening) to the end of its headers.

uvicorn waits for headers forever: a client that opens connections and sends half a request line holds each
one, and enough of them hold the server (slowloris). The app cannot help, since it only sees a request once
its headers are in; --body-timeout covers what follows them. Past `header_timeout` seconds the client gets
408 with a JSON error and the connection closes, as nginx's client_header_timeout does.
"""

from __future__ import annotations

import asyncio
import json

from server.api.errors import error_body

HEADER_TIMEOUT_CODE = "header_timeout"


def timeout_answer(seconds: float) -> bytes:
    body = json.dumps(
        error_body(
            408,
            f"the request's headers did not all arrive within {seconds:g} s "
            "(--header-timeout); send the whole request line and headers at once",
            None,
            HEADER_TIMEOUT_CODE,
        )
    ).encode()
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


class HeaderTimer:
    """The timer of one connection: armed while headers are awaited, disarmed once they are in."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, transport: asyncio.Transport) -> None:
        if self.handle is None:
            self.handle = asyncio.get_running_loop().call_later(self.seconds, self._expire, transport)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expire(self, transport: asyncio.Transport) -> None:
        self.handle = None
        if not transport.is_closing():
            transport.write(timeout_answer(self.seconds))
            transport.close()


def protocol_with_header_timeout(seconds: float) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn's "auto" would pick (httptools when installed, else h11), with the limit."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return _h11_protocol(seconds)

    class HttpToolsWithHeaderTimeout(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = HeaderTimer(seconds)
            self.header_timer.arm(transport)

        def on_message_begin(self) -> None:  # the first byte of a request (the next one on a kept-alive connection)
            super().on_message_begin()
            self.header_timer.arm(self.transport)

        def on_headers_complete(self) -> None:
            self.header_timer.disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self.header_timer.disarm()
            super().connection_lost(exc)

    return HttpToolsWithHeaderTimeout


def _h11_protocol(seconds: float) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithHeaderTimeout(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = HeaderTimer(seconds)
            self.header_timer.arm(transport)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # headers not all in yet
                self.header_timer.arm(self.transport)
            else:
                self.header_timer.disarm()

        def connection_lost(self, exc) -> None:
            self.header_timer.disarm()
            super().connection_lost(exc)

    return H11WithHeaderTimeout
