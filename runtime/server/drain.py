"""Draining: what a serving process does between SIGTERM (or SIGINT, or
``Service.request_exit()``) and its exit.

The drain timeout bounds all of it: ``ServerConfig.drain_timeout_s`` (``batchscope
serve --drain-timeout-s``, default ``DRAIN_TIMEOUT_S`` = 5 s) from the signal until
``Service.serve`` returns, and ``batchscope serve`` exits right after
(``runtime.tools.cli.run_service``). Within it, two phases:

1. Draining, until nothing is owed an answer, for at most the timeout less
   ``stop_reserve_s``: the HTTP server keeps listening and reading
   (``HttpServer.drain``), and answers every request that arrives from now on with
   ``refusal``: a 503 ``shutting_down`` with ``Retry-After`` and ``Connection: close``,
   in OpenAI's error shape under ``/v1/`` and as ``{"error": ...}`` elsewhere, all
   built by ``runtime.api.errors.error_answer``; only ``GET /v2/health/live`` is still
   answered as usual (the process is alive until it exits; readiness is refused).
   Requests taken in before go on as usual: KServe requests are batched and
   answered, streamed and whole completions keep generating. The gRPC server refuses
   new calls and lets those in flight finish.
2. Stopping, in the reserve: whatever still runs is ended with an answer of its own.
   A generation still under way ends with ``ShuttingDown``: a stream that has sent its
   status line gets a last ``data: {"error": ...}`` event and ``data: [DONE]``, any
   other request a 503. Requests still queued for a request model are answered 503
   (``Engine.stop``). The last answers are written out, every connection is closed
   (``HttpServer.shutdown``), then the rest of ``Service.shutdown`` runs (recorder,
   live link).

Before this, the HTTP server closed every connection still busy 5 s after the signal
and only then stopped the generation engines, so a stream that outlived those 5 s
was cut without a last event (and the process exited 7 s after the signal), and new
requests met a closed socket or a closed connection instead of an answer.
"""

from __future__ import annotations

import asyncio

from runtime.api.errors import Answer, ShuttingDown, error_answer
from runtime.server.openai_errors import openai_answer

#: the default drain timeout, seconds (``ServerConfig.drain_timeout_s``)
DRAIN_TIMEOUT_S = 5.0
#: of the drain timeout, at most this much is kept for stopping (phase 2): ending the
#: generations still running, writing the last answers, stopping the engines and
#: the device process (0.2-0.4 s on a 2-vCPU machine), the recorder and live link
STOP_RESERVE_S = 1.0
#: ... and never more than this share of it
STOP_RESERVE_SHARE = 0.4
#: of the reserve, this much is kept after the engines stop and the connections close,
#: for the rest of ``Service.shutdown`` (recorder, live link)
STOP_FINAL_S = 0.25
#: ``Retry-After`` on the refusals while draining: this instance is going away, so
#: the least there is, for a client (or load balancer) to go elsewhere
RETRY_AFTER_S = 1.0
#: answered as usual while draining (the process is alive)
LIVE_PATHS = frozenset({"/v2/health/live"})

_MESSAGE = ("the server is shutting down and takes no new requests; send this request "
            "again to another instance, or to this address once the server is back")
_answers: dict[bool, Answer] = {}


def refusal(method: bytes, path: str) -> Answer | None:
    """The answer to a request that arrives while the server drains (the hook of
    ``HttpServer.drain``): 503 with ``Retry-After``, OpenAI-shaped under ``/v1``;
    None (served as usual) for the liveness probe."""
    if path in LIVE_PATHS and method in (b"GET", b"HEAD"):
        return None
    openai = path == "/v1" or path.startswith("/v1/")
    answer = _answers.get(openai)
    if answer is None:
        error = ShuttingDown(_MESSAGE, retry_after_s=RETRY_AFTER_S)
        where = "a request while draining"
        answer = openai_answer(error, where) if openai else error_answer(error, where)
        _answers[openai] = answer  # the same headers list each time: its head is cached
    return answer


class DrainClock:
    """The deadlines of one drain, on the event loop's clock, from when it began."""

    def __init__(self, timeout_s: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.began = self.loop.time()
        #: when ``serve()`` must be done
        self.deadline = self.began + timeout_s
        #: when draining ends and stopping begins, whatever is still running
        self.stop_at = self.deadline - min(STOP_RESERVE_S, STOP_RESERVE_SHARE * timeout_s)

    def to_stop(self) -> float:
        """Seconds left for draining (phase 1)."""
        return max(0.0, self.stop_at - self.loop.time())

    def left(self, keep_s: float = 0.0) -> float:
        """Seconds left until the deadline, less ``keep_s`` kept for what comes after."""
        return max(0.0, self.deadline - keep_s - self.loop.time())

    def elapsed(self) -> float:
        return self.loop.time() - self.began
