"""What the Batch timeline page decides and says, as pure functions of what it knows
(``batchscope.dashboard.timeline`` draws the page and keeps its state; nothing here
touches Streamlit or the database, so each decision is tested alone).

* Where the window lies: :func:`window_end`, decided once per page run inside the
  sidebar's window; a live one ends ``LIVE_LAG_S`` before now, once the recorder has
  written the rows of its last moments.
* How often a live window refreshes: :func:`live_every_s`, from the sidebar's refresh
  and what the last run cost (:func:`refresh_cost_s`); when following stops by itself
  (:func:`too_many_to_follow`), and while its note still holds (:func:`stop_note_shown`:
  a shorter window may hold few enough batches to follow, and a window not live cannot
  follow at all).
* What a typed batch number means: :func:`parse_batch_number`; why it was not gone to
  (:func:`not_found_note`, :func:`outside_window_note`); and, each page run anew, what
  to do with a number the page could not go to (:func:`number_again`): the box acts only
  when its text changes, so once the model, instance or sidebar's window is changed as
  its note says, the page looks it up again or goes to it itself, and a note of the
  batch lying outside the sidebar's window is said of the window shown, never of an
  older one.
* What the chart marks picked (:func:`marked`: a chart whose figure is unchanged keeps
  the user's zoom) and when the slowest-requests table's tick is stale
  (:func:`stale_tick`).
* Times are the dashboard's local time (``scope.fmt_time``), their zone named wherever
  one is shown (:func:`zone`); trace downloads are named by the window's start on that
  clock, with its UTC offset (:func:`trace_file_name`). A picked generation step gets a
  header line (:func:`step_header`) and, where the chart draws other sequences than the
  engine counted, a note saying why (:func:`step_sequences_note`).
"""

from __future__ import annotations

import math
from datetime import tzinfo
from typing import NamedTuple

import pandas as pd

from batchscope.analysis.queries.timeline import TimelineRows
from batchscope.dashboard.scope import Scope, fmt_time
from batchscope.presentation import timeline_chart
from batchscope.storage.recorder import FLUSH_INTERVAL_S

#: the recorder writes its rows every this many seconds (its default)
RECORDER_FLUSH_S = FLUSH_INTERVAL_S
#: a live window ends this long before now: by then the recorder has written its rows
LIVE_LAG_S = 2 * RECORDER_FLUSH_S
#: a live refresh waits at least this many times what the last one took to read and draw
COST_FACTOR = 5.0
#: what drawing one batch or step costs the browser (chromium without a GPU draws a
#: figure of 3,154 batches in about 456 ms; see docs/tracing.md), counted into a refresh's
#: cost since the page cannot time the browser
DRAW_S_PER_BAR = 0.15e-3
#: a live window of more batches and steps than this (marks counted at ``MARKS_PER_BAR``
#: to a batch) stops following: each refresh sends and redraws all of them (about 3 MB of
#: figure for 10,000 batches), more than a tab keeps up with
LIVE_MAX_BARS = 10_000
#: marks (refused, expired, cancelled, bypassed requests) that weigh as one batch: a mark
#: is a point with a hover text, about 54 bytes of figure (5.4 MB for 100,000), a bar
#: about 300
MARKS_PER_BAR = 5


class WindowEnd(NamedTuple):
    """Where the timeline's window lies (see :func:`window_end`)."""

    #: where it ends, never after now nor after the sidebar's window
    end_s: float
    #: its length: the one picked, or the sidebar's window's when that is shorter
    length_s: float
    #: the range the "Window ends at" slider offers; None when the window cannot move
    bounds: tuple[float, float] | None


def window_end(start_s: float, end_s: float, length_s: float, now: float,
               wanted_s: float | None) -> WindowEnd:
    """Where a window of ``length_s`` ends inside the sidebar's window ``start_s``..``end_s``
    (a live one passes ``end_s=now``; ``now`` is the live edge, ``LIVE_LAG_S`` before the
    clock): at ``wanted_s`` kept inside it, at its end when nothing is wanted. A window
    longer than the sidebar's is cut to it; one with under a second of room has no slider
    and ends where the sidebar's does."""
    hi = min(end_s, now)
    length = max(0.0, min(length_s, hi - start_s))
    lo = start_s + length
    if hi - lo < 1.0:
        return WindowEnd(hi, length, None)
    end = hi if wanted_s is None else min(max(wanted_s, lo), hi)
    return WindowEnd(end, length, (lo, hi))


def live_every_s(refresh_s: float | None, cost_s: float | None,
                 current_s: float | None) -> float | None:
    """Seconds between live refreshes of the region: the sidebar's ``refresh_s``, or, when
    the last run took ``cost_s`` seconds to read and draw, ``COST_FACTOR`` times that in
    whole seconds where that is longer, so a refresh never takes more than a fifth of the
    time. The cadence in effect, ``current_s``, is kept until the cost outgrows it
    (stretched at once) or falls to half of it (shortened), so a cost near a whole second
    does not change it (and rerun the page) at every refresh. None: no live refresh."""
    if refresh_s is None:
        return None
    wanted = COST_FACTOR * cost_s if cost_s is not None else 0.0
    fit = refresh_s if wanted <= refresh_s else float(math.ceil(wanted))
    if current_s is None or current_s < refresh_s or wanted > current_s \
            or wanted <= current_s / 2:
        return fit
    return current_s


def live_load(bars: int, marks: int = 0) -> float:
    """What a live refresh of ``bars`` batches and steps and ``marks`` marked requests
    (refused, expired, cancelled, bypassed) sends and redraws, in batches: a mark weighs
    ``1 / MARKS_PER_BAR`` of one."""
    return bars + marks / MARKS_PER_BAR


def refresh_cost_s(run_s: float, bars: int, marks: int = 0) -> float:
    """What one live refresh costs: ``run_s``, the region's run (read, build and send the
    figure), and the browser's drawing of its ``bars`` batches and steps and ``marks``
    marked requests."""
    return run_s + live_load(bars, marks) * DRAW_S_PER_BAR


def behind_edge_in_s(t: float, now: float) -> float:
    """How long until ``t`` is behind the live edge (``LIVE_LAG_S`` before ``now``), the
    latest a window ends: a batch that ended just now is shown once it is."""
    return min(LIVE_LAG_S, max(0.0, t - (now - LIVE_LAG_S)))


def too_many_to_follow(bars: int, marks: int = 0) -> bool:
    """Whether a live window of ``bars`` batches and steps and ``marks`` marked requests
    stops following (an overloaded server refuses tens of thousands a second). Counted
    in whole numbers: ``live_load`` past ``LIVE_MAX_BARS``."""
    return bars * MARKS_PER_BAR + marks > LIVE_MAX_BARS * MARKS_PER_BAR


def stop_note(bars: int, marks: int = 0) -> str:
    """Why a window of ``bars`` batches and steps and ``marks`` marked requests stopped
    following the clock."""
    held = f"{bars:,} batches and steps"
    if marks:
        kinds = timeline_chart.count(marks, "refused, expired, cancelled or bypassed request")
        held += (f" and {kinds} (marks, {MARKS_PER_BAR} of which weigh as much as one batch: the "
                 f"equivalent of {math.ceil(live_load(bars, marks)):,} batches)")
    return (f"Follow live stopped by itself: the window held {held}, more than the "
            f"{LIVE_MAX_BARS:,} batches a live page redraws at every refresh (the tab would "
            "do little else). The window stays where it stopped; to follow the clock, "
            "choose a shorter window and press Follow live.")


def following_view(scope: Scope, model: str | None, length_s: float) -> tuple:
    """What a live window shows, as far as how many batches it holds goes: its length, the
    model (None: all), the instance, the database and the sidebar's window's length. The
    end is left out: a window moved by the slider is the one that stopped, looked at
    elsewhere. Lengths are rounded to the millisecond, as a live window's are computed
    from the clock anew at each run."""
    return (round(float(length_s), 3), model, scope.instance, scope.db_url, scope.snapshot,
            round(scope.duration_s, 3))


def stop_note_shown(kept: tuple | None, view: tuple, live: bool) -> str | None:
    """The note of why following stopped by itself (``kept``: the view it stopped in and
    the note, or None) while the page still shows that ``view`` of a ``live`` window, else
    None. A view changed since (a shorter window, another model...) may hold few enough
    batches to follow, so the count the note gives is not that window's; a window that is
    not live has its Follow live off, so the note's advice to press it cannot be taken."""
    if kept is None or not live or kept[0] != view:
        return None
    return kept[1]


def not_found_note(text: str, other: dict | None, model: str | None,
                   instance: str | None) -> str:
    """What the page says when batch (or a generation model's step) ``text`` is not one of
    ``model`` on ``instance`` (None: any): ``other`` is the batch or step of that number
    found without either filter, if any (a step's has ``kind`` "step")."""
    if other is None:
        return f"there is no batch or generation step {text} in this database"
    kind = other.get("kind", "batch")
    if model is not None and other["model"] != model:
        return (f"{kind} {text} is a {kind} of {other['model']}, not of {model}: choose "
                f"\"all models\" under Models (or {other['model']} in the sidebar's Model "
                "picker) to go to it")
    return (f"{kind} {text} ran on instance {other['instance_id']}, not on {instance}: choose "
            f"{other['instance_id']} (or all) in the sidebar's Instance picker to go to it")


def outside_window_note(kind: str, text: str, started_at: float, start_s: float,
                        end_s: float, live: bool) -> str | None:
    """Why ``kind`` ("batch" or "step") ``text``, which started at ``started_at``, is not
    gone to in the sidebar's window ``start_s``..``end_s`` (a ``live`` one holds anything
    after its start), or None when the window holds it."""
    when = f"it started {fmt_time(started_at)} {zone(started_at)}"
    if started_at < start_s:
        return (f"{kind} {text} ran before the time window the sidebar sets ({when}): choose "
                "a longer window, or a custom one that holds it, and the page goes to it")
    if not live and started_at >= end_s:
        return (f"{kind} {text} ran after the time window the sidebar sets ({when}): end that "
                "window later, and the page goes to it")
    return None


class NumberTried(NamedTuple):
    """A number typed that the page could not go to, and what it was looked up in."""

    #: the box's text, stripped
    text: str
    #: the model (None: all models) and instance (None: any) it was looked up for
    model: str | None
    instance: str | None
    #: the database: its URL and the snapshot's name (None: the live database)
    source: tuple[str, str | None]
    #: the batch or step found (:func:`find_numbered`), which the sidebar's window did not
    #: hold; None: none of that number of the model and instance
    found: dict | None


class NumberAgain(NamedTuple):
    """What the page does with a number it could not go to (:func:`number_again`)."""

    #: "find": look the number up again; "go": go to the batch found; None: say ``note``
    action: str | None
    #: what the page says of the number now, when it does neither
    note: str | None = None


def number_again(tried: NumberTried | None, text: str, model: str | None,
                 instance: str | None, source: tuple[str, str | None], start_s: float,
                 end_s: float, live: bool) -> NumberAgain | None:
    """What a page run does with ``tried``, the number the page could not go to, now that
    the box holds ``text`` and the page shows ``model`` on ``instance`` of ``source`` in
    the sidebar's window ``start_s``..``end_s`` (``live``, or not). The box acts only when
    its text changes, so the page acts itself once its note's advice is taken: with the
    model, instance or database changed, it looks the number up again ("find"); with the
    sidebar's window holding the batch found, it goes to it ("go"); else it says why not,
    of the window shown (a note said of an older window may no longer be true). None:
    nothing to do (no such number there, its note stands; or another text typed since)."""
    if tried is None or tried.text != text:
        return None
    if (tried.model, tried.instance, tried.source) != (model, instance, source):
        return NumberAgain("find")
    if tried.found is None:
        return None
    note = outside_window_note(tried.found["kind"], text, float(tried.found["started_at"]),
                               start_s, end_s, live)
    return NumberAgain("go") if note is None else NumberAgain(None, note)


def stale_tick(picks: list[tuple[str, object]], ticked: list[int],
               selected: tuple[str, int] | None) -> bool:
    """Whether the slowest-requests table's ticked row (``ticked``: its row numbers) no
    longer names the batch shown: the table holds no such row, the row's batch (``picks``:
    each row's instance and batch key, None/NaN without one) is not ``selected``, or
    nothing is. Such a tick is cleared, so a tick always marks the batch drawn."""
    if not ticked:
        return False
    if ticked[0] >= len(picks):
        return True
    inst, pick = picks[ticked[0]]
    if pick is None or pd.isna(pick) or selected is None:
        return True
    return (str(inst), int(pick)) != (str(selected[0]), int(selected[1]))


def parse_batch_number(text: str) -> int | None:
    """The batch number typed, or None when it is not a whole number >= 0 written with
    the digits 0-9 (as ``-5``, ``abc``, ``1.5`` or ``²`` are not)."""
    text = text.strip()
    if not text or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def zone(t: float) -> str:
    """The name of the local time zone at ``t`` (e.g. ``EST``), the zone ``fmt_time`` uses."""
    return timeline_chart.moment(t, None).tzname() or "local time"


def trace_file_name(start_s: float, suffix: str, tz: tzinfo | None = None) -> str:
    """The name a trace download of a window starting at ``start_s`` gets: the start on the
    page's clock (``tz``; None: the local zone, the caption's, axis's and slider's) with
    its UTC offset, which tells the same wall-clock time in two zones apart:
    ``batchscope-20261205T221503+0100.pftrace``."""
    return f"batchscope-{timeline_chart.moment(start_s, tz):%Y%m%dT%H%M%S%z}{suffix}"


def drawn_view(rows: TimelineRows) -> tuple:
    """What a timeline chart of ``rows`` shows: its window and how many batches, steps
    and request marks it holds. The same view is the same figure: the chart the browser
    holds stays as it is (its zoom too) when it is drawn again."""
    w = rows.window
    return (w.start_s, w.end_s, w.model, w.instance_id, len(rows.batches), len(rows.steps),
            len(rows.requests))


def marked(selected: tuple[str, int] | None, view: tuple, clicked: tuple | None,
           drawn: tuple | None) -> tuple[str, int] | None:
    """The batch the chart of ``view`` marks picked: the one ``selected``, unless a click
    on this same view picked it. Then the chart is drawn as it was (``drawn``: the last
    chart's view and mark): the browser keeps a chart whose figure is unchanged as it
    is, showing the click's selection and the user's zoom, where a figure marking the
    batch anew would be drawn afresh, zoomed out, so that each click in a zoomed-in
    window would first have to zoom again."""
    if selected is None:
        return None
    if (clicked is not None and (clicked[0], clicked[1]) == selected and clicked[2] == view
            and drawn is not None and drawn[0] == view):
        return drawn[1]
    return selected


def step_header(steps: pd.DataFrame, inst: str, step_id: int) -> str:
    """What the page says of a picked generation step (row ``step_id`` of ``inst``), as a
    picked batch gets its line: number, model, sequences, tokens, time, KV cache. The
    sequences are the engine's counts: those that ran in the step, and those it left
    waiting when it scheduled the step."""
    row = steps[(steps["instance_id"] == inst) & (steps["id"] == step_id)].iloc[0]
    name = timeline_chart.step_name(row["seq"] if "seq" in row else None).capitalize()
    return (f"**{name}** · {row['model']} · {int(row['running'])} running, "
            f"{int(row['waiting'])} waiting (the engine's counts as it scheduled the step) · "
            f"ended {fmt_time(float(row['at']))}  \n"
            f"step {1000 * row['step_s']:.2f} ms · prefill "
            f"{timeline_chart.count(int(row['prefill_tokens']), 'token')} · decode "
            f"{timeline_chart.count(int(row['decode_tokens']), 'token')} · KV blocks "
            f"{int(row['blocks_used'])} used, {int(row['blocks_free'])} free · preempted "
            f"{int(row['preemptions'])}")


def step_sequences_note(steps: pd.DataFrame, inst: str, step_id: int,
                        sequences: pd.DataFrame) -> str | None:
    """Why the chart of picked step ``step_id`` of ``inst`` draws another number of
    ``sequences`` than its header's running and waiting, or None where they agree. The
    header gives the engine's counts as it scheduled the step (the sequences that ran in
    it, those left waiting); the chart draws every sequence recorded alive at some moment
    of the step (arrived by its end, ended after its start): one that arrived while the
    step ran is in the chart, waiting, and in neither count (it joined a later step). A
    sequence's row is written when it ends, so one counted that has not ended yet is not
    drawn."""
    row = steps[(steps["instance_id"] == inst) & (steps["id"] == step_id)].iloc[0]
    running, waiting = int(row["running"]), int(row["waiting"])
    drawn, counted = len(sequences), running + waiting
    if drawn == counted:
        return None
    arrived = int((sequences["arrived_at"].astype(float) > float(row["started_at"])).sum())
    why = [f"The chart below draws {timeline_chart.count(drawn, 'sequence')}: every one "
           f"recorded alive at some moment of the step, where the {running} running and "
           f"{waiting} waiting above were counted as it was scheduled."]
    if arrived:
        why.append(f"{arrived:,} of them arrived while it ran, after that count: waiting, "
                   "in neither number (each joined a later step).")
    others = drawn - arrived
    if others > counted:
        why.append(f"{others - counted:,} more were alive but in neither count (arrived as "
                   "it was scheduled, ended as it began, or had no work in it).")
    elif others < counted:
        why.append(f"{counted - others:,} counted are not drawn: a sequence is recorded "
                   "when it ends, and these had not (or were not recorded).")
    return " ".join(why)
