"""``batchscope serve --replicas N``: start (or join) Ray, run the replicas, wait.

Without ``--ray-address`` a Ray instance is started on this machine for the fleet and
stopped with it; with one, the fleet joins that cluster (``auto`` for the cluster this
machine is part of) and leaves it running. Ray Serve's proxy listens on ``--host`` and
``--port``; SIGINT/SIGTERM delete the application and end the command with 0.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from runtime.api.errors import ConfigError
from runtime.fleet.ray_serve import (APP_NAME, SPREAD_ON_ONE_MACHINE, FleetSpec, Replicas,
                                     build_application, with_public_url)


def serve_fleet(spec: FleetSpec, replicas: Replicas, *, host: str, port: int,
                ray_address: str | None = None, num_cpus: int | None = None,
                announce: Any = print) -> int:
    """Run the fleet in the foreground until a signal; the exit code."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--replicas needs Ray Serve: pip install 'batchscope[fleet]'") from None
    if port == 0:
        raise ConfigError("--replicas needs a fixed --port (Ray Serve's proxy listens on it)")
    spec = with_public_url(spec, host, port)
    local = ray_address is None
    if local:
        os.environ.update(SPREAD_ON_ONE_MACHINE)
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=ray_address, log_to_driver=False)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_application(spec, replicas), name=APP_NAME, route_prefix="/",
                  blocking=False)
        shape = (f"{replicas.min_count}..{replicas.max_count} replicas (autoscaling)"
                 if replicas.autoscaling else f"{replicas.count} replicas")
        where = spec.database_url or "not recording"
        announce(f"batchscope fleet serving on {spec.public_url}  models: "
                 f"{', '.join(spec.models)}  {shape} on Ray "
                 f"({'local' if local else ray_address})  database: {where}", flush=True)
        while not stop.wait(0.5):
            pass
        serve.delete(APP_NAME)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if local:
            serve.shutdown()
        ray.shutdown()
    announce("batchscope fleet stopped", flush=True)
    return 0
