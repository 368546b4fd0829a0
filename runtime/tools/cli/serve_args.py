"""``batchscope serve``'s flags and the checks that turn them into what the service
is built from: the models (``load_models``), each model's settings (``model_settings``),
the device, the control token (``serve_auth``), ``--trace-config`` and ``--adapter``."""

from __future__ import annotations

import argparse
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from batchscope import settings as schema
from runtime.api.errors import ConfigError
from runtime.tools.cli.common import UsageError, _add_setting_flags, _add_token_flags


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve models over HTTP (KServe v2)")
    p.add_argument("--model", action="append", dest="models", metavar="SPEC",
                   help="builtin name (mlp, encoder, minilm, wide; decoder = generation at "
                        "/v1/completions), module:Class, path/file.py:Class, or files you "
                        "have: hf:DIR, onnx:FILE.onnx, pt2:FILE.pt2 (options after the path: "
                        "hf:DIR,task=generation); NAME=SPEC serves it as NAME; repeat for "
                        "several models (default: mlp and encoder)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); any other than loopback "
                        "needs a control token")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                   help="also serve the KServe v2 / Triton gRPC API on PORT (0 picks a free "
                        "port; default: no gRPC server)")
    _add_token_flags(p, "settings changes over HTTP")
    fleet = p.add_argument_group(
        "replicas behind Ray Serve's router (the fleet extra: pip install 'batchscope[fleet]')")
    fleet.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve N replicas, each the whole engine recording to --db (use a "
                            "database every replica reaches: PostgreSQL across machines)")
    fleet.add_argument("--min-replicas", type=int, default=None, metavar="N",
                       help="autoscale with Ray Serve between --min-replicas and --max-replicas")
    fleet.add_argument("--max-replicas", type=int, default=None, metavar="N")
    fleet.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="join this Ray cluster ('auto': the one this machine belongs to); "
                            "default: start Ray on this machine for the fleet")
    p.add_argument("--db", default=None, metavar="URL",
                   help="SQLAlchemy URL, e.g. sqlite:////abs/path/file.db (default "
                        "$BATCHSCOPE_DB_URL or sqlite:///data/batchscope.db)")
    p.add_argument("--no-record", action="store_true", help="do not write to the database")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--device-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the request models in a child process with its own GIL, so "
                        "HTTP handling and the forward pass do not wait for each other "
                        "(default: on with --device cpu, off on a GPU)")
    p.add_argument("--direct-max-compute-ms", type=float, default=None, metavar="MS",
                   help="with the device process on the CPU: a batch that finds the process "
                        "idle and is expected to take at most this long runs in the serving "
                        "process, without the hop, and a lone longer one (up to 50 ms) that "
                        "finds it busy runs on a thread there (default 2; 0: never)")
    p.add_argument("--device-nice", type=int, default=None, metavar="N",
                   help="run the device process N levels nicer than the serving process, "
                        "0 to 19 (default: the same, and on the CPU 10 nicer once the model "
                        "is measured to cost less per request than the event loop, which "
                        "then goes first)")
    p.add_argument("--recorder-process", action=argparse.BooleanOptionalAction, default=True,
                   help="write recorded rows to the database from a child process, so the "
                        "database work costs the serving process almost nothing (default: on)")
    p.add_argument("--instance-id", default=None)
    p.add_argument("--heartbeat-interval-s", type=float, default=2.0)
    p.add_argument("--control-poll-interval-s", type=float, default=0.5)
    p.add_argument("--retention-raw-s", type=float, default=24 * 3600.0)
    p.add_argument("--drain-timeout-s", type=float, default=5.0, metavar="S",
                   help="on SIGTERM/SIGINT: new requests are answered 503 with Retry-After, "
                        "those taken in are answered (streams finish, or end with an error "
                        "event and [DONE]), and the process exits, all within S seconds "
                        "(default 5; keep it under the orchestrator's grace period)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans of traced requests and their batches to "
                        "this OTLP endpoint (gRPC, or http/protobuf by "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); turns tracing on at Triton's "
                        "default rate (1 in 1000; --trace-config rate=N to change it)")
    p.add_argument("--trace-config", action="append", default=[], metavar="[MODE,]KEY=VALUE",
                   help="trace settings at start, as Triton's --trace-config: level=TIMESTAMPS, "
                        "rate=N, count=N, mode=triton|opentelemetry, triton,file=PATH, "
                        "triton,log-frequency=N, opentelemetry,url=URL (OTLP/HTTP), "
                        "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_*=N "
                        "(the settings changeable later at /v2/trace/setting)")
    p.add_argument("--nvtx", action="store_true",
                   help="NVTX ranges around each batch and generation step (batch id as payload) "
                        "for Nsight Systems; nothing without CUDA or a profiler")
    _add_setting_flags(p)
    p.add_argument("--adapter", action="append", default=[], dest="adapters",
                   metavar="[MODEL:]NAME=PATH",
                   help="a LoRA adapter to serve from the start: a PEFT directory "
                        "(adapter_config.json, adapter_model.safetensors); MODEL may be left "
                        "out when one served model takes adapters (docs/adapters.md)")
    p.add_argument("--model-config", action="append", default=[], metavar="NAME=PATH.json",
                   help="per-model settings from a JSON object (BatchingConfig fields; "
                        "GenerationConfig fields for a generation model such as decoder)")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="NAME.FIELD=VALUE",
                   help="one setting of one model; VALUE as JSON or as its flag takes it (e.g. "
                        "mlp.max_batch_size=8, mlp.bucket_edges=16,32,64, "
                        "decoder.max_num_seqs=16). Request models take the batching settings "
                        "above; generation models take "
                        + ", ".join(s.name for s in schema.GENERATION))


def _set_value(setting: schema.Setting | None, text: str) -> Any:
    """A ``--set`` value: JSON when it reads as JSON, else the setting's own text form
    (``16,32``, ``none``, ``static``); the config class then checks it."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    if setting is None:  # an unknown field: the config class names the known ones
        return text
    return setting.parse_text(text)


def _per_model_changes(args: argparse.Namespace, names: Sequence[str],
                       request_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each model's settings changes: the shared batching flags (request models only),
    then ``--model-config`` files, then ``--set``, later ones winning."""
    shared = {s.name: getattr(args, s.name) for s in schema.BATCHING
              if hasattr(args, s.name)}  # only the flags given ('none' included)
    per_model: dict[str, dict[str, Any]] = {
        name: dict(shared) if name in request_names else {} for name in names}
    for item in args.model_config:
        name, sep, path = item.partition("=")
        if not sep or name not in per_model:
            raise UsageError(f"--model-config {item!r}: write NAME=PATH.json with NAME one of "
                             f"{list(names)}")
        try:
            doc = json.loads(_settings_file(path))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--model-config {item!r}: cannot read a JSON object from {path} "
                             f"({exc})") from None
        if not isinstance(doc, dict):
            raise UsageError(f"--model-config {item!r}: {path} must hold a JSON object of settings")
        per_model[name].update(doc)
    for item in args.sets:
        key, sep, value = item.partition("=")
        name, dot, field_name = key.rpartition(".")
        if not sep or not dot or name not in per_model:
            raise UsageError(f"--set {item!r}: write NAME.FIELD=VALUE with NAME one of {list(names)}")
        kind = "request" if name in request_names else "generate"
        try:
            per_model[name][field_name] = _set_value(schema.setting(kind, field_name), value)
        except ValueError as exc:
            raise UsageError(f"--set {item!r}: {exc}") from None
    return per_model


def model_settings(args: argparse.Namespace, models: dict, generation: dict) -> dict:
    """Per-model settings from the command line: a ``BatchingConfig`` for each request
    model and a ``GenerationConfig`` for each generation model (the latter is also put
    on the model as ``generation_config``, which its engine starts with)."""
    from runtime.api.config import BatchingConfig
    from runtime.generation.config import GenerationConfig

    names = list(models) + list(generation)
    per_model = _per_model_changes(args, names, list(models))
    configs: dict[str, Any] = {}
    for name, changes in per_model.items():
        try:
            if name in generation:
                model = generation[name]
                configs[name] = GenerationConfig.for_model(model.max_model_len, changes)
                model.generation_config = configs[name]
            else:
                configs[name] = BatchingConfig().with_changes(changes)
        except ConfigError as exc:
            kind = "generation" if name in generation else "batching"
            raise UsageError(f"batchscope serve: {kind} model {name!r}: {exc.message}") from None
    return configs


def load_models(specs: Sequence[str]) -> tuple[dict, dict]:
    """(request models, generation models) by served name, from ``--model`` specs."""
    from runtime.models.loader import is_generation_model, load_model

    models: dict[str, Any] = {}
    generation: dict[str, Any] = {}
    for spec in specs:
        model = load_model(spec)
        if model.name in models or model.name in generation:
            raise UsageError(f"two models are named {model.name!r}; serve one under another name "
                             f"with NAME=SPEC, e.g. --model {model.name}2={_bare(spec)}")
        model.source_spec = spec  # the device process loads request models again from it
        (generation if is_generation_model(model) else models)[model.name] = model
    return models, generation


def device_process_default(flag: bool | None, device: str) -> bool:
    """``--device-process`` as given, else on for the CPU: there the event loop and the
    forward pass would otherwise share one interpreter lock (about 1.4x the throughput
    for small models); on a GPU the forward pass mostly waits on the device already."""
    if flag is not None:
        return flag
    return device.strip().lower() == "cpu"


def check_device(spec: str) -> str:
    """``--device`` as torch names it, or a ``UsageError`` saying what is available."""
    import torch

    try:
        device = torch.device(spec.strip())
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {spec!r} is not a device name; write cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = torch.version.cuda or "none (a CPU-only build)"
            raise UsageError(f"--device {spec!r}: no CUDA device is available here (torch "
                             f"{torch.__version__}, CUDA {build}); serve with --device cpu")
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {spec!r}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise UsageError(f"--device {spec!r}: only cpu and cuda devices are supported")
    return str(device)


def serve_auth(args: argparse.Namespace, environ: Any = None) -> Any:
    """The server's ``AuthConfig`` from the token flags (or the environment) and
    ``--host``; a ``UsageError`` when it would listen beyond loopback without a token."""
    from runtime.server.auth import auth_for_listening, token_from

    try:
        token = token_from(args.control_token, args.control_token_file, environ)
        return auth_for_listening(args.host, token)
    except ConfigError as exc:
        raise UsageError(f"batchscope serve: {exc.message}") from None


#: ``--trace-config KEY=VALUE``: Triton's global keys and ours
_TRACE_KEYS = {"level": "trace_level", "rate": "trace_rate", "count": "trace_count",
               "mode": "trace_mode", "file": "trace_file", "log_frequency": "log_frequency",
               "log-frequency": "log_frequency"}
#: ``--trace-config triton,KEY=VALUE``: the keys of Triton's own trace mode
_TRITON_KEYS = {"file": "trace_file", "log-frequency": "log_frequency",
                "log_frequency": "log_frequency"}
#: ``--trace-config opentelemetry,KEY=VALUE``: Triton's batch span processor keys, as the
#: standard variables the SDK reads (``url`` is the endpoint, ``resource`` an attribute)
_OTEL_VARIABLES = {"bsp_max_queue_size": "OTEL_BSP_MAX_QUEUE_SIZE",
                   "bsp_schedule_delay": "OTEL_BSP_SCHEDULE_DELAY",
                   "bsp_max_export_batch_size": "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"}
_TRACE_FORMS = ("level=OFF|TIMESTAMPS, rate=N, count=N, mode=triton|opentelemetry, "
                "triton,file=PATH, triton,log-frequency=N, opentelemetry,url=URL, "
                "opentelemetry,resource=KEY=VALUE, opentelemetry,"
                + "|".join(_OTEL_VARIABLES) + "=N")


@dataclass(frozen=True)
class TraceFlags:
    """What ``--trace-config`` flags say: trace settings at start (``(key, value)``
    pairs, ``ServerConfig.trace_config``), the OTLP endpoint, and the standard ``OTEL_*``
    variables Triton's ``opentelemetry,...`` keys stand for (set for the span process)."""

    pairs: tuple[tuple[str, str], ...] = ()
    otlp_endpoint: str | None = None
    environ: dict[str, str] = field(default_factory=dict)


def trace_config(flags: list[str], otlp_endpoint: str | None = None,
                 environ: dict[str, str] | None = None) -> TraceFlags:
    """``--trace-config`` flags in Triton's forms: ``KEY=VALUE`` (``level``, ``rate``,
    ``count``, ``mode``, and ours: ``file``, ``log_frequency``), ``triton,KEY=VALUE``
    (``file``, ``log-frequency``) and ``opentelemetry,KEY=VALUE`` (``url``, ``resource``,
    ``bsp_*``), checked as ``/v2/trace/setting`` checks them. ``opentelemetry,url`` is the
    endpoint ``--otlp-traces-endpoint`` gives, over OTLP/HTTP as Triton's exporter sends
    unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says otherwise; ``mode=opentelemetry``
    needs an endpoint. ``environ``: the variables already set (default ``os.environ``)."""
    environ = dict(os.environ if environ is None else environ)
    pairs: list[tuple[str, str, str]] = []  # (setting, value, the flag it came from)
    variables: dict[str, str] = {}
    resources: list[str] = []
    url = None
    for flag in flags:
        mode, comma, rest = flag.partition(",")
        mode = mode.strip().lower() if comma else ""
        if comma and mode not in ("triton", "opentelemetry"):
            raise UsageError(f"--trace-config {flag!r}: a mode's setting is triton,KEY=VALUE "
                             f"or opentelemetry,KEY=VALUE; the forms: {_TRACE_FORMS}")
        key, sep, value = (rest if comma else flag).partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--trace-config {flag!r}: give KEY=VALUE, e.g. rate=100; the "
                             f"forms: {_TRACE_FORMS}")
        if mode == "opentelemetry":
            if key == "url":
                url = value.strip()
            elif key == "resource":
                if "=" not in value:
                    raise UsageError(f"--trace-config {flag!r}: give resource=KEY=VALUE, "
                                     "e.g. opentelemetry,resource=deployment.environment=prod")
                resources.append(value.strip())
            elif key in _OTEL_VARIABLES:
                variables[_OTEL_VARIABLES[key]] = value.strip()
            else:
                raise UsageError(f"--trace-config {flag!r}: unknown OpenTelemetry setting "
                                 f"{key[:64]!r}; the forms: {_TRACE_FORMS}")
            continue
        name = (_TRITON_KEYS if mode == "triton" else _TRACE_KEYS).get(key.lower())
        if name is None:
            raise UsageError(f"--trace-config {flag!r}: unknown {mode + ' ' if mode else ''}"
                             f"trace setting {key[:64]!r}; the forms: {_TRACE_FORMS}")
        pairs.append((name, value, flag))
    endpoint = otlp_endpoint
    if url is not None:
        if otlp_endpoint and otlp_endpoint != url:
            raise UsageError(f"--trace-config opentelemetry,url={url[:200]!r} and "
                             f"--otlp-traces-endpoint {otlp_endpoint[:200]!r} name two "
                             "endpoints: give one")
        endpoint = url
        if not otlp_endpoint and not (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                                      or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")):
            variables["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    if resources:
        variables["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(
            [*filter(None, [environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip()]), *resources])
    _check_trace_pairs(pairs, endpoint)
    return TraceFlags(tuple((key, value) for key, value, _ in pairs), endpoint, variables)


def _check_trace_pairs(pairs: list[tuple[str, str, str]], endpoint: str | None) -> None:
    """Each setting's value, as the trace settings check it at run time."""
    from runtime.api.errors import ClientError
    from runtime.core.tracing import config_changes

    for key, value, flag in pairs:
        try:
            changes = config_changes([(key, value)])
        except ClientError as exc:
            raise UsageError(f"--trace-config {flag!r}: {exc.message.split('; send ')[0]}; "
                             f"it takes {_value_form(key)}") from None
        if changes.get("trace_mode") == "opentelemetry" and not endpoint:
            raise UsageError(f"--trace-config {flag!r}: spans go to an OTLP endpoint; give "
                             "--otlp-traces-endpoint URL (or --trace-config "
                             "opentelemetry,url=URL) too, or leave the mode triton")


def _value_form(key: str) -> str:
    """What a ``--trace-config`` setting takes, in the command line's words."""
    return {"trace_level": "OFF or TIMESTAMPS", "trace_rate": "a whole number of at least 1",
            "trace_count": "a whole number of at least -1 (-1: no limit)",
            "log_frequency": "a whole number of at least 0 (0: one file)",
            "trace_file": "a path", "trace_mode": "triton or opentelemetry"}[key]


def adapter_args(items: list[str], models: dict) -> list[tuple[str, str, str]]:
    """``--adapter [MODEL:]NAME=PATH`` values as (model, name, path)."""
    takers = [name for name, model in models.items() if getattr(model, "adapter_targets", None)]
    out = []
    for item in items:
        head, eq, path = item.partition("=")
        model, colon, name = head.rpartition(":")
        if not eq or not name or not path:
            raise UsageError(f"--adapter {item!r}: write NAME=PATH or MODEL:NAME=PATH")
        if not colon:
            if len(takers) != 1:
                raise UsageError(f"--adapter {item!r}: name the model (MODEL:NAME=PATH); models "
                                 f"that take adapters: {takers or 'none'}")
            model = takers[0]
        if model not in takers:
            raise UsageError(f"--adapter {item!r}: model {model!r} takes no adapters; models "
                             f"that do: {takers or 'none'}")
        out.append((model, name, path))
    return out


#: the largest settings file ``--model-config`` reads
MAX_SETTINGS_FILE_BYTES = 1 << 20


def _settings_file(path: str) -> str:
    """The text of a settings file: a regular file of at most ``MAX_SETTINGS_FILE_BYTES``
    (a device or a pipe would be read without end), else ``ValueError`` saying so."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("it is not a regular file")
    if st.st_size > MAX_SETTINGS_FILE_BYTES:
        raise ValueError(f"it holds {st.st_size:,} bytes, more than a settings file may "
                         f"({MAX_SETTINGS_FILE_BYTES:,})")
    return Path(path).read_text()


def _bare(spec: str) -> str:
    """``spec`` without the ``NAME=`` it may start with (a kind such as ``hf:`` or a
    path holds no ``=`` before its first ``:`` or ``/``)."""
    name, sep, rest = spec.partition("=")
    return rest if sep and not any(c in name for c in ":/,") else spec
