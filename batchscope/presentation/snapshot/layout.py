"""What a snapshot file holds: its member names, format version, the tables exported
(and how each is cut to the window), the error every problem with a file raises, and the
limits a file is checked against."""

from __future__ import annotations

from dataclasses import dataclass

FORMAT = "batchscope-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.html"
TRACE = "trace.pftrace"
#: a window holding more batches and requests gets no trace (about 250 bytes of trace
#: each, 4 s of writing per 60,000; ``batchscope trace`` exports any window on its own)
TRACE_MAX_ROWS = 200_000
#: nor does one whose trace comes out larger than this (generation steps and events
#: are not counted in the rows)
TRACE_MAX_BYTES = 96 * 1024 ** 2

#: table -> (time column used to cut the window, whether the model filter applies)
TABLES: dict[str, tuple[str | None, bool]] = {
    "batches": ("ended_at", True),
    "requests": ("finished_at", True),
    #: the traced requests' timestamps: a trace made again from an opened snapshot
    #: draws their receive, send and compute parts as the stored one does
    "request_traces": ("request_end_at", True),
    "events": ("at", True),
    "device_samples": ("at", False),
    "generation_steps": ("at", True),
    "model_settings": (None, True),
    "runtime_instances": (None, False),
    "control_commands": ("requested_at", True),
    "tuning_sessions": ("started_at", True),
    #: the trials of the sessions above (see ``CHILDREN``)
    "tuning_trials": (None, False),
}
#: table -> (its column naming the parent row, the parent table, the parent's key): the
#: rows of the parents exported, whatever the window
CHILDREN: dict[str, tuple[str, str, str]] = {
    "tuning_trials": ("session_id", "tuning_sessions", "id"),
}
#: manifest keys that hold lists of objects
LISTS = ("flags", "fleet_flags", "recommendations")
#: bytes read from a member at a time while streaming it
READ_CHUNK = 1024 ** 2


class SnapshotError(ValueError):
    """The file is not a snapshot this version can open; the message says why."""


@dataclass(frozen=True)


class Limits:
    max_file_bytes: int = 256 * 1024 ** 2
    max_member_bytes: int = 1024 ** 3
    max_total_bytes: int = 2 * 1024 ** 3
    max_ratio: float = 200.0
    max_rows_per_table: int = 20_000_000
    max_text_chars: int = 100_000
    max_manifest_bytes: int = 16 * 1024 ** 2
    #: the stored trace, expanded (twice what an export writes at most)
    max_trace_bytes: int = 2 * TRACE_MAX_BYTES
