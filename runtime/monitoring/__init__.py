"""Monitoring assets that ship with the runtime, for the series ``GET /metrics`` exports.

- ``grafana-dashboard.json``: a Grafana dashboard (import it, pick the Prometheus data
  source): request rates by outcome, p50/p99 latency overall and by priority, queue wait
  against compute time, mean batch size, batches by outcome, queue depth and requests in
  flight, the effective max batch size after OOM back-off, recorder drops, and for
  generation models time to first token, time per output token, tokens per second,
  running/waiting sequences, preemptions and KV-cache usage.
- ``alerts.yml``: Prometheus alerting rules (requests refused or expired, model errors,
  p99 over an SLO, a saturated queue, OOM back-off, recorder drops, a full KV cache,
  preemptions), each with what to do in its description.

``python -m runtime.monitoring DIR`` copies both into ``DIR``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

ASSETS = ("grafana-dashboard.json", "alerts.yml")


def asset_path(name: str) -> Path:
    """The installed path of one of ``ASSETS``."""
    if name not in ASSETS:
        raise KeyError(f"no monitoring asset {name!r}; there are {list(ASSETS)}")
    return Path(str(resources.files(__name__).joinpath(name)))


def asset_text(name: str) -> str:
    return asset_path(name).read_text(encoding="utf-8")
