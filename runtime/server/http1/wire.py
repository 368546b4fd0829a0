"""What the connection, the server and the ASGI bridge share: one request's state
(``Exchange``), the status lines and the ``Date`` header of answers, the refusal
that stops a parse, and the signatures of the hooks a server is given."""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Callable

from runtime.api.errors import MethodNotAllowed
from runtime.server.http1.limits import ALLOW

Answer = Callable[[int, list[tuple[bytes, bytes]], bytes], None]
#: (connection, method, path, headers, body, answer) -> True when it took the request
FastHook = Callable[[Any, bytes, str, list[tuple[bytes, bytes]], bytes, Answer], bool]
#: the optional ``early`` method of a fast hook: (method, path, headers) -> answer or None
EarlyHook = Callable[[bytes, str, list[tuple[bytes, bytes]]],
                     "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]
#: the optional ``edge`` method: (raw request target of a POST) -> answer or None
EdgeHook = Callable[[bytes], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]
#: ``drain``'s hook: (method, path) of a request arriving while draining -> its refusal,
#: or None to serve it as usual
DrainHook = Callable[[bytes, str], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]


class Dropped:
    """Stands in for an exchange's body list when the body is read only to be dropped."""

    __slots__ = ()

    def append(self, data: bytes) -> None:
        pass


DROPPED = Dropped()


def _status_lines() -> dict[int, bytes]:
    return {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode() for s in HTTPStatus}


STATUS_LINES = _status_lines()


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} \r\n".encode()


class Clock:
    """The Date header, refreshed once per tick instead of formatted per response."""

    __slots__ = ("header",)

    def __init__(self) -> None:
        self.header = b""
        self.refresh()

    def refresh(self) -> bool:
        """Format the header for now; True when it changed (a new second)."""
        header = b"date: " + formatdate(time.time(), usegmt=True).encode() + b"\r\n"
        changed = header != self.header
        self.header = header
        return changed


class Exchange:
    """One request on a connection: its parsed head, body and response state."""

    __slots__ = ("method", "url", "headers", "body", "version", "keep_alive", "expect_continue",
                 "complete", "head_sent", "finished", "buffered", "chunked", "is_head",
                 "disconnect", "continue_sent", "reserved", "hosts")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.method = b""
        self.version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.continue_sent = False
        self.complete = False
        self.head_sent = False
        self.finished = False
        #: response bytes written while an earlier exchange still answers
        self.buffered: list[bytes] = []
        self.chunked = False
        self.is_head = False
        #: resolved when the client goes away or the response is done (ASGI receive)
        self.disconnect: asyncio.Future | None = None
        #: body bytes counted against the server's in-flight budget until it finishes
        self.reserved = 0
        #: Host header fields seen (HTTP/1.1 wants exactly one)
        self.hosts = 0


class Refused(Exception):
    """Raised out of a parser callback to stop parsing after a refusal was answered."""


def unsupported_method(method: bytes) -> MethodNotAllowed:
    name = method.decode("latin-1")
    why = "this server is not a proxy" if method == b"CONNECT" else "this server does not serve it"
    return MethodNotAllowed(f"{name} is not supported: {why}; it serves {', '.join(ALLOW)}",
                            allow=ALLOW)
