"""The load generator's HTTP/1.1 client: a minimal keep-alive client (an
``asyncio.Protocol`` per connection, one future per request, ``Content-Length`` framing)
whose request bytes are prepared up front (``request_bytes``), so it costs little per
request; ``exchange`` resends once on a fresh connection when a kept-alive one was closed
while idle. ``fetch_metadata`` reads a model's v2 metadata with it."""

from __future__ import annotations

import asyncio
import socket
from typing import Any
from urllib.parse import urlsplit

import orjson

from batchscope.load.payloads import LoadError, item_metadata


def split_response(buf: bytes) -> tuple[int, bytes, bool, bytes] | None:
    """The first whole ``Content-Length`` response in ``buf``: (status, body, whether the
    server closes the connection after it, the bytes after it); None while it is
    incomplete. Raises ``ConnectionError`` for a response without ``Content-Length``."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].lower()
    at = head.find(b"content-length:")
    if at < 0:
        raise ConnectionError("response without Content-Length")
    stop = head.find(b"\r\n", at)
    size = int(head[at + 15:] if stop < 0 else head[at + 15:stop])
    total = end + 4 + size
    if len(buf) < total:
        return None
    return int(buf[9:12]), buf[end + 4:total], b"connection: close" in head, buf[total:]


class _ClientProtocol(asyncio.Protocol):
    """One keep-alive connection's reading side: frames ``Content-Length`` responses and
    hands each (status, body, close) to the future of the request waiting for it."""

    __slots__ = ("transport", "buf", "waiter", "lost")

    def __init__(self) -> None:
        self.transport: Any = None
        self.buf = b""
        self.waiter: asyncio.Future | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        try:
            framed = split_response(buf)
        except ConnectionError as exc:
            self._fail(exc)
            return
        if framed is None:
            self.buf = buf
            return
        status, body, close, self.buf = framed
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((status, body, close))

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("the server closed the connection"))


class KeepAlive:
    __slots__ = ("proto", "loop")

    def __init__(self, proto: _ClientProtocol, loop: asyncio.AbstractEventLoop) -> None:
        self.proto = proto
        self.loop = loop

    @classmethod
    async def open(cls, host: str, port: int) -> "KeepAlive":
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_ClientProtocol, host, port)
        return cls(proto, loop)

    async def send(self, request: bytes) -> tuple[int, bytes]:
        proto = self.proto
        if proto.lost is not None:
            raise ConnectionError("the connection is closed")
        waiter = self.loop.create_future()
        proto.waiter = waiter
        proto.transport.write(request)
        status, body, close = await waiter
        if close:
            self.close()
        return status, body

    def close(self) -> None:
        proto = self.proto
        if proto.lost is None:
            proto.lost = ConnectionError("closed by the client")
        try:
            proto.transport.close()
        except Exception:
            pass


TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, ValueError, ConnectionError)


async def exchange(conn: KeepAlive | None, host: str, port: int,
                    request: bytes) -> tuple[KeepAlive, int]:
    """Send on ``conn`` (or a new connection); returns the connection and the status.

    A kept-alive connection the server closed while it sat idle fails before any
    answer arrives; the request is then sent once more on a fresh connection.
    """
    if conn is not None:
        try:
            status, _ = await conn.send(request)
            return conn, status
        except (asyncio.IncompleteReadError, ConnectionError):
            conn.close()
    conn = await KeepAlive.open(host, port)
    try:
        status, _ = await conn.send(request)
    except BaseException:
        conn.close()
        raise
    return conn, status


def request_bytes(method: str, host: str, port: int, path: str, body: bytes) -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme != "http" or not parts.hostname:
        raise LoadError(f"--url {url!r} must look like http://127.0.0.1:8000")
    return parts.hostname, parts.port or 80


async def fetch_metadata(url: str, model: str) -> dict:
    """The model's v2 metadata, shapes of one item (see ``item_metadata``)."""
    host, port = split_url(url)

    async def get(path: str) -> tuple[int, bytes]:
        conn = await asyncio.wait_for(KeepAlive.open(host, port), 10)
        try:
            return await asyncio.wait_for(
                conn.send(request_bytes("GET", host, port, path, b"")), 30)
        finally:
            conn.close()

    try:
        status, body = await get(f"/v2/models/{model}")
        config_status, config = await get(f"/v2/models/{model}/config") if status == 200 \
            else (0, b"")
    except (OSError, asyncio.TimeoutError) as exc:
        raise LoadError(f"cannot reach {url} ({type(exc).__name__}: {exc}); is "
                        "`batchscope serve` running there?") from None
    if status != 200:
        try:  # a KServe server says why in JSON; another server's page is not repeated
            why = str(orjson.loads(body)["error"])[:200]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise LoadError(f"{url} answered HTTP {status} to GET /v2/models/{model}, and not "
                            "in KServe's JSON: is it a `batchscope serve` (or another KServe "
                            "v2) server?") from None
        raise LoadError(f"model {model!r} is not served at {url} (HTTP {status}: {why})")
    try:
        config_doc = orjson.loads(config) if config_status == 200 else None
    except orjson.JSONDecodeError:
        config_doc = None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise LoadError(f"{url} answered GET /v2/models/{model} with something other than "
                        "JSON: is it a `batchscope serve` (or another KServe v2) server?"
                        ) from None
    return item_metadata(doc, config_doc if isinstance(config_doc, dict) else None)
