"""One serving process: engine + recorders + metrics + live glue + HTTP, wired once.

``Service`` is what ``batchscope serve`` and the demo run. Records flow through
one path: the engine puts each record into a tee of the database recorder (when
recording) and the Prometheus adapter. ``serve()`` binds the socket first so the
URL is known before the instance registers itself, runs ``startup()``, then serves
HTTP/1.1 with ``runtime.server.http1`` (the inference route through
``runtime.server.fastpath``, everything else through the Starlette app) until a
signal (or ``request_exit()``), then drains (``runtime.server.drain``): new requests
are answered 503 with ``Retry-After``, those taken in are answered (streams finish,
or end with an error event and ``[DONE]``), and ``shutdown()`` has run, all within
the drain timeout (``ServerConfig.drain_timeout_s``) of the signal.
``ServiceThread`` runs a Service on its own event loop in a thread (tests, demo).

Control requests (settings changes over HTTP) are decided by the ``AuthConfig``
given as ``auth`` (``runtime.server.auth``; default: no token). ``serve()`` checks it
against the address it actually listens on before starting anything: beyond
loopback without a token it refuses to start (``ConfigError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import uuid
from typing import Any, Callable, Iterator, Sequence

from batchscope import gctune
from batchscope.threadnames import name_native
from batchscope.version import version
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.api.errors import ListenError
from runtime.api.model import ModelAPI
from runtime.server.auth import AuthConfig, auth_for_listening
from runtime.server.drain import DRAIN_TIMEOUT_S, STOP_FINAL_S, DrainClock, refusal
from runtime.server.routes import build_app
from runtime.server.fastpath import InferHook
from runtime.server.http1 import HttpServer
from runtime.server.metrics import MetricsRecorder

log = logging.getLogger("batchscope.server")

#: the installed BatchScope's version, as ``batchscope --version`` says it
VERSION = version()
#: idle keep-alive connections stay open this long (load generators reuse them)
KEEP_ALIVE_S = 60
#: the default drain timeout: from the signal to the end of ``serve()``, at most this
#: long (``ServerConfig.drain_timeout_s``, ``--drain-timeout-s``; ``runtime.server.drain``)
GRACEFUL_SHUTDOWN_S = DRAIN_TIMEOUT_S
#: the least time the span export gets to send what it holds as the server stops
SPANS_CLOSE_MIN_S = 0.2


def open_database_child(url: str) -> Any:
    """A ``DatabaseCalls`` child for ``url``, started: it creates the database and brings
    its schema up to date (``SchemaTooNew`` and ``DatabaseNotFound`` come back as
    themselves)."""
    from batchscope.storage import db
    from batchscope.storage.db_calls import DatabaseCalls, RemoteCallError

    calls = DatabaseCalls(url)
    try:
        calls.start()
    except RemoteCallError as exc:
        known = getattr(db, exc.name, None)
        if (isinstance(known, type) and issubclass(known, Exception)
                and known.__module__ == db.__name__):  # BatchScope's own, built from a message
            raise known(exc.message) from None
        raise db.DatabaseUnavailable(exc.message) from None
    return calls


def new_instance_id() -> str:
    return f"{socket.gethostname()[:32]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free ephemeral port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GenerationMount:
    """Generation models (continuous batching) served at ``/v1/completions``: one
    ``GenerationEngine`` per model, started and stopped with the server."""

    def __init__(self, models: dict[str, Any], *, recorder: Any, instance_id: str,
                 device: str, clock: Any = None) -> None:
        """``clock``: the server's (the tracer's), so that the generation models' rows
        and their traces turn monotonic times into wall-clock ones with one offset (a
        trace pairs with its request row by the same reading of the arrival)."""
        from runtime.generation.engine import GenerationEngine

        self.engines = {name: GenerationEngine(model, recorder=recorder, instance_id=instance_id,
                                               device=device, clock=clock)
                        for name, model in models.items()}

    async def start(self) -> None:
        for engine in self.engines.values():
            await engine.start()

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_timeout_s``,
        then end the rest with ``ShuttingDown`` (a stream: an error event, ``[DONE]``)."""
        await asyncio.gather(*(e.stop(drain_timeout_s) for e in self.engines.values()))


def _request_specs(models: dict[str, Any], specs: Sequence[str]) -> list[str]:
    """The specs the device processes load: those of the request models when the models
    say which they came from (``source_spec``), so a generation model's weights are not
    loaded again in a child that never runs it; else every spec."""
    known = [getattr(m, "source_spec", None) for m in models.values()]
    return [str(s) for s in known] if known and all(known) else list(specs)


class Service:
    """Everything one serving process runs, built from models and settings."""

    def __init__(self, models: dict[str, ModelAPI], configs: dict[str, BatchingConfig] | None,
                 server: ServerConfig, *, instance_id: str | None = None, device: str = "cpu",
                 generation: dict[str, Any] | None = None, version: str = VERSION,
                 on_started: Callable[["Service"], None] | None = None,
                 auth: AuthConfig | None = None,
                 adapters: Sequence[tuple[str, str, str]] = (),
                 own_process: bool = False) -> None:
        """``adapters``: (model, name, path) of the LoRA adapters served from the start.
        ``own_process``: the process serves this service alone (``batchscope serve``), so
        once started its garbage collector is settled for serving (``gctune.settle``); a
        service embedded in another program (a thread, a test) leaves the host's collector
        as it is."""
        from runtime.engine.engine import Engine  # the engine pulls in torch; import on use

        self.server_config = server
        self.own_process = own_process
        if server.nvtx:  # before any device process starts: they inherit the switch
            from runtime.device import nvtx
            os.environ[nvtx.ENV] = "1"
            nvtx.reload()
        self.auth = auth if auth is not None else AuthConfig()
        self.instance_id = instance_id or new_instance_id()
        self.device = device
        self.version = version
        self.url: str | None = None
        self.metrics = MetricsRecorder()
        self.db = None
        #: the child that holds the live link's database connections (recorder_process)
        self.db_calls = None
        self.db_recorder = None
        recorder: Any = self.metrics
        if server.record:
            from batchscope.storage.db import make_engine
            from batchscope.storage.recorder import Recorder, TeeRecorder

            if server.recorder_process:
                # every connection lives in a child: a storage fault (a full disk, files
                # made immutable, a read-only remount) must not kill the serving process,
                # which it would by SIGBUS through SQLite's mapped WAL index
                self.db_calls = open_database_child(server.database_url)
                self.db = make_engine(server.database_url, create=False)
            else:
                self.db = make_engine(server.database_url)
            self.db_recorder = Recorder(self.db, buffer_size=server.recorder_buffer_size,
                                        instance_id=self.instance_id,
                                        writer_process=server.recorder_process)
            recorder = TeeRecorder(self.db_recorder, self.metrics)
        self.engine = Engine(models, configs, recorder=recorder, instance_id=self.instance_id,
                             device=device, device_process=server.device_process,
                             direct_max_compute_ms=server.direct_max_compute_ms,
                             device_nice=server.device_nice,
                             model_specs=_request_specs(models, server.models)
                             if server.device_process else ())
        self.spans = self._trace_settings(server, recorder)
        from runtime.autopilot.shell import Autopilot

        #: moves the settings of models with autopilot_slo_p99_ms set (runtime.autopilot)
        self.autopilot = Autopilot(self.engine, recorder=recorder, instance_id=self.instance_id)
        self.metrics.bind(stats=self._all_stats, dropped=self._dropped,
                          adapters=self._adapter_models)
        self.live = None
        self.sampler = None
        self.generation = None
        if generation:
            self.generation = GenerationMount(generation, recorder=recorder,
                                              instance_id=self.instance_id, device=device,
                                              clock=self.engine.tracer.clock)
            # one set of trace settings and one exporter for every model of the server
            self.engine.tracer.control.add_models(self.generation.engines)
            for gen in self.generation.engines.values():
                gen.tracer = self.engine.tracer
        from runtime.api.errors import BatchScopeError, ConfigError

        for model, name, path in adapters:
            gen = self.generation.engines.get(model) if self.generation is not None else None
            try:
                if gen is not None:
                    gen.register_adapter(name, path, requested_by="start")
                else:
                    self.engine.register_adapter(model, name, path, requested_by="start")
            except BatchScopeError as exc:
                raise ConfigError(f"--adapter {model}:{name}={path}: {exc.message}") from None
        self.on_started = on_started
        self._recorder = recorder
        #: every served model, for the start-up event saying what serves each
        self._all_models: dict[str, Any] = {**models, **(generation or {})}
        from runtime.server.openai_api import openai_routes

        extra_routes = openai_routes(self.engine, self.generation.engines
                                     if self.generation is not None else {})
        self.app = build_app(self.engine, metrics=self.metrics, extra_routes=extra_routes,
                             version=version, auth=self.auth)
        self.app.state.autopilot = self.autopilot  # its state, for the control API
        # where /v2/trace/export reads (in a child process: runtime.server.trace_api)
        self.app.state.trace_db_url = server.database_url if server.record else None
        self.grpc = None
        #: the port the gRPC server listens on once started (None: no gRPC server)
        self.grpc_port: int | None = None
        if server.grpc_port is not None:
            from runtime.server.grpc import GrpcServer

            self.grpc = GrpcServer(self.engine, version=version,
                                   generation=list(generation or {}),
                                   budget=self.app.state.budget, auth=self.auth)
        self._exit_requested = False
        self._exit: asyncio.Future | None = None
        self.started = threading.Event()

    def _trace_settings(self, server: ServerConfig, recorder: Any) -> Any:
        """Apply ``trace_config``; start the OTLP span exporter when an endpoint is set
        (tracing then defaults to ``TIMESTAMPS``, mode ``opentelemetry``). Its exporter."""
        from runtime.core.tracing import config_changes

        from runtime.api.errors import ClientError, ConfigError

        pairs = list(server.trace_config)
        if server.otlp_traces_endpoint:  # the flags, after these, may say otherwise
            pairs[:0] = [("trace_level", "TIMESTAMPS"), ("trace_mode", "opentelemetry")]
        tracer = self.engine.tracer

        def configured() -> None:  # the settings at start, once the exporter (if any) is set
            if pairs:
                try:
                    tracer.update(None, config_changes(pairs))
                except ClientError as exc:
                    raise ConfigError(f"--trace-config: {exc.message}") from None

        if not server.otlp_traces_endpoint:
            configured()
            return None
        from batchscope.storage.records import EventRow
        from runtime.engine.otel_config import ConfigurationError
        from runtime.engine.otel_process import SpanProcess

        def dropped(new: int, total: int) -> None:
            recorder.put(EventRow(
                instance_id=self.instance_id, model=None, at=tracer.clock.to_wall(
                    tracer.clock.now()), kind="trace_export_drops", severity="warning",
                message=f"{new} OpenTelemetry spans dropped ({total} so far): the collector "
                        f"at {server.otlp_traces_endpoint[:200]} did not take them, or the "
                        "export queue was full; check the collector, or raise "
                        "OTEL_BSP_MAX_QUEUE_SIZE or lower trace_rate",
                details_json=f'{{"dropped": {new}, "total": {total}}}'))

        try:
            spans = SpanProcess(server.otlp_traces_endpoint, self.instance_id, on_drops=dropped)
        except ImportError as exc:
            raise ConfigError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP "
                              f"exporters ({exc.name} is missing): pip install "
                              "'batchscope[otel]'") from None
        except ConfigurationError as exc:  # the line names the flag or the variable
            raise ConfigError(str(exc)) from None
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"--otlp-traces-endpoint: {exc}") from None
        self.engine.export_spans(spans)
        try:
            configured()
        except ConfigError:
            spans.close()
            raise
        self.metrics.bind(spans_dropped=lambda: spans.dropped)
        return spans

    # -- scrape-time sources ------------------------------------------------------------
    def _all_stats(self) -> dict[str, dict[str, Any]]:
        stats = {name: self.engine.stats(name) for name in self.engine.model_names()}
        if self.generation is not None:
            stats.update({name: e.stats() for name, e in self.generation.engines.items()})
        return stats

    def _adapter_models(self) -> dict[str, list[str]]:
        """Model -> its registered adapters' names, request and generation models alike
        (the ``adapter`` label of the per-adapter series takes only these)."""
        out = self.engine.adapter_models()
        generation = getattr(self, "generation", None)  # read at fold time
        if generation is not None:
            out.update({name: e.adapter_entries() for name, e in generation.engines.items()
                        if e.runner.adapters is not None})
        return out

    def _dropped(self) -> int:
        return self.db_recorder.dropped if self.db_recorder is not None else 0

    # -- lifecycle ------------------------------------------------------------------------
    def _record_models(self) -> None:
        """One ``model_loaded`` event per model: which backend serves it, from where, with
        which options (the metadata's ``platform`` and ``source``), for the dashboard and
        snapshots."""
        import json

        from batchscope.storage.records import EventRow

        clock = self.engine.tracer.clock
        for name, model in self._all_models.items():
            meta = model.metadata()
            platform = meta.get("platform", "pytorch")
            source = meta.get("source") or {"kind": "python", "class": type(model).__qualname__,
                                             "module": type(model).__module__}
            where = source.get("path") or f"{source.get('module')}.{source.get('class')}"
            self._recorder.put(EventRow(
                instance_id=self.instance_id, model=name, at=clock.to_wall(clock.now()),
                kind="model_loaded", severity="info",
                message=f"{name!r} is served by {platform} from {where}",
                details_json=json.dumps({"platform": platform, "source": source}, default=str)))

    async def startup(self) -> None:
        if self.db_recorder is not None:
            self.db_recorder.start()
        await self.engine.start()
        self._record_models()
        self.autopilot.start()
        if self.generation is not None:
            await self.generation.start()
        if self.db is not None:
            from runtime.server.live import LiveLink

            from runtime.device import mps

            # a GPU shared through MPS says so (and its thread share) where instances show
            device = mps.describe(str(self.device), mps.detect()
                                  if str(self.device).startswith("cuda") else None)
            self.live = LiveLink(self.engine, self.db_calls or self.db,
                                 instance_id=self.instance_id,
                                 url=self.url, device=device, version=self.version,
                                 recorder=self.db_recorder, server=self.server_config,
                                 generation=(self.generation.engines
                                             if self.generation is not None else None))
            await self.live.start()
            from batchscope.telemetry import DeviceSampler

            self.sampler = DeviceSampler(self.instance_id, self.db_recorder,
                                         interval_s=self.server_config.device_sample_interval_s,
                                         torch_device=str(self.device))
            self.sampler.start()
        if self.grpc is not None:
            self.grpc_port = await self.grpc.start(self.server_config.host,
                                                   self.server_config.grpc_port)
        self.started.set()
        if self.on_started is not None:
            self.on_started(self)

    async def _stop_grpc(self, grace_s: float | None = None) -> None:
        """Refuse new gRPC calls; those in flight get ``grace_s`` (default: the drain
        timeout) to finish."""
        if self.grpc is not None:
            await self.grpc.stop(self.server_config.drain_timeout_s if grace_s is None
                                 else grace_s)

    async def shutdown(self, spans_timeout_s: float = 5.0) -> None:
        """Stop everything ``startup`` started; the span export gets ``spans_timeout_s``
        to send what it holds (what it cannot is counted as dropped)."""
        try:
            await self._stop_grpc()
            await self.autopilot.stop()
            if self.generation is not None:
                await self.generation.stop()
            await self.engine.stop()
            if self.spans is not None:
                await asyncio.to_thread(self.spans.close, spans_timeout_s)
        finally:
            if self.sampler is not None:
                await asyncio.to_thread(self.sampler.stop)
            if self.live is not None:
                await self.live.stop()
            if self.db_recorder is not None:
                await asyncio.to_thread(self.db_recorder.close)
            if self.db_calls is not None:
                await asyncio.to_thread(self.db_calls.stop)

    async def serve(self, sock: socket.socket | None = None) -> None:
        """Serve until a signal or ``request_exit()``; binds host:port unless given ``sock``."""
        cfg = self.server_config
        if sock is None:
            self._settle_auth(cfg.host)  # refuse before binding when the host says enough
            sock = bind_socket(cfg.host, cfg.port)
        try:
            self._settle_auth(sock.getsockname()[0])
        except BaseException:
            sock.close()
            raise
        self.url = _url(sock)
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        if self._exit_requested:
            self._exit.set_result(None)
        http = HttpServer(self.app, fast=InferHook(self.app.state), keep_alive_s=KEEP_ALIVE_S)
        try:
            with _exit_on_signals(loop, self.request_exit):
                try:
                    await self.startup()
                except ListenError:  # the caller's to say, in one line
                    with contextlib.suppress(Exception):
                        await self.shutdown()
                    raise
                except Exception as exc:
                    log.exception("startup failed")
                    with contextlib.suppress(Exception):
                        await self.shutdown()
                    raise RuntimeError(f"the server did not start ({type(exc).__name__}: "
                                       f"{exc}); see the log above for the reason") from exc
                if self.own_process:
                    # what startup built (models, torch, libraries) lives as long as the
                    # process: out of the garbage collector's scans, which come less often
                    gctune.settle()
                try:
                    await http.start(sock)
                    await self._exit
                finally:
                    await self._drain_and_stop(http)
        finally:
            sock.close()

    async def _drain_and_stop(self, http: HttpServer) -> None:
        """Drain, then stop (``runtime.server.drain``), within the drain timeout: new
        requests are refused 503 with ``Retry-After`` at once; those taken in get until
        the reserve for stopping to be answered; what still runs then is ended with
        an answer of its own, the connections closed and ``shutdown()`` run."""
        clock = DrainClock(self.server_config.drain_timeout_s)
        grpc = asyncio.ensure_future(self._stop_grpc(clock.to_stop()))
        try:
            try:
                if http.loop is not None:  # it started
                    await asyncio.wait([http.drain(refusal), grpc], timeout=clock.to_stop())
                    owed = http.owed_answers()
                    if owed:
                        log.warning("%d request(s) still running %.1f s after the signal are "
                                    "ended now (drain timeout %.1f s)", owed, clock.elapsed(),
                                    clock.timeout_s)
                if self.generation is not None:
                    # what still generates ends with ShuttingDown: a stream under way with
                    # an error event and [DONE], any other request with a 503
                    await self.generation.stop(drain_timeout_s=0.0)
            finally:
                await asyncio.gather(
                    self.engine.stop(drain_timeout_s=clock.left(STOP_FINAL_S)),
                    http.shutdown(clock.left(STOP_FINAL_S)), grpc)
        finally:
            # the span export gets what is left but the rest of shutdown's reserve
            await self.shutdown(spans_timeout_s=max(SPANS_CLOSE_MIN_S,
                                                    clock.left(STOP_FINAL_S)))
        log.info("stopped %.2f s after the signal (drain timeout %.1f s)", clock.elapsed(),
                 clock.timeout_s)

    def _settle_auth(self, host: str) -> None:
        """Fit ``auth`` to where the server listens; ``ConfigError`` when that is beyond
        loopback and there is no token."""
        self.auth = auth_for_listening(host, self.auth.token)
        self.app.state.auth = self.auth
        if self.grpc is not None:  # the trace settings' gate over gRPC
            self.grpc.handlers.auth = self.auth

    def request_exit(self) -> None:
        """Ask ``serve()`` to stop (call on the loop's thread)."""
        self._exit_requested = True
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(None)


@contextlib.contextmanager
def _exit_on_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[], None]) -> Iterator[None]:
    """SIGINT/SIGTERM end the service cleanly (exit 0); only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        loop.add_signal_handler(sig, handler)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when available (faster), else the default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()


class ServiceThread:
    """Runs a Service in a background thread with its own event loop."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = service
        self._sock = bind_socket(host, port)
        self.url = _url(self._sock)
        self._thread = threading.Thread(target=self._run, name="batchscope-server", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        name_native()
        self._loop = new_event_loop()
        try:
            self._loop.run_until_complete(self.service.serve(self._sock))
        except BaseException as exc:  # surfaced by start()/stop()
            self.error = exc
        finally:
            self._loop.close()

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread.start()
        deadline_step = 0.05
        waited = 0.0
        while not self.service.started.wait(deadline_step):
            waited += deadline_step
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the server failed to start: {self.error!r}")
            if waited >= timeout_s:
                raise TimeoutError(f"the server did not start within {timeout_s} s")
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.service.request_exit)
        self._thread.join(timeout_s)

    def __enter__(self) -> "ServiceThread":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
