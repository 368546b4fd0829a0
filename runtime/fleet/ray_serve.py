"""Replicas of the BatchScope engine behind Ray Serve's router.

Each replica is a Ray Serve deployment replica that runs one whole BatchScope ``Service``
(batching, OOM recovery, the device thread, recording, the control link) and serves its
Starlette app through Ray Serve's HTTP proxy, so every route of ``batchscope serve`` works
unchanged (KServe v2, ``/v1/completions``, the control API, ``/metrics`` of that replica).

    app = build_application(FleetSpec(models=("mlp",), database_url=...), Replicas(2))
    serve.run(app, name="batchscope", route_prefix="/")

or from a shell, with Ray Serve's own tooling::

    serve run runtime.fleet.ray_serve:app_builder models=mlp,encoder replicas=2 \\
        db=postgresql+psycopg://user@host/batchscope

What each replica does:

* registers as its own instance, named after its node and its Ray Serve replica id, and
  records into the shared database (several replicas need a database they can all
  reach: PostgreSQL; a SQLite file works for replicas on one machine);
* follows the control table like a single server does: a change the dashboard sends to
  one instance or to every instance serving a model is applied and acknowledged (or
  refused) by each replica on its own;
* applies the ``settings`` of the deployment's ``user_config`` in ``reconfigure`` (the
  Ray Serve way to change every replica at once: ``serve.run`` again, or ``serve deploy``
  with a new config), each replica recording its own settings-change event.

Ray Serve's defaults that would silently cap batching are set here: a replica takes at
most ``max_ongoing_requests`` requests at once (5 unless set), far fewer than a batch;
the default here is the sum of the models' ``max_queue_size``, so the engine's own queue
and its 429s decide. Replicas run their batches on the device thread (no device child
process inside a Ray actor) and write their rows from the recorder's thread.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ray import serve
from ray.serve.config import AutoscalingConfig

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.api.errors import BatchScopeError, ConfigError

log = logging.getLogger("batchscope.fleet")

#: the Ray Serve application and deployment names
APP_NAME = "batchscope"
DEPLOYMENT_NAME = "BatchScopeReplica"
#: requester recorded for a change made through the deployment's user_config
USER_CONFIG_REQUESTER = "ray-serve:user_config"
#: environment for a Ray cluster whose nodes all run on one machine: Ray Serve's proxy
#: prefers replicas on its own node, which would leave the other nodes' replicas idle
SPREAD_ON_ONE_MACHINE = {"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}


@dataclass(frozen=True)
class FleetSpec:
    """What every replica serves: model specs, their settings and the server settings."""

    #: ``--model`` specs (builtin name, module:Class, file.py:Class, NAME=SPEC)
    models: tuple[str, ...] = ("mlp",)
    #: per-model settings changes applied on top of each model's defaults
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    database_url: str | None = None
    device: str = "cpu"
    torch_threads: int | None = 1
    #: the URL clients reach the fleet at (Ray Serve's proxy), published by each replica
    public_url: str | None = None
    #: the control token (required when the proxy listens beyond loopback)
    control_token: str | None = None
    #: the address the proxy listens on, to decide whether a token is needed
    listen_host: str = "127.0.0.1"
    heartbeat_interval_s: float = 2.0
    control_poll_interval_s: float = 0.5

    def server_config(self) -> ServerConfig:
        record = self.database_url is not None
        return ServerConfig(host=self.listen_host, port=0,
                            database_url=self.database_url or ServerConfig.database_url,
                            record=record, torch_threads=self.torch_threads,
                            heartbeat_interval_s=self.heartbeat_interval_s,
                            control_poll_interval_s=self.control_poll_interval_s,
                            models=tuple(self.models), device_process=False,
                            recorder_process=False)


@dataclass(frozen=True)
class Replicas:
    """How many replicas: a fixed ``count``, or autoscaling between ``min_count`` and
    ``max_count`` on Ray Serve's ongoing-requests target."""

    count: int = 1
    min_count: int | None = None
    max_count: int | None = None
    #: autoscaling target: ongoing requests per replica
    target_ongoing_requests: float = 64.0
    #: requests one replica takes at once; None: the sum of its models' max_queue_size
    max_ongoing_requests: int | None = None
    #: CPUs Ray reserves for each replica
    num_cpus: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.count, int) and self.count >= 1):
            problems.append(f"replicas={self.count!r} must be a positive integer")
        lo, hi = self.min_count, self.max_count
        if (lo is None) != (hi is None):
            problems.append("give both --min-replicas and --max-replicas to autoscale")
        elif lo is not None and not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi and hi >= 1):
            problems.append(f"min_replicas={lo!r}, max_replicas={hi!r}: need 0 <= min <= max, max >= 1")
        if not self.target_ongoing_requests > 0:
            problems.append("target_ongoing_requests must be positive")
        if self.max_ongoing_requests is not None and not (
                isinstance(self.max_ongoing_requests, int) and self.max_ongoing_requests >= 1):
            problems.append("max_ongoing_requests must be a positive integer")
        if not self.num_cpus >= 0:
            problems.append("num_cpus must be zero or more")
        if problems:
            raise ConfigError("invalid replica settings: " + "; ".join(problems))

    @property
    def autoscaling(self) -> bool:
        return self.min_count is not None


def replica_instance_id() -> str:
    """``<host>-<node>-<replica>``: unique per replica, stable for its lifetime."""
    import ray

    context = serve.get_replica_context()
    node = ray.get_runtime_context().get_node_id()[:8]
    return f"{socket.gethostname()[:24]}-{node}-{context.replica_id.unique_id}"


def build_configs(models: Mapping[str, Any], settings: Mapping[str, Mapping[str, Any]]) -> dict:
    """The ``BatchingConfig`` of every request model, with ``settings`` applied."""
    unknown = sorted(set(settings) - set(models))
    if unknown:
        raise ConfigError(f"settings name models that are not served: {unknown}; served "
                          f"request models are {sorted(models)}")
    return {name: BatchingConfig().with_changes(dict(settings.get(name, {})))
            for name in models}


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class BatchScopeReplica:
    """One replica: a BatchScope ``Service`` whose app Ray Serve's proxy calls."""

    def __init__(self, spec: FleetSpec) -> None:
        from runtime.models.loader import is_generation_model, load_model
        from runtime.server.auth import auth_for_listening
        from runtime.server.service import Service

        if spec.torch_threads is not None:
            import torch

            torch.set_num_threads(spec.torch_threads)
        models: dict[str, Any] = {}
        generation: dict[str, Any] = {}
        for text in spec.models:
            model = load_model(text)
            (generation if is_generation_model(model) else models)[model.name] = model
        for name, model in generation.items():
            if name in spec.settings:
                from runtime.generation.config import GenerationConfig

                model.generation_config = GenerationConfig.for_model(
                    model.max_model_len, dict(spec.settings[name]))
        request_settings = {k: v for k, v in spec.settings.items() if k not in generation}
        configs = build_configs(models, request_settings)
        self.instance_id = replica_instance_id()
        auth = auth_for_listening(spec.listen_host, spec.control_token)
        self.service = Service(models, configs, spec.server_config(), device=spec.device,
                               instance_id=self.instance_id, generation=generation or None,
                               auth=auth)
        self.service.url = spec.public_url
        self.service.app.state.auth = auth
        #: the user_config settings applied last (a reconfigure with the same ones is a no-op)
        self._applied: dict[str, dict] = {}

    def __serve_build_asgi_app__(self) -> Any:
        return LifespanApp(self.service)

    def reconfigure(self, user_config: Mapping[str, Any]) -> None:
        """Apply ``user_config["settings"]`` ({model: {setting: value}}) on this replica.

        Ray Serve calls it at start and whenever the deployment's user_config changes.
        A refused change (unknown model or setting, value out of bounds) is logged and
        recorded by the engine as refused; the replica keeps its settings."""
        from runtime.engine.directory import ModelDirectory

        settings = (user_config or {}).get("settings") or {}
        directory = ModelDirectory(self.service.engine,
                                   self.service.generation.engines
                                   if self.service.generation is not None else None)
        for model, changes in settings.items():
            changes = dict(changes)
            if self._applied.get(model) == changes:
                continue
            try:
                directory.update_settings(directory.require(model), changes,
                                          requested_by=USER_CONFIG_REQUESTER)
            except BatchScopeError as exc:
                log.error("replica %s refused user_config settings for %r: %s",
                          self.instance_id, model, exc)
                continue
            self._applied[model] = changes


class LifespanApp:
    """The service's Starlette app, with the ASGI lifespan starting and stopping the
    service (engine, recorder, control link) on the replica's own event loop."""

    def __init__(self, service: Any) -> None:
        self.service = service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.service.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.service.startup()
                except Exception as exc:  # reported to Ray, which fails the replica
                    log.exception("replica startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.service.shutdown()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return


def _max_ongoing(spec: FleetSpec, replicas: Replicas) -> int:
    if replicas.max_ongoing_requests is not None:
        return replicas.max_ongoing_requests
    total = 0
    for text in spec.models:
        name = text.split("=", 1)[0] if "=" in text else text
        queue = dict(spec.settings.get(name, {})).get("max_queue_size",
                                                      BatchingConfig.max_queue_size)
        total += int(queue)
    return max(1, total)


def build_application(spec: FleetSpec, replicas: Replicas = Replicas(),
                      user_config: Mapping[str, Any] | None = None) -> Any:
    """The Ray Serve application of ``spec`` on ``replicas``."""
    options: dict[str, Any] = {
        "max_ongoing_requests": _max_ongoing(spec, replicas),
        "ray_actor_options": {"num_cpus": replicas.num_cpus},
        "user_config": dict(user_config or {"settings": {}}),
        "graceful_shutdown_timeout_s": 10.0,
    }
    if replicas.autoscaling:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=replicas.min_count, max_replicas=replicas.max_count,
            target_ongoing_requests=replicas.target_ongoing_requests)
    else:
        options["num_replicas"] = replicas.count
    return BatchScopeReplica.options(**options).bind(spec)


def _split(text: Any) -> tuple[str, ...]:
    return tuple(part.strip() for part in str(text).split(",") if part.strip())


def app_builder(args: Mapping[str, str]) -> Any:
    """For ``serve run runtime.fleet.ray_serve:app_builder key=value ...``.

    Keys: ``models`` (comma-separated specs, default mlp), ``db`` (SQLAlchemy URL; none:
    no recording), ``replicas`` (default 1) or ``min_replicas`` and ``max_replicas``,
    ``device``, ``torch_threads``, ``public_url``, ``control_token``, ``listen_host``."""
    known = {"models", "db", "replicas", "min_replicas", "max_replicas", "device",
             "torch_threads", "public_url", "control_token", "listen_host"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"unknown arguments {unknown}; known: {sorted(known)}")

    def number(key: str) -> int | None:
        if key not in args:
            return None
        try:
            return int(args[key])
        except ValueError:
            raise ConfigError(f"{key}={args[key]!r} must be an integer") from None

    spec = FleetSpec(models=_split(args.get("models", "mlp")) or ("mlp",),
                     database_url=args.get("db") or None, device=args.get("device", "cpu"),
                     torch_threads=number("torch_threads") or 1,
                     public_url=args.get("public_url"), control_token=args.get("control_token"),
                     listen_host=args.get("listen_host", "127.0.0.1"))
    replicas = Replicas(count=number("replicas") or 1, min_count=number("min_replicas"),
                        max_count=number("max_replicas"))
    return build_application(spec, replicas)


def with_public_url(spec: FleetSpec, host: str, port: int) -> FleetSpec:
    shown = f"[{host}]" if ":" in host else host
    return replace(spec, public_url=f"http://{shown}:{port}", listen_host=host)
