"""What one request may make the server do, bounded before the server does it.

A count read from a request (a dimension, a number of items, prompts or choices, a
binary size) must never drive an allocation or a loop before it is checked. Every
decoder checks the counts a request *declares* against the bounds here first, in time
independent of the declared size, and only then converts or allocates anything:

* ``RequestBounds`` — what one model accepts per request: at most ``max_items`` items
  (a batch dimension, the inputs of ``/v1/embeddings``; the model's ``max_queue_size``,
  never more than ``MAX_REQUEST_ITEMS``) and, for a model that declares one, at most
  ``max_length`` along every variable dimension.
* ``MAX_JSON_BYTES`` — the JSON a request may ask the server to parse. Parsing holds
  the interpreter lock for its whole length (about 12 ms a MiB of numbers here, and
  turning the values into arrays as much again), so this bounds how long one request
  can keep the event loop from every other client, and how much memory a parse makes
  (Python objects cost up to ~40 bytes per byte of JSON). Larger tensors go in the
  binary tensor extension, which costs one copy.
* ``MemoryBudget`` — the bytes the arrays of the requests being decoded and served
  hold together. A request reserves what its declared shapes will allocate
  (``tensor_bytes``, ``ITEM_BYTES`` per item) before the values are converted, and
  gives it back when it is answered. More than ``per_request_bytes`` for one request
  is a 413; a reservation that would take the total past ``total_bytes`` is a 507 with
  ``Retry-After`` (the server is holding as much as it will; the request is fine).

The HTTP server's own limits (``runtime.server.http1``: body size, bytes in flight,
header count and size, URL length) bound what arrives; these bound what it becomes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from runtime.api.config import MAX_REQUEST_ITEMS
from runtime.api.errors import InsufficientMemory, RequestTooLarge

#: the most bytes of JSON one request may ask the server to parse
MAX_JSON_BYTES = 4 << 20
#: the most bytes the arrays of one request may hold
PER_REQUEST_BYTES = 256 << 20
#: the most bytes the arrays of every request being decoded or served may hold together
TOTAL_BYTES = 1 << 30
#: what one item of a request costs besides its values (its dict of views, its queue entry)
ITEM_BYTES = 512
#: what one element of a BYTES tensor costs besides its bytes (a bytes object, its slot)
OBJECT_ELEMENT_BYTES = 48
#: seconds a client is told to wait when the budget is full
RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class RequestBounds:
    """What one model accepts in one request."""

    #: items per request (a batch dimension, a list of inputs), 1 ... MAX_REQUEST_ITEMS
    max_items: int = MAX_REQUEST_ITEMS
    #: the most along any variable dimension of one item; None: the data bounds it
    max_length: int | None = None

    @classmethod
    def of(cls, max_queue_size: int, max_length: int | None) -> "RequestBounds":
        return cls(max(1, min(max_queue_size, MAX_REQUEST_ITEMS)), max_length)


def check_json_size(size: int, what: str, remedy: str) -> None:
    """Refuse (413) ``size`` bytes of JSON over ``MAX_JSON_BYTES``."""
    if size > MAX_JSON_BYTES:
        raise RequestTooLarge(f"{what} is {size} bytes of JSON, more than the {MAX_JSON_BYTES} "
                              f"bytes this server parses per request; {remedy}")


def tensor_bytes(datatype_itemsize: int, count: int, raw_bytes: int = 0) -> int:
    """Bytes an array of ``count`` elements will hold: ``count`` x the item size, or for
    BYTES (item size 0) an object per element plus the ``raw_bytes`` they are made of."""
    if datatype_itemsize:
        return count * datatype_itemsize
    return count * OBJECT_ELEMENT_BYTES + raw_bytes


def itemsize(np_dtype: object) -> int:
    """The bytes per element of a numpy dtype, 0 for object (BYTES)."""
    dt = np.dtype(np_dtype)
    return 0 if dt.kind == "O" else dt.itemsize


class Reservation:
    """Bytes held in a ``MemoryBudget`` until ``release`` (which may be called twice)."""

    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: "MemoryBudget", nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self.budget._give_back(nbytes)


class MemoryBudget:
    """The bytes the requests being decoded and served hold, in all (thread-safe: large
    bodies are parsed on a parser thread)."""

    def __init__(self, per_request_bytes: int = PER_REQUEST_BYTES,
                 total_bytes: int = TOTAL_BYTES) -> None:
        if not 0 < per_request_bytes <= total_bytes:
            raise ValueError("need 0 < per_request_bytes <= total_bytes")
        self.per_request_bytes = per_request_bytes
        self.total_bytes = total_bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        #: refusals: one request over ``per_request_bytes`` / the total full
        self.refused_too_large = 0
        self.refused_full = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> Reservation:
        """Hold ``nbytes`` for ``what`` (a request, in words), or refuse: 413 when one
        request may not hold that much, 507 (with ``Retry-After``) when the server holds
        as much as it will right now."""
        if nbytes > self.per_request_bytes:
            with self._lock:
                self.refused_too_large += 1
            raise RequestTooLarge(
                f"{what} would hold {nbytes} bytes once decoded, more than the "
                f"{self.per_request_bytes} bytes one request may; send fewer or smaller "
                "tensors per request")
        with self._lock:
            held = self.held_bytes + nbytes
            if held > self.total_bytes:
                self.refused_full += 1
                raise InsufficientMemory(
                    f"the server holds {self.held_bytes} bytes of decoded requests and room "
                    f"for {self.total_bytes - self.held_bytes} more; {what} needs {nbytes}. "
                    f"Retry in about {RETRY_AFTER_S:g}s", retry_after_s=RETRY_AFTER_S)
            self.held_bytes = held
            if held > self.peak_bytes:
                self.peak_bytes = held
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes -= nbytes
