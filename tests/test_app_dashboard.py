"""The Streamlit app rendered with AppTest on a synthetic database (no demo runtime)."""

from __future__ import annotations

import json
import time
from sqlalchemy.orm import Session
from streamlit.testing.v1 import AppTest

from batchscope.analysis.queries import Window
from batchscope.presentation import snapshot
from batchscope.storage import control
from batchscope.storage.schema import EventRecord
from batchscope.testing import synthetic

from tests.factories import APP, PAGES, run_app


def publish_as_a_runtime_does(engine, model: str, kind: str) -> None:
    """Publish ``model``'s synthetic settings again under the kind a runtime names it
    (the synthetic data names generation models "generation"; runtimes say "generate")."""
    version, cur = control.current_settings(engine, "synthetic-1", model)
    control.publish_settings(engine, instance_id="synthetic-1", model=model, version=version,
                             settings=cur, kind=kind, now=time.time())


def test_headline_metrics_and_flags_render(app_db):
    at = run_app()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["mean batch / max"].endswith("/ 16")
    assert metrics["latency p99"].endswith("ms")
    assert metrics["rejected/expired/errors"] == "0 / 0 / 0"
    assert any("Out of memory 2 time(s)" in e.label for e in at.expander)
    # the instance reported until now, so it counts as live and no demo is started
    assert any("Attached to live runtime" in c.value for c in at.caption)
    assert len(at.get("plotly_chart")) >= 10


def test_apply_writes_a_control_command(app_db):
    at = run_app("tuning")
    box = next(n for n in at.number_input if n.label == "Max batch size")
    assert box.value == 16  # the published current settings
    box.set_value(24)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception
    cmds = control.recent_commands(app_db, model="mlp")
    assert len(cmds) == 1
    assert cmds[0].changes == {"max_batch_size": 24} and cmds[0].status == "pending"
    assert any("pending" in i.value for i in at.info)
    control.ack_command(app_db, cmds[0].id, applied_version=3, now=time.time())
    at.run()
    assert any("applied as settings version 3" in s.value for s in at.success)


def test_refusal_reason_is_shown(app_db):
    at = run_app("tuning")
    next(n for n in at.number_input if n.label == "Max batch size").set_value(8)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    cid = control.recent_commands(app_db, model="mlp")[0].id
    control.refuse_command(app_db, cid, reason="max_batch_size=8 is too small", now=time.time())
    at.run()
    assert any("refused — max_batch_size=8 is too small" in e.value for e in at.error)


def test_revert_requests_the_old_settings(app_db):
    at = run_app("tuning")
    assert any("max_batch_size" in str(d.value) for d in at.dataframe)
    next(b for b in at.button if b.label.startswith("Revert")).click()
    at.run()
    cmd = control.recent_commands(app_db, model="mlp")[0]
    assert cmd.changes == {"max_batch_size": 32}
    assert cmd.requested_by == "dashboard (revert)"


def test_generation_model_gets_its_own_settings_form(app_db):
    synthetic.generate(app_db, synthetic.SCENARIOS["generation"].with_(
        duration_s=120, batches_per_s=2, gen_steps_per_s=5), end_s=time.time(), seed=5)
    publish_as_a_runtime_does(app_db, "decoder", "generate")
    at = run_app()
    at.selectbox(key="model").set_value("decoder").run()
    assert not at.exception
    assert "Generation: sequences, tokens, cache, preemptions" in json.dumps(
        [c.proto.spec for c in at.get("plotly_chart")])
    at.switch_page(f"{PAGES}/tuning.py").run()
    assert not at.exception
    box = next(n for n in at.number_input if n.label == "Max num seqs")
    box.set_value(8)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    cmd = control.recent_commands(app_db, model="decoder")[0]
    assert cmd.changes == {"max_num_seqs": 8}


def test_the_settings_form_follows_the_schema(app_db):
    at = run_app("tuning")
    policy = next(s for s in at.selectbox if s.label == "Policy")
    assert policy.options == ["static", "dynamic", "adaptive"] and policy.value == "dynamic"
    assert [c.value for c in at.checkbox if c.label == "Bucketing"] == [False]
    delay = next(t for t in at.text_input if t.label == "Max queue delay (ms)")
    assert delay.value == "5" and "work-conserving" in delay.help
    box = next(n for n in at.number_input if n.label == "Max batch size")
    assert (box.min, box.max) == (1, 4096) and "integer 1-4096 requests" in box.help
    # a nullable number set to empty becomes null; an unchanged field is not sent
    delay.set_value("")
    next(t for t in at.text_input if t.label == "Preferred batch sizes").set_value("8, 16")
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception
    cmd = control.recent_commands(app_db, model="mlp")[0]
    assert cmd.changes == {"max_queue_delay_ms": None, "preferred_batch_sizes": [8, 16]}


def test_invalid_values_are_explained_and_nothing_is_sent(app_db):
    at = run_app("tuning")
    next(t for t in at.text_input if t.label == "Preferred batch sizes").set_value("8, x")
    next(t for t in at.text_input if t.label == "Bucket edges").set_value("[]")
    next(n for n in at.number_input if n.label == "Max batch size").set_value(24)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    errors = [e.value for e in at.error]
    assert any("preferred_batch_sizes" in e and "comma-separated list of integers" in e
               for e in errors), errors
    assert any("bucket_edges=()" in e and "non-empty list" in e for e in errors), errors
    assert control.recent_commands(app_db, model="mlp") == []


def test_a_setting_unknown_to_the_schema_is_a_text_field(app_db):
    version, cur = control.current_settings(app_db, "synthetic-1", "mlp")
    control.publish_settings(app_db, instance_id="synthetic-1", model="mlp", version=version + 1,
                             settings={**cur, "warmup_batches": 3}, kind="request", now=time.time())
    at = run_app("tuning")
    field = next(t for t in at.text_input if t.label == "warmup_batches")
    assert field.value == "3"
    field.set_value("5")
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert control.recent_commands(app_db, model="mlp")[0].changes == {"warmup_batches": 5}


def test_every_page_browses_an_opened_snapshot(app_db):
    now = time.time()
    data = snapshot.export_bytes(app_db, Window(now - 600, now), slo_ms=50.0)
    at = run_app("snapshots")
    assert any(b.label == "Prepare snapshot of the current window" for b in at.button)
    at.session_state["snapshots"] = {"s.zip": snapshot.load_snapshot(data)}
    at.session_state["switch_source"] = "Snapshot: s.zip"  # what opening one does
    at.run()
    assert any("Browsing snapshot s.zip" in i.value for i in at.info)
    at.switch_page(f"{PAGES}/tuning.py").run()
    assert any("Tuning acts on the live database" in c.value for c in at.caption)
    assert not any(b.label == "Apply" for b in at.button)
    at.switch_page(f"{PAGES}/live.py").run()
    assert not at.exception and len(at.get("plotly_chart")) >= 10
    assert any("Out of memory 2 time(s)" in e.label for e in at.expander)


def test_the_demo_runtime_is_named_as_such(app_db):
    now = time.time()
    control.register_instance(app_db, instance_id="demo-1", host="localhost", pid=1,
                              models=["mlp"], url=None, device="cpu", version="0.1.0-demo",
                              now=now)
    with app_db.begin() as conn:  # only the demo reports: the synthetic instance went quiet
        conn.exec_driver_sql("UPDATE runtime_instances SET last_seen_at = ? WHERE id != 'demo-1'",
                             (now - 3600,))
    at = run_app()
    banner = [i.value for i in at.info if "bundled demo runtime" in i.value]
    assert banner and not any("Attached to live runtime" in c.value for c in at.caption)
    # this dashboard did not start it: it does not say so, nor how to turn its own off
    assert "started outside this dashboard" in banner[0] and "NO_DEMO" not in banner[0]



def test_a_change_for_every_instance_shows_each_instance_s_outcome(app_db):
    now = time.time()
    for name in ("replica-a", "replica-b", "replica-c"):
        control.register_instance(app_db, instance_id=name, host="node", pid=1, models=["mlp"],
                                  url=None, device="cpu", version="t", now=now)
    cid = control.request_change(app_db, model="mlp", changes={"max_batch_size": 8},
                                 requested_by="dashboard")
    control.ack_command(app_db, cid, applied_version=3, now=now, instance_id="replica-a")
    control.refuse_command(app_db, cid, reason="max_batch_size=8 is below the floor",
                           now=now, instance_id="replica-b")
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["last_command"] = cid
    at.run()
    at.switch_page(f"{PAGES}/tuning.py").run()
    assert not at.exception, [e.value for e in at.exception]
    summary = [e.value for e in at.error if f"Change #{cid}" in e.value]
    # the synthetic runtime reports mlp too, and has not answered either
    waiting = {i.id for i in control.live_instances(app_db, now=time.time())
               if "mlp" in i.models} - {"replica-a", "replica-b"}
    assert "replica-c" in waiting
    assert summary and f"1 applied, 1 refused, {len(waiting)} waiting" in summary[0], summary
    table = next(d.value for d in at.dataframe if "outcome" in d.value.columns)
    outcomes = dict(zip(table["instance"], table["outcome"]))
    assert outcomes == {"replica-a": "applied", "replica-b": "refused",
                        **{i: "waiting" for i in waiting}}
    assert "below the floor" in " ".join(table["reason"])


def open_tab(at) -> str:
    """The label of the Live page's open tab, as the last run sent it to the browser."""
    def find(node):
        for child in getattr(node, "children", {}).values():
            if getattr(child, "type", "") == "tab_container":
                return child
            found = find(child)
            if found is not None:
                return found
        return None
    tabs = find(at._tree)
    labels = [t.label for t in tabs.children.values()]
    return labels[tabs.proto.tab_container.default_tab_index]


def test_the_open_live_tab_stays_open_when_findings_and_model_change(app_db):
    """A tab's label was its identity: "Diagnosis (7)" becoming "(6)" made new tabs, and
    the browser showed Charts again; so did a page run for another model."""
    at = run_app()
    assert [t.label for t in at.tabs] == ["Charts", "Diagnosis"] and open_tab(at) == "Charts"
    at.session_state["live_tab"] = "Diagnosis"  # what a click on the tab sends
    at.run()
    first = [c.value for c in at.caption if c.value.startswith("Diagnosis:")]
    assert open_tab(at) == "Diagnosis" and first == ["Diagnosis: 1 finding(s) · 🔴 1 critical"]
    synthetic.generate(app_db, synthetic.SCENARIOS["generation"].with_(
        duration_s=120, batches_per_s=2, gen_steps_per_s=5), end_s=time.time(), seed=5)
    at.run()
    at.selectbox(key="model").set_value("decoder").run()
    assert not at.exception
    now = [c.value for c in at.caption if c.value.startswith("Diagnosis:")]
    assert now and now != first, now
    assert [t.label for t in at.tabs] == ["Charts", "Diagnosis"] and open_tab(at) == "Diagnosis"


def test_the_history_says_what_each_change_changed(app_db):
    at = run_app("tuning")
    history = next(d.value for d in at.dataframe if "changed" in d.value.columns)
    assert list(history.columns)[0] == "changed"
    assert history["changed"].iloc[0] == "max_batch_size 32 → 16"
    picker = next(s for s in at.selectbox if s.label == "Change")
    assert picker.options[0].endswith(": max_batch_size 32 → 16")


def test_before_and_after_a_change_cover_the_same_length():
    """A change 24 s ago is compared over 24 s on each side, not 24 s against the
    window's 15 min (which read a quiet moment as a drop in traffic); an old one over the
    window's length on each side; a change of a moment ago over the least side."""
    from batchscope.dashboard.tuning import AROUND_MIN_S, around

    before, after = around(1000.0, 900.0, 1024.0, "mlp", None)
    assert (before.start_s, before.end_s, after.start_s, after.end_s) == (976, 1000, 1000, 1024)
    before, after = around(1000.0, 900.0, 5000.0, "mlp", "i")
    assert before.duration_s == after.duration_s == 900.0 and after.instance_id == "i"
    before, after = around(1000.0, 900.0, 1001.0, "mlp", None)
    assert before.duration_s == after.duration_s == AROUND_MIN_S


def test_an_applied_change_not_recorded_yet_is_said_to_be_on_its_way(app_db):
    """Applied, but the recorder has not written its settings_change event yet: the
    history says so (it said nothing of it), then lists it once written."""
    at = run_app("tuning")
    next(n for n in at.number_input if n.label == "Max batch size").set_value(24)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    cmd = control.recent_commands(app_db, model="mlp")[0]
    version, cur = control.current_settings(app_db, "synthetic-1", "mlp")
    now = time.time()
    control.publish_settings(app_db, instance_id="synthetic-1", model="mlp",
                             version=version + 1, settings={**cur, "max_batch_size": 24},
                             kind="request", now=now)
    control.ack_command(app_db, cmd.id, applied_version=version + 1, now=now)
    at.run()
    assert any(f"on synthetic-1, version {version + 1}" in c.value for c in at.caption)
    waiting = [c.value for c in at.caption if "being recorded" in c.value]
    assert waiting == [f"Change #{cmd.id} (max_batch_size → 24) was applied as version "
                       f"{version + 1} on synthetic-1; it is being recorded and appears here "
                       "within a second or so."], waiting
    with Session(app_db) as session, session.begin():  # what the runtime's recorder writes
        session.add(EventRecord(
            at=now, instance_id="synthetic-1", model="mlp", kind="settings_change",
            message="settings changed", details_json=json.dumps({
                "old": cur, "new": {**cur, "max_batch_size": 24}, "version": version + 1,
                "requested_by": "dashboard"})))
    at.run()
    assert not any("being recorded" in c.value for c in at.caption)
    history = next(d.value for d in at.dataframe if "changed" in d.value.columns)
    assert history["changed"].iloc[0] == "max_batch_size 16 → 24"


def test_setting_labels_spell_acronyms_as_such(app_db):
    version, cur = control.current_settings(app_db, "synthetic-1", "mlp")
    control.publish_settings(app_db, instance_id="synthetic-1", model="mlp", version=version + 1,
                             settings={**cur, "oom_recovery": True, "cuda_graphs": False,
                                       "oom_probe_after_batches": 40,
                                       "autopilot_slo_p99_ms": None},
                             kind="request", now=time.time())
    at = run_app("tuning")
    labels = {w.label for w in [*at.checkbox, *at.number_input, *at.text_input]}
    assert {"OOM recovery", "CUDA graphs", "OOM probe after batches",
            "Autopilot SLO p99 (ms)"} <= labels, labels


def test_the_timeline_tables_show_latency_first_and_ms_alike(app_db):
    with app_db.connect() as conn:
        seq = conn.exec_driver_sql("SELECT seq FROM batches WHERE outcome = 'ok' "
                                   "ORDER BY ended_at DESC LIMIT 1 OFFSET 40").scalar()
    at = run_app("timeline")
    next(t for t in at.text_input if t.label == "Go to batch number").set_value(str(seq)).run()
    assert not at.exception and any(f"**Batch {seq}**" in m.value for m in at.markdown)
    slowest = next(d for d in at.dataframe if "latency_ms" in d.value.columns)
    assert list(slowest.proto.column_order)[:2] == ["latency_ms", "batch"]
    members = next(d for d in at.dataframe if "latency (ms)" in d.value.columns)
    formats = {name: c.get("type_config", {}).get("format") for d in (slowest, members)
               for name, c in json.loads(d.proto.columns).items()}
    assert formats["latency_ms"] == formats["latency (ms)"] == "%.2f"
    assert formats["queue wait (ms)"] == formats["queue_ms"] == "%.2f"
