"""The Tuning page: change a model's settings, follow the change, revert one.

Apply queues a command in the control table (``control.request_change``) with only the
settings that changed; the runtime polls it, applies or refuses it and publishes the new
settings. The status of the last command refreshes on its own until it is settled. The
history lists every settings change with a revert button and a before/after comparison
of the headline numbers around it.
"""

from __future__ import annotations

import json
import time

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from batchscope import settings
from batchscope.analysis import queries
from batchscope.dashboard import settings_form
from batchscope.dashboard.scope import Scope, engine_for, fmt_time
from batchscope.presentation import charts
from batchscope.storage import control

#: seconds between refreshes of the last command's status while live
STATUS_EVERY_S = 1.0
_LAST_COMMAND = "last_command"


def render(scope: Scope) -> None:
    if scope.snapshot is not None:
        st.caption("Tuning acts on the live database; switch Data back to it.")
        return
    engine = engine_for(scope.db_url)
    settings_section(engine, scope)
    run_every = STATUS_EVERY_S if scope.refresh_s is not None else None
    st.fragment(run_every=run_every)(command_status)(engine)
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


def command_status(engine: Engine) -> None:
    """Where the last command of this session stands: pending, applied or refused."""
    cid = st.session_state.get(_LAST_COMMAND)
    if cid is None:
        return
    try:
        cmd = control.command_status(engine, cid)
    except ValueError as exc:
        st.warning(str(exc))
        return
    text = json.dumps(cmd.changes)
    if cmd.status == control.PENDING:
        st.info(f"Change #{cmd.id} {text}: pending — waiting for the runtime to apply it.")
    elif cmd.status == control.APPLIED:
        st.success(f"Change #{cmd.id} {text}: applied as settings version {cmd.applied_version}.")
    else:
        st.error(f"Change #{cmd.id} {text}: refused — {cmd.reason}")


def history_and_revert(engine: Engine, scope: Scope) -> None:
    model = scope.model
    if model is None:
        return
    hist = control.settings_history(engine, model, scope.instance, limit=100)
    st.subheader("Settings history")
    if not hist:
        st.caption("No settings changes recorded for this model.")
        return
    table = pd.DataFrame([{"when": fmt_time(h.at), "instance": h.instance_id, "version": h.version,
                           "by": h.requested_by, "old": json.dumps(h.old), "new": json.dumps(h.new)}
                          for h in hist])
    st.dataframe(table, hide_index=True, width="stretch")
    labels = {f"v{h.version} at {fmt_time(h.at)}: {json.dumps(h.new)}": h for h in hist}
    chosen = labels[st.selectbox("Change", list(labels), key="revert_choice")]
    c1, c2 = st.columns(2)
    if c1.button("Revert to the settings before this change", key="revert"):
        cid = control.request_change(engine, model=model, changes=chosen.old,
                                     requested_by="dashboard (revert)", instance_id=scope.instance)
        st.session_state[_LAST_COMMAND] = cid
        st.toast(f"Requested revert #{cid}: {json.dumps(chosen.old)}")
    span = scope.duration_s
    before = queries.Window(chosen.at - span, chosen.at, model, scope.instance)
    after = queries.Window(chosen.at, min(time.time(), chosen.at + span), model, scope.instance)
    c2.caption(f"Before/after: {span / 60:.0f} min on each side of the change "
               f"(after covers {after.duration_s / 60:.1f} min so far)")
    st.plotly_chart(charts.compare(queries.headline(engine, before),
                                   queries.headline(engine, after)), key="before-after")
