"""OTLP trace requests written straight in protobuf's wire format.

The OpenTelemetry SDK's OTLP encoder (``encode_spans``) builds a protobuf object per
span, attribute and value, and costs about 21 us of CPU per span here; building the
spans themselves costs 3 us. With every request traced that encoder alone took more CPU
than serving the request. ``encode_request(spans)`` writes the same
``ExportTraceServiceRequest`` as bytes from the SDK's ``ReadableSpan`` objects, about 6 us
a span (``python -m benchmarks.bench_tracing --encode`` measures both), and
``fast_grpc_exporter`` is the SDK's gRPC exporter with that encoding in place of its
own, whose bytes go to the channel as they are; everything else (channel, retries,
headers, timeouts, the ``OTEL_*`` variables) is the SDK's. ``fast_http_exporter`` is the
same for the SDK's HTTP/protobuf exporter. The bytes parse back to a message equal to the SDK's for the same spans
(``tests/test_otlp_wire.py`` compares them field by field).

It covers what span exporters meet: resources, scopes, names, kinds, times, parents,
trace state, status, links, attributes of every OTLP value type (strings, booleans,
integers, floats, bytes, sequences and mappings of them). A batch holding anything it
does not know (events, for one: BatchScope's spans have none) is encoded by the SDK.
Field numbers are those of ``opentelemetry/proto/trace/v1/trace.proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

# A field's tag byte is its number << 3 | its wire type: 0 varint, 1 fixed64,
# 2 length-delimited (bytes, strings, messages), 5 fixed32. So b"\x0a" is field 1 as
# bytes/message, b"\x12" field 2, b"\x18" field 3 as a varint, b"\x21" field 4 as
# fixed64; Span's flags (field 16, fixed32) need two bytes, b"\x85\x01".
_PACK_DOUBLE = struct.Struct("<d").pack
_PACK_FIXED64 = struct.Struct("<Q").pack
_PACK_FIXED32 = struct.Struct("<I").pack
#: SpanFlags: the parent's (or link's) is_remote is known; and it is remote
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_KIND = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}  # SDK SpanKind value -> OTLP Span.SpanKind


class Unsupported(Exception):
    """A span holds something this encoder does not write (the SDK's encoder then does)."""


_SMALL = [bytes((i,)) for i in range(0x80)]


def _varint(n: int) -> bytes:
    """A base-128 varint; a negative int64 as its two's complement."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    if 0 < n < 0x4000:  # two bytes: lengths of most messages, batch ids, sizes
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0:  # int64: two's complement, ten bytes
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


#: encoded KeyValue messages of attributes whose value repeats (strings, booleans), and
#: the encoded keys; both bounded
_pairs: dict[tuple[str, Any], bytes] = {}
_keys: dict[str, bytes] = {}
_HELD = 4096


def _key(key: str) -> bytes:
    """KeyValue.key (field 1)."""
    done = _keys.get(key)
    if done is None:
        done = _field(b"\x0a", key.encode())
        if len(_keys) < _HELD:
            _keys[key] = done
    return done


def _value(v: Any) -> bytes:
    """An AnyValue message."""
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        return _field(b"\x0a", v.encode())
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + _PACK_DOUBLE(v)
    if isinstance(v, bytes):
        return _field(b"\x3a", v)
    if v is None:
        return b""
    if isinstance(v, Sequence):  # ArrayValue: values = 1
        return _field(b"\x2a", b"".join(_field(b"\x0a", _value(x)) for x in v))
    if isinstance(v, Mapping):  # KeyValueList: values = 1
        return _field(b"\x32", b"".join(_field(b"\x0a", _key(str(k)) + _field(b"\x12", _value(x)))
                                        for k, x in v.items()))
    raise Unsupported(f"attribute value of type {type(v).__name__}")


def _pair(k: str, v: Any) -> bytes:
    """One KeyValue message."""
    kind = type(v)
    if kind is str or kind is bool:  # values that repeat: model, outcome, policy, ids
        done = _pairs.get((k, v))
        if done is None:
            done = _key(k) + _field(b"\x12", _value(v))
            _keep(_pairs, (k, v), done)
        return done
    if kind is float:
        return _key(k) + b"\x12\x09\x21" + _PACK_DOUBLE(v)
    if kind is int:
        body = b"\x18" + _varint(v)
        return _key(k) + b"\x12" + _SMALL[len(body)] + body
    return _key(k) + _field(b"\x12", _value(v))


#: attributes framed under their tag, ready to join: (tag, key) -> the bytes before a
#: double's eight; (tag, key, varint length) -> the bytes before an integer's varint.
#: Bounded.
_framed: dict[tuple, bytes] = {}
#: (tag, key) -> {string or boolean value -> the attribute framed}; at most
#: ``_VALUES_HELD`` values a key (a key whose values do not repeat, such as a request id,
#: stops there and keeps out no other key's)
_values: dict[tuple[bytes, str], dict[Any, bytes]] = {}
_VALUES_HELD = 256
#: span names as Span.name fields
_names: dict[str, bytes] = {}


def _keep(cache: dict, key: Any, value: bytes) -> None:
    """Remember ``value``; a full cache starts over (values that never repeat, such as
    request ids, must not keep out those that do)."""
    if len(cache) >= _HELD:
        cache.clear()
    cache[key] = value


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Repeated KeyValue under ``tag``."""
    if not attributes:
        return b""
    out = []
    framed = _framed
    for k, v in attributes.items():
        kind = type(v)
        if kind is float:
            head = framed.get((tag, k))
            if head is None:
                head = _field(tag, _key(k) + b"\x12\x09\x21" + _PACK_DOUBLE(0.0))[:-8]
                _keep(framed, (tag, k), head)
            out.append(head + _PACK_DOUBLE(v))
        elif kind is int:
            value = b"\x18" + _varint(v)
            key = (tag, k, len(value))
            head = framed.get(key)
            if head is None:
                head = _field(tag, _key(k) + b"\x12" + _SMALL[len(value)] + value)[:-len(value)]
                _keep(framed, key, head)
            out.append(head + value)
        elif kind is str or kind is bool:
            values = _values.get((tag, k))
            if values is None:
                values = {}
                _keep(_values, (tag, k), values)
            done = values.get(v)
            if done is None:
                done = _field(tag, _key(k) + _field(b"\x12", _value(v)))
                if len(values) < _VALUES_HELD:  # else this key's values do not repeat
                    values[v] = done
            out.append(done)
        else:
            out.append(_field(tag, _pair(k, v)))
    return b"".join(out)


def _flags(context: Any) -> bytes:
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0)
    return _PACK_FIXED32(flags)


def _trace_state(context: Any) -> str:
    state = context.trace_state
    return ",".join(f"{k}={v}" for k, v in state.items()) if state is not None else ""


def _link(link: Any) -> bytes:
    """A Span.Link: trace_id = 1, span_id = 2, attributes = 4, dropped = 5, flags = 6."""
    ctx = link.context
    out = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big"),
           _attributes(b"\x22", link.attributes)]
    dropped = link.dropped_attributes
    if dropped:
        out.append(b"\x28" + _varint(dropped))
    out.append(b"\x35" + _flags(ctx))
    return b"".join(out)


_statuses: dict[tuple[int, str | None], bytes] = {}


def _status(status: Any) -> bytes:
    """Span.status (15): message = 2, code = 3; present even when empty."""
    key = (status.status_code.value, status.description)
    done = _statuses.get(key)
    if done is None:
        body = b""
        if status.description:
            body += _field(b"\x12", status.description.encode())
        if key[0]:
            body += b"\x18" + _varint(key[0])
        done = _field(b"\x7a", body)
        if len(_statuses) < _HELD:
            _statuses[key] = done
    return done


def _span(span: Any) -> bytes:
    """A Span message."""
    if span.events:
        raise Unsupported("span events")
    ctx = span.context
    # trace_id = 1 (16 bytes), span_id = 2 (8 bytes)
    out = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big")]
    if ctx.trace_state:  # trace_state = 3
        out.append(_field(b"\x1a", _trace_state(ctx).encode()))
    parent = span.parent
    if parent is not None:  # parent_span_id = 4
        out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    if span.name:  # name = 5
        out.append(_field(b"\x2a", span.name.encode()))
    out.append(b"\x30" + _varint(_KIND[span.kind.value]))  # kind = 6
    if span.start_time:  # start_time_unix_nano = 7, end_time_unix_nano = 8 (fixed64)
        out.append(b"\x39" + _PACK_FIXED64(span.start_time))
    if span.end_time:
        out.append(b"\x41" + _PACK_FIXED64(span.end_time))
    out.append(_attributes(b"\x4a", span.attributes))  # attributes = 9
    # dropped_attributes_count = 10, dropped_events_count = 12, dropped_links_count = 14
    for tag, count in ((b"\x50", span.dropped_attributes), (b"\x60", span.dropped_events),
                       (b"\x70", span.dropped_links)):
        if count:
            out.append(tag + _varint(count))
    for link in span.links or ():  # links = 13
        out.append(_field(b"\x6a", _link(link)))
    status = span.status
    if status is not None:
        out.append(_status(status))
    out.append(b"\x85\x01" + _flags(parent))  # flags = 16, fixed32
    return b"".join(out)


class _Sampled:
    """What the SDK's batch processor asks of a span's context: is it sampled (yes)."""

    __slots__ = ()
    sampled = True

    @property
    def trace_flags(self) -> "_Sampled":
        return self


_SAMPLED = _Sampled()
_UNSET, _ERROR = _field(b"\x7a", b""), _field(b"\x7a", b"\x18\x02")  # Span.status


class WireSpan:
    """A span already written as its ``Span`` message (``wire_span``), for the SDK's
    ``BatchSpanProcessor`` to queue and ``encode_request`` to send as it is: building
    a ``ReadableSpan`` and then encoding it cost about twice as much."""

    __slots__ = ("wire", "resource", "instrumentation_scope")
    context = _SAMPLED

    def __init__(self, wire: bytes, resource: Any, scope: Any) -> None:
        self.wire = wire
        self.resource = resource
        self.instrumentation_scope = scope


def attributes_block(attributes: Mapping[str, Any]) -> bytes:
    """``Span.attributes`` of ``attributes`` as ``wire_span`` writes them. The blocks of
    two mappings joined are the block of the one after the other, so a caller writes what
    repeats from span to span once and joins it."""
    return _attributes(b"\x4a", attributes)


def link_block(trace_id: int, span_id: int, attributes: Mapping[str, Any] | None) -> bytes:
    """One ``Span.links`` entry, to a local, sampled span."""
    return _field(b"\x6a", b"".join((
        b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big"),
        _attributes(b"\x22", attributes), b"\x35", _LOCAL_FLAGS)))


def double_head(key: str) -> bytes:
    """The bytes of a ``Span.attributes`` entry ``key`` = a double, up to the double's
    own eight (``_PACK_DOUBLE``)."""
    head = _framed.get((b"\x4a", key))
    if head is None:
        head = _attributes(b"\x4a", {key: 0.0})[:-8]
    return head


#: a double's eight bytes, as they follow ``double_head``
pack_double = _PACK_DOUBLE


def name_field(name: str) -> bytes:
    """``Span.name`` (field 5) of ``name``, as ``wire_span`` writes it (kept)."""
    named = _names.get(name)
    if named is None:
        named = _field(b"\x2a", name.encode())
        _keep(_names, name, named)
    return named


def child_span(trace_id: bytes, span_id: int, parent: bytes, name: str | bytes, start_ns: int,
               end_ns: int) -> bytes:
    """``wire_span`` of an ``INTERNAL`` span with no attributes or links, unset status,
    under a local parent (``trace_id``, ``parent``: the ids' bytes, as the request span's
    children share them; ``name`` may come written already, ``name_field``)."""
    named = name if type(name) is bytes else name_field(name)
    return b"".join((b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big"),
                     b"\x22\x08", parent, named, _INTERNAL, b"\x39", _PACK_FIXED64(start_ns),
                     b"\x41", _PACK_FIXED64(end_ns), _UNSET, _CHILD_FLAGS))


#: the parts ``child_span`` and ``server_span`` write around what changes from span to
#: span, for a writer that joins a batch's spans itself (``SpanBuilder.plain_spans``):
#: ``ID_HEAD`` trace id ``SPAN_HEAD`` span id [``PARENT_HEAD`` parent id], then
#: ``child_head(name)`` (or ``server_head``) start ``END_HEAD`` end, then a child's
#: ``CHILD_END`` (a server span's attributes and ``server_end``)
ID_HEAD, SPAN_HEAD, PARENT_HEAD, END_HEAD = b"\x0a\x10", b"\x12\x08", b"\x22\x08", b"\x41"
#: a time's eight bytes, as they follow ``child_head``/``server_head`` and ``END_HEAD``
pack_fixed64 = _PACK_FIXED64


def child_head(named: bytes) -> bytes:
    """An ``INTERNAL`` span's name (``name_field``) and kind, up to its start time."""
    return named + _INTERNAL + b"\x39"


def server_head(named: bytes) -> bytes:
    """A ``SERVER`` span's name (``name_field``) and kind, up to its start time."""
    return named + _SERVER + b"\x39"


def server_end(links: bytes, error: bool) -> bytes:
    """What follows a ``SERVER`` span's attributes: its links (``link_block``), status
    and flags, under a local parent or none."""
    return links + (_ERROR if error else _UNSET) + _CHILD_FLAGS


def server_span(trace_id: bytes, span_id: bytes, parent_span_id: int | None,
                parent_remote: bool, named: bytes, start_ns: int, end_ns: int,
                attributes: bytes, links: bytes, error: bool) -> bytes:
    """``wire_span`` of a ``SERVER`` span from parts written already: the ids' bytes,
    its name (``name_field``), its attributes (``attributes_block``) and links
    (``link_block``); the same bytes in one step."""
    return b"".join((
        b"\x0a\x10", trace_id, b"\x12\x08", span_id,
        b"" if parent_span_id is None else b"\x22\x08" + parent_span_id.to_bytes(8, "big"),
        named, _SERVER, b"\x39" + _PACK_FIXED64(start_ns) if start_ns else b"",
        b"\x41" + _PACK_FIXED64(end_ns) if end_ns else b"", attributes, links,
        _ERROR if error else _UNSET, _REMOTE_CHILD_FLAGS if parent_remote else _CHILD_FLAGS))


def wire_span(name: str, trace_id: int, span_id: int, parent_span_id: int | None,
              parent_remote: bool, kind: int, start_ns: int, end_ns: int,
              attributes: Mapping[str, Any] | bytes | None,
              links: Sequence[tuple[int, int, Mapping]] | bytes, error: bool) -> bytes:
    """The ``Span`` message ``_span`` writes for a ``ReadableSpan`` of these values (no
    trace state, events or dropped counts; ``kind`` the SDK's ``SpanKind`` value; each
    link (trace id, span id, attributes) to a local, sampled span). ``attributes`` and
    ``links`` may come written already (``attributes_block``, ``link_block``)."""
    out = [b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big")]
    if parent_span_id is not None:
        out += (b"\x22\x08", parent_span_id.to_bytes(8, "big"))
    if name:
        named = _names.get(name)
        if named is None:
            named = _field(b"\x2a", name.encode())
            _keep(_names, name, named)
        out.append(named)
    out.append(b"\x30" + _SMALL[_KIND[kind]])
    if start_ns:
        out.append(b"\x39" + _PACK_FIXED64(start_ns))
    if end_ns:
        out.append(b"\x41" + _PACK_FIXED64(end_ns))
    out.append(attributes if type(attributes) is bytes else _attributes(b"\x4a", attributes))
    if type(links) is bytes:
        out.append(links)
    else:
        for link_trace, link_span, link_attributes in links:
            out.append(link_block(link_trace, link_span, link_attributes))
    out.append(_ERROR if error else _UNSET)
    out.append(b"\x85\x01" + (_REMOTE_FLAGS if parent_remote else _LOCAL_FLAGS))
    return b"".join(out)


_LOCAL_FLAGS = _PACK_FIXED32(_HAS_IS_REMOTE)
_REMOTE_FLAGS = _PACK_FIXED32(_HAS_IS_REMOTE | _IS_REMOTE)
_CHILD_FLAGS = b"\x85\x01" + _LOCAL_FLAGS
_REMOTE_CHILD_FLAGS = b"\x85\x01" + _REMOTE_FLAGS
_INTERNAL = b"\x30" + _SMALL[_KIND[0]]  # Span.kind of the SDK's SpanKind.INTERNAL (0)
_SERVER = b"\x30" + _SMALL[_KIND[1]]  # and of SpanKind.SERVER (1)
CHILD_END = _UNSET + _CHILD_FLAGS
_resources: dict[int, tuple[Any, bytes]] = {}
_scopes: dict[int, tuple[Any, bytes]] = {}


def _resource(resource: Any) -> bytes:
    """Resource (attributes = 1), kept per resource object (one per process)."""
    held = _resources.get(id(resource))
    if held is None or held[0] is not resource:
        held = (resource, _attributes(b"\x0a", resource.attributes))
        if len(_resources) > 64:
            _resources.clear()
        _resources[id(resource)] = held
    return held[1]


def _scope(scope: Any) -> bytes:
    """InstrumentationScope (name = 1, version = 2, attributes = 3)."""
    if scope is None:
        return b""
    held = _scopes.get(id(scope))
    if held is None or held[0] is not scope:
        body = b""
        if scope.name:
            body += _field(b"\x0a", scope.name.encode())
        if scope.version:
            body += _field(b"\x12", scope.version.encode())
        body += _attributes(b"\x1a", scope.attributes)
        if len(_scopes) > 64:
            _scopes.clear()
        held = _scopes[id(scope)] = (scope, body)
    return held[1]


def encode_request(spans: Sequence[Any]) -> bytes:
    """The ``ExportTraceServiceRequest`` of ``spans`` (``ReadableSpan``), serialized;
    raises ``Unsupported`` for a span it cannot write."""
    pieces = _one_scope(spans)
    if pieces is not None:  # the common batch: WireSpans of one resource and scope
        first = spans[0]
        return _resource_spans(first.resource, [(first.instrumentation_scope, pieces)])
    # grouped by identity: Resource.__hash__ writes its attributes as JSON on every call,
    # and a process has one resource and one scope
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        held = groups.get(id(resource))
        if held is None:
            held = groups[id(resource)] = (resource, {})
        kept = held[1].get(id(scope))
        if kept is None:
            kept = held[1][id(scope)] = (scope, [])
        kept[1].append(_field(b"\x12", span.wire if type(span) is WireSpan else _span(span)))
    return b"".join(_resource_spans(resource, list(by_scope.values()))
                    for resource, by_scope in groups.values())


#: the varints of lengths up to 2 kB, the lengths of almost every span
_LENGTHS = [_varint(n) for n in range(0x800)]


def _one_scope(spans: Sequence[Any]) -> list[bytes] | None:
    """The ``ScopeSpans.spans`` fields of ``spans``, as pieces to join, when every one is
    a ``WireSpan`` of the first's resource and scope (the batches this module's builder
    makes); else None. One pass, no grouping."""
    if not spans or type(spans[0]) is not WireSpan:
        return None
    first = spans[0]
    resource, scope = first.resource, first.instrumentation_scope
    if not scope:
        return None
    pieces: list[bytes] = []
    append, lengths = pieces.append, _LENGTHS
    for span in spans:
        if type(span) is not WireSpan or span.resource is not resource \
                or span.instrumentation_scope is not scope:
            return None
        wire = span.wire
        n = len(wire)
        append(b"\x12")  # ScopeSpans.spans = 2
        append(lengths[n] if n < 0x800 else _varint(n))
        append(wire)
    return pieces


def _resource_spans(resource: Any, scopes: list[tuple[Any, list[bytes]]]) -> bytes:
    """One ``ExportTraceServiceRequest.resource_spans`` field: ``resource`` and, for each
    (scope, its ``spans`` fields written already), a ``ScopeSpans``."""
    body = [_field(b"\x0a", _resource(resource))]  # ResourceSpans.resource = 1
    for scope, spans in scopes:
        inner = [_field(b"\x0a", _scope(scope)), *spans]  # ScopeSpans.scope = 1
        if scope is not None and scope.schema_url:
            inner.append(_field(b"\x1a", scope.schema_url.encode()))
        body.append(_field(b"\x12", b"".join(inner)))  # scope_spans = 2
    if resource.schema_url:
        body.append(_field(b"\x1a", resource.schema_url.encode()))
    return _field(b"\x0a", b"".join(body))  # resource_spans = 1


#: the gRPC method the OTLP trace exporter calls
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _request_bytes(request: Any) -> bytes:
    """What goes on the wire: ``encode_request``'s bytes as they are, a message (the
    SDK's encoder's, for a batch this one cannot write) serialized."""
    return request if isinstance(request, bytes) else request.SerializeToString()


class _BytesTraceStub:
    """The trace service's stub, sending a request given as bytes without parsing it
    into a message first (that parse and the serialization after it cost about a
    tenth of the encoding)."""

    def __init__(self, channel: Any) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse)

        self.Export = channel.unary_unary(EXPORT_METHOD, request_serializer=_request_bytes,
                                          response_deserializer=ExportTraceServiceResponse.FromString)


def fast_grpc_exporter(**kwargs: Any) -> Any:
    """The SDK's OTLP gRPC span exporter (``kwargs`` as its own) encoding with
    ``encode_request`` and sending its bytes as they are; a batch it cannot write goes
    through the SDK's encoder."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class FastOTLPSpanExporter(OTLPSpanExporter):
        #: ``WireSpan``s are sent as they are (``SpanBuilder(wire=True)`` makes them)
        takes_wire_spans = True

        def _initialize_channel_and_stub(self) -> None:  # also on each reconnection
            super()._initialize_channel_and_stub()
            self._client = _BytesTraceStub(self._channel)

        def _translate_data(self, data: Sequence[Any]) -> Any:
            try:
                return encode_request(data)
            except Unsupported:
                return super()._translate_data(data)

    return FastOTLPSpanExporter(**kwargs)


class _Written:
    """What the SDK's HTTP exporter takes from its encoder for a batch of ``WireSpan``s:
    ``encode_request``'s bytes, serialized already."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializePartialToString(self) -> bytes:  # noqa: N802 - protobuf's names
        return self.data

    SerializeToString = SerializePartialToString

    def ByteSize(self) -> int:  # noqa: N802
        return len(self.data)


def _written_by_wire(module: Any) -> bool:
    """Make the encoder the SDK's HTTP span exporter module ``module`` calls
    (``encode_spans``) write a batch of ``WireSpan``s with ``encode_request``; any other
    batch still goes to the SDK's. False when this SDK's module has no such encoder."""
    sdk = getattr(module, "encode_spans", None)
    if sdk is None:
        return False
    if getattr(sdk, "writes_wire_spans", False):
        return True

    def encode_spans(spans: Sequence[Any]) -> Any:
        if spans and type(spans[0]) is WireSpan:
            return _Written(encode_request(spans))
        return sdk(spans)

    encode_spans.writes_wire_spans = True  # type: ignore[attr-defined]
    module.encode_spans = encode_spans
    return True


def fast_http_exporter(**kwargs: Any) -> Any:
    """The SDK's OTLP HTTP/protobuf span exporter (``kwargs`` as its own) taking
    ``WireSpan``s, whose bytes it posts as they are; everything else (session, retries,
    headers, compression, timeouts, the ``OTEL_*`` variables) is the SDK's. Its module's
    encoder is wrapped for that (``_written_by_wire``): the exporter calls it by name,
    and has no hook of its own for the encoding. A batch of the SDK's spans is encoded as
    before. Where this SDK's module has no such encoder, the SDK's exporter as it is
    (its spans are then built as ``ReadableSpan``s)."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    if not _written_by_wire(trace_exporter):
        return trace_exporter.OTLPSpanExporter(**kwargs)

    class FastOTLPHttpSpanExporter(trace_exporter.OTLPSpanExporter):
        #: ``WireSpan``s are posted as they are (``SpanBuilder(wire=True)`` makes them)
        takes_wire_spans = True

    return FastOTLPHttpSpanExporter(**kwargs)
