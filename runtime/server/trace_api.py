"""Triton's trace extension over HTTP: read and change the trace settings.

``GET  /v2/trace/setting``                  -> the global trace settings
``POST /v2/trace/setting``                  partial JSON object of settings -> applied
``GET  /v2/models/{name}/trace/setting``    -> the settings model ``name`` is traced with
``POST /v2/models/{name}/trace/setting``    its own values for some keys (null: clear one)

Settings and values as Triton has them (``runtime.core.tracing``): strings, and a list
of strings for ``trace_level``; every answer is the effective settings (a model's own
values over the global ones, ``trace_count`` the traces left). An unknown key, a key
given twice or a bad value is a 400 naming the known keys or the accepted form (what
was sent quoted short), and nothing changes.
``tritonclient``'s ``get_trace_settings``/``update_trace_settings`` work as they are;
the gRPC ``TraceSetting`` call (``runtime.server.grpc.handlers``) does the same.

A ``POST`` is a control request (``runtime.server.auth``, as the batching control
routes): another site's request is refused (403), the token is required when the server
has one (401 missing, 403 wrong), and without one only this machine may send it. The
body must be JSON, sent as ``application/json`` or without a ``Content-Type`` (as
``tritonclient.http`` sends it); any other type is a 400.

``GET /v2/trace/export?last=10&format=perfetto|json[&model=M][&end=EPOCH]`` answers the
recorded window (at most ``EXPORT_MAX_S`` seconds and ``EXPORT_MAX_ROWS`` rows, else 413)
as a trace file (a parameter given twice, or a window outside 1970..2255, is a 400).
It runs ``batchscope trace`` in a child process, one export at a time
(429 while one runs): the serving process neither opens the database (a storage fault
must not reach it) nor spends the CPU. The child gets the database URL in its
environment, not on its command line, and its exit status says why it failed
(``export_failed``: 413, 507, else 503).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import logging
import re
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batchscope.storage.db import ENV_URL
from batchscope.trace.exits import EXIT_NO_ROOM, EXIT_TOO_MANY_ROWS
from batchscope.trace.timespec import LATEST_S, WRITTEN_LAG_S, check_window
from runtime.api.errors import (ClientError, InsufficientStorage, ModelNotFound, QueueFull, RequestTooLarge,
                                RouteNotFound, ServerBusy)
from runtime.core.tracing import KEYS, parse_changes, quoted
from runtime.server.auth import AuthConfig, is_loopback
from runtime.server.bounds import check_json_size
from runtime.server.control_api import DEFAULT_AUTH, json_response, model_directory


def tracer_of(app: Any) -> Any:
    """The tracer of the app's engine (``runtime.engine.tracing``)."""
    tracer = getattr(app.state.engine, "tracer", None)
    if tracer is None:
        raise RouteNotFound("this server's engine has no trace settings")
    return tracer


def traced_model(app: Any, name: str) -> str:
    """``name`` when it is a request model of the app's engine, else ``ModelNotFound``
    (naming at most the first ``quoted`` characters of what was sent)."""
    engine = app.state.engine
    traced = engine.tracer.control.models if getattr(engine, "tracer", None) else ()
    if name in engine.model_names() or name in traced:
        return name
    if name in model_directory(app).generation:
        raise ModelNotFound(f"model {quoted(name)} is a generation model this server does not "
                            f"trace; traced models: {sorted(traced)}")
    raise ModelNotFound(f"unknown model {quoted(name)}; served models are "
                        f"{sorted({*engine.model_names(), *traced})}")


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is refused (which one would
    count is anybody's guess)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        twice = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        raise ClientError(f"the trace settings {quoted(twice)} are given more than once in "
                          "one JSON object; give each once")
    return doc


_BOM = b"\xef\xbb\xbf"


def read_changes(body: bytes) -> dict[str, Any]:
    """The checked changes of a trace setting request body (400 before anything changes)."""
    check_json_size(len(body), "the trace setting request", "send only the settings to change")
    body = body.removeprefix(_BOM)  # JSON's RFC 8259 lets a reader ignore one
    try:
        doc = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise ClientError(f"the body is not JSON this server reads ({str(exc)[:200]}); send "
                          'a JSON object of trace settings in UTF-8, e.g. {"trace_level": '
                          '["TIMESTAMPS"], "trace_rate": "100"}; the trace settings are '
                          f"{', '.join(KEYS)}") from None
    if isinstance(doc, dict) and doc:  # valid JSON (orjson said so): now its keys, once each
        try:
            doc = json.loads(body, object_pairs_hook=_no_repeats)
        except RecursionError:  # nested deeper than any setting: parse_changes refuses it
            pass
    return parse_changes(doc)


async def get_setting(request: Request) -> Response:
    name = request.path_params.get("name")
    model = None if name is None else traced_model(request.app, name)
    return json_response(tracer_of(request.app).settings(model))


async def change_setting(request: Request) -> Response:
    auth: AuthConfig = getattr(request.app.state, "auth", None) or DEFAULT_AUTH
    client = request.client
    auth.check(request.method, request.headers, client.host if client else None,
               untyped_json=True)
    name = request.path_params.get("name")
    model = None if name is None else traced_model(request.app, name)
    changes = read_changes(await request.body())
    return json_response(tracer_of(request.app).update(model, changes))


def trace_routes() -> list[Route]:
    return [
        Route("/v2/trace/setting", get_setting, methods=["GET"]),
        Route("/v2/trace/setting", change_setting, methods=["POST"]),
        Route("/v2/models/{name}/trace/setting", get_setting, methods=["GET"]),
        Route("/v2/models/{name}/trace/setting", change_setting, methods=["POST"]),
        Route("/v2/trace/export", export_trace, methods=["GET"]),
    ]


# -- trace export from the running server -------------------------------------------------
#: the longest window the server exports, seconds, and the most rows (batches + requests)
EXPORT_MAX_S = 600.0
#: the shortest (a millisecond: the window's start stays below its end at any epoch time)
EXPORT_MIN_S = 0.001
EXPORT_MAX_ROWS = 200_000
#: how long one export may take before it is abandoned
EXPORT_TIMEOUT_S = 120.0
log = logging.getLogger(__name__)
_FORMATS = {"perfetto": ("pftrace", "application/octet-stream"),
            "json": ("json", "application/json")}


class _Exports:
    """At most one export at a time (each runs ``batchscope trace`` in a child process,
    so the serving process never opens the database or spends the CPU)."""

    busy = False


async def export_trace(request: Request) -> Response:
    """``GET /v2/trace/export?last=10&format=perfetto|json[&model=M][&end=EPOCH]``: the
    recorded window as a trace file (see ``batchscope.trace``)."""
    auth: AuthConfig = getattr(request.app.state, "auth", None) or DEFAULT_AUTH
    auth.check_costly_read(request.headers)
    url = getattr(request.app.state, "trace_db_url", None)
    if not url:
        raise RouteNotFound("this server records nothing (--no-record), so it has no trace "
                            "to export; run it with a database")
    q = request.query_params
    unknown = set(q) - {"last", "format", "model", "end"}
    if unknown:
        raise ClientError(f"unknown parameter(s) {quoted(sorted(unknown))}; give last "
                          "(seconds), format (perfetto or json), model, end (epoch seconds)")
    twice = sorted(k for k in set(q) if len(q.getlist(k)) > 1)
    if twice:  # which one would count is anybody's guess
        raise ClientError(f"parameter(s) {twice} given more than once; give each once")
    fmt = q.get("format", "perfetto")
    if fmt not in _FORMATS:
        raise ClientError(f"format={fmt[:40]!r}: give perfetto or json")
    try:
        last = float(q.get("last", "10"))
        # by default 1 s back: by then the recorder has written the window's rows
        end = float(q["end"]) if "end" in q else time.time() - WRITTEN_LAG_S
    except ValueError:
        raise ClientError("last and end must be numbers of seconds (end: epoch seconds, "
                          "e.g. 1767225600)") from None
    if not (math.isfinite(last) and math.isfinite(end)):
        raise ClientError(f"last={last:g}, end={end:g}: give finite numbers of seconds (end: "
                          "epoch seconds, e.g. 1767225600)")
    if not EXPORT_MIN_S <= last <= EXPORT_MAX_S:
        raise ClientError(f"last={last:g}: give a window of {EXPORT_MIN_S:g} to "
                          f"{EXPORT_MAX_S:g} seconds (longer ones: batchscope trace)")
    # an end far out of range is said to be so (end - last would round to end itself and
    # be told it does not start before its end)
    if math.isfinite(end) and end > LATEST_S:
        raise ClientError(f"end={end:g} is after {LATEST_S:,.0f} epoch seconds (the year "
                          "2255), past what a trace's nanosecond times can hold; give an "
                          "earlier end")
    if math.isfinite(end) and end < 0:
        raise ClientError(f"end={end:g} is before 1970 (epoch second 0); give the epoch "
                          "seconds the window ends at, e.g. now's")
    try:  # the window the export would read, checked here: a bad one is the client's
        check_window(end - last, end, fix_start="a later end or a smaller last")
    except ValueError as exc:
        raise ClientError(f"end={q.get('end', 'now')[:40]}, last={last:g}: {exc}") from None
    model = q.get("model")
    if model is not None:
        traced_model(request.app, model)
    if _Exports.busy:
        raise QueueFull("another trace export is running; retry in a few seconds",
                        retry_after_s=2.0)
    _Exports.busy = True
    suffix, media = _FORMATS[fmt]
    folder = None
    try:
        # a folder of its own (owner-only), removed whole: what a killed export leaves goes
        # too; one that cannot be made (a full or missing temporary folder) fails this
        # export, and the next one may run
        try:
            folder = tempfile.mkdtemp(prefix="batchscope-export-")
        except OSError as exc:
            raise ServerBusy(f"the export found no room for its file ({exc.strerror or exc} "
                             "in the temporary folder); retry once there is",
                             retry_after_s=5.0) from None
        path = os.path.join(folder, f"trace.{suffix}")
        # the database URL goes in the child's environment: a command line (and a
        # password in it) is there for any user of the machine to read
        cmd = [sys.executable, "-m", "runtime.tools.cli", "trace",
               f"--start={end - last!r}", f"--end={end!r}", "--format", fmt,
               "--max-rows", str(EXPORT_MAX_ROWS), "-o", path]
        if model is not None:
            cmd.append(f"--model={model}")  # one argument, whatever the name starts with
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, ENV_URL: url})
        except OSError as exc:  # no process to be had now (too many, out of memory)
            raise ServerBusy(f"the export could not start ({exc.strerror or exc}); retry in "
                             "a few seconds", retry_after_s=5.0) from None
        try:
            _, err = await asyncio.wait_for(proc.communicate(), EXPORT_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise ServerBusy(f"the export took longer than {EXPORT_TIMEOUT_S:g} s; ask for a "
                             "shorter window", retry_after_s=5.0) from None
        except BaseException:  # cancelled (the server stops): the child goes too
            if proc.returncode is None:
                proc.kill()
            raise
        if proc.returncode != 0:
            client = request.client
            raise export_failed(proc.returncode, err.decode("utf-8", "replace"),
                                is_loopback(client.host if client else None))
        with open(path, "rb") as fh:
            data = fh.read()
    finally:
        _Exports.busy = False
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(end - last))
    return Response(data, media_type=media, headers={
        "Content-Disposition": f'attachment; filename="batchscope-{stamp}.{suffix}"'})


#: the CLI's hint of a window that fits, as the route asks for one
_ROUTE_HINT = re.compile(r"pick a window of at most ([0-9][0-9.,]*) s \(or one model or instance\)")


def export_failed(status: int, stderr: str, local: bool) -> Exception:
    """The error that answers an export whose ``batchscope trace`` child exited with
    ``status`` and wrote ``stderr``: too many rows (413, with the length that fits), no
    room on the server's disk (507), else a 503. The child's own line (file paths,
    the database's host) is passed on to a client on this machine (``local``) only;
    another is told that the server's log has it, and the line is logged."""
    line = (stderr.strip().splitlines() or ["failed"])[-1].removeprefix("batchscope trace: ")
    if status == EXIT_TOO_MANY_ROWS:  # its hints (--max-rows, an instance) are the CLI's
        said = _ROUTE_HINT.sub(lambda m: f"ask for last={m[1].replace(',', '')} or less, or "
                               "for one model (model=NAME)",
                               line.split("; or raise --max-rows")[0])
        return RequestTooLarge(said[:400])
    if not local:
        log.warning("trace export failed (exit %s): %s", status, line[:1000])
    if status == EXIT_NO_ROOM:  # the line's hint of -o is the CLI's, not the route's
        return InsufficientStorage(
            "the server's temporary folder has no room for the trace file"
            + (f" ({line.split(': free some space')[0][:300]})" if local else "")
            + "; ask for a shorter window, or retry once there is room")
    said = f": {line[:300]}" if local else " (the server's log says why)"
    return ServerBusy(f"the export failed{said}; retry in a few seconds, or export with "
                      "batchscope trace on the server", retry_after_s=5.0)
