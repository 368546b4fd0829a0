"""``batchscope serve`` run: its checked flags made into a ``ServerConfig`` and served
in the foreground (``run_service``), or on Ray Serve replicas (``--replicas``)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from typing import Any, Sequence

from runtime.tools.cli.common import UsageError, check_database_url
from runtime.tools.cli.serve_args import (_per_model_changes, adapter_args, check_device,
                                          device_process_default, load_models, model_settings,
                                          serve_auth, trace_config)


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
    tracing = trace_config(args.trace_config, args.otlp_traces_endpoint)
    os.environ.update(tracing.environ)  # Triton's opentelemetry,... keys: the SDK reads these
    server = ServerConfig(host=args.host, port=args.port, database_url=database_url,
                          record=not args.no_record, torch_threads=args.torch_threads,
                          heartbeat_interval_s=args.heartbeat_interval_s,
                          control_poll_interval_s=args.control_poll_interval_s,
                          retention_raw_s=args.retention_raw_s, models=tuple(specs),
                          device_process=device_process_default(args.device_process,
                                                                args.device),
                          recorder_process=args.recorder_process, grpc_port=args.grpc_port,
                          drain_timeout_s=args.drain_timeout_s,
                          otlp_traces_endpoint=tracing.otlp_endpoint,
                          trace_config=tracing.pairs, nvtx=args.nvtx,
                          device_nice=args.device_nice,
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
    tracing = [flag for flag, given in (("--trace-config", args.trace_config),
                                         ("--otlp-traces-endpoint", args.otlp_traces_endpoint),
                                         ("--nvtx", args.nvtx)) if given]
    if tracing:  # taken and then ignored, a user would look for traces that never come
        raise UsageError(f"{', '.join(tracing)}: not served by replicas yet; each replica "
                         "serves its requests untraced (drop them, or --replicas)")
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

    from sqlalchemy.exc import SQLAlchemyError

    from batchscope.storage.db import DatabaseNotFound, DatabaseUnavailable, SchemaTooNew
    from runtime.api.errors import BatchScopeError, ListenError

    try:
        service = Service(models, configs, server, device=device, instance_id=instance_id,
                          generation=generation, on_started=announce, auth=auth,
                          adapters=adapters, own_process=True)
    except BatchScopeError as exc:  # it names the flag it is about
        raise UsageError(exc.message) from None
    except (DatabaseUnavailable, DatabaseNotFound, SchemaTooNew, SQLAlchemyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"cannot open the database at {server.database_url}: {first[:300]}; "
                         "check --db (or $BATCHSCOPE_DB_URL), or serve with --no-record"
                         ) from None
    loop = new_event_loop()
    try:
        loop.run_until_complete(service.serve())
    except ListenError as exc:
        said = str(exc).removesuffix("; is the port in use?")
        raise UsageError(f"{said}; pick another --grpc-port or stop what uses it") from None
    except OSError as exc:
        what = ("pick another --port or stop what uses it" if exc.errno == errno.EADDRINUSE
                else "check --host: an address of this machine (127.0.0.1, 0.0.0.0, or one "
                     "of its interfaces)")
        raise UsageError(f"cannot listen on {server.host}:{server.port} ({exc.strerror or exc}); "
                         f"{what}") from None
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
