"""Read timeouts for slow clients: uvicorn's h11 protocol with a deadline on reading each request.

uvicorn times out only an idle keep-alive connection (``timeout_keep_alive``); a client that sends its headers one
byte a second (slowloris), or stops halfway through its body, holds a connection and its task forever. As nginx's
``client_header_timeout`` and ``client_body_timeout``: a request's headers must arrive in full within
``read_timeout`` seconds of its first byte (of the connection, for the first request), and its body may pause at
most ``read_timeout`` seconds between two reads. A connection past either is closed (headers: after a 408 answer;
body: the route sees a disconnect). Time the server itself spends not reading (flow control, while a route has not
yet read the body it has) is not counted against the client.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("mlx_engine.server")

_408 = b"request headers not received in time\n"
_408_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(_408), _408))


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with the read deadlines of the module docstring (``read_timeout``, seconds)."""

    read_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        self._phase = ""  # "headers" or "body": what the running deadline is for
        super().connection_made(transport)
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:  # (part of) the headers of a request
            if self._phase != "headers":
                self._arm("headers")  # one deadline for all of them: a byte a second does not extend it
        elif self.conn.their_state is h11.SEND_BODY:
            self._arm("body")  # the longest pause between two reads
        else:
            self._disarm()  # the request is in (or the connection is done with)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        self._read_timer = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._phase = None, ""

    def _expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server is not reading (its buffer is full): not the client's delay
            self._arm(self._phase)
            return
        client = "%s:%d" % self.client if self.client else "a client"
        log.info("closing the connection of %s: its request %s did not arrive within the read timeout (%g s)",
                 client, "headers" if self._phase == "headers" else "body", self.read_timeout)
        if self._phase == "headers" and self.conn.our_state is h11.IDLE:
            self.transport.write(_408_RESPONSE)
        self._phase = ""
        self.transport.close()


def read_timeout_protocol(seconds: float) -> type[ReadTimeoutProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with a read timeout of ``seconds``."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout": float(seconds)})
