"""A request body's ``Content-Encoding`` undone before it is decoded.

A body sent with ``Content-Encoding: gzip`` or ``deflate`` (zlib or raw) is inflated
first, up to ``MAX_DECODED_BYTES`` (more is a ``RequestTooLarge``, 413).
"""

from __future__ import annotations

import zlib

from runtime.api.errors import ClientError, RequestTooLarge, UnsupportedEncoding

#: the most bytes a compressed request body may inflate to (the HTTP server's own
#: body limit, ``runtime.server.http1.MAX_BODY_BYTES``)
MAX_DECODED_BYTES = 64 * 1024 * 1024


def decoded_body(body: bytes, content_encoding: str | None,
                 limit: int = MAX_DECODED_BYTES) -> bytes:
    """``body`` without the codings ``content_encoding`` names (gzip, deflate, identity,
    applied in the order listed); at most ``limit`` bytes, else ``RequestTooLarge``."""
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip"):
            body = _inflate(body, 16 + zlib.MAX_WBITS, "gzip", limit)
        elif coding == "deflate":
            zlib_header = (len(body) >= 2 and body[0] & 0x0F == 8
                           and (body[0] << 8 | body[1]) % 31 == 0)
            body = _inflate(body, zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS,
                            "deflate", limit)
        else:
            raise UnsupportedEncoding(f"Content-Encoding {coding!r} is not supported; send the "
                                      "body uncompressed, or compressed with gzip or deflate")
    return body


INFLATE_SLICE_BYTES = 1 << 20


def _inflate(data: bytes, wbits: int, coding: str, limit: int) -> bytes:
    """Inflate ``data`` (several gzip members one after the other, too), at most ``limit``
    bytes out, in slices of ``INFLATE_SLICE_BYTES``: zlib lets go of the GIL while it
    works, and the slices keep any one hold on it short, so a bomb costs the event loop
    nothing and stops at ``limit`` + 1 bytes."""
    parts: list[bytes] = []
    total = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        pending = data
        while True:
            try:
                out = inflater.decompress(pending, min(INFLATE_SLICE_BYTES, limit - total + 1))
            except zlib.error as exc:
                raise ClientError(f"the request body is not valid {coding} data ({exc}); "
                                  f"send it compressed with {coding}, or drop "
                                  "Content-Encoding") from None
            total += len(out)
            if total > limit:
                raise RequestTooLarge(f"the {coding}-compressed request body inflates to more "
                                      f"than this server accepts ({limit} bytes); send a "
                                      "smaller request")
            parts.append(out)
            pending = inflater.unconsumed_tail
            if inflater.eof or (not pending and not out):
                break
        if not inflater.eof:
            raise ClientError(f"the {coding}-compressed request body ends before its "
                              "compressed stream does; send the whole body")
        data = inflater.unused_data
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if coding != "gzip":
            raise ClientError(f"the request body has {len(data)} bytes after its {coding} "
                              "stream; send exactly one compressed stream")
