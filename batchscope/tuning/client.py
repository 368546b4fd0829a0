"""The server's control API over HTTP, as a tuning session uses it.

``GET /v2/models/{name}`` (metadata), ``GET /v2/models/{name}/batching`` (settings),
``PATCH /v2/models/{name}/batching`` (change), ``GET /v2/models/{name}/stats`` and
``GET /metrics``. A change is a control request: it carries ``Content-Type:
application/json`` and, when the server has one, ``Authorization: Bearer <token>``
(the same token ``batchscope serve`` takes: ``--control-token-file``,
``$BATCHSCOPE_CONTROL_TOKEN`` or ``--control-token``); ``X-Requested-By`` notes that
the tuner asked. Each call opens its own short connection.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import quote, urlsplit

from batchscope.load.loadgen import item_metadata

#: the note each change carries in ``X-Requested-By``
REQUESTED_BY = "batchscope tune"
ENV_TOKEN = "BATCHSCOPE_CONTROL_TOKEN"


class TuningError(Exception):
    """A session cannot go on: the server is unreachable, the model unknown, the token
    missing... The text says what was wrong and what to do."""

    http_status = 400

    @property
    def message(self) -> str:
        return str(self)


class SettingsRefused(TuningError):
    """The server refused a settings change (422): the point is infeasible."""


class ControlClient:
    def __init__(self, url: str, model: str, *, token: str | None = None,
                 timeout_s: float = 15.0, requested_by: str = REQUESTED_BY) -> None:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http" or not parts.hostname:
            raise TuningError(f"--url {url!r} must look like http://127.0.0.1:8000")
        self.url = f"http://{parts.netloc}"
        self.host, self.port = parts.hostname, parts.port or 80
        self.model, self.token, self.timeout_s = model, token, timeout_s
        self.requested_by = requested_by
        self._base = f"/v2/models/{quote(model, safe='')}"

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers.update({"Content-Type": "application/json",
                            "X-Requested-By": self.requested_by})
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise TuningError(f"cannot reach {self.url} ({type(exc).__name__}: {exc}); is "
                              "`batchscope serve` running there?") from None
        finally:
            conn.close()

    @staticmethod
    def _error_text(raw: bytes) -> str:
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict) and "error" in doc:
                return str(doc["error"])
        except ValueError:
            pass
        return raw.decode(errors="replace")[:300]

    def _json(self, method: str, path: str, body: Any = None) -> dict:
        status, raw = self._call(method, path, body)
        if status == 200:
            return json.loads(raw)
        text = self._error_text(raw)
        if status == 404:
            raise TuningError(f"model {self.model!r} is not served at {self.url} ({text})")
        if status in (401, 403):
            raise TuningError(f"the server refused the settings change (HTTP {status}: {text}); "
                              f"give `batchscope tune` the server's control token with "
                              f"--control-token-file PATH, ${ENV_TOKEN} or --control-token")
        if status == 422 and body is not None:
            raise SettingsRefused(text)
        raise TuningError(f"{method} {path} at {self.url} answered HTTP {status}: {text}")

    # -- the calls ----------------------------------------------------------------------
    def metadata(self) -> dict:
        """The model's metadata with the shapes of one item (``item_metadata``)."""
        meta = self._json("GET", self._base)
        status, raw = self._call("GET", f"{self._base}/config")
        try:
            config = json.loads(raw) if status == 200 else None
        except ValueError:
            config = None
        return item_metadata(meta, config if isinstance(config, dict) else None)

    def batching(self) -> dict:
        """``{model, kind, version, settings}``."""
        return self._json("GET", f"{self._base}/batching")

    def change(self, changes: dict) -> dict:
        """Apply ``changes``; ``SettingsRefused`` when the server finds them invalid."""
        return self._json("PATCH", f"{self._base}/batching", changes)

    def stats(self) -> dict:
        return self._json("GET", f"{self._base}/stats")

    def metrics_text(self) -> str:
        status, raw = self._call("GET", "/metrics")
        if status != 200:
            raise TuningError(f"GET /metrics at {self.url} answered HTTP {status}")
        return raw.decode("utf-8", errors="replace")
