"""``GrpcServer``: the Open Inference Protocol's gRPC binding, next to the HTTP server.

A ``grpc.aio`` server on the event loop the engine runs on, so a gRPC request is
queued, batched and answered exactly like an HTTP one (``runtime.server.grpc.handlers``)::

    grpc_server = GrpcServer(engine, version=VERSION)
    port = await grpc_server.start("0.0.0.0", 8001)   # after engine.start(); 0: any port
    ...
    await grpc_server.stop(grace_s=5.0)                # before engine.stop()

Its bounds: a request message of at most ``max_request_bytes`` and an answer of at
most ``max_message_bytes`` (a larger one is refused by gRPC itself with
RESOURCE_EXHAUSTED), and at most
``max_concurrent_rpcs`` calls at once (more are refused with RESOURCE_EXHAUSTED at
once, never queued). ``stop(grace_s)`` refuses new calls (UNAVAILABLE, at once; a
liveness call is still answered), gives those in flight up to ``grace_s`` to be
answered and then cancels the rest (their queued requests are taken out of the
engine's queue). The port is bound without ``SO_REUSEPORT``, so a port
already in use is an error rather than a silently shared one. Plaintext only (no TLS).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import grpc

from runtime.api.errors import ConfigError, ListenError
from runtime.server.auth import AuthConfig
from runtime.server.bounds import MemoryBudget
from runtime.server.grpc.handlers import InferenceHandlers
from runtime.server.kserve import MAX_DECODED_BYTES

#: the largest answer, as the HTTP server's largest request body
MAX_MESSAGE_BYTES = MAX_DECODED_BYTES
#: the largest request: gRPC parses a message whole, holding the interpreter lock on the
#: event loop (about 12 ms a MiB of typed values, which also grow up to 8x in memory), so
#: this bounds how long one call keeps every other client waiting, as
#: ``runtime.server.bounds.MAX_JSON_BYTES`` does for JSON (gRPC's own default; larger
#: tensors go over HTTP with the binary tensor extension, up to 64 MiB)
MAX_REQUEST_BYTES = 4 << 20
#: calls served at once; more are refused with RESOURCE_EXHAUSTED
MAX_CONCURRENT_RPCS = 4096
#: at stop, calls in flight get this long to be answered
GRACE_S = 5.0


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """Serves ``inference.GRPCInferenceService`` for ``engine``'s request models."""

    def __init__(self, engine: Any, *, version: str = "0.1.0",
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
                 generation: Iterable[str] = (), budget: MemoryBudget | None = None,
                 auth: AuthConfig | None = None) -> None:
        """``generation``: names of generation models served over HTTP, so a gRPC call
        to one is told where it is served; ``budget``: the memory of decoded requests,
        shared with the HTTP server's (``runtime.server.bounds``); ``auth``: who may
        change the trace settings (``runtime.server.auth``; default: loopback peers,
        no token; ``handlers.auth`` may be replaced before the server starts)."""
        for name, value in (("max_message_bytes", max_message_bytes),
                            ("max_request_bytes", max_request_bytes),
                            ("max_concurrent_rpcs", max_concurrent_rpcs)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        self.handlers = InferenceHandlers(engine, version=version, generation=generation,
                                          budget=budget, auth=auth)
        self.max_message_bytes = max_message_bytes
        self.max_request_bytes = min(max_request_bytes, max_message_bytes)
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind ``host:port`` (0: a free port) and serve; returns the bound port. Call on
        the engine's event loop, once."""
        if self._server is not None:
            raise RuntimeError("the gRPC server is already started")
        limit = self.max_message_bytes
        server = grpc.aio.server(
            handlers=[self.handlers.generic_handler()],
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", self.max_request_bytes),
                     ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0)])
        try:
            bound = server.add_insecure_port(_address(host, port))
        except RuntimeError as exc:
            raise ListenError(f"the gRPC server could not listen on "
                                  f"{_address(host, port)} ({exc}); is the port in use?") from None
        if not bound:
            raise ListenError(f"the gRPC server could not listen on {_address(host, port)}; "
                                  "is the port in use?")
        await server.start()
        self._server = server
        self.port = bound
        return bound

    async def stop(self, grace_s: float = GRACE_S) -> None:
        """Refuse new calls, let those in flight finish for up to ``grace_s``, cancel the
        rest. Does nothing when not started."""
        server = self._server
        if server is None:
            return
        self._server = None
        # the server goes on taking calls while those in flight finish, and refuses them
        # itself (UNAVAILABLE, at once): gRPC's own stop closes the port, so a call made
        # then may wait on a connection never answered until its deadline passes
        flight = self.handlers.flight
        flight.stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        await flight.drained(grace_s)
        await server.stop(max(0.0, end - loop.time()))
