"""The Tuning page: change a model's settings, follow the change, revert one, or let a
tuning session find the best settings.

Apply queues a command in the control table (``control.request_change``) with only the
settings that changed; the runtime polls it, applies or refuses it and publishes the new
settings. The status of the last command refreshes on its own until it is settled. The
history lists every settings change with a revert button and a before/after comparison
of the headline numbers around it.

"Find best settings" runs the same session as ``batchscope tune``
(``batchscope.tuning.runner.TuningJob``, on a thread of its own) against the URL the
selected model's instance registered (``runtime_instances.url``): trials fill a
throughput-vs-p99 chart as they finish, the starting settings are put back at the end,
and Apply sends the recommendation through the normal control path (a command
requested by ``tuner``, acknowledged by the runtime, marked on every chart). Control
requests to a server with a token send ``$BATCHSCOPE_CONTROL_TOKEN``.

Every session is stored in the dashboard's database as it runs
(``batchscope.tuning.store``). "Tuning sessions" lists the stored ones, newest first,
each with its trials chart, and the golden-parameter table (``batchscope.tuning.golden``:
the best settings per session on its hardware, beside the published rules of thumb),
downloadable as CSV or Markdown. Browsing a snapshot, the page shows the sessions the
snapshot holds.
"""

from __future__ import annotations

import json
import os
import time

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from batchscope import settings
from batchscope.analysis import queries
from batchscope.dashboard import settings_form
from batchscope.dashboard.scope import Scope, data_engine, engine_for, fmt_time, fragment
from batchscope.load.replay import recorded_lengths
from batchscope.presentation import charts
from batchscope.storage import control
from batchscope.tuning import golden, store
from batchscope.tuning.client import ENV_TOKEN
from batchscope.tuning.figures import Stability
from batchscope.tuning.runner import TuneOptions, TuningJob
from batchscope.tuning.space import format_point

#: seconds between refreshes of the last command's status while live
STATUS_EVERY_S = 1.0
_LAST_COMMAND = "last_command"
#: what the page run read: the scope's published settings version and newest history entry
_PAGE_STATE = "tuning_page_state"
#: seconds after a change of this session was handled during which the status region
#: rebuilds the page when the published settings or the history move on: the runtime
#: publishes its new settings on its next pass, the recorder writes the settings_change
#: event within a second
FOLLOW_S = 15.0
#: seconds between refreshes of a running tuning session's chart and table
TUNE_EVERY_S = 1.0
_JOBS = "tuning_jobs"
_SHOWN = "tuning_jobs_shown"
LOADS = {"synthetic, closed loop": "closed", "synthetic, open loop": "open",
         "replay of recorded traffic": "replay", "live traffic (measure only)": "live"}
#: the requester a tuner recommendation is applied under
TUNER = "tuner"


def render(scope: Scope) -> None:
    if scope.snapshot is not None:
        st.caption("Tuning acts on the live database; switch Data back to it. Below: the "
                   "tuning sessions stored in the snapshot.")
        stored_sessions(data_engine(scope), scope)
        return
    engine = engine_for(scope.db_url)
    st.session_state[_PAGE_STATE] = page_state(engine, scope)
    settings_section(engine, scope)
    run_every = STATUS_EVERY_S if scope.refresh_s is not None else None
    fragment(command_status, run_every)(engine, scope)
    find_best_settings(engine, scope)
    stored_sessions(engine, scope)
    history_and_revert(engine, scope)


def published_settings(engine: Engine, scope: Scope) -> tuple[str | None, int | None, dict]:
    """``(instance, version, settings)`` of the scope's model, from the scope's instance or
    else the first live (or else known) instance that published some; ``(None, None, {})``
    when none did."""
    candidates = [scope.instance] if scope.instance else list(scope.live_ids)
    if not candidates:
        rows = queries.instances(engine)
        candidates = list(rows["id"]) if len(rows) else []
    for inst_id in candidates:
        found = control.current_settings(engine, inst_id, scope.model)
        if found is not None:
            return inst_id, found[0], found[1]
    return None, None, {}


def schema_for(engine: Engine, instance: str | None, model: str) -> tuple[settings.Setting, ...]:
    """The schema of the model's published kind; empty for a kind the schema does not know,
    whose settings are then all shown as plain text fields."""
    kind = queries.model_kinds(engine, instance).get(model, "request")
    try:
        return settings.fields_for(kind)
    except ValueError:
        st.caption(f"Settings of kind {kind!r} are not in this dashboard's schema; they are "
                   "shown as text.")
        return ()


def settings_section(engine: Engine, scope: Scope) -> None:
    model = scope.model
    if model is None:
        st.info("No model has reported yet; tuning appears once a runtime publishes its settings.")
        return
    inst_id, version, current = published_settings(engine, scope)
    st.caption(f"Current settings of **{model}**" + (f" on {inst_id}, version {version}"
                                                     if inst_id else " (none published yet; "
                                                     "showing the defaults)"))
    schema = schema_for(engine, inst_id, model)
    asked = settings_form.draw(f"settings-{inst_id}-{model}-v{version}", schema, current)
    if asked is None:
        return
    for problem in asked.problems:
        st.error(problem)
    if asked.problems:
        return
    if not asked.changes:
        st.info("Nothing differs from the current settings.")
        return
    # sent to the scope's instance, or to every instance serving the model when "all"
    cid = control.request_change(engine, model=model, changes=asked.changes,
                                 requested_by="dashboard", instance_id=scope.instance)
    st.session_state[_LAST_COMMAND] = cid
    st.toast(f"Requested change #{cid}: {json.dumps(asked.changes)}")


def page_state(engine: Engine, scope: Scope) -> tuple:
    """What the settings header and the history show: the instance and version of the
    published settings, and the newest settings change recorded."""
    if scope.model is None:
        return ()
    inst_id, version, _ = published_settings(engine, scope)
    newest = control.settings_history(engine, scope.model, scope.instance, limit=1)
    return inst_id, version, newest[0].id if newest else None


def last_command(engine: Engine) -> control.Command | None:
    """The last command this session sent, as the control table has it now."""
    cid = st.session_state.get(_LAST_COMMAND)
    if cid is None:
        return None
    try:
        return control.command_status(engine, cid)
    except ValueError:
        return None


def handled_at(cmd: control.Command) -> float | None:
    """When the runtime (the last instance, for a broadcast) answered ``cmd``; None
    while nobody has."""
    times = [a.handled_at for a in cmd.acks] + [cmd.handled_at or 0.0]
    return max(times) or None


def follow_the_change(engine: Engine, scope: Scope, cmd: control.Command) -> None:
    """Rebuild the whole page once what it shows is behind the change just handled.

    This status is a fragment that reruns on its own; the settings header and the
    history above and below it are drawn by the page run, which read them before the
    runtime applied the change. Without this they kept the old version and "no settings
    changes" until something else rebuilt the page.
    """
    done = handled_at(cmd)
    if done is None or time.time() > done + FOLLOW_S:
        return
    if page_state(engine, scope) != st.session_state.get(_PAGE_STATE):
        st.rerun(scope="app")


def command_status(engine: Engine, scope: Scope) -> None:
    """Where the last command of this session stands: pending, applied or refused."""
    cid = st.session_state.get(_LAST_COMMAND)
    if cid is None:
        return
    try:
        cmd = control.command_status(engine, cid)
    except ValueError as exc:
        st.warning(str(exc))
        return
    follow_the_change(engine, scope, cmd)
    text = json.dumps(cmd.changes)
    if cmd.instance_id is None:
        broadcast_status(engine, cmd, text)
        return
    if cmd.status == control.PENDING:
        st.info(f"Change #{cmd.id} {text}: pending — waiting for the runtime to apply it.")
    elif cmd.status == control.APPLIED:
        st.success(f"Change #{cmd.id} {text}: applied as settings version {cmd.applied_version}.")
    else:
        st.error(f"Change #{cmd.id} {text}: refused — {cmd.reason}")


def broadcast_status(engine: Engine, cmd: control.Command, text: str) -> None:
    """A change sent to every instance of a model: each instance's own outcome, and the
    live instances serving the model that have not answered yet."""
    acks = {a.instance_id: a for a in cmd.acks}
    serving = [i.id for i in control.live_instances(engine, now=time.time())
               if cmd.model in i.models]
    waiting = [i for i in serving if i not in acks]
    refused = [a for a in acks.values() if a.status != control.APPLIED]
    summary = (f"Change #{cmd.id} {text} for every instance of {cmd.model}: "
               f"{len(acks) - len(refused)} applied, {len(refused)} refused, "
               f"{len(waiting)} waiting")
    (st.error if refused else st.info if waiting else st.success)(summary)
    rows = [{"instance": a.instance_id, "outcome": a.status,
             "settings version": a.applied_version, "reason": a.reason or "",
             "when": fmt_time(a.handled_at)} for a in acks.values()]
    rows += [{"instance": i, "outcome": "waiting", "settings version": None, "reason": "",
              "when": ""} for i in waiting]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def history_and_revert(engine: Engine, scope: Scope) -> None:
    model = scope.model
    if model is None:
        return
    hist = control.settings_history(engine, model, scope.instance, limit=100)
    st.subheader("Settings history")
    waiting = unrecorded_change(last_command(engine), model, scope.instance, hist)
    if waiting:
        st.caption(waiting)
    if not hist:
        if not waiting:
            st.caption("No settings changes recorded for this model.")
        return
    st.dataframe(history_table(hist), hide_index=True, width="stretch")
    labels = {f"v{h.version} at {fmt_time(h.at)}: {changed_text(h.old, h.new)}": h for h in hist}
    chosen = labels[st.selectbox("Change", list(labels), key="revert_choice")]
    c1, c2 = st.columns(2)
    if c1.button("Revert to the settings before this change", key="revert"):
        cid = control.request_change(engine, model=model, changes=chosen.old,
                                     requested_by="dashboard (revert)", instance_id=scope.instance)
        st.session_state[_LAST_COMMAND] = cid
        st.toast(f"Requested revert #{cid}: {json.dumps(chosen.old)}")
    before, after = around(chosen.at, scope.duration_s, time.time(), model, scope.instance)
    side = after.duration_s
    c2.caption(f"Before/after: {side / 60:.1f} min on each side of the change"
               + ("" if side >= scope.duration_s else
                  f" (the time since it, so far; up to {scope.duration_s / 60:.0f} min)"))
    st.plotly_chart(charts.compare(queries.headline(engine, before),
                                   queries.headline(engine, after)), key="before-after")


#: the least time each side of a before/after comparison covers
AROUND_MIN_S = 10.0


def around(at: float, span_s: float, now: float, model: str,
           instance: str | None) -> tuple[queries.Window, queries.Window]:
    """The windows before and after a change at ``at``: ``span_s`` each, or, while less
    than that has passed since it, the time that has (at least ``AROUND_MIN_S``) on both
    sides. Sides of equal length: 24 s after a change against 15 min before it compared
    a quiet moment with a quarter of an hour's mean, and read as a drop in traffic."""
    side = max(AROUND_MIN_S, min(span_s, now - at))
    return (queries.Window(at - side, at, model, instance),
            queries.Window(at, at + side, model, instance))


#: a setting one side of a change lacks
_ABSENT = object()


def value_text(value) -> str:
    """A setting's value as the history shows it: JSON, strings without quotes."""
    return value if isinstance(value, str) else json.dumps(value)


def changed_text(old: dict, new: dict) -> str:
    """Only what a change changed: "max_batch_size 16 → 12, policy static → dynamic"
    (— where a side lacks the setting); the whole settings are in the old/new columns."""
    parts = [f"{k} {value_text(old[k]) if k in old else '—'} → "
             f"{value_text(new[k]) if k in new else '—'}"
             for k in sorted({*old, *new}) if old.get(k, _ABSENT) != new.get(k, _ABSENT)]
    return ", ".join(parts) or "no setting changed"


def asked_text(changes: dict) -> str:
    """A command's changes: "max_batch_size → 12"."""
    return ", ".join(f"{k} → {value_text(v)}" for k, v in changes.items())


def history_table(hist: list[control.SettingsChange]) -> pd.DataFrame:
    """The settings changes, newest first, what changed in the first column."""
    return pd.DataFrame([{"changed": changed_text(h.old, h.new), "when": fmt_time(h.at),
                          "instance": h.instance_id, "version": h.version,
                          "by": h.requested_by, "old": json.dumps(h.old),
                          "new": json.dumps(h.new)} for h in hist])


def unrecorded_change(cmd: control.Command | None, model: str, instance: str | None,
                      hist: list[control.SettingsChange]) -> str | None:
    """What to say while this session's last change is applied but its settings_change
    event is not in the database yet (the recorder writes it within a second), rather
    than "no settings changes"; None otherwise."""
    if cmd is None or cmd.model != model:
        return None
    applied = {(a.instance_id, a.applied_version) for a in cmd.acks
               if a.status == control.APPLIED}
    if cmd.status == control.APPLIED and cmd.instance_id is not None:
        applied.add((cmd.instance_id, cmd.applied_version))
    applied = {(i, v) for i, v in applied if instance in (None, i)}  # the history's instance
    recorded = {(h.instance_id, h.version) for h in hist}
    done = handled_at(cmd)
    if not applied - recorded or done is None or time.time() > done + FOLLOW_S:
        return None
    versions = ", ".join(f"version {v} on {i}" for i, v in sorted(applied - recorded))
    return (f"Change #{cmd.id} ({asked_text(cmd.changes)}) was applied as {versions}; "
            "it is being recorded and appears here within a second or so.")


# -- find best settings ------------------------------------------------------------------------
def instance_url(engine: Engine, scope: Scope) -> tuple[str | None, str | None]:
    """``(instance, url)`` of a live instance serving the scope's model that registered a
    URL: the scope's instance, else the first such one; ``(None, None)`` when none."""
    for inst in control.live_instances(engine, now=time.time()):
        if scope.model in inst.models and inst.url and scope.instance in (None, inst.id):
            return inst.id, inst.url
    return None, None


def find_best_settings(engine: Engine, scope: Scope) -> None:
    model = scope.model
    if model is None:
        return
    st.subheader("Find best settings")
    inst_id, url = instance_url(engine, scope)
    if url is None:
        st.caption(f"A tuning session needs a live runtime serving {model!r} that registered "
                   "its URL; none does now.")
        return
    key = f"{inst_id}/{model}"
    jobs: dict[str, TuningJob] = st.session_state.setdefault(_JOBS, {})
    job = jobs.get(key)
    if job is None or not job.running:
        options = tuning_form(engine, scope, inst_id, url, model)
        if options is not None:
            job = jobs[key] = TuningJob(options).start()
            st.session_state.setdefault(_SHOWN, set()).discard(key)
    if job is not None:
        every = TUNE_EVERY_S if job.running else None
        fragment(session_view, every)(engine, job, inst_id, key)


def tuning_form(engine: Engine, scope: Scope, inst_id: str | None, url: str,
                model: str) -> TuneOptions | None:
    """The session's options once the form is sent, else None."""
    seen = recorded_lengths(engine, model, since=time.time() - 3600, instance_id=inst_id)
    with st.form(f"tune-{inst_id}-{model}"):
        st.caption(f"Tunes {model!r} on {url} through its control API, under load, and puts "
                   "the starting settings back at the end; Apply keeps the recommendation.")
        c1, c2, c3 = st.columns(3)
        slo = c1.number_input("SLO: p99 at most (ms)", min_value=0.1, value=float(scope.slo_ms),
                              key=f"tune-slo-{model}")
        budget = c2.number_input("Budget (s)", min_value=10.0, max_value=3600.0, value=120.0,
                                 step=10.0, key=f"tune-budget-{model}")
        load = c3.selectbox("Load", list(LOADS), key=f"tune-load-{model}")
        c4, c5, c6 = st.columns(3)
        concurrency = c4.number_input("Connections (closed loop)", min_value=1, value=64,
                                      key=f"tune-conc-{model}")
        rate = c5.number_input("Requests/s (open loop, or the target rate)", min_value=0.1,
                               value=100.0, key=f"tune-rate-{model}")
        lengths = c6.text_input("Input lengths (variable-length models)",
                                value=f"uniform:{seen[0]}:{seen[1]}" if seen else "",
                                help="uniform:8:128, fixed:64 or choice:16,64; taken from the "
                                     "recorded requests when there are some",
                                key=f"tune-lengths-{model}")
        objective = st.radio("Objective", ["most goodput under the SLO",
                                           "lowest p99 at the target rate"], horizontal=True,
                             key=f"tune-objective-{model}")
        with st.expander("Trial options"):
            t1, t2, t3 = st.columns(3)
            window = t1.number_input("Measurement window (s)", min_value=0.1, max_value=60.0,
                                     value=1.0, key=f"tune-window-{model}")
            settle = t2.number_input("Settle after a change (s)", min_value=0.0, max_value=60.0,
                                     value=0.5, key=f"tune-settle-{model}")
            tolerance = t3.number_input(
                "Windows agree within (%)", min_value=1.0, max_value=99.0, value=10.0,
                help="a trial counts once its last three windows' throughput and p99 are each "
                     "within this of their mean; widen it on a noisy machine",
                key=f"tune-tolerance-{model}")
        sent = st.form_submit_button("Find best settings", type="primary")
    if not sent:
        return None
    mode = LOADS[load]
    options = TuneOptions(
        url=url, model=model, slo_p99_ms=float(slo), budget_s=float(budget),
        load="synthetic" if mode in ("closed", "open") else mode,
        concurrency=int(concurrency) if mode == "closed" else None,
        rate=float(rate) if mode == "open" or objective.startswith("lowest") else None,
        lengths=lengths.strip() or None, db_url=scope.db_url, replay_window_s=3600.0,
        objective="latency" if objective.startswith("lowest") else "goodput",
        token=os.environ.get(ENV_TOKEN) or None, instance_id=inst_id, requested_by="dashboard",
        window_s=float(window), settle_s=float(settle),
        stability=Stability(tolerance=float(tolerance) / 100.0))
    try:
        return options.check()
    except ValueError as exc:  # TuningError, SpaceError
        st.error(str(exc))
        return None


def session_view(engine: Engine, job: TuningJob, inst_id: str | None, key: str) -> None:
    """A session's progress, trials and result; Cancel while it runs, Apply after."""
    progress, result = job.progress, job.result
    if progress is not None:
        st.progress(progress.fraction, text=f"{progress.message} - {progress.elapsed_s:.0f} s "
                                            f"of {job.options.budget_s:.0f} s")
    if job.running and st.button("Cancel the session", key=f"tune-cancel-{key}"):
        job.cancel()
    rows = pd.DataFrame(progress.rows if progress is not None else [])
    best = result.best.number if result is not None and result.best is not None else None
    if progress is not None:
        ended = sum(r["status"] != "running" for r in progress.rows)
        st.caption(f"{ended} trial(s) measured; {progress.stored or 'not stored'}")
    if len(rows):
        st.plotly_chart(charts.tuning_trials(rows, slo_ms=job.options.slo_p99_ms,
                                             recommended=best), key=f"tune-chart-{key}")
        st.dataframe(rows[["trial", "status", "changed", "goodput_rps", "throughput_rps",
                           "p99_ms", "windows", "problem"]], hide_index=True, width="stretch")
    if job.error:
        st.error(f"The tuning session stopped: {job.error}")
    if result is not None:
        st.success(result.sentence())
        st.caption(f"Stopped: {result.stop_reason}; {result.outcome}.")
        if result.recommended and st.button(f"Apply {format_point(result.recommended)}",
                                            key=f"tune-apply-{key}", type="primary"):
            cid = control.request_change(engine, model=job.options.model,
                                         changes=result.recommended, requested_by=TUNER,
                                         instance_id=inst_id)
            st.session_state[_LAST_COMMAND] = cid
            st.toast(f"Requested change #{cid}: {json.dumps(result.recommended)}")
    if job.lines:
        with st.expander("Session log"):
            st.code("\n".join(job.lines[-200:]), language=None)
    shown: set = st.session_state.setdefault(_SHOWN, set())
    if not job.running and key not in shown:
        shown.add(key)  # once: rebuild the page, whose fragment then has no timer
        st.rerun()


# -- stored sessions and the golden-parameter table --------------------------------------------
#: the most sessions the page lists
SESSIONS_SHOWN = 50


def session_label(s: store.StoredSession) -> str:
    return f"#{s.id} · {s.model} · {fmt_time(s.started_at)} · {s.state}"


def stored_sessions(engine: Engine, scope: Scope) -> None:
    """The stored sessions of the scope's model (newest first) with the chosen one's
    trials, and the golden-parameter table over every stored session."""
    st.subheader("Tuning sessions")
    found = store.sessions(engine, model=scope.model, instance_id=scope.instance,
                           limit=SESSIONS_SHOWN)
    if not found:
        st.caption("No tuning session is stored" + (f" for {scope.model}" if scope.model else "")
                   + " yet; Find best settings (or `batchscope tune --db URL`) stores each one.")
    else:
        st.caption(f"{len(found)} stored session(s)" +
                   (f" of {scope.model}" if scope.model else "") + ", newest first.")
        table = pd.DataFrame([{
            "session": s.id, "started": fmt_time(s.started_at), "model": s.model,
            "instance": s.instance_id or "", "hardware": s.hardware or "", "state": s.state,
            "trials": s.trials, "SLO p99 ms": s.slo_p99_ms, "load": s.load_description or s.load_kind,
            "best": "" if s.recommended is None else (format_point(s.recommended) or "(starting)"),
            "result": s.sentence or s.stop_reason or ""} for s in found])
        st.dataframe(table, hide_index=True, width="stretch")
        labels = {session_label(s): s for s in found}
        chosen = labels[st.selectbox("Session", list(labels), key="stored-session")]
        trials = store.trials_of(engine, [chosen.id])[chosen.id]
        rows = pd.DataFrame([t.row() for t in trials])
        if len(rows):
            st.plotly_chart(charts.tuning_trials(rows, slo_ms=chosen.slo_p99_ms,
                                                 recommended=chosen.best_trial),
                            key=f"stored-chart-{chosen.id}")
            st.dataframe(rows[["trial", "status", "changed", "goodput_rps", "throughput_rps",
                               "p99_ms", "windows", "problem"]], hide_index=True, width="stretch")
        else:
            st.caption("No trial of this session is stored.")
    golden_table(engine)


def golden_table(engine: Engine) -> None:
    st.subheader("Golden parameters")
    found = store.sessions(engine, limit=store.MAX_SESSIONS)
    rows = golden.golden_rows(found, store.best_trials(engine, found))
    mine, theirs = st.columns([3, 1])
    with mine:
        st.caption("The best settings of each stored session on its hardware (timeout: "
                   "max_queue_delay_ms of the dynamic policy, 0 = work-conserving).")
        if rows:
            st.dataframe(pd.DataFrame([golden.cells(r) for r in rows], columns=golden.COLUMNS),
                         hide_index=True, width="stretch")
        else:
            st.caption("No stored session found a setting that meets its SLO yet.")
    with theirs:
        st.caption("Published rules of thumb")
        st.dataframe(pd.DataFrame(golden.article_cells(), columns=golden.ARTICLE_COLUMNS),
                     hide_index=True, width="stretch")
    c1, c2 = st.columns(2)
    c1.download_button("Download CSV", golden.to_csv(rows), file_name="golden-parameters.csv",
                       mime="text/csv", key="golden-csv")
    c2.download_button("Download Markdown", golden.to_markdown(rows),
                       file_name="golden-parameters.md", mime="text/markdown", key="golden-md")
