"""The ``batchscope`` command: ``serve``, ``load``, ``tune``, ``snapshot``, ``trace`` and ``k8s``.

Input mistakes (unknown model, bad flag values, invalid settings) end with exit
status 2 and one line on stderr saying what was wrong; no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from batchscope import settings as schema
from batchscope.load.loadgen import LoadError
from batchscope.tuning.client import TuningError
from runtime.api.errors import BatchScopeError, ConfigError

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake in the command line; reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


# -- serve --------------------------------------------------------------------------------
# Every request-model setting of ``batchscope.settings.BATCHING`` is a flag of its own
# (``max_batch_size`` -> ``--max-batch-size``; a true/false one -> ``--bucketing`` /
# ``--no-bucketing``) that applies to every served request model; ``--set`` reaches any
# setting of one model, generation models included. Adding a setting to the schema adds
# its flag and its help text here.
def _flag_type(setting: schema.Setting) -> Callable[[str], Any]:
    """The argparse ``type`` of a setting's flag: ``Setting.parse_text``, with argparse's
    usual wording for a value that is not a number (``invalid int value: 'lots'``)."""

    def parse(text: str) -> Any:
        try:
            return setting.parse_text(text)
        except ValueError as exc:
            if setting.kind in ("int", "float"):
                raise argparse.ArgumentTypeError(
                    f"invalid {setting.kind} value: {text!r}; write {setting.describe()}") from None
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.kind
    return parse


def _flag_help(setting: schema.Setting) -> str:
    text = f"{setting.doc} Valid: {setting.describe()}; default {setting.default_text()}."
    return text.replace("%", "%%")


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("batching settings (every request model; see also --set)")
    for setting in schema.BATCHING:
        if setting.kind == "bool":
            group.add_argument(setting.flag, dest=setting.name, default=argparse.SUPPRESS,
                               action=argparse.BooleanOptionalAction, help=_flag_help(setting))
        else:
            metavar = {"int_list": "N,N,...", "choice": "{" + ",".join(setting.choices) + "}"
                       }.get(setting.kind, setting.name.upper())
            group.add_argument(setting.flag, dest=setting.name, default=argparse.SUPPRESS,
                               type=_flag_type(setting), metavar=metavar,
                               help=_flag_help(setting))


def _add_token_flags(p: argparse.ArgumentParser, what: str) -> None:
    token = p.add_argument_group(
        f"control token ({what} send 'Authorization: Bearer <token>'; required beyond "
        "loopback, optional on it)")
    token.add_argument("--control-token-file", default=None, metavar="PATH",
                       help="read the token from PATH, a file only its owner may read "
                            "(chmod 600)")
    token.add_argument("--control-token", default=None, metavar="TOKEN",
                       help="the token itself (other local users can see it in the process "
                            "list: prefer --control-token-file or $BATCHSCOPE_CONTROL_TOKEN, "
                            "which is read when neither flag is given)")


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve models over HTTP (KServe v2)")
    p.add_argument("--model", action="append", dest="models", metavar="SPEC",
                   help="builtin name (mlp, encoder, minilm, wide; decoder = generation at "
                        "/v1/completions), module:Class or path/file.py:Class; repeat for "
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
    p.add_argument("--trace-config", action="append", default=[], metavar="KEY=VALUE",
                   help="trace settings at start, as Triton's --trace-config: level=TIMESTAMPS, "
                        "rate=N, count=N, log_frequency=N, file=PATH, mode=triton|opentelemetry "
                        "(changeable later at /v2/trace/setting)")
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
            doc = json.loads(Path(path).read_text())
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
                             f"with NAME=SPEC, e.g. --model {model.name}2={spec}")
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


def check_database_url(url: str, source: str) -> str:
    """``url`` if SQLAlchemy can open that kind of database here, else a ``UsageError``
    saying what to write (a plain path gets the ``sqlite:///`` URL of that path) or
    which driver is missing."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    example = "sqlite:////abs/path/file.db or postgresql+psycopg://user@host/db"
    if "://" not in url and ":" not in url.split("/", 1)[0]:
        path = Path(url).expanduser().absolute()
        raise UsageError(f"{source} {url!r} is a path, not a database URL; write "
                         f"sqlite:///{path} (sqlite:/// then the absolute path)")
    try:
        dialect = make_url(url).get_dialect()
    except NoSuchModuleError:  # before ArgumentError, its base class
        raise UsageError(f"{source} {url!r}: SQLAlchemy knows no database "
                         f"{url.split(':', 1)[0]!r}; write one like {example}") from None
    except ArgumentError:
        raise UsageError(f"{source} {url!r} is not a database URL; write one like "
                         f"{example}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise UsageError(f"{source} {url!r} needs the database driver {exc.name or exc}, "
                         "which is not installed; install it with pip") from None
    return url


def serve_auth(args: argparse.Namespace, environ: Any = None) -> Any:
    """The server's ``AuthConfig`` from the token flags (or the environment) and
    ``--host``; a ``UsageError`` when it would listen beyond loopback without a token."""
    from runtime.server.auth import auth_for_listening, token_from

    try:
        token = token_from(args.control_token, args.control_token_file, environ)
        return auth_for_listening(args.host, token)
    except ConfigError as exc:
        raise UsageError(f"batchscope serve: {exc.message}") from None


def trace_config(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """``--trace-config KEY=VALUE`` flags, checked as ``/v2/trace/setting`` checks them."""
    from runtime.api.errors import ClientError
    from runtime.core.tracing import config_changes

    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--trace-config {pair!r}: give KEY=VALUE, e.g. rate=100")
        try:
            config_changes([(key, value)])
        except ClientError as exc:
            raise UsageError(f"--trace-config {pair!r}: {exc.message}") from None
        out.append((key, value))
    return tuple(out)


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


def _serve(args: argparse.Namespace) -> int:
    from runtime.api.config import ServerConfig
    from batchscope.storage.db import ENV_URL, default_url

    auth = serve_auth(args)
    database_url = default_url()
    if args.db is not None:
        database_url = check_database_url(args.db, "--db")
    elif not args.no_record:
        database_url = check_database_url(database_url, f"${ENV_URL}")
    args.device = check_device(args.device)
    specs = args.models or ["mlp", "encoder"]
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None:
        return _serve_fleet(args, specs, None if args.no_record else database_url, auth)
    if args.ray_address is not None:
        raise UsageError("--ray-address goes with --replicas N (or --min/--max-replicas)")
    server = ServerConfig(host=args.host, port=args.port, database_url=database_url,
                          record=not args.no_record, torch_threads=args.torch_threads,
                          heartbeat_interval_s=args.heartbeat_interval_s,
                          control_poll_interval_s=args.control_poll_interval_s,
                          retention_raw_s=args.retention_raw_s, models=tuple(specs),
                          device_process=device_process_default(args.device_process,
                                                                args.device),
                          recorder_process=args.recorder_process, grpc_port=args.grpc_port,
                          drain_timeout_s=args.drain_timeout_s,
                          otlp_traces_endpoint=args.otlp_traces_endpoint,
                          trace_config=trace_config(args.trace_config), nvtx=args.nvtx,
                          **({} if args.direct_max_compute_ms is None else
                             {"direct_max_compute_ms": args.direct_max_compute_ms}))
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    models, generation = load_models(specs)
    settings = model_settings(args, models, generation)
    configs = {name: settings[name] for name in models}
    return run_service(models, configs, server, device=args.device, instance_id=args.instance_id,
                       generation=generation, auth=auth,
                       adapters=adapter_args(args.adapters, {**models, **generation}))


def _serve_fleet(args: argparse.Namespace, specs: Sequence[str], database_url: str | None,
                 auth: Any) -> int:
    """``serve --replicas N``: the same models and settings on Ray Serve replicas."""
    try:
        from runtime.fleet.launch import serve_fleet
        from runtime.fleet.ray_serve import FleetSpec, Replicas
    except ImportError:
        raise UsageError("batchscope serve --replicas needs Ray Serve: pip install "
                         "'batchscope[fleet]'") from None
    if args.grpc_port is not None:
        raise UsageError("--grpc-port is not served by replicas yet; Ray Serve's proxy "
                         "serves HTTP (drop --grpc-port or --replicas)")
    replicas = Replicas(count=1 if args.replicas is None else args.replicas,
                        min_count=args.min_replicas, max_count=args.max_replicas)
    models, generation = load_models(specs)
    model_settings(args, models, generation)  # every setting checked here, before Ray starts
    changes = _per_model_changes(args, list(models) + list(generation), list(models))
    spec = FleetSpec(models=tuple(specs), settings={k: v for k, v in changes.items() if v},
                     database_url=database_url, device=args.device,
                     torch_threads=args.torch_threads or 1, control_token=auth.token,
                     listen_host=args.host, heartbeat_interval_s=args.heartbeat_interval_s,
                     control_poll_interval_s=args.control_poll_interval_s)
    return serve_fleet(spec, replicas, host=args.host, port=args.port,
                       ray_address=args.ray_address)


def run_service(models: dict, configs: dict, server: Any, *, device: str = "cpu",
                instance_id: str | None = None, generation: dict | None = None,
                auth: Any = None, end_process: bool = True,
                adapters: list[tuple[str, str, str]] = ()) -> int:
    """Serve in the foreground until SIGINT/SIGTERM; prints the URL once ready.

    Once the service has stopped (its drain is over, every answer written, the
    recorder and child processes closed), ``end_process`` ends the process at once
    (``end_now``): the interpreter's own teardown of torch and the rest takes 0.6 to
    1.6 s on a 2-vCPU machine, time the drain timeout does not have."""
    from runtime.server.service import Service, new_event_loop

    def announce(service: Service) -> None:
        where = server.database_url if server.record else "not recording"
        names = list(models) + list(generation or {})
        grpc = "" if service.grpc_port is None else f"  grpc: {server.host}:{service.grpc_port}"
        print(f"batchscope serving on {service.url}{grpc}  models: {', '.join(names)}  "
              f"device: {device}  database: {where}  {service.auth.describe()}", flush=True)

    from runtime.api.errors import BatchScopeError

    try:
        service = Service(models, configs, server, device=device, instance_id=instance_id,
                          generation=generation, on_started=announce, auth=auth,
                          adapters=adapters)
    except BatchScopeError as exc:
        raise UsageError(f"--adapter: {exc.message}") from None
    loop = new_event_loop()
    try:
        loop.run_until_complete(service.serve())
    except OSError as exc:
        raise UsageError(f"cannot listen on {server.host}:{server.port} ({exc.strerror or exc}); "
                         "pick another --port or stop what uses it") from None
    except RuntimeError as exc:  # startup failed; the reason was logged above
        print(f"batchscope: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    print("batchscope stopped", flush=True)
    if end_process:
        end_now(0)
    return 0


def end_now(code: int) -> None:
    """Flush the log and the standard streams and end the process with ``code``,
    without the interpreter's teardown (call only once everything is closed)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# -- load ---------------------------------------------------------------------------------
def _add_load(sub: Any) -> None:
    p = sub.add_parser("load", help="drive a server with closed- or open-loop load")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="mlp")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: connections")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson arrivals per second (overrides --concurrency)")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--lengths", default=None, help="uniform:8:128, fixed:64 or choice:16,64")
    p.add_argument("--priority", default=None,
                   help="HTTP priority (1 = most urgent) or a mix like 1=0.1,2=0.9")
    p.add_argument("--timeout-ms", type=float, default=None)
    p.add_argument("--bypass", action="store_true", help="ask for the bypass lane")
    p.add_argument("--adapter", action="append", default=[], dest="adapters",
                   metavar="NAME",
                   help="the LoRA adapter each request names, drawn evenly from those given; "
                        "repeat for several, 'base' for requests without one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--ceiling", action="store_true",
                   help="measure the generator's own ceiling against a trivial local server")


def _load(args: argparse.Namespace) -> int:
    from batchscope.load.loadgen import measure_ceiling, run_load

    if args.ceiling:
        report = measure_ceiling(duration_s=args.duration_s, concurrency=args.concurrency)
    else:
        report = run_load(args.url, args.model, concurrency=args.concurrency, rate=args.rate,
                          duration_s=args.duration_s, max_requests=args.max_requests,
                          lengths=args.lengths, priority=args.priority,
                          timeout_ms=args.timeout_ms, bypass=args.bypass, seed=args.seed,
                          adapters=[None if a == "base" else a for a in args.adapters])
    print(json.dumps(report.to_dict()) if args.json else report.summary(), flush=True)
    return 0


# -- tune ---------------------------------------------------------------------------------
def _add_tune(sub: Any) -> None:
    p = sub.add_parser("tune", help="find the settings that serve a model best under an SLO, "
                                    "on a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    p.add_argument("--model", required=True, help="the served model to tune")
    p.add_argument("--slo-p99-ms", type=float, required=True, metavar="MS",
                   help="the latency SLO: p99 at most this many milliseconds")
    p.add_argument("--budget-s", type=float, default=120.0, metavar="S",
                   help="the session's time budget in seconds (default 120)")
    p.add_argument("--load", choices=("synthetic", "replay", "live"), default="synthetic",
                   help="synthetic: the session's own closed loop (--concurrency) or open "
                        "loop (--rate); replay: the model's recorded traffic from --db; "
                        "live: measure the traffic the server gets (default synthetic)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: connections (default 64)")
    rate.add_argument("--rate", type=float, default=None,
                      help="open loop: Poisson arrivals per second; the target rate of "
                           "--objective latency")
    p.add_argument("--lengths", default=None,
                   help="synthetic input lengths: uniform:8:128, fixed:64 or choice:16,64 "
                        "(variable-length models)")
    p.add_argument("--db", default=None, metavar="URL",
                   help="the database (SQLAlchemy URL): replay reads the recorded traffic from "
                        "it, and the session and its trials are stored in it")
    p.add_argument("--replay-window-s", type=float, default=None, metavar="S",
                   help="replay: the last S seconds of recorded traffic (default: the newest "
                        "100000 requests)")
    p.add_argument("--replay-speed", type=float, default=1.0,
                   help="replay: this many times as fast as recorded (default 1)")
    p.add_argument("--objective", choices=("goodput", "latency"), default="goodput",
                   help="goodput: most requests per second within the SLO (default); "
                        "latency: the lowest p99 at --rate")
    p.add_argument("--apply", action="store_true",
                   help="keep the best settings at the end (default: put the starting ones "
                        "back)")
    p.add_argument("--grid", action="store_true",
                   help="measure every point of the space instead of searching it (slow)")
    space = p.add_argument_group("search space (the starting values are always included)")
    space.add_argument("--policies", default=None, metavar="P,P",
                       help="default dynamic,adaptive,static")
    space.add_argument("--max-batch-sizes", default=None, metavar="N,N",
                       help="default 4,8,16,32,64,128")
    space.add_argument("--queue-delays-ms", default=None, metavar="MS,MS",
                       help="none = work-conserving; default none,1,2,5,10")
    space.add_argument("--preferred", default=None, metavar="OPT,OPT",
                       help="preferred batch sizes: none, powers_of_two (default both)")
    space.add_argument("--edge-steps", default=None, metavar="N,N",
                       help="bucket edges every N tokens (variable-length models; default "
                            "8,16,32)")
    space.add_argument("--batch-tokens", default=None, metavar="N,N",
                       help="token limits per batch, none for no limit (variable-length "
                            "models; default none and 4, 8 and 16 times the longest length; "
                            "an empty list keeps the current limit)")
    trial = p.add_argument_group("trials")
    trial.add_argument("--window-s", type=float, default=1.0,
                       help="one measurement window (default 1 s)")
    trial.add_argument("--settle-s", type=float, default=0.5,
                       help="discarded after each change (default 0.5 s)")
    trial.add_argument("--warmup-s", type=float, default=2.0,
                       help="the session's load runs this long before the first trial "
                            "(default 2 s)")
    trial.add_argument("--drain-limit-s", type=float, default=20.0,
                       help="an open loop pauses before a trial while the server works off "
                            "a backlog an earlier trial left, at most this long (default 20 s;"
                            " 0: never)")
    trial.add_argument("--seed", type=int, default=0, help="the optimizer's seed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_token_flags(p, "settings changes")


def _space_options(args: argparse.Namespace) -> Any:
    from batchscope.tuning.space import SpaceError, SpaceOptions, parse_values

    given: dict[str, Any] = {}
    try:
        for flag, field_name, kind in (("--policies", "policies", "word"),
                                       ("--max-batch-sizes", "max_batch_sizes", "int"),
                                       ("--queue-delays-ms", "queue_delays_ms", "delay"),
                                       ("--preferred", "preferred", "word"),
                                       ("--edge-steps", "edge_steps", "int"),
                                       ("--batch-tokens", "batch_tokens", "int_or_none")):
            text = getattr(args, field_name)
            if text is not None and field_name == "batch_tokens" and not text.strip():
                given[field_name] = ()
            elif text is not None:
                given[field_name] = parse_values(text, kind, flag)
        return SpaceOptions(**given).check()
    except SpaceError as exc:
        raise UsageError(f"batchscope tune: {exc}") from None


def tune_options(args: argparse.Namespace, environ: Any = None) -> Any:
    """The session's ``TuneOptions`` from the command line; ``UsageError`` for a mistake."""
    from batchscope.tuning.client import TuningError
    from batchscope.tuning.runner import TuneOptions
    from runtime.server.auth import token_from

    try:
        token = token_from(args.control_token, args.control_token_file, environ)
    except ConfigError as exc:
        raise UsageError(f"batchscope tune: {exc.message}") from None
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError(f"batchscope tune: --concurrency {args.concurrency} must be at least 1")
    if args.load == "live" and (args.concurrency or args.rate) and args.objective != "latency":
        raise UsageError("batchscope tune: --load live sends no load of its own; leave out "
                         "--concurrency and --rate")
    if args.db is not None:
        check_database_url(args.db, "--db")
    options = TuneOptions(
        url=args.url, model=args.model, slo_p99_ms=args.slo_p99_ms, budget_s=args.budget_s,
        load=args.load, concurrency=args.concurrency or (None if args.rate else 64),
        rate=args.rate, lengths=args.lengths, db_url=args.db,
        replay_window_s=args.replay_window_s, replay_speed=args.replay_speed,
        objective=args.objective, apply=args.apply, grid=args.grid, seed=args.seed,
        token=token, window_s=args.window_s, settle_s=args.settle_s, warmup_s=args.warmup_s,
        drain_limit_s=args.drain_limit_s, space=_space_options(args))
    try:
        return options.check()
    except TuningError as exc:
        raise UsageError(f"batchscope tune: {exc.message}") from None


def _tune(args: argparse.Namespace) -> int:
    from batchscope.load.loadgen import parse_lengths
    from batchscope.tuning.runner import run_tuning

    options = tune_options(args)
    parse_lengths(options.lengths)  # a LoadError before anything is sent
    say = (lambda text: None) if args.json else (lambda text: print(text, flush=True))
    result = run_tuning(options, say=say)
    if args.json:
        print(json.dumps(result.to_dict()), flush=True)
    else:
        print(f"stopped: {result.stop_reason}", flush=True)
        print(result.sentence(), flush=True)
        print(f"settings: {result.outcome}", flush=True)
    return 130 if result.stop_reason == "cancelled" else 0


# -- snapshot -------------------------------------------------------------------------------
def _snapshot(argv: list[str]) -> int:
    try:
        from batchscope.presentation import snapshot
    except ImportError as exc:
        raise UsageError(f"snapshot export needs the dashboard packages ({exc.name} is not "
                         "installed); install them with: pip install 'batchscope[dashboard]'"
                         ) from None
    export = snapshot.cli_export
    if argv[:1] != ["export"]:
        raise UsageError("usage: batchscope snapshot export [options]; see "
                         "batchscope snapshot export --help")
    return int(export(argv[1:]) or 0)


# -- trace --------------------------------------------------------------------------------
def _add_trace(sub: Any) -> None:
    p = sub.add_parser("trace", help="export a window's batches and requests as a trace for "
                                     "ui.perfetto.dev or chrome://tracing")
    p.add_argument("--db", default=None, help="database URL (default: $BATCHSCOPE_DB_URL or "
                                              "sqlite:///data/batchscope.db)")
    p.add_argument("--start", default=None, help="window start: epoch seconds, ISO date and "
                                                 "time, now, or back from now (-30s, -5m)")
    p.add_argument("--end", default=None, help="window end, written the same way (default: now)")
    p.add_argument("--last", type=float, default=None, metavar="SECONDS",
                   help="window length back from its end, instead of --start (default 10)")
    p.add_argument("--model", default=None, help="only this model (default: all)")
    p.add_argument("--instance", default=None, help="only this runtime instance")
    p.add_argument("--format", choices=("perfetto", "json"), default=None,
                   help="perfetto (.pftrace) or json (Chrome Trace Event); default: from the "
                        "-o name")
    p.add_argument("--max-rows", type=int, default=None,
                   help="refuse a window holding more batches and requests (default 1,000,000)")
    p.add_argument("-o", "--out", required=True, help="output file, e.g. run.pftrace or run.json")


def _glued(argv: list[str]) -> list[str]:
    """``--start -10s`` as ``--start=-10s`` (argparse takes a value that starts with a
    dash for an option of its own)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--start", "--end") and arg.startswith("-"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _trace(args: argparse.Namespace) -> int:
    import time

    try:
        from batchscope.storage.db import DatabaseNotFound, make_engine
        from batchscope.trace import WindowTooLarge, export_trace, format_for
        from batchscope.trace.timespec import window_from
    except ImportError as exc:
        raise UsageError(f"trace export needs the dashboard packages ({exc.name} is not "
                         "installed); install them with: pip install 'batchscope[dashboard]'"
                         ) from None
    from sqlalchemy.exc import SQLAlchemyError

    try:
        fmt = args.format or format_for(args.out)
        w = window_from(args.start, args.end, args.last, now=time.time(), model=args.model,
                        instance_id=args.instance)
    except ValueError as exc:
        raise UsageError(f"batchscope trace: {exc}") from None
    if args.db is not None:
        check_database_url(args.db, "--db")
    kwargs = {} if args.max_rows is None else {"max_rows": args.max_rows}
    try:
        engine = make_engine(args.db, create=False)
        try:
            summary = export_trace(engine, w, args.out, fmt, **kwargs)
        finally:
            engine.dispose()
    except WindowTooLarge as exc:
        return _fail(f"batchscope trace: {exc}; or raise --max-rows (the rows are read into "
                     "memory)")
    except DatabaseNotFound as exc:
        return _fail(f"batchscope trace: {exc}")
    except SQLAlchemyError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _fail(f"batchscope trace: cannot read the database: {first}")
    except OSError as exc:
        return _fail(f"batchscope trace: cannot write {args.out}: {exc.strerror or exc}")
    except ImportError as exc:  # the perfetto package, imported when a trace is written
        raise UsageError(f"batchscope trace: {exc.name} is not installed; install it with: "
                         f"pip install {exc.name}") from None
    written = summary.bytes_written
    size = f"{written / 1e6:.1f} MB" if written >= 100_000 else f"{written:,} bytes"
    where = "ui.perfetto.dev" if fmt == "perfetto" else "ui.perfetto.dev or chrome://tracing"
    if summary.empty:
        print(f"wrote {args.out} ({fmt}, {size}): no batch, request or step was recorded in "
              "this window; the trace holds only a note saying so")
        return 0
    print(f"wrote {args.out} ({fmt}, {size}): {summary.batch_slices:,} batches, "
          f"{summary.request_slices:,} requests, {summary.flows:,} flows, "
          f"{summary.step_slices:,} steps, {summary.events:,} events; open it in {where}")
    return 0


# -- entry point --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="batchscope", description="BatchScope: batching inference runtime "
                                                    "with a live observability dashboard")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(sub)
    _add_load(sub)
    _add_tune(sub)
    _add_trace(sub)
    sub.add_parser("snapshot", help="diagnostic snapshots: batchscope snapshot export ...",
                   add_help=False)
    sub.add_parser("k8s", help="Kubernetes manifests for one model: batchscope k8s --model "
                               "NAME ...", add_help=False)
    return parser


def _fail(message: str) -> int:
    # the whole message: some carry the code to write on the lines after the first
    print(message.rstrip() or "batchscope: error", file=sys.stderr)
    return EXIT_USAGE


def version_line() -> str:
    """What ``batchscope --version`` prints: ``batchscope 0.1.0``."""
    from batchscope.version import version

    return f"batchscope {version()}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:
        print(version_line())
        return 0
    try:
        if argv[:1] == ["snapshot"]:
            return _snapshot(argv[1:])
        if argv[:1] == ["k8s"]:
            from batchscope.deploy import k8s

            return k8s.main(argv[1:])
        if "trace" in argv:
            argv = _glued(argv)
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.command == "serve":
            return _serve(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "trace":
            return _trace(args)
        return _load(args)
    except UsageError as exc:
        return _fail(str(exc))
    except BatchScopeError as exc:  # ConfigError from the loader, ...
        return _fail(f"batchscope: {exc.message}")
    except (LoadError, TuningError) as exc:  # bad load options, unreachable server, ...
        return _fail(f"batchscope: {exc.message}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
