"""Control store: instances and heartbeats, published settings, commands."""

from __future__ import annotations

import json
import threading

import pytest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.storage.records import EventRow
from batchscope.storage.schema import EventRecord

pytestmark = pytest.mark.both_backends


def register(db, instance_id="rt-1", models=("mlp",), now=100.0):
    control.register_instance(db, instance_id=instance_id, host="h", pid=42, models=list(models),
                              url="http://127.0.0.1:8000", device="cpu", version="0.1.0", now=now)


def test_heartbeat_staleness_with_explicit_now(db):
    register(db, "a", now=100.0)
    register(db, "b", now=100.0)
    assert control.heartbeat(db, "a", 105.0, records_dropped=3)
    live = control.live_instances(db, now=112.0, stale_after_s=10.0)
    assert [i.id for i in live] == ["a"]
    assert live[0].records_dropped == 3 and live[0].models == ("mlp",) and live[0].pid == 42
    assert [i.id for i in control.live_instances(db, now=109.0, stale_after_s=10.0)] == ["a", "b"]
    assert control.live_instances(db, now=116.0, stale_after_s=10.0) == []
    control.heartbeat(db, "b", 115.0)
    control.mark_stopped(db, "b", 115.5)
    assert control.live_instances(db, now=116.0, stale_after_s=10.0) == []
    assert not control.heartbeat(db, "never-registered", 116.0)
    # registering again revives a stopped instance with a fresh start time
    register(db, "b", now=120.0)
    (b,) = control.live_instances(db, now=121.0)
    assert b.started_at == 120.0 and b.stopped_at is None
    assert {i.id for i in control.all_instances(db)} == {"a", "b"}


def test_publish_and_read_settings(db):
    assert control.current_settings(db, "rt-1", "mlp") is None
    control.publish_settings(db, instance_id="rt-1", model="mlp", version=1,
                             settings={"max_batch_size": 8}, kind="request", now=1.0)
    control.publish_settings(db, instance_id="rt-1", model="mlp", version=2,
                             settings={"max_batch_size": 16, "max_wait_ms": 3.0}, kind="request", now=2.0)
    assert control.current_settings(db, "rt-1", "mlp") == (2, {"max_batch_size": 16, "max_wait_ms": 3.0})


def test_command_round_trip_applied_and_refused(db):
    register(db, "rt-1", models=("mlp", "enc"))
    first = control.request_change(db, model="mlp", changes={"max_batch_size": 32},
                                   requested_by="dashboard", instance_id="rt-1", now=200.0)
    second = control.request_change(db, model="enc", changes={"max_wait_ms": -1},
                                    requested_by="dashboard", instance_id="rt-1", now=201.0)
    other = control.request_change(db, model="mlp", changes={"max_batch_size": 4},
                                   requested_by="dashboard", instance_id="rt-2", now=202.0)
    pending = control.pending_commands(db, "rt-1", ["mlp", "enc"])
    assert [c.id for c in pending] == [first, second]
    assert pending[0].changes == {"max_batch_size": 32} and pending[0].status == "pending"
    assert [c.id for c in control.pending_commands(db, "rt-1", ["mlp"])] == [first]

    control.ack_command(db, first, applied_version=5, now=203.0)
    control.refuse_command(db, second, reason="max_wait_ms must be >= 0", now=204.0)
    assert control.pending_commands(db, "rt-1", ["mlp", "enc"]) == []
    done = control.command_status(db, first)
    assert (done.status, done.applied_version, done.handled_at) == ("applied", 5, 203.0)
    refused = control.command_status(db, second)
    assert (refused.status, refused.reason) == ("refused", "max_wait_ms must be >= 0")
    assert control.command_status(db, other).status == "pending"
    # a second outcome does not overwrite the first
    control.refuse_command(db, first, reason="late", now=205.0)
    assert control.command_status(db, first).status == "applied"
    assert [c.id for c in control.recent_commands(db, model="mlp")] == [other, first]


@pytest.mark.parametrize("changes", [[("max_batch_size", 8)], "max_batch_size=8", {}, {1: 2},
                                     {"x": float("nan")}, {"x": object()}])
def test_request_change_rejects_non_objects(db, changes):
    with pytest.raises(ValueError, match="changes"):
        control.request_change(db, model="mlp", changes=changes, requested_by="t")


def test_unknown_command_id(db):
    with pytest.raises(ValueError, match="no control command"):
        control.command_status(db, 999)
    with pytest.raises(ValueError, match="no control command"):
        control.ack_command(db, 999, applied_version=1, now=1.0)


def test_broadcast_handled_once_per_instance(db):
    register(db, "a", models=("mlp",), now=100.0)
    register(db, "b", models=("mlp",), now=100.0)
    cid = control.request_change(db, model="mlp", changes={"max_batch_size": 8},
                                 requested_by="dash", instance_id=None, now=150.0)
    assert [c.id for c in control.pending_commands(db, "a", ["mlp"])] == [cid]
    assert [c.id for c in control.pending_commands(db, "b", ["mlp"])] == [cid]
    assert control.pending_commands(db, "b", ["other"]) == []

    control.ack_command(db, cid, applied_version=2, now=151.0, instance_id="a")
    assert control.pending_commands(db, "a", ["mlp"]) == []
    assert [c.id for c in control.pending_commands(db, "b", ["mlp"])] == [cid]
    assert control.command_status(db, cid).status == "applied"

    # a runtime started after the request does not replay a command others handled
    register(db, "late", models=("mlp",), now=160.0)
    assert control.pending_commands(db, "late", ["mlp"]) == []

    control.refuse_command(db, cid, reason="bad", now=152.0, instance_id="b")
    assert control.pending_commands(db, "b", ["mlp"]) == []
    status = control.command_status(db, cid)
    assert status.status == "applied" and status.applied_version == 2
    assert [(a.instance_id, a.status) for a in status.acks] == [("a", "applied"), ("b", "refused")]


def test_broadcast_single_runtime_ack_without_instance(db):
    register(db, "solo", now=100.0)
    cid = control.request_change(db, model="mlp", changes={"max_batch_size": 8}, requested_by="d", now=101.0)
    control.ack_command(db, cid, applied_version=3, now=102.0)
    assert control.pending_commands(db, "solo", ["mlp"]) == []
    # a broadcast nobody handled yet is taken by a runtime that starts later
    later = control.request_change(db, model="mlp", changes={"max_batch_size": 4}, requested_by="d", now=103.0)
    register(db, "new", now=110.0)
    assert [c.id for c in control.pending_commands(db, "new", ["mlp"])] == [later]


def test_settings_history_from_events(db):
    from batchscope.storage.recorder import Recorder

    rec = Recorder(db)
    for version, (old, new) in enumerate([(8, 16), (16, 32)], start=2):
        rec.put(EventRow(instance_id="rt-1", model="mlp", at=100.0 + version, kind="settings_change",
                         message="max_batch_size changed",
                         details_json=json.dumps({"old": {"max_batch_size": old}, "new": {"max_batch_size": new},
                                                  "requested_by": "dashboard", "version": version})))
    rec.put(EventRow(instance_id="rt-2", model="mlp", at=50.0, kind="settings_change", message="m",
                     details_json="not json"))
    rec.put(EventRow(instance_id="rt-1", model="mlp", at=500.0, kind="oom", message="m"))
    rec.close()
    history = control.settings_history(db, "mlp")
    assert [h.version for h in history] == [3, 2, None]
    assert history[0].old == {"max_batch_size": 16} and history[0].new == {"max_batch_size": 32}
    assert history[0].requested_by == "dashboard" and history[2].old == {}
    assert [h.instance_id for h in control.settings_history(db, "mlp", instance_id="rt-1", limit=1)] == ["rt-1"]
    assert control.settings_history(db, "other") == []
    with db.connect() as conn:
        assert conn.execute(EventRecord.__table__.select()).fetchall()


def test_runtime_polls_while_dashboard_writes(db_url):
    """Two engines on the same file: one writes commands, the other polls and acks."""
    dash = make_engine(db_url)
    runtime = make_engine(db_url)
    register(runtime, "rt-1")
    total = 60
    errors: list[BaseException] = []

    def dashboard():
        try:
            for i in range(total):
                control.request_change(dash, model="mlp", changes={"max_batch_size": i + 1},
                                       requested_by="dash", instance_id="rt-1", now=1000.0 + i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    writer = threading.Thread(target=dashboard)
    writer.start()
    applied: list[int] = []
    for _ in range(10_000):
        for cmd in control.pending_commands(runtime, "rt-1", ["mlp"]):
            control.ack_command(runtime, cmd.id, applied_version=len(applied) + 1, now=2000.0)
            applied.append(cmd.changes["max_batch_size"])
        if len(applied) == total or errors:
            break
        if not writer.is_alive() and len(applied) < total and not control.pending_commands(runtime, "rt-1", ["mlp"]):
            break
    writer.join(timeout=30)
    assert not errors
    assert applied == list(range(1, total + 1))
    dash.dispose()
    runtime.dispose()
