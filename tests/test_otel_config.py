"""The span export's configuration is checked at start: an endpoint the exporter would
misread, an ``OTEL_*`` variable the SDK would trip over late (a traceback, a default in
its place, an error at the first span) or that the server cannot honour, each refused
in one line naming the flag or the variable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.engine.otel_config import ConfigurationError, check, check_endpoint, \
    check_environment, protocol_of

GOOD = "http://127.0.0.1:4317"


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:4317", "https://collector:4318/x",
                                      "http://[::1]:4317", "http://collector"])
def test_urls_with_a_scheme_a_host_and_a_port_that_exists_are_taken(endpoint):
    check_endpoint(endpoint)  # over HTTP a URL without a port is its scheme's


def test_over_grpc_the_endpoint_names_its_port():
    check_endpoint(GOOD, "grpc")
    with pytest.raises(ConfigurationError, match="give the collector's gRPC port"):
        check_endpoint("http://collector", "grpc")  # was dialled at 443
    with pytest.raises(ConfigurationError, match="gRPC port"):
        check("http://collector", None, {})  # gRPC: the default protocol


@pytest.mark.parametrize("endpoint, words", [
    # was dialled at port 34463 (99999 - 65536)
    ("http://127.0.0.1:99999", "not a number from 1 to 65535"),
    ("http://127.0.0.1:port", "not a number from 1 to 65535"),
    ("http://127.0.0.1:0", "port 0 is no port"),
    # were dialled over TLS, every export failing its handshake
    ("127.0.0.1:4317", "give a URL, http://HOST:PORT (plain)"),
    ("ftp://127.0.0.1:4317", "give a URL"),
    ("http://", "give a URL"),
])
def test_an_endpoint_the_exporter_would_misread_is_refused(endpoint, words):
    with pytest.raises(ConfigurationError) as info:
        check_endpoint(endpoint)
    assert words in str(info.value) and str(info.value).startswith("--otlp-traces-endpoint")


@pytest.mark.parametrize("environ, words", [
    ({"OTEL_SDK_DISABLED": "true"}, "OTEL_SDK_DISABLED=true turns OpenTelemetry off"),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, "OTEL_TRACES_SAMPLER='always_off' is not used"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio"}, "--trace-config rate=N"),
    # printed a traceback and went on with the default
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "garbage"}, "OTEL_BSP_MAX_QUEUE_SIZE='garbage' is not a "
                                             "whole number"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY='soon'"),
    # stopped the server blaming the wrong flag
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE=0 must be at least 1"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "-1"}, "OTEL_BSP_SCHEDULE_DELAY=-1 must be at least 1"),
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100000"}, "more than the queue holds"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "11"},
     "OTEL_BSP_MAX_QUEUE_SIZE, 10)"),
    # a queue smaller than the default batch: the SDK refused it in the child, blaming the
    # endpoint flag
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE (512, the default)"),
    ({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "nan"}, "is not a positive number"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "0"}, "OTEL_EXPORTER_OTLP_TIMEOUT='0'"),
])
def test_an_otel_variable_the_export_cannot_run_with_is_named(environ, words):
    with pytest.raises(ConfigurationError) as info:
        check_environment(environ)
    assert words in str(info.value)


def test_the_variables_it_can_run_with_are_taken():
    check_environment({})
    check_environment({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_SAMPLER": "always_on",
                       "OTEL_BSP_MAX_QUEUE_SIZE": "4096", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE":
                       "4096", "OTEL_BSP_SCHEDULE_DELAY": " 100 ",
                       "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5"})
    check_environment({"OTEL_TRACES_SAMPLER": "ParentBased_Always_On"})


def test_the_protocol_comes_from_the_argument_then_the_variables_each_named_when_wrong():
    assert protocol_of(None, {}) == "grpc"
    assert protocol_of(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/protobuf"}) == \
        "http/protobuf"
    assert protocol_of(None, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                              "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "grpc"
    assert protocol_of("http/protobuf", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "x"}) == \
        "http/protobuf"
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        with pytest.raises(ConfigurationError, match=f"{name}='http/json' is not an OTLP"):
            protocol_of(None, {name: "http/json"})
    assert check(GOOD, None, {}) == "grpc"


@pytest.mark.parametrize("args, env, words", [
    (["--otlp-traces-endpoint", "http://127.0.0.1:99999"], {}, "not a number from 1 to 65535"),
    (["--otlp-traces-endpoint", GOOD], {"OTEL_BSP_MAX_QUEUE_SIZE": "garbage"},
     "OTEL_BSP_MAX_QUEUE_SIZE='garbage'"),
    (["--otlp-traces-endpoint", GOOD], {"OTEL_SDK_DISABLED": "TRUE"}, "OTEL_SDK_DISABLED"),
])
def test_serve_stops_at_start_in_one_line_naming_the_flag_or_variable(args, env, words,
                                                                     monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    r = subprocess.run([sys.executable, "-m", "runtime.tools.cli", "serve", "--model", "mlp",
                        "--port", "0", "--no-record", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert words in r.stderr and "Traceback" not in r.stderr
    assert "--adapter" not in r.stderr  # it named the wrong flag
