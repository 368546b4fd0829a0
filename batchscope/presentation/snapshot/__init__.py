"""Diagnostic snapshots: one zip file holding a window of recorded data.

Layout of the file::

    manifest.json            format, version, the BatchScope version that wrote it,
                             window, row counts, environment, flags, fleet flags,
                             resource recommendations
    tables/<table>.json      {"columns": [...], "rows": [[...], ...]}
    report.html              the offline report (Plotly inlined)
    trace.pftrace            the window's batches and requests as a Perfetto trace
                             (``batchscope.trace``), when it holds at most
                             ``TRACE_MAX_ROWS`` of them; the manifest's ``trace`` entry
                             says what it holds, or why it was left out

The tables are the window's rows (``TABLES``), the tuning sessions started in it and
their trials among them. The manifest also holds what the fleet rules
(``analysis.fleet_rules``) found over the window and the resource recommendations
(``analysis.recommend.for_snapshot``, CPU in cores when the instances registered one
CPU count).

``export_snapshot`` writes one; ``load_snapshot`` checks one thoroughly (size
limits, member names, compression method and ratio, manifest format/version and
field types, column names and value types; strict UTF-8 JSON only, nothing is
executed) and loads it into a temporary SQLite database with the live schema, so
the dashboard's queries run on it unchanged. Tables are streamed: read in chunks,
parsed many rows at a time, checked column by column and inserted in batches, so
opening a large snapshot takes memory for a chunk, not for the file (a 60 MB
snapshot: about 15 MB over the interpreter, against 1.5 GB when whole members were
parsed; ``benchmarks/reliability/snapshot_import.py``). Whatever is wrong with a
file (damaged, cut off, hostile, or not a snapshot) is a ``SnapshotError`` saying
what. ``trace_bytes`` gives the stored trace back (after the same member checks), to
open in ui.perfetto.dev. ``cli_export`` backs ``batchscope snapshot export``.

The parts, each a module of this package:

* ``layout``: the member names, the format version, the tables exported (``TABLES``,
  ``CHILDREN``), ``SnapshotError`` and ``Limits``;
* ``export``: writing one (``export_snapshot``, ``export_bytes``, ``window_trace``);
* ``checks``: the member, manifest and value checks every file passes first;
* ``tables``: the table members streamed into the temporary database;
* ``load``: opening one (``load_snapshot``, ``Snapshot``, ``report_html``,
  ``trace_bytes``);
* ``cli``: ``batchscope snapshot export``.

This module puts the public names of all of them in one place, so callers import
``batchscope.presentation.snapshot`` alone.
"""

from __future__ import annotations

# ``_value_checker`` and ``_column_checker`` too: the tests hold them to each other
from batchscope.presentation.snapshot.checks import (COMPRESSIONS, _column_checker,
                                                     _value_checker, written_by)
from batchscope.presentation.snapshot.cli import cli_export, export_parser
from batchscope.presentation.snapshot.export import (
    environment, export_bytes, export_snapshot, fleet_flags, recommendations, served_models,
    tuning_sessions, window_trace)
from batchscope.presentation.snapshot.layout import (
    CHILDREN, FORMAT, FORMAT_VERSION, LISTS, MANIFEST, READ_CHUNK, REPORT, TABLES, TRACE,
    TRACE_MAX_BYTES, TRACE_MAX_ROWS, Limits, SnapshotError)
from batchscope.presentation.snapshot.load import Snapshot, load_snapshot, report_html, trace_bytes
from batchscope.presentation.snapshot.tables import INSERT_BATCH

__all__ = [
    "CHILDREN", "COMPRESSIONS", "FORMAT", "FORMAT_VERSION", "INSERT_BATCH", "LISTS", "Limits",
    "MANIFEST", "READ_CHUNK", "REPORT", "Snapshot", "SnapshotError", "TABLES", "TRACE",
    "TRACE_MAX_BYTES", "TRACE_MAX_ROWS", "cli_export", "environment", "export_bytes",
    "export_parser", "export_snapshot", "fleet_flags", "load_snapshot", "recommendations",
    "report_html", "served_models", "trace_bytes", "tuning_sessions", "window_trace",
    "written_by",
]
