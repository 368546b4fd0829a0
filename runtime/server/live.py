"""Live glue between a running engine and the shared database.

``LiveLink`` keeps the runtime visible and tunable from the dashboard:

* registers the instance (id, host, pid, models, url, device, version) and sends a
  heartbeat every ``heartbeat_interval_s`` with the recorder's drop count;
* publishes every model's settings at start and again after each change (it
  listens on ``engine.on_settings_change``);
* polls ``control_commands`` every ``control_poll_interval_s``, applies each one
  through ``engine.update_settings`` and acknowledges it with the applied version,
  or refuses it with the ``ConfigError`` message;
* rolls raw rows up periodically (``batchscope.storage.retention``, when available);
* marks the instance stopped at shutdown.

Database calls run in a worker thread, on ``db``: an engine, or a
``batchscope.storage.db_calls.DatabaseCalls`` whose child process holds every
connection (what ``Service`` gives it when the recorder writes from a child too, so
that the serving process never maps a SQLite file); settings are applied on the event
loop, the same place the HTTP control API applies them. A failing database never stops
serving: each duty logs its first failure, keeps retrying, and logs recovery.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any, Callable

from batchscope.storage import control
from batchscope.storage.db_calls import DatabaseCalls
from runtime.api.config import ServerConfig
from runtime.engine.directory import ModelDirectory
from runtime.api.errors import BatchScopeError

log = logging.getLogger("batchscope.live")


def _retention_runner() -> Callable[..., Any] | None:
    """``batchscope.storage.retention.run_retention`` when that module exists, else None."""
    try:
        from batchscope.storage import retention
    except ImportError:
        return None
    return getattr(retention, "run_retention", None)


class LiveLink:
    def __init__(self, engine: Any, db: Any, *, instance_id: str, url: str | None,
                 device: str | None, version: str | None, recorder: Any = None,
                 server: ServerConfig | None = None, host: str | None = None,
                 pid: int | None = None, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 generation: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.models = ModelDirectory(engine, generation)
        self.db = db
        self.instance_id = instance_id
        self.url = url
        self.device = device
        self.version = version
        self.recorder = recorder
        self.server = server or ServerConfig()
        self.host = host or socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self._wall = wall
        self._mono = monotonic
        self.registered = False
        self._pending: dict[str, tuple[int, Any]] = {}
        self._next_heartbeat = 0.0
        self._next_poll = 0.0
        self._next_retention = monotonic() + self.server.rollup_interval_s
        self._failing: set[str] = set()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._retention = _retention_runner()
        #: counters for tests and the log: commands applied / refused
        self.applied = 0
        self.refused = 0

    # -- settings listener --------------------------------------------------------------
    def _on_settings_change(self, model: str, version: int, config: Any) -> None:
        self._pending[model] = (version, config)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- one duty at a time, each failure contained ---------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(engine, ...)`` on the database: in the child process of a
        ``DatabaseCalls``, or here with an engine."""
        db = self.db
        if isinstance(db, DatabaseCalls):
            return db.call(fn, *args, **kwargs)
        return fn(db, *args, **kwargs)

    async def _safely(self, duty: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(database, *args, **kwargs)`` on a worker thread; ``_FAILED`` if it failed."""
        try:
            result = await asyncio.to_thread(self._call, fn, *args, **kwargs)
        except Exception as exc:
            if duty not in self._failing:
                self._failing.add(duty)
                log.warning("database %s failed (%s: %s); serving goes on, retrying",
                            duty, type(exc).__name__, exc)
            return _FAILED
        if duty in self._failing:
            self._failing.discard(duty)
            log.info("database %s works again", duty)
        return result

    def _models(self) -> list[str]:
        return self.models.names()

    def _kind(self, model: str) -> str:
        return self.models.kind(model)

    async def _register(self) -> None:
        ok = await self._safely("registration", control.register_instance,
                                instance_id=self.instance_id, host=self.host, pid=self.pid,
                                models=self._models(), url=self.url, device=self.device,
                                version=self.version, now=self._wall())
        if ok is _FAILED:
            return
        self.registered = True
        for model in self._models():
            self._pending[model] = self.models.get_settings(model)

    async def _publish(self) -> None:
        while self._pending:
            model, (version, config) = next(iter(self._pending.items()))
            del self._pending[model]
            ok = await self._safely("settings publication", control.publish_settings,
                                    instance_id=self.instance_id, model=model, version=version,
                                    settings=config.to_dict(), kind=self._kind(model),
                                    now=self._wall())
            if ok is _FAILED:
                # keep it (unless a newer version arrived meanwhile) and retry later
                self._pending.setdefault(model, (version, config))
                return

    async def _heartbeat(self) -> None:
        dropped = int(getattr(self.recorder, "dropped", 0) or 0)
        alive = await self._safely("heartbeat", control.heartbeat, self.instance_id,
                                   self._wall(), dropped)
        if alive is False:  # the row is gone (database replaced): register again
            self.registered = False

    async def _poll(self) -> None:
        commands = await self._safely("control polling", control.pending_commands,
                                      self.instance_id, self._models())
        if commands is _FAILED:
            return
        for cmd in commands:
            await self.apply_command(cmd)

    async def apply_command(self, cmd: control.Command) -> None:
        """Apply one command on this loop, then acknowledge or refuse it in the database."""
        try:
            version, _ = self.models.update_settings(cmd.model, cmd.changes,
                                                     requested_by=cmd.requested_by)
        except BatchScopeError as exc:
            self.refused += 1
            await self._safely("command acknowledgement", control.refuse_command,
                               cmd.id, reason=exc.message, now=self._wall(),
                               instance_id=self.instance_id)
            return
        self.applied += 1
        await self._safely("command acknowledgement", control.ack_command, cmd.id,
                           applied_version=version, now=self._wall(),
                           instance_id=self.instance_id)

    async def _run_retention(self) -> None:
        if self._retention is None:
            return
        await self._safely("retention", self._retention,
                           now=self._wall(), raw_keep_s=self.server.retention_raw_s)

    async def step(self) -> None:
        """One pass over the duties that are due. Passes never overlap: a caller that
        arrives while the background task is mid-pass waits for that pass to finish."""
        if self._step_lock is None:
            self._step_lock = asyncio.Lock()
        async with self._step_lock:
            await self._step()

    async def _step(self) -> None:
        if not self.registered:
            await self._register()
            if not self.registered:
                return
        await self._publish()
        now = self._mono()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.server.heartbeat_interval_s
            await self._heartbeat()
        if now >= self._next_poll:
            self._next_poll = now + self.server.control_poll_interval_s
            await self._poll()
        if now >= self._next_retention:
            self._next_retention = now + self.server.rollup_interval_s
            await self._run_retention()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        for listeners in self.models.listeners():
            listeners.append(self._on_settings_change)
        self._next_heartbeat = self._mono() + self.server.heartbeat_interval_s
        await self.step()
        self._task = asyncio.create_task(self._run(), name="batchscope-live")

    async def _run(self) -> None:
        interval = min(self.server.control_poll_interval_s, self.server.heartbeat_interval_s, 1.0)
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.step()
            except Exception:  # a bug here must not end the heartbeat for good
                log.exception("live link step failed; retrying")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for listeners in self.models.listeners():
            try:
                listeners.remove(self._on_settings_change)
            except ValueError:
                pass
        if self.registered:
            await self._publish()
            await self._safely("stop marker", control.mark_stopped, self.instance_id,
                               self._wall())


class _Failed:
    def __repr__(self) -> str:
        return "<failed>"


_FAILED = _Failed()
