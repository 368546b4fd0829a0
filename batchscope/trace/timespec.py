"""The window of ``batchscope trace``, from what a person types.

A time is epoch seconds (``1767225600.5``), an ISO 8601 date and time
(``2026-01-01T12:00:00``, local time unless it names a zone, ``Z`` for UTC), ``now``,
or an offset back from now (``-10s``, ``-1.5m``, ``-2h``, ``-500ms``).
``window_from(start, end, last_s, now=...)`` turns the three options into a ``Window``:
by default the last ``DEFAULT_LAST_S`` seconds before the end, itself ``WRITTEN_LAG_S``
before now unless given: a runtime's recorder writes its rows every half second, so the
last moments before now may not be in the database yet (``recent_note`` says so of a
window that ends in them). Anything it cannot read, and a window outside
1970..``LATEST_S``, is a ``ValueError`` that says what it accepts.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server checks windows without the dashboard packages
    from batchscope.analysis.queries.window import Window

#: the window when neither a start nor a length is given
DEFAULT_LAST_S = 10.0
#: how long before now a runtime's rows are surely written: two of its recorder's flushes
#: (``batchscope.storage.recorder.FLUSH_INTERVAL_S``, 0.5 s by default), as the timeline
#: page's live edge
WRITTEN_LAG_S = 1.0
#: the latest time a window may reach (2255-03-14): a trace holds nanoseconds in 64-bit
#: integers, which end in 2262
LATEST_S = 9_000_000_000.0
_EPOCH = datetime(1970, 1, 1)  # UTC, naive: dates before 1970 work on every platform
_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_OFFSET = re.compile(r"^-\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)$")
ACCEPTED = ("epoch seconds (1767225600), an ISO date and time (2026-01-01T12:00:00, "
            "local time unless it ends in Z or +HH:MM), now, or an offset back from now "
            "(-10s, -5m, -1h)")


def parse_time(text: str, *, now: float) -> float:
    """Epoch seconds of ``text`` (see module doc)."""
    raw = text.strip()
    if raw.lower() == "now":
        return now
    m = _OFFSET.match(raw.lower())
    if m:
        return now - float(m.group(1)) * _UNITS_S[m.group(2)]
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{text!r} is not a time: give {ACCEPTED}")
        return value
    try:
        when = datetime.fromisoformat(raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give {ACCEPTED}") from None
    try:
        return when.timestamp()  # a naive time is local time
    except (ValueError, OverflowError):  # a date too early for the local time zone's rules
        raise ValueError(f"{text!r} is before 1970; give a later time: {ACCEPTED}") from None


def parse_seconds(text: str) -> float:
    """A length of time in seconds from ``text`` (``12``, ``2.5``, ``1e3``); ``ValueError``
    echoing ``text`` for anything else, an infinite or NaN one and one not above 0."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number of seconds")
    if value <= 0:
        raise ValueError(f"{text!r} must be a positive number of seconds")
    return value


def window_from(start: str | None, end: str | None, last_s: float | None, *, now: float,
                model: str | None = None, instance_id: str | None = None) -> Window:
    """The window of the options (see module doc); ``ValueError`` when they clash. A
    window the checks refuse is reported with the options that were given."""
    end_s = parse_time(end, now=now) if end is not None else now - WRITTEN_LAG_S
    if last_s is not None:
        if start is not None:
            raise ValueError("give --start or --last, not both")
        if not (math.isfinite(last_s) and last_s > 0):
            raise ValueError(f"--last {last_s!r} must be a positive, finite number of seconds")
        start_s = end_s - last_s
    else:
        start_s = parse_time(start, now=now) if start is not None else end_s - DEFAULT_LAST_S
    if start is not None:
        fix_start = ("--start and --end after 1970" if end is not None and end_s <= 0
                     else "a later --start")
    elif last_s is not None:
        fix_start = "a shorter --last" + (" or a later --end" if end is not None else "")
    else:  # the default length back from --end
        fix_start = f"a later --end (the window is the {DEFAULT_LAST_S:g} s before it)"
    if end is None and start is not None and start_s >= end_s:
        raise ValueError(f"--start {start!r} is not before the default end, {WRITTEN_LAG_S:g} "
                         "s ago (by then the runtime's rows are surely written); give an "
                         "earlier --start, or --end now")
    check_window(start_s, end_s, fix_start=fix_start,
                 fix_end="an earlier --end" if end is not None else "an earlier end")
    from batchscope.analysis.queries.window import Window
    return Window(start_s, end_s, model, instance_id)


def recent_note(end_s: float, now: float) -> str | None:
    """What a trace of a window ending at ``end_s``, read at ``now``, says of its last
    moments when the runtime may not have written them yet (None: it has)."""
    missing = end_s - (now - WRITTEN_LAG_S)
    if missing <= 0:
        return None
    return (f"the window ends {max(0.0, now - end_s):.2f} s before it was read, and a "
            "runtime writes its rows every half second: batches and requests of its last "
            f"{missing:.2f} s may be missing; end it at least "
            f"{WRITTEN_LAG_S:g} s back (the default) for all of them")


def utc_text(epoch_s: float) -> str:
    """``epoch_s`` as an ISO 8601 UTC time (``2026-01-01T12:00:00.250Z``, milliseconds
    only when it has them), or as epoch seconds where no date can show it."""
    try:
        when = _EPOCH + timedelta(seconds=epoch_s)
    except (OverflowError, ValueError):
        return f"{epoch_s:,.3f} epoch seconds"
    spec = "seconds" if when.microsecond == 0 else "milliseconds"
    return when.isoformat(timespec=spec) + "Z"


def check_window(start_s: float, end_s: float, *,
                 fix_start: str = "a later start or a shorter window",
                 fix_end: str = "an earlier end") -> None:
    """``ValueError`` for a window that is not a finite span within 1970..``LATEST_S``;
    ``fix_start`` and ``fix_end`` say what to change when it starts too early or ends too
    late (named after the options the caller takes)."""
    if not (math.isfinite(start_s) and math.isfinite(end_s)):
        raise ValueError(f"the window {start_s!r}..{end_s!r} is not finite; give {ACCEPTED}")
    if start_s >= end_s:
        raise ValueError(f"the window starts ({utc_text(start_s)}) at or after its end "
                         f"({utc_text(end_s)}); the start must come first")
    if start_s < 0:
        raise ValueError(f"the window starts before 1970 ({utc_text(start_s)}); give "
                         f"{fix_start}")
    if end_s > LATEST_S:
        raise ValueError(f"the window ends after {LATEST_S:,.0f} epoch seconds (the year 2255), "
                         f"past what a trace's nanosecond times can hold; give {fix_end}")
