"""The settings form, generated from the settings schema (``batchscope.settings``).

One widget per setting a model publishes, chosen by the setting's kind:

- ``int`` / ``float``: a number input bounded by ``min`` / ``max``;
- ``choice``: a select box; ``bool``: a checkbox;
- ``int_list`` and nullable numbers: a text box (empty = null, its meaning in the help);
- a published key the schema does not know (a newer runtime): a plain text box.

A value the widget for its kind cannot show (out of bounds, wrong type) gets a text box
too, so the form always draws. Settings fixed at start are shown but disabled. The help
of each field is the setting's ``doc`` and ``describe()``. :func:`draw` returns only the
fields that differ from the current settings, checked with ``Setting.problem``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import streamlit as st

from batchscope.settings import Setting

COLUMNS = 3
OTHER_GROUP = "other"


@dataclass(frozen=True)
class Submitted:
    """What an Apply of the form asks for."""

    #: the settings whose value differs from the current one, as JSON values
    changes: dict[str, Any]
    #: one message per field that could not be read or is not valid; send nothing then
    problems: tuple[str, ...]


def label(s: Setting) -> str:
    """The field's label: the schema's (``Setting.label``), so acronyms read as such
    ("OOM recovery") wherever a setting is named."""
    return s.label


def help_text(s: Setting) -> str:
    parts = [s.doc, f"Values: {s.describe()}; default {s.default_text()}."]
    if s.nullable:
        parts.append(f"Leave empty for null ({s.null_means or 'no value'}).")
    if s.fixed_at_start:
        parts.append("The runtime sets this when it starts: restart it with a new value to "
                     "change it.")
    return "\n\n".join(parts)


def draw(form_key: str, schema: tuple[Setting, ...], current: dict[str, Any]) -> Submitted | None:
    """Draw the form for ``current`` (a model's published settings; empty when none were
    published, then the schema's defaults are shown). Returns None until Apply is pressed."""
    known = {s.name: s for s in schema}
    if current:
        shown = [s for s in schema if s.name in current]
        values = dict(current)
    else:
        shown = list(schema)
        values = {s.name: s.default for s in schema}
    unknown = [k for k in values if k not in known]
    groups: dict[str, list[Setting | str]] = {}
    for s in shown:
        groups.setdefault(s.group, []).append(s)
    if unknown:
        groups[OTHER_GROUP] = list(unknown)

    readers = []
    with st.form(form_key):
        for group, items in groups.items():
            st.markdown(f"**{group.capitalize()}**")
            cols = st.columns(COLUMNS)
            for i, item in enumerate(items):
                key = f"{form_key}-{item if isinstance(item, str) else item.name}"
                with cols[i % COLUMNS]:
                    if isinstance(item, str):
                        readers.append(_unknown_field(item, values[item], key))
                    else:
                        readers.append(_field(item, values[item.name], key))
        submitted = st.form_submit_button("Apply", type="primary")
    if not submitted:
        return None
    changes, problems = {}, []
    for read in readers:
        try:
            found = read()
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if found is not None:
            name, value = found
            changes[name] = value
    return Submitted(changes=changes, problems=tuple(problems))


# -- one field ---------------------------------------------------------------------------
def _fits_number(s: Setting, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if s.kind == "int" and not isinstance(value, int):
        return False
    return (s.min is None or value >= s.min) and (s.max is None or value <= s.max)


def _field(s: Setting, value: Any, key: str):
    """Draw the widget of ``s`` showing ``value``; return a reader that gives
    ``(name, new value)`` when it changed, None when not, or raises ValueError."""
    value = s.coerce(value)
    opts = {"key": key, "help": help_text(s), "disabled": s.fixed_at_start}
    name = label(s)
    if s.kind == "bool" and isinstance(value, bool):
        return _compare(s, value, st.checkbox(name, value=value, **opts))
    if s.kind == "choice" and value in s.choices:
        return _compare(s, value, st.selectbox(name, s.choices, index=s.choices.index(value),
                                               **opts))
    if s.kind in ("int", "float") and not s.nullable and _fits_number(s, value):
        if s.kind == "int":
            low = None if s.min is None else int(s.min) + (1 if s.min_exclusive else 0)
            high = None if s.max is None else int(s.max)
            new = st.number_input(name, min_value=low, max_value=high, value=int(value),
                                  step=1, **opts)
        else:
            low = None if s.min is None else float(s.min)
            high = None if s.max is None else float(s.max)
            new = st.number_input(name, min_value=low, max_value=high, value=float(value),
                                  **opts)
        return _compare(s, value, new)
    before = "" if value is None else s.to_text(value)
    text = st.text_input(name, before, placeholder=s.null_means if s.nullable else None, **opts)

    def read():
        if text.strip() == before.strip():
            return None
        new = s.parse_text(text)
        return _checked(s, new) if new != value else None
    return read


def _compare(s: Setting, value: Any, new: Any):
    return lambda: _checked(s, new) if new != value else None


def _checked(s: Setting, new: Any) -> tuple[str, Any]:
    problem = s.problem(new)
    if problem is not None:
        raise ValueError(problem)
    return s.name, list(new) if isinstance(new, tuple) else new


def _unknown_field(name: str, value: Any, key: str):
    """A setting the schema does not know: a text box, read back as JSON when it parses."""
    before = _as_text(value)
    text = st.text_input(name, before, key=key,
                         help="Not in this dashboard's settings schema (a newer runtime?). "
                              "Write a JSON value, comma-separated integers for a list, or "
                              "leave empty for null.")

    def read():
        if text.strip() == before.strip():
            return None
        new = _parse_unknown(text, value)
        return (name, new) if new != value else None
    return read


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, (bool, dict)):
        return json.dumps(value)
    return str(value)


def _parse_unknown(text: str, like: Any) -> Any:
    text = text.strip()
    if text.lower() in ("", "null", "none"):
        return None
    if isinstance(like, list) and not text.startswith("["):
        try:
            return [int(x) for x in text.replace(";", ",").split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{text!r} is not a list of whole numbers separated by commas, "
                             "e.g. 8, 16, 32") from None
    try:
        return json.loads(text)
    except ValueError:
        return text
