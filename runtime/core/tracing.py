"""Triton's trace settings and the per-request decision to trace: pure counts, no clock.

Triton's trace extension (``docs/protocol/extension_trace.md`` of Triton's server) has
one set of trace settings for the server and, per model, settings that override it key
by key. The keys and their JSON form, values as strings (``trace_level`` a list):

* ``trace_level``: ``["OFF"]`` (the default) or ``["TIMESTAMPS"]``. ``TENSORS`` is
  refused (400): this server records timestamps only;
* ``trace_rate``: ``"1000"`` (the default) traces 1 request in every 1000;
* ``trace_count``: traces left to take, ``"-1"`` (the default) for no limit; it counts
  down as requests are traced and tracing stops at ``"0"``;
* ``log_frequency``: ``"0"`` (the default) appends every trace to ``trace_file``;
  ``"N"`` to ``trace_file.0`` until it holds N traces, then ``trace_file.1``, ...;
* ``trace_file``: where Triton's JSON trace format is written (``""``: nowhere; the
  database rows are written either way);
* ``trace_mode``: ``"triton"`` (the default) or ``"opentelemetry"``.

``parse_changes(doc)`` checks a request's settings (unknown key or bad value: a
``ClientError`` naming the known keys or the accepted form; JSON ``null`` clears a
key); ``TraceControl`` holds the global settings, each model's overrides and the
samplers, and answers ``effective(model)``, the settings a model is traced with, in
that JSON form.

Sampling is a count, never a draw: ``TraceSampler`` takes the first request and then
every ``trace_rate``-th (so ``trace_rate`` 10 and 1,000 requests trace exactly 100),
while its ``trace_count`` lasts. A model with settings of its own samples with a
sampler of its own (its own 1-in-N counter and its own ``trace_count``, which starts
from the model's effective ``trace_count`` when its settings change); the other models
share the global sampler. Changing ``trace_level`` or ``trace_rate`` restarts the
1-in-N count of the samplers it applies to; changing ``trace_count`` sets their count
left.

``RequestTrace`` is one traced request's timestamps (monotonic seconds, the engine's
clock), filled in as the request goes: the transport stamps receiving, the start and
the sending, the engine (``runtime.engine.booking``) the queue and the compute
timestamps of the batch it ran in. A request that is not traced has none: the hot path
checks one attribute for ``None``.

A plain trace is the same for the common traced request (an HTTP request of one item
with no ``traceparent``, sampled by the settings, whose model writes no trace file):
only what is its own (its ids, span ids where spans are exported, receive and send
times, the batch it ran in), in a list (``plain_trace``, positions ``PLAIN_*``), as
few allocations and stores as the hot path can make; the engine's booking hands the
traced members of a batch over together, with what they share held once
(``batchscope.storage.records.TraceBatch``). One that does not end in a batch that
ran (refused, expired, failed) becomes a ``RequestTrace`` (``full``) and is recorded
as one. ``settled`` and ``span_of`` take either kind.

``parse_traceparent(value)`` reads a W3C ``traceparent`` header: (trace id, parent
span id, sampled) or None when it is malformed (then it is ignored, as W3C Trace
Context says).

Synchronous and clock-free: the caller passes the times in.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any, Callable, Iterable, Mapping, Sequence

from runtime.api.errors import ClientError

#: the answer header naming the batch a traced request ran in (its ``seq``)
BATCH_ID_HEADER = "batchscope-batch-id"
_BATCH_ID_B = BATCH_ID_HEADER.encode()


#: a span is named by its answer's ``traceparent`` header line (``span_line``): the
#: transport writes it as it is, and the ids are read back from it where spans are made
TRACE_ID_AT = slice(16, 48)
SPAN_ID_AT = slice(49, 65)
_VALUE_AT = slice(13, 68)


def span_line(trace_id: int, span_id: int) -> bytes:
    """The ``traceparent`` header line (``traceparent: 00-<trace id>-<span id>-01``, CRLF)
    naming span ``(trace id, span id)``, sampled: how a trace holds its span's ids
    (``RequestTrace.span``; the tracer draws them in blocks,
    ``runtime.engine.otel_spans.SpanIds``)."""
    return b"traceparent: 00-%032x-%016x-01\r\n" % (trace_id, span_id)


def span_ids(span: bytes) -> tuple[int, int]:
    """(trace id, span id) of a span held as its ``span_line``."""
    return int(span[TRACE_ID_AT], 16), int(span[SPAN_ID_AT], 16)


def traceparent_bytes(span: bytes) -> bytes:
    """The W3C ``traceparent`` value of a span held as its ``span_line``."""
    return span[_VALUE_AT]


#: the trace settings, in the order answers list them
KEYS = ("trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency",
        "trace_mode")
OFF = "OFF"
TIMESTAMPS = "TIMESTAMPS"
#: the trace levels accepted (``TENSORS`` is Triton's too, refused here)
LEVELS = (OFF, TIMESTAMPS)
MODES = ("triton", "opentelemetry")
#: the server's settings before any change (Triton's defaults)
DEFAULTS: dict[str, Any] = {"trace_file": "", "trace_level": (OFF,), "trace_rate": 1000,
                            "trace_count": -1, "log_frequency": 0, "trace_mode": "triton"}
#: the settings that decide which requests are traced
_SAMPLING = frozenset({"trace_level", "trace_rate", "trace_count"})
#: the largest number a setting takes (a signed 64-bit integer, as Triton's)
_MOST = (1 << 63) - 1
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")

_FORMS = {
    "trace_level": 'a list of levels: ["TIMESTAMPS"] to trace, ["OFF"] not to (a single '
                   'string is taken as a list of one)',
    "trace_rate": 'a whole number of at least 1 as a string, e.g. "1000" (1 request traced '
                  'in every 1000)',
    "trace_count": 'a whole number of at least -1 as a string, e.g. "100" (traces left to '
                   'take) or "-1" (no limit)',
    "log_frequency": 'a whole number of at least 0 as a string: "0" (every trace in '
                     'trace_file) or e.g. "100" (a new file trace_file.N every 100 traces)',
    "trace_file": 'a string: the path of the file Triton\'s JSON trace format is appended '
                  'to, or "" for none',
    "trace_mode": '"triton" or "opentelemetry"',
}


#: how a refused value is quoted back: a few levels, items and characters of it, so a
#: value nested 1,000 deep or a list of a million items gets a short answer, not an error
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict = 3, 6, 4
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = 100
#: unknown keys named in an answer at most
_MOST_SHOWN = 10


def quoted(value: Any) -> str:
    """``value`` as an answer quotes it: a bounded ``repr`` (never deeper, or longer, than
    a line of an error message)."""
    shown = _QUOTE.repr(value)
    return shown if len(shown) <= 120 else shown[:120] + "..."


def _bad(key: str, value: Any) -> ClientError:
    return ClientError(f"{key}={quoted(value)} is not accepted; send {_FORMS[key]}, or null to "
                       "clear a model's own value (the global one applies again)")


def _integer(key: str, value: Any, least: int) -> int:
    if isinstance(value, list) and len(value) == 1:  # gRPC sends every value as a list
        value = value[0]
    if type(value) is int:
        number = value
    elif isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        number = int(value.strip())
    else:
        raise _bad(key, value)
    if not least <= number <= _MOST:
        raise _bad(key, value)
    return number


def _level(value: Any) -> tuple[str, ...]:
    levels = [value] if isinstance(value, str) else value
    if not isinstance(levels, list) or not levels or not all(isinstance(v, str) for v in levels):
        raise _bad("trace_level", value)
    out: list[str] = []
    for level in levels:
        if not level.isascii():  # "tımestamps".upper() is "TIMESTAMPS": not a level name
            raise _bad("trace_level", value)
        name = level.strip().upper()
        if name == "TENSORS":
            raise ClientError('trace_level "TENSORS" is not supported: this server records '
                              'timestamps only; send ["TIMESTAMPS"]')
        if name not in LEVELS:
            raise _bad("trace_level", value)
        if name not in out:
            out.append(name)
    if OFF in out and len(out) > 1:
        raise ClientError(f'trace_level {quoted(levels)} asks for "OFF" and for tracing at '
                          'once; send ["OFF"] or ["TIMESTAMPS"]')
    return tuple(out)


def _text(key: str, value: Any, choices: tuple[str, ...] | None = None) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or "\x00" in value:
        raise _bad(key, value)
    if choices is not None:
        if not value.isascii() or value.strip().lower() not in choices:
            raise _bad(key, value)
        return value.strip().lower()
    return value


def parse_value(key: str, value: Any) -> Any:
    """The setting ``key`` from its JSON form (None: clear it), or a ``ClientError``."""
    if value is None:
        return None
    if key == "trace_level":
        return _level(value)
    if key == "trace_rate":
        return _integer(key, value, 1)
    if key == "trace_count":
        return _integer(key, value, -1)
    if key == "log_frequency":
        return _integer(key, value, 0)
    if key == "trace_file":
        return _text(key, value)
    if key == "trace_mode":
        return _text(key, value, MODES)
    raise unknown_keys([key])


def unknown_keys(keys: Iterable[str]) -> ClientError:
    names = sorted(str(k)[:64] for k in keys)
    more = len(names) - _MOST_SHOWN
    shown = f"{names[:_MOST_SHOWN]}" + (f" and {more} more" if more > 0 else "")
    return ClientError(f"unknown trace setting(s) {shown}; the trace settings are "
                       f"{', '.join(KEYS)}")


def parse_changes(doc: Any) -> dict[str, Any]:
    """The changes a trace setting request asks for: key -> value, None to clear. Raises
    ``ClientError`` (400) for a body that is not an object, an unknown key or a bad value,
    before anything changes."""
    if not isinstance(doc, Mapping):
        raise ClientError('the body must be a JSON object of trace settings, e.g. '
                          '{"trace_level": ["TIMESTAMPS"], "trace_rate": "100"}; the trace '
                          f"settings are {', '.join(KEYS)}")
    unknown = [k for k in doc if k not in DEFAULTS]
    if unknown:
        raise unknown_keys(unknown)
    return {key: parse_value(key, value) for key, value in doc.items()}


def config_changes(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """``parse_changes`` of start-up ``KEY=VALUE`` pairs (``--trace-config``), whose keys
    may be Triton's short ones (``rate`` for ``trace_rate``, ``level``...)."""
    return parse_changes({key if key in DEFAULTS else f"trace_{key}": value
                          for key, value in pairs})


def to_json(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings in Triton's JSON form: strings, ``trace_level`` a list of strings."""
    out: dict[str, Any] = {}
    for key in KEYS:
        value = values[key]
        out[key] = list(value) if key == "trace_level" else str(value)
    return out


class TraceSampler:
    """Whether to trace the next request: the first, then every ``rate``-th, while the
    count lasts (``left``: traces left, -1 for no limit). Pure counts.

    ``sample`` is a countdown: one attribute read and store for a request it skips (the
    path every untraced request takes while tracing is on). A sampler that may not
    trace (``on`` False) keeps a countdown no server reaches, so ``sample`` needs no
    check of ``on``; ``spent`` is called once when the count runs out."""

    __slots__ = ("on", "rate", "left", "_until", "spent")

    #: the countdown of a sampler that may not trace: 2**62 requests, never reached
    NEVER = 1 << 62

    def __init__(self, tracing: bool, rate: int, left: int,
                 spent: Callable[[], None] | None = None) -> None:
        if rate < 1:
            raise ValueError(f"rate={rate!r} must be at least 1")
        self.rate = rate
        self.left = left
        #: whether it may still trace: a level other than OFF and traces left
        self.on = tracing and left != 0
        #: requests until the next one traced (1: the next one)
        self._until = 1 if self.on else self.NEVER
        self.spent = spent

    def sample(self, model: str | None = None) -> bool:
        """Count one request (of ``model``: unused, so a caller may hold this bound
        method in place of ``TraceControl.sample``); True when it is to be traced."""
        until = self._until - 1
        if until:
            self._until = until
            return False
        if self.left < 0 and self.on:  # no count to keep: the next countdown, inline
            self._until = self.rate
            return True
        return self._take()

    def _take(self) -> bool:
        if not self.on:  # a countdown of NEVER ran out: not on a real server
            self._until = self.NEVER
            return False
        self._until = self.rate
        left = self.left
        if left > 0:
            self.left = left - 1
            if left == 1:
                self.on = False
                self._until = self.NEVER
                if self.spent is not None:
                    self.spent()
        return True


class TraceControl:
    """The trace settings of a server (global, and per model where set) and its samplers.

    ``update(model, changes)`` applies checked changes (``parse_changes``; ``model``
    None: the global settings) and returns the effective settings; ``sample(model)``
    decides one request of ``model``. ``active`` is False while no sampler can trace,
    so a caller checks that one attribute before anything else (the default: tracing
    is OFF)."""

    def __init__(self, models: Iterable[str] = (),
                 settings: Mapping[str, Any] | None = None) -> None:
        self.models = frozenset(models)
        #: the global settings (every key)
        self.values: dict[str, Any] = dict(DEFAULTS)
        if settings:
            self.values.update({k: v for k, v in settings.items() if v is not None})
        #: model -> the keys it sets itself
        self.overrides: dict[str, dict[str, Any]] = {}
        self._global = self._sampler(self.values, self.values["trace_count"])
        #: model -> its own sampler (models with overrides only)
        self._own: dict[str, TraceSampler] = {}
        self.active = self._global.on
        self._refresh()

    def add_models(self, names: Iterable[str]) -> None:
        """Trace ``names`` too (the generation models of the same server)."""
        self.models = self.models | frozenset(names)

    def _sampler(self, values: Mapping[str, Any], left: int) -> TraceSampler:
        return TraceSampler(values["trace_level"] != (OFF,), values["trace_rate"], left,
                            self._refresh)

    def _refresh(self) -> None:
        """``active`` and ``sample`` after the samplers changed (or one's count ran out)."""
        self.active = self._global.on or any(s.on for s in self._own.values())
        #: ``sample(model)``: count one request of ``model``; True when it is to be
        #: traced. While no model has a sampler of its own, the global sampler's own
        #: bound method: one call for a request, not two.
        self.sample: Callable[[str], bool] = (
            self._sample_own if self._own else self._global.sample)

    def _check(self, model: str | None) -> None:
        if model is not None and model not in self.models:
            raise KeyError(model)

    def values_of(self, model: str | None) -> dict[str, Any]:
        """Every setting ``model`` (None: the server) is traced with, as values."""
        self._check(model)
        values = dict(self.values)
        if model is not None:
            values.update(self.overrides.get(model, {}))
        values["trace_count"] = self.sampler_of(model).left
        return values

    def effective(self, model: str | None = None) -> dict[str, Any]:
        """The settings ``model`` (None: the server) is traced with, in Triton's JSON form;
        ``trace_count`` is the count left."""
        return to_json(self.values_of(model))

    def sampler_of(self, model: str | None) -> TraceSampler:
        if model is None:
            return self._global
        return self._own.get(model, self._global)

    def update(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` (checked values, None to clear) to the global settings
        (``model`` None) or to ``model``'s own; returns its effective settings."""
        self._check(model)
        if model is None:
            self._update_global(changes)
        else:
            self._update_model(model, changes)
        self._refresh()
        return self.effective(model)

    def _update_global(self, changes: Mapping[str, Any]) -> None:
        for key, value in changes.items():
            self.values[key] = DEFAULTS[key] if value is None else value
        changed = _SAMPLING.intersection(changes)
        if changed:
            left = self.values["trace_count"] if "trace_count" in changed else self._global.left
            self._global = self._sampler(self.values, left)
        # the models with samplers of their own follow what they inherit
        for name, own in list(self._own.items()):
            inherited = changed - set(self.overrides[name])
            if inherited:
                values = {**self.values, **self.overrides[name]}
                left = values["trace_count"] if "trace_count" in inherited else own.left
                self._own[name] = self._sampler(values, left)

    def _update_model(self, model: str, changes: Mapping[str, Any]) -> None:
        own = dict(self.overrides.get(model, {}))
        for key, value in changes.items():
            if value is None:
                own.pop(key, None)
            else:
                own[key] = value
        if not own:
            self.overrides.pop(model, None)
            self._own.pop(model, None)  # back on the global sampler
            return
        self.overrides[model] = own
        before = self._own.get(model)
        if before is None or _SAMPLING.intersection(changes):
            # its count goes on from where it stands (a spent one stays spent), unless
            # this change sets it; cleared, it goes on from the global count left
            if changes.get("trace_count") is not None:
                left = changes["trace_count"]
            elif before is None or "trace_count" in changes:
                left = self._global.left
            else:
                left = before.left
            self._own[model] = self._sampler({**self.values, **own}, left)

    def _sample_own(self, model: str) -> bool:
        """``sample`` while some model has a sampler of its own."""
        return self._own.get(model, self._global).sample()


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def one_traceparent(values: Sequence[str | bytes]) -> str | bytes | None:
    """The ``traceparent`` a request carried in headers (or gRPC metadata) ``values``:
    None when it had none, "" (malformed: not followed) when it had several, which name
    no one parent (W3C Trace Context)."""
    if not values:
        return None
    return values[0] if len(values) == 1 else ""


def parse_traceparent(value: str | bytes | None) -> tuple[str, str, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent`` header, or None when
    there is none or it is malformed (all-zero ids, version ff, a version 00 header with
    more after the flags)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    # only HTTP's optional white space around it: str.strip would also take a NBSP
    # (b"\xa0") or NEL, bytes no valid header holds
    m = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 \
            or span_id == "0" * 16:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


class RequestTrace:
    """One traced request's timestamps, monotonic seconds (None: not reached or not seen).

    The transport sets ``recv_start``/``recv_end`` (the request's bytes arriving),
    ``request_start`` (handed to the engine) and ``send_start``/``send_end`` (its answer
    going out); the engine's booking calls ``ran`` (or ``settled``) when the request's
    batch is answered. A request of several items is traced once: each item's batch
    widens the compute span (the earliest start, the latest end)."""

    __slots__ = ("trace_id", "model", "protocol", "request_id", "w3c_trace_id",
                 "w3c_parent_span_id", "recv_start", "recv_end", "request_start",
                 "queue_start", "compute_start", "compute_input_end", "compute_output_start",
                 "compute_end", "request_end", "send_start", "send_end", "batch_seq",
                 "outcome", "span", "operation", "first_token", "input_tokens",
                 "output_tokens", "finish_reasons")

    w3c_trace_id: str | None
    w3c_parent_span_id: str | None
    queue_start: float | None
    compute_start: float | None
    compute_input_end: float | None
    compute_output_start: float | None
    compute_end: float | None
    request_end: float | None
    send_start: float | None
    send_end: float | None
    batch_seq: int | None
    outcome: str | None
    span: bytes | None
    first_token: float | None
    input_tokens: int | None
    output_tokens: int | None

    def __init__(self, trace_id: int, model: str, protocol: str, request_start: float,
                 request_id: str | None = None, w3c: tuple[str, str, bool] | None = None,
                 recv_start: float | None = None, recv_end: float | None = None,
                 operation: str = "infer") -> None:
        self.trace_id = trace_id
        self.model = model
        self.protocol = protocol
        self.request_id = request_id
        if w3c is None:
            self.w3c_trace_id = self.w3c_parent_span_id = None
        else:
            self.w3c_trace_id, self.w3c_parent_span_id = w3c[0], w3c[1]
        self.recv_start = recv_start
        self.recv_end = recv_end
        self.request_start = request_start
        # not reached yet; ``batch_seq``: the batch it ran in; ``outcome``: as its
        # ``RequestRow`` has it (None: not settled yet); ``span``: the ``span_line`` of
        # its OpenTelemetry span, drawn when it begins while spans are exported
        # (``runtime.engine.otel``), else None
        self.queue_start = self.compute_start = self.compute_input_end = None
        self.compute_output_start = self.compute_end = self.request_end = None
        self.send_start = self.send_end = self.batch_seq = self.outcome = self.span = None
        #: what the request asked for, in GenAI's words: infer (a request model),
        #: text_completion or chat (a generation model)
        self.operation = operation
        #: a generation request's first token (monotonic s), its prompt and output tokens
        #: (over its choices) and why each choice ended
        self.first_token = self.input_tokens = self.output_tokens = None
        self.finish_reasons: tuple[str, ...] = ()

    def answer_headers(self) -> list[tuple[str, str]]:
        """What its answer carries: the ``traceparent`` of its span (when spans are
        exported) and the id of the batch it ran in."""
        out = []
        if self.span is not None:
            out.append(("traceparent", traceparent_bytes(self.span).decode()))
        if self.batch_seq is not None:
            out.append((BATCH_ID_HEADER, str(self.batch_seq)))
        return out

    def answer_header_bytes(self) -> list[tuple[bytes, bytes]]:
        """``answer_headers`` as the HTTP/1.1 layer writes them."""
        out = []
        if self.span is not None:
            out.append((b"traceparent", traceparent_bytes(self.span)))
        if self.batch_seq is not None:
            out.append((_BATCH_ID_B, b"%d" % self.batch_seq))
        return out

    def ran(self, queued_s: float, started_s: float, input_end_s: float,
            output_start_s: float, ended_s: float, batch_seq: int | None, now: float,
            outcome: str) -> None:
        """The request (or one of its items) queued at ``queued_s`` ran in a batch from
        ``started_s`` to ``ended_s`` (inputs ready at ``input_end_s``, outputs taken from
        ``output_start_s``) and was settled at ``now``."""
        if self.compute_start is None:
            self.compute_start = started_s
            self.compute_input_end = input_end_s
            self.compute_output_start = output_start_s
            self.compute_end = ended_s
            self.batch_seq = batch_seq
        else:  # another item's batch: the span widens
            self.compute_start = min(self.compute_start, started_s)
            if self.compute_input_end is None or input_end_s < self.compute_input_end:
                self.compute_input_end = input_end_s
            if self.compute_output_start is None or output_start_s > self.compute_output_start:
                self.compute_output_start = output_start_s
            if self.compute_end is None or ended_s > self.compute_end:
                self.compute_end = ended_s
        self.settled(queued_s, now, outcome)

    def settled(self, queued_s: float | None, now: float, outcome: str,
                started_s: float | None = None, batch_seq: int | None = None) -> None:
        """The request (or one of its items) got its outcome at ``now`` without a batch
        that ran to the end (``started_s``: when its batch started, if one did)."""
        if queued_s is not None and (self.queue_start is None or queued_s < self.queue_start):
            self.queue_start = queued_s
        if started_s is not None and self.compute_start is None:
            self.compute_start = started_s
            self.batch_seq = batch_seq
        if self.request_end is None or now > self.request_end:
            self.request_end = now
        if self.outcome is None or self.outcome == "ok":
            self.outcome = outcome

    def timeline(self) -> list[tuple[str, float | None]]:
        """(Triton's name, time) of every timestamp in the order they happen, each made
        no earlier than the one before it (the items of one request may overlap)."""
        grpc = self.protocol == "grpc"
        stamps = [
            ("GRPC_WAITREAD_START" if grpc else "HTTP_RECV_START", self.recv_start),
            ("GRPC_WAITREAD_END" if grpc else "HTTP_RECV_END", self.recv_end),
            ("REQUEST_START", self.request_start),
            ("QUEUE_START", self.queue_start),
            ("COMPUTE_START", self.compute_start),
            ("COMPUTE_INPUT_END", self.compute_input_end),
            ("COMPUTE_OUTPUT_START", self.compute_output_start),
            ("COMPUTE_END", self.compute_end),
            ("REQUEST_END", self.request_end),
            ("GRPC_SEND_START" if grpc else "HTTP_SEND_START", self.send_start),
            ("GRPC_SEND_END" if grpc else "HTTP_SEND_END", self.send_end),
        ]
        out: list[tuple[str, float | None]] = []
        last = None
        for name, at in stamps:
            if at is not None:
                if last is not None and at < last:
                    at = last
                last = at
            out.append((name, at))
        return out


# -- plain traces ---------------------------------------------------------------------
#: A plain trace (the common traced request's, see the module doc) is a list, made in
#: one step with no constructor call (the cheapest object the hot path can make), its
#: values at these positions: its trace id, request id, receive times and, once answered
#: from its batch, its request start (the engine's queue start), send times and batch;
#: ``PLAIN_SPAN`` its ``span`` as ``RequestTrace``'s (the tracer sets it where spans are
#: exported); ``PLAIN_ENDING`` what ``settled`` keeps of an outcome that was not its
#: batch run to the end, for ``full``. The engine's booking hands its values over as a
#: tuple (``batchscope.storage.records.PLAIN_MEMBER_FIELDS`` names the same positions).
(PLAIN_TRACE_ID, PLAIN_REQUEST_ID, PLAIN_RECV_START, PLAIN_RECV_END, PLAIN_REQUEST_START,
 PLAIN_SEND_START, PLAIN_SEND_END, PLAIN_SPAN, PLAIN_BATCH_SEQ, PLAIN_ENDING) = range(10)


def plain_trace(trace_id: int, request_id: str | None, recv_start: float | None,
                recv_end: float | None, span: Any = None) -> list:
    """A new plain trace (``Tracer.begin_plain`` writes the same list inline)."""
    return [trace_id, request_id, recv_start, recv_end, None, None, None, span, None, None]


def settled(trace: RequestTrace | list, queued_s: float | None, now: float, outcome: str,
            started_s: float | None = None, batch_seq: int | None = None) -> None:
    """``RequestTrace.settled`` of either kind of trace: a plain one keeps the outcome
    until its answer makes it ``full``."""
    if type(trace) is list:
        trace[PLAIN_ENDING] = (queued_s, now, outcome, started_s, batch_seq)
    else:
        trace.settled(queued_s, now, outcome, started_s, batch_seq)


def full(trace: RequestTrace | list, model: str, now: float) -> RequestTrace:
    """A plain trace of a request of ``model`` as a ``RequestTrace``, with the outcome
    ``settled`` gave it (a ``RequestTrace`` as it is). Its request start is its queue
    start (the engine queues a request as it takes it), or ``now`` for a request the
    engine refused."""
    if type(trace) is not list:
        return trace
    ending = trace[PLAIN_ENDING]
    queued = ending[0] if ending is not None else None
    out = RequestTrace(trace[PLAIN_TRACE_ID], model, "http",
                       queued if queued is not None else now, trace[PLAIN_REQUEST_ID], None,
                       trace[PLAIN_RECV_START], trace[PLAIN_RECV_END])
    out.span = trace[PLAIN_SPAN]
    out.send_start, out.send_end = trace[PLAIN_SEND_START], trace[PLAIN_SEND_END]
    if ending is not None:
        out.settled(*ending)
    return out


def span_of(trace: RequestTrace | list) -> Any:
    """The ``span`` of either kind of trace."""
    return trace[PLAIN_SPAN] if type(trace) is list else trace.span
