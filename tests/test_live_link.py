"""LiveLink against a real engine and a real SQLite file, stepped by hand."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from sqlalchemy import create_engine

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.storage.records import ListRecorder
from runtime.api.config import ServerConfig
from runtime.engine.engine import Engine
from runtime.server.live import LiveLink
from runtime.models.toys import DoubleModel


class Ticks:
    """A monotonic source that moves only when told to."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_link(engine, db, ticks, **server):
    cfg = ServerConfig(heartbeat_interval_s=5.0, control_poll_interval_s=1.0,
                       rollup_interval_s=60.0, **server)
    wall = iter(range(1_000_000))
    return LiveLink(engine, db, instance_id="inst-1", url="http://127.0.0.1:1", device="cpu",
                    version="t", recorder=ListRecorder(), server=cfg, host="h", pid=1,
                    wall=lambda: 1_700_000_000.0 + next(wall), monotonic=ticks)


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def linked(db, ticks):
    """A started engine serving ``double`` and a started LiveLink on ``db``."""
    engine = Engine({"double": DoubleModel()}, instance_id="inst-1")
    await engine.start()
    link = make_link(engine, db, ticks)
    try:
        await link.start()
        yield engine, link
    finally:
        await link.stop()
        await engine.stop()


def test_register_publish_apply_refuse_and_stop(tmp_path):
    db = make_engine(f"sqlite:///{tmp_path / 'live.db'}")
    ticks = Ticks()

    async def scenario():
        async with linked(db, ticks) as (engine, link):
            inst = control.all_instances(db)
            assert [i.id for i in inst] == ["inst-1"] and inst[0].models == ("double",)
            assert control.current_settings(db, "inst-1", "double")[0] == 1

            good = control.request_change(db, model="double", changes={"max_batch_size": 4},
                                          requested_by="dash")
            bad = control.request_change(db, model="double", changes={"max_batch_size": "many"},
                                         requested_by="dash")
            await link.step()               # not due yet: nothing polled
            assert control.command_status(db, good).status == "pending"
            ticks.t += 1.0
            await link.step()
            ok = control.command_status(db, good)
            assert ok.status == "applied" and ok.applied_version == 2
            assert engine.get_settings("double")[1].max_batch_size == 4
            refused = control.command_status(db, bad)
            assert refused.status == "refused" and "max_batch_size='many'" in refused.reason
            assert (link.applied, link.refused) == (1, 1)
            await link.step()               # the listener queued version 2: published now
            version, settings = control.current_settings(db, "inst-1", "double")
            assert version == 2 and settings["max_batch_size"] == 4

            engine.update_settings("double", {"max_batch_size": 6}, requested_by="http")
            await link.step()
            assert control.current_settings(db, "inst-1", "double")[0] == 3

            before = control.all_instances(db)[0].last_seen_at
            ticks.t += 5.0
            await link.step()
            assert control.all_instances(db)[0].last_seen_at > before
        assert control.all_instances(db)[0].stopped_at is not None

    run(scenario())


def test_database_failures_never_raise_and_recover(tmp_path, caplog):
    folder = tmp_path / "missing-dir"
    broken = create_engine(f"sqlite:///{folder / 'x.db'}")
    ticks = Ticks()

    async def scenario():
        with caplog.at_level(logging.WARNING, logger="batchscope.live"):
            async with linked(broken, ticks) as (engine, link):
                for _ in range(3):
                    ticks.t += 10
                    await link.step()
                assert not link.registered
                warnings = [r for r in caplog.records if "registration failed" in r.getMessage()]
                assert len(warnings) == 1   # logged once, retried quietly
                # the database comes back: the next step registers and publishes
                folder.mkdir()
                make_engine(f"sqlite:///{folder / 'x.db'}")
                await link.step()
                assert link.registered
                assert control.current_settings(broken, "inst-1", "double")[0] == 1

    run(scenario())


def test_heartbeat_reregisters_when_the_row_is_gone(tmp_path):
    db = make_engine(f"sqlite:///{tmp_path / 'live.db'}")
    ticks = Ticks()

    async def scenario():
        async with linked(db, ticks) as (engine, link):
            with db.begin() as conn:
                conn.exec_driver_sql("DELETE FROM runtime_instances")
            ticks.t += 5.0
            await link.step()               # heartbeat finds no row
            await link.step()               # registers again
            assert [i.id for i in control.all_instances(db)] == ["inst-1"]

    run(scenario())
