"""``Tracer``: the engine's trace settings, which requests are traced, and their records.

The settings and the sampling decision are ``runtime.core.tracing``'s (pure counts);
this shell numbers the traces of the instance, stamps them with the engine's clock,
and records each traced request once it is answered: a ``TraceRow`` (the
``request_traces`` table) through the engine's recorder, never blocking, and, when
the model's ``trace_file`` is set and its ``trace_mode`` is ``triton``, Triton's JSON
trace format through ``runtime.engine.tracefile`` (written on a thread of its own).

How a transport uses it, on the event loop's thread::

    trace = tracer.begin(model, "http", request_id, traceparent)   # None: not traced
    ...engine.submit(..., trace=trace)...     # the engine stamps queue and compute times
    tracer.finish(trace)                      # once answered (send times stamped first)

The HTTP fast path traces the common request (one item, no ``traceparent``, sampled by
the settings, a model that writes no trace file) leaner: ``begin_plain`` (also what
``begin(..., plain=True)`` calls) gives a plain trace (``runtime.core.tracing.plain_trace``:
a list of its ids, span ids where spans are exported, receive times), the engine's
booking stamps the batch it ran in, the transport its send times, and booking hands
the batch's traced members to ``plain_batch`` together, once they are answered. Every
``flush`` hands what was kept to the recorder as one ``TraceBatch``; when a plain
trace in it has spans, the span exporter gets the same record and makes spans of its
plain members with spans. Where either sends the record to a child process (the
database writer's, the span process) it is pickled once, by ``flush``
(``TraceBatch.packed``): 256 traces at a time, while they are in the cache, rather than
all of half a second's at once on a sender thread, which held the event loop for
milliseconds.

A request that carries a W3C ``traceparent`` marked sampled (trace flags ``01``) is
always traced, whatever the trace settings (also with ``trace_level`` OFF): its
caller is tracing it, and the OpenTelemetry exporter (``runtime.engine.otel``, when
``--otlp-traces-endpoint`` is set) sends this server's part of it to the same trace.
Other traced requests become spans when their model's ``trace_mode`` is
``opentelemetry`` (the default once an endpoint is set). It does not count against ``trace_rate`` or
``trace_count``. A ``traceparent`` not marked sampled is traced only when the settings
sample the request; its ids are kept either way. Nothing else is read for a request
that is not traced: the transports check ``control.active`` and whether a
``traceparent`` came, and allocate nothing more.
"""

from __future__ import annotations

import asyncio
import os
from operator import attrgetter
from typing import Any, Iterable, Mapping

from batchscope.storage.records import TRACE_FIELDS, RecorderLike, TraceBatch, put_many_of
from runtime.api.errors import ClientError, QueueFull
from runtime.core.tracing import (DEFAULTS, PLAIN_SPAN, RequestTrace, TraceControl,
                                  parse_traceparent)
from runtime.engine.otel_spans import SpanIds
from runtime.engine.tracefile import TraceFileWriter, check_writable

#: ``TraceRow`` timestamp columns in order, with Triton's names over HTTP and gRPC
COLUMNS = ("recv_start_at", "recv_end_at", "request_start_at", "queue_start_at",
           "compute_start_at", "compute_input_end_at", "compute_output_start_at",
           "compute_end_at", "request_end_at", "send_start_at", "send_end_at")
HTTP_NAMES = ("HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START",
              "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
              "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END")
GRPC_NAMES = ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END") + HTTP_NAMES[2:9] + (
    "GRPC_SEND_START", "GRPC_SEND_END")
#: the longest request id kept
MAX_REQUEST_ID_CHARS = 256
#: how a model's sampled one-item HTTP requests are traced (``Tracer._plain_kind``)
_NOT_PLAIN, _PLAIN, _PLAIN_SPANS = 0, 1, 2
#: finished traces are handed to the recorder together: at this many, or this long after
#: the first of them
FLUSH_EVERY = 256
FLUSH_AFTER_S = 0.1
_TRACE_FIELDS = attrgetter(*TRACE_FIELDS)


def _holds_trace_array(path: str) -> bool:
    """Whether traces may be appended to the file at ``path``: none there, an empty one,
    or one that is a JSON array (as ``runtime.engine.tracefile.append_to_array`` asks:
    ``[`` first, ``]`` last). Called once ``check_writable`` found it a regular file."""
    try:
        with open(path, "rb") as fh:
            first = fh.read(1)
            if not first:
                return True
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            return first == b"[" and fh.read().rstrip().endswith(b"]")
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _has_spans(batches: list[tuple]) -> bool:
    """Whether a member of these batches of plain traces has spans (its model's
    ``trace_mode`` was ``opentelemetry`` when it began): the span exporter gets only
    those. Stops at the first; with spans exported, that is the first member."""
    for batch in batches:
        for member in batch[-1]:
            if member[PLAIN_SPAN] is not None:
                return True
    return False


def outcome_of(error: BaseException | None) -> str:
    """The outcome of a request that ended with ``error`` before the engine settled it."""
    if error is None:
        return "ok"
    if isinstance(error, QueueFull):
        return "rejected"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    return "error"


class Tracer:
    """The trace settings of one engine's request models and the recording of traces."""

    def __init__(self, models: Iterable[str], recorder: RecorderLike, instance_id: str,
                 clock: Any) -> None:
        self.control = TraceControl(models)
        self.recorder = recorder
        self.instance_id = instance_id
        self.clock = clock
        #: the number of the last trace begun (Triton's trace ``id``)
        self.last_id = 0
        #: traces recorded so far
        self.traced = 0
        self.files = TraceFileWriter(list(zip(HTTP_NAMES, COLUMNS)),
                                     grpc_names=list(zip(GRPC_NAMES, COLUMNS)))
        #: the OpenTelemetry exporter (``runtime.engine.otel.OtlpSpans``), when one is set
        self._otel: Any = None
        #: where the spans' ids come from (drawn while spans are exported)
        self.span_ids = SpanIds()
        #: traces finished and not yet handed to the recorder, and the flush due for them
        self._pending: list[tuple] = []
        #: batches of plain traces (``plain_batch``) not yet handed over, and their traces
        self._pending_batches: list[tuple] = []
        self._pending_plain = 0
        #: model -> how its sampled one-item requests are traced (``_plain_kind``)
        self._plain: dict[str, int] = {}
        self._timer: asyncio.TimerHandle | None = None
        #: whether the recorder takes ``TraceBatch`` records (else it gets the rows)
        self._batches = bool(getattr(recorder, "accepts_request_batches", False))
        #: whether any model writes a trace file (then a trace's row is built at once)
        self._files_on = False

    @property
    def otel(self) -> Any:
        """The OpenTelemetry exporter (``runtime.engine.otel.OtlpSpans``), when one is set."""
        return self._otel

    @otel.setter
    def otel(self, exporter: Any) -> None:
        self._otel = exporter
        self._plain.clear()

    # -- settings ---------------------------------------------------------------------
    def settings(self, model: str | None = None) -> dict[str, Any]:
        """The effective settings of ``model`` (None: the global ones), Triton's JSON form."""
        return self.control.effective(model)

    def update(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply checked changes (``runtime.core.tracing.parse_changes``); the effective
        settings after them. A ``trace_file`` whose folder does not exist, that the
        server cannot write, or that holds something other than a trace array, is refused;
        so is a ``log_frequency`` whose first file (``trace_file.0``) would be, for the
        settings changed and for every model that inherits the change. ``trace_mode``
        ``opentelemetry`` is refused on a server without a span exporter."""
        if changes.get("trace_mode") == "opentelemetry" and self._otel is None:
            raise ClientError('trace_mode "opentelemetry" sends spans to an OTLP endpoint, and '
                              "this server was started without one; start it with "
                              '--otlp-traces-endpoint URL, or keep trace_mode "triton"')
        path = changes.get("trace_file")
        files = "trace_file" in changes or "log_frequency" in changes
        # the scopes whose file changes: the one changed, and for a global change every
        # model that inherits a changed key
        scopes = [model]
        if files and model is None:
            scopes += [name for name, own in self.control.overrides.items()
                       if any(k not in own for k in ("trace_file", "log_frequency")
                              if k in changes)]
        for scope in scopes if files else ():
            # the file the traces will go to once changed (a value cleared: the one that
            # applies again), checked whichever of the two changed
            target = self._after_in(scope, model, changes, "trace_file")
            if target:
                every = self._after_in(scope, model, changes, "log_frequency")
                now = self.control.values_of(scope)
                try:
                    self._check_file(target, every, (target, every > 0) == (
                        now["trace_file"], now["log_frequency"] > 0))
                except ClientError as exc:
                    if scope == model:
                        raise
                    raise ClientError(f"model {scope!r} inherits this change, and its "
                                      f"file would be refused: {exc.message}") from None
        for scope in scopes if files else ():
            before = self.control.values_of(scope)["trace_file"]
            if before:
                self.files.reset(before)
        settings = self.control.update(model, changes)
        self._plain.clear()
        if path:
            self.files.reset(path)
        control = self.control
        self._files_on = bool(control.values["trace_file"]) or any(
            own.get("trace_file") for own in control.overrides.values())
        return settings

    def _after_in(self, scope: str | None, model: str | None, changes: Mapping[str, Any],
                  key: str) -> Any:
        """The value of ``key`` for ``scope`` (a model, or None: the server) once
        ``changes`` to ``model``'s settings (None: the global ones) apply."""
        if scope == model:
            return self._after(model, changes, key)
        own = self.control.overrides.get(scope, {})  # a global change reaching a model
        return own[key] if key in own else self._after(None, changes, key)

    def _after(self, model: str | None, changes: Mapping[str, Any], key: str) -> Any:
        """The value of ``key`` for ``model`` (None: the server) once ``changes`` apply."""
        if key not in changes:
            return self.control.values_of(model)[key]
        value = changes[key]
        if value is not None:
            return value
        return DEFAULTS[key] if model is None else self.control.values[key]

    @staticmethod
    def _check_file(path: str, every: int, writing: bool = False) -> None:
        """``ClientError`` unless traces can be appended to ``path`` (``every`` its
        ``log_frequency``): a folder that exists, a file this server may write, and no
        file there that is not a trace array (``TraceFileWriter`` never writes over one;
        not read where ``writing``: the file the traces go to already, which the writer
        thread may be appending to)."""
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            what = "is not a folder" if os.path.exists(folder) else "does not exist"
            raise ClientError(f"trace_file {path[:200]!r}: the folder {folder[:200]!r} "
                              f"{what}; give a file in an existing folder")
        if os.path.isdir(path):
            raise ClientError(f"trace_file {path[:200]!r} is a folder; give a file path")
        first = f"{path}.0" if every > 0 else path
        why = check_writable(first)
        if why is None and not writing and not _holds_trace_array(first):
            raise ClientError(f"trace_file {path[:200]!r}: {first[:200]!r} holds something "
                              "other than a JSON array of traces, and this server never "
                              "writes over it; give a new file, or a trace file it wrote")
        if why is not None:
            raise ClientError(f"trace_file {path[:200]!r}: this server cannot write "
                              f"{first[:200]!r} ({why}); give a file in a folder it may "
                              "write to")

    # -- one request ------------------------------------------------------------------
    def begin(self, model: str, protocol: str, request_id: str | None = None,
              traceparent: str | bytes | None = None, operation: str = "infer",
              recv_start: float | None = None, recv_end: float | None = None,
              sampled: bool = False, plain: bool = False) -> RequestTrace | list | None:
        """A new trace of one request of ``model`` about to be handed to the engine, or
        None when it is not traced (see the module doc for the ``traceparent`` rule).
        ``recv_start``/``recv_end``: when its bytes began and finished arriving, where
        the transport saw it. ``sampled``: the caller has counted the request already
        (``control.sample(model)`` said yes; it had no ``traceparent``), so a request
        the settings do not sample costs it no call here. ``plain``: an HTTP request of
        one item, traced as a plain trace when it has no ``traceparent`` and its model
        writes no trace file."""
        if traceparent is None:
            if not sampled:
                control = self.control
                if not (control.active and control.sample(model)):
                    return None
            if plain:
                return self.begin_plain(model, request_id, recv_start, recv_end)
            w3c = None
        else:
            w3c = parse_traceparent(traceparent)
            if w3c is None or not w3c[2]:
                control = self.control
                if not (control.active and control.sample(model)):
                    return None
        self.last_id += 1
        if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
            request_id = request_id[:MAX_REQUEST_ID_CHARS]
        trace = RequestTrace(self.last_id, model, protocol, self.clock.now(), request_id, w3c,
                             recv_start, recv_end, operation)
        if self.otel is not None and (w3c is not None and w3c[2]
                                      or self._values(model)["trace_mode"] == "opentelemetry"):
            trace.span = span = self.span_ids.child_of(trace.w3c_trace_id)
            if trace.w3c_trace_id is None:  # a trace of its own: its row names it too
                trace.w3c_trace_id = span[16:48].decode()
        return trace

    def begin_plain(self, model: str, request_id: str | None, recv_start: float | None,
                    recv_end: float | None) -> RequestTrace | list:
        """The trace of an HTTP request of one item with no ``traceparent`` that the
        settings sampled (the fast path's common traced request; ``begin(...,
        plain=True)`` comes here): a plain trace (``runtime.core.tracing.plain_trace``,
        its list written here inline), or a ``RequestTrace`` while its model writes a
        trace file."""
        kind = self._plain.get(model)
        if kind is None:
            kind = self._plain[model] = self._plain_kind(model)
        if not kind:
            return self.begin(model, "http", request_id, None, "infer", recv_start, recv_end,
                              sampled=True)
        self.last_id += 1
        if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
            request_id = request_id[:MAX_REQUEST_ID_CHARS]
        if kind == _PLAIN:
            return [self.last_id, request_id, recv_start, recv_end, None, None, None, None,
                    None, None]
        ready = self.span_ids.ready
        return [self.last_id, request_id, recv_start, recv_end, None, None, None,
                ready.pop() if ready else self.span_ids.refill(), None, None]

    def _plain_kind(self, model: str) -> int:
        """Whether ``model``'s sampled requests of one item are traced plain: not while
        it writes a trace file (``_NOT_PLAIN``), with spans where its ``trace_mode`` is
        ``opentelemetry`` and an exporter is set (``_PLAIN_SPANS``), else ``_PLAIN``."""
        values = self._values(model)
        if values["trace_file"]:
            return _NOT_PLAIN
        if self._otel is not None and values["trace_mode"] == "opentelemetry":
            return _PLAIN_SPANS
        return _PLAIN

    def plain_batch(self, batch: tuple) -> None:
        """Keep the plain traces of one batch's answered members (a
        ``PLAIN_BATCH_FIELDS`` tuple, see ``batchscope.storage.records``) for the next
        ``flush``, as ``finish`` keeps a trace."""
        self._pending_batches.append(batch)
        n = len(batch[-1])
        self.traced += n
        self._pending_plain += n
        self._due(len(self._pending) + self._pending_plain)

    def _values(self, model: str) -> Mapping[str, Any]:
        """The settings ``model`` is traced with (its own, or the global ones)."""
        control = self.control
        return control.values_of(model) if model in control.overrides else control.values

    def finish(self, trace: RequestTrace, error: BaseException | None = None,
               decode: tuple[float, float | None] | None = None) -> None:
        """Record ``trace`` once its request is answered (``error``: what it ended with,
        when the engine did not settle it). Never raises into the answer path.
        ``decode``: a generation request's decoding, (start, end or None), monotonic
        seconds, for its ``decode`` span (``runtime.engine.otel_spans.FinishedTrace``); None:
        no choice of it decoded past its first token, or not a generation request.

        The trace is kept with one list append; ``flush`` hands the kept traces to the
        recorder as one ``TraceBatch`` (at ``FLUSH_EVERY`` traces, or ``FLUSH_AFTER_S``
        after the first), whose rows are built off this thread. The span exporter gets
        the same tuple at once (its spans are built off this thread too); a trace file
        needs its row now, and gets it now. A plain trace is given as the
        ``RequestTrace`` it makes (``runtime.core.tracing.full``)."""
        if trace.request_end is None:
            trace.request_end = self.clock.now()
        if trace.outcome is None:
            trace.outcome = outcome_of(error)
        self.traced += 1
        fields = _TRACE_FIELDS(trace)  # a tuple of plain values: no work for the GC
        if trace.span is not None and self.otel is not None:
            self.otel.put_raw((fields, trace.span, trace.operation, trace.first_token,
                               trace.input_tokens, trace.output_tokens, trace.finish_reasons,
                               decode), self.clock.to_wall(0.0))
        if self._files_on:
            self._to_file(trace.model, fields)
        pending = self._pending
        pending.append(fields)
        self._due(len(pending) + self._pending_plain)

    def _due(self, kept: int) -> None:
        """Flush at ``FLUSH_EVERY`` traces kept, else ``FLUSH_AFTER_S`` after the first."""
        if kept >= FLUSH_EVERY:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop (a synchronous caller): at once
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_AFTER_S, self.flush)

    def _to_file(self, model: str, fields: tuple) -> None:
        """The trace file's row of a trace (``TRACE_FIELDS`` values), when its model's
        settings write one."""
        values = self._values(model)
        path = values["trace_file"]
        if path and values["trace_mode"] == "triton":
            row = TraceBatch(self.instance_id, self.clock.to_wall(0.0), [fields]).rows()[0]
            self.files.put(path, values["log_frequency"], row)

    def flush(self) -> None:
        """Hand the traces finished since the last flush to the recorder, and the
        batches of plain traces among them to the span exporter (``put_traces``)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        pending, self._pending = self._pending, []
        batches, self._pending_batches = self._pending_batches, []
        self._pending_plain = 0
        if not pending and not batches:
            return
        batch = TraceBatch(self.instance_id, self.clock.to_wall(0.0), pending, batches)
        otel = self._otel
        spans = batches and otel is not None and _has_spans(batches)
        if (self._batches and getattr(self.recorder, "pickles_records", False)) or (
                spans and getattr(otel, "pickles_records", False)):
            batch.packed()  # here, in a small piece (module doc)
        if self._batches:
            self.recorder.put(batch)
        else:
            put_many_of(self.recorder)(batch.rows())
        if spans:
            otel.put_traces(batch)  # the same record: pickled once for both processes

    def close(self, timeout_s: float = 5.0) -> None:
        """Hand over the traces still kept, write those waiting for the trace file and
        stop its thread."""
        self.flush()
        self.files.close(timeout_s)
