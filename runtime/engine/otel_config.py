"""The span export's configuration, checked once at start: the endpoint and the standard
``OTEL_*`` variables the OpenTelemetry SDK reads.

The SDK reads these variables late and forgivingly: a queue size of ``garbage`` prints a
traceback and falls back to the default, a protocol it does not know fails only when
the first span is sent, ``http://host:99999`` connects to port 34463 (99999 - 65536),
and an endpoint without a scheme is dialled over TLS. ``check(endpoint, protocol,
environ)`` refuses each of these before the server starts, with a ``ConfigurationError``
whose one line names the flag or the variable and says what it takes.

Two variables the server cannot honour are refused rather than ignored:
``OTEL_SDK_DISABLED=true`` (the flag asks for spans, the variable for none) and an
``OTEL_TRACES_SAMPLER`` other than ``always_on`` / ``parentbased_always_on`` (which
requests are traced is Triton's ``trace_rate``, or a caller's sampled ``traceparent``).
"""

from __future__ import annotations

import math
from typing import Mapping
from urllib.parse import urlsplit

#: the OTLP transports the server's exporters speak
PROTOCOLS = ("grpc", "http/protobuf")
#: samplers that take every span the server makes (it samples by ``trace_rate`` itself)
TAKE_ALL_SAMPLERS = ("always_on", "parentbased_always_on")
#: the batch span processor's variables: whole numbers of at least 1 (milliseconds for
#: the delay and the timeout)
_BSP = ("OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
#: the SDK's default queue and batch sizes (the batch may not exceed the queue)
_DEFAULT_QUEUE = 2048
_DEFAULT_BATCH = 512
#: the exporters' timeouts: a positive number
_TIMEOUTS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


class ConfigurationError(ValueError):
    """A span export configuration the server refuses; its message is the whole line."""


def protocol_of(protocol: str | None, environ: Mapping[str, str]) -> str:
    """The OTLP protocol: ``protocol``, else the standard variables', else ``grpc``;
    ``ConfigurationError`` naming where an unknown one came from."""
    for source, value in (("the protocol", protocol),
                          ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                           environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")),
                          ("OTEL_EXPORTER_OTLP_PROTOCOL",
                           environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"))):
        if value is not None and value.strip():
            chosen = value.strip().lower()
            if chosen not in PROTOCOLS:
                raise ConfigurationError(
                    f"{source}={value.strip()[:60]!r} is not an OTLP protocol the server "
                    f"sends; use {' or '.join(PROTOCOLS)}")
            return chosen
    return "grpc"


def check_endpoint(endpoint: str, protocol: str = "http/protobuf") -> None:
    """``ConfigurationError`` unless ``endpoint`` is an http(s) URL with a host and, if
    it names one, a port from 1 to 65535; over gRPC it must name one (a gRPC target
    without a port is dialled at 443)."""
    shown = endpoint.strip()[:200]
    try:
        parts = urlsplit(endpoint.strip())
        port = parts.port
    except ValueError:
        raise ConfigurationError(f"--otlp-traces-endpoint {shown!r}: its port is not a "
                                 "number from 1 to 65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"--otlp-traces-endpoint {shown!r}: give a URL, http://HOST:PORT (plain) or "
            "https://HOST:PORT (TLS), e.g. http://127.0.0.1:4317 for a collector's gRPC port")
    if port == 0:
        raise ConfigurationError(f"--otlp-traces-endpoint {shown!r}: port 0 is no port; give "
                                 "the collector's (4317 for gRPC, 4318 for HTTP)")
    if port is None and protocol == "grpc":
        raise ConfigurationError(f"--otlp-traces-endpoint {shown!r}: give the collector's "
                                 "gRPC port, e.g. http://HOST:4317 (without one it is "
                                 "dialled at 443)")


def _whole(name: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigurationError(f"{name}={value.strip()[:60]!r} is not a whole number; give "
                                 "one of at least 1, or unset it") from None
    if number < 1:
        raise ConfigurationError(f"{name}={number} must be at least 1 (or unset it)")
    return number


def check_environment(environ: Mapping[str, str]) -> None:
    """``ConfigurationError`` for an ``OTEL_*`` variable the export cannot run with."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        raise ConfigurationError("OTEL_SDK_DISABLED=true turns OpenTelemetry off, and "
                                 "--otlp-traces-endpoint asks for spans: unset one of them")
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler and sampler not in TAKE_ALL_SAMPLERS:
        raise ConfigurationError(
            f"OTEL_TRACES_SAMPLER={sampler[:60]!r} is not used: which requests are traced "
            "is set by trace_rate (--trace-config rate=N, or /v2/trace/setting) and a "
            "caller's sampled traceparent; unset it, or set it to always_on")
    numbers = {name: _whole(name, environ[name]) for name in _BSP
               if environ.get(name, "").strip()}
    batch = numbers.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _DEFAULT_BATCH)
    queue = numbers.get("OTEL_BSP_MAX_QUEUE_SIZE", _DEFAULT_QUEUE)
    if batch > queue:
        raise ConfigurationError(
            f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE ({batch}"
            f"{'' if 'OTEL_BSP_MAX_EXPORT_BATCH_SIZE' in numbers else ', the default'}) is "
            f"more than the queue holds (OTEL_BSP_MAX_QUEUE_SIZE, {queue}"
            f"{'' if 'OTEL_BSP_MAX_QUEUE_SIZE' in numbers else ', the default'}); make the "
            "batch size at most the queue size")
    for name in _TIMEOUTS:
        value = environ.get(name, "").strip()
        if not value:
            continue
        try:
            timeout = float(value)
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise ConfigurationError(f"{name}={value[:60]!r} is not a positive number; give "
                                     "one, or unset it")


def check(endpoint: str, protocol: str | None, environ: Mapping[str, str]) -> str:
    """Check the whole configuration (module doc); the protocol it uses."""
    chosen = protocol_of(protocol, environ)
    check_endpoint(endpoint, chosen)
    check_environment(environ)
    return chosen
