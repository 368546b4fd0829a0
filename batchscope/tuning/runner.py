"""Run one tuning session end to end: the thin shell around ``TuningSession``.

``run_tuning(options)`` reads the model's settings and metadata from the server, builds
the search space, starts the load (synthetic, replayed, or none for live traffic), and
then loops: send a trial's settings through the control API, let them settle, let the
server work off a backlog an earlier trial left (the session's open loop pauses), measure
windows until the session has a verdict. At the end, and on cancel or any error, the
starting settings are put back, unless ``apply`` asks for the best point to stay.
``batchscope tune`` and the dashboard's "Find best settings" panel both call it; the
dashboard runs it on a thread and passes ``cancel`` and ``on_update``.

With a database URL (``db_url``) the session is stored as it runs
(``batchscope.tuning.store``): its row when it starts, each trial as it ends, the
result at the end, with the instance tuned (the one registered at the URL, unless
``instance_id`` names it) and its hardware. A database given that cannot be opened is
refused before anything is sent to the server (``TuningError``); without one the session
runs all the same and says it is not stored, and so does a session whose writes fail.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from batchscope.load.background import BackgroundLoad
from batchscope.load.loadgen import LoadError, longest_length
from batchscope.load.replay import RecordedTraffic, read_traffic
from batchscope.storage.db import DatabaseNotFound, make_engine, shown_url
from batchscope.threadnames import name_native
from batchscope.tuning import store
from batchscope.tuning.client import ControlClient, SettingsRefused, TuningError
from batchscope.tuning.figures import GOODPUT, LATENCY, Objective, Stability
from batchscope.tuning.measure import LiveMeter, LoadMeter, Meter
from batchscope.tuning.search import GridSearch, OptunaSearch
from batchscope.tuning.session import Stopping, TuningSession, Verdict
from batchscope.tuning.space import (SearchSpace, SpaceError, SpaceOptions, changes_between,
                                     format_point)
from batchscope.tuning.trials import Trial, TuningResult

log = logging.getLogger("batchscope.tuning")

LOADS = ("synthetic", "replay", "live")


@dataclass(frozen=True)
class TuneOptions:
    url: str
    model: str
    slo_p99_ms: float
    budget_s: float = 120.0
    #: synthetic (closed loop at ``concurrency``, or open loop at ``rate``), replay, live
    load: str = "synthetic"
    concurrency: int | None = 64
    rate: float | None = None
    lengths: str | None = None
    #: the database: replay reads the recorded traffic from it, and the session is stored
    #: in it; replay: how far back (seconds) and how fast
    db_url: str | None = None
    replay_window_s: float | None = None
    replay_speed: float = 1.0
    #: goodput, or latency (lowest p99 at ``rate``)
    objective: str = GOODPUT
    apply: bool = False
    grid: bool = False
    seed: int = 0
    token: str | None = None
    window_s: float = 1.0
    settle_s: float = 0.5
    #: the session's own load runs this long before the first trial (not in the budget)
    warmup_s: float = 2.0
    stability: Stability = field(default_factory=Stability)
    min_trials: int = 16
    patience: int = 10
    min_gain: float = 0.02
    #: a window lasts until this many requests finished in it (up to 3 x window_s)
    min_requests: int = 50
    space: SpaceOptions = field(default_factory=SpaceOptions)
    #: the runtime instance tuned, stored with the session (None: the one registered at
    #: ``url`` in the database, if any)
    instance_id: str | None = None
    #: who started the session (cli | dashboard), stored with it
    requested_by: str = "cli"
    #: at most this long a trial waits for the backlog an earlier one left to be worked off
    drain_limit_s: float = 20.0

    def check(self) -> "TuneOptions":
        """A ``TuningError`` naming the first option that cannot work."""
        if self.load not in LOADS:
            raise TuningError(f"--load {self.load!r}: use one of {', '.join(LOADS)}")
        for name, value in (("--slo-p99-ms", self.slo_p99_ms), ("--budget-s", self.budget_s),
                            ("--window-s", self.window_s)):
            if not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
                raise TuningError(f"{name} {value!r} must be a positive number")
        if self.settle_s < 0 or self.warmup_s < 0:
            raise TuningError(f"--settle-s {self.settle_s!r} and --warmup-s {self.warmup_s!r} "
                              "must be 0 or more")
        if not (0 <= self.drain_limit_s <= 3600):
            raise TuningError(f"--drain-limit-s {self.drain_limit_s!r} must be 0-3600 s")
        if self.load == "replay" and not self.db_url:
            raise TuningError("--load replay reads the recorded traffic from a database: give "
                              "--db URL (e.g. sqlite:////abs/path/batchscope.db)")
        if self.objective == LATENCY and not self.rate and self.load == "synthetic":
            raise TuningError("--objective latency tunes for the lowest p99 at a target rate: "
                              "give --rate R")
        try:
            Objective(self.slo_p99_ms, self.objective, self.target_rps)
            self.space.check()
        except (ValueError, SpaceError) as exc:
            raise TuningError(str(exc)) from None
        return self

    def describe_goal(self) -> str:
        goal = (f"the most goodput at p99 <= {self.slo_p99_ms:g} ms" if self.objective == GOODPUT
                else f"the lowest p99 at {self.rate:g} req/s (SLO {self.slo_p99_ms:g} ms)")
        return f"goal {goal}, budget {self.budget_s:g} s" + (" (grid)" if self.grid else "")

    @property
    def target_rps(self) -> float | None:
        return self.rate if self.objective == LATENCY else None


@dataclass
class Progress:
    """What a session looks like now, for a live view (the dashboard)."""

    fraction: float
    elapsed_s: float
    message: str
    #: the trials so far, as ``Trial.row`` gives them
    rows: list[dict]
    result: TuningResult | None = None
    #: where the session is stored, or why it is not
    stored: str = ""


def _load_for(options: TuneOptions, traffic: RecordedTraffic | None) -> BackgroundLoad:
    if traffic is not None:
        return BackgroundLoad(options.url, options.model, traffic=traffic,
                              speed=options.replay_speed, seed=options.seed)
    return BackgroundLoad(options.url, options.model, concurrency=options.concurrency,
                          rate=options.rate, lengths=options.lengths, seed=options.seed)


def _recorded(options: TuneOptions) -> RecordedTraffic:
    """The model's recorded traffic in ``options.db_url`` (the database must exist)."""
    try:
        engine = make_engine(options.db_url, create=False)
    except DatabaseNotFound as exc:
        raise TuningError(f"--db {options.db_url!r}: {exc}") from None
    try:
        since = (time.time() - options.replay_window_s) if options.replay_window_s else None
        return read_traffic(engine, options.model, since=since)
    finally:
        engine.dispose()


def run_tuning(options: TuneOptions, *, cancel: threading.Event | None = None,
               on_update: Callable[[Progress], None] | None = None,
               say: Callable[[str], None] | None = None) -> TuningResult:
    """Run a session; the starting settings are back on the server when it returns,
    unless ``options.apply`` (then the best point runs). ``TuningError`` /
    ``LoadError`` for what stops a session before it begins: a ``db_url`` that cannot be
    opened is one, found before anything is sent to the server."""
    options.check()
    engine = open_store(options)
    try:
        return _run(options, engine, cancel=cancel, on_update=on_update, say=say)
    finally:
        if engine is not None:  # the writer's engine, disposed already when it had one
            engine.dispose()


def open_store(options: TuneOptions) -> Engine | None:
    """The database ``options.db_url`` names, its schema brought up to date, or None
    without one; a ``TuningError`` naming the URL (password hidden) when it cannot be
    opened, so a session that was asked to be stored is not run unstored."""
    if not options.db_url:
        return None
    try:
        return store.open_database(options.db_url)
    except store.StoreUnavailable as exc:
        unstored = ("" if options.load == "replay"
                    else "; or leave out --db to tune without storing the session")
        raise TuningError(f"--db {shown_url(options.db_url)} cannot be used, so nothing "
                          f"was tuned: {exc}{unstored}") from None


def _run(options: TuneOptions, engine: Engine | None, *, cancel: threading.Event | None,
         on_update: Callable[[Progress], None] | None,
         say: Callable[[str], None] | None) -> TuningResult:
    cancel = cancel or threading.Event()
    say = say or (lambda text: log.info("%s", text))
    client = ControlClient(options.url, options.model, token=options.token)
    doc = client.batching()
    if doc.get("kind", "request") != "request":
        raise TuningError(f"model {options.model!r} is a {doc.get('kind')} model; tuning "
                          "sessions cover request models (KServe /infer)")
    metadata = client.metadata()
    say(f"tuning {options.model!r} at {client.url}: " + options.describe_goal())
    traffic = _recorded(options) if options.load == "replay" else None
    longest = (traffic.max_length if traffic is not None else longest_length(options.lengths))
    try:
        space = SearchSpace.for_model(doc, metadata, longest_length=longest,
                                      options=options.space)
    except SpaceError as exc:
        raise TuningError(str(exc)) from None
    objective = Objective(options.slo_p99_ms, options.objective, options.target_rps)
    stopping = Stopping(budget_s=options.budget_s, min_trials=options.min_trials,
                        patience=None if options.grid else options.patience,
                        min_gain=options.min_gain, max_repeats=30)
    search = GridSearch(space) if options.grid else OptunaSearch(space, seed=options.seed)
    load = None
    if options.load != "live":
        load = _load_for(options, traffic).start()
        meter: Meter = LoadMeter(load, client, options.slo_p99_ms)
        clock = load.now
        say(f"load: {load.describe()}; warming up for {options.warmup_s:g} s")
        if cancel.wait(options.warmup_s):
            load.stop()
            raise TuningError("the session was cancelled before its first trial")
    else:
        live = LiveMeter(client, options.slo_p99_ms)
        live.check()
        meter, clock = live, time.perf_counter
        say("load: the live traffic (measured from the server's stats and metrics)")
    say(f"space: {space.describe()}")
    session = TuningSession(space, search, objective, now=clock(), stopping=stopping,
                            stability=options.stability, settle_s=options.settle_s,
                            window_s=options.window_s, live=options.load == "live")
    writer, stored = open_writer(options, engine, session.start,
                                 load.describe() if load is not None else "the live traffic",
                                 wall_offset_s=time.time() - clock())
    say(f"session: {stored}")

    def update(message: str, result: TuningResult | None = None) -> None:
        if on_update is not None:
            now = clock()
            on_update(Progress(fraction=session.progress(now), elapsed_s=session.elapsed_s(now),
                               message=message, rows=[t.row(session.start) for t in session.trials],
                               result=result, stored=writer.note if writer else stored))

    def send(changes: dict) -> None:
        if changes:
            client.change(changes)

    def pause_for_backlog() -> str | None:
        if load is None:
            return None
        return drain_backlog(load, slo_p99_ms=options.slo_p99_ms, limit_s=options.drain_limit_s,
                             clock=clock, wait=lambda seconds: cancel.wait(seconds))

    error: BaseException | None = None
    try:
        update("measuring the starting settings")
        drive(session, send=send, meter=meter, clock=clock,
              wait=lambda seconds: cancel.wait(max(0.0, seconds)),
              min_requests=options.min_requests, say=say, update=update,
              done=(lambda trial: writer.trial(trial, session.start)) if writer else _nothing,
              drain=pause_for_backlog)
    except BaseException as exc:
        error = exc
        raise
    finally:
        if load is not None:
            load.stop()
        result = None
        try:
            result = finish(session, send, apply=options.apply, now=clock(), model=options.model)
        finally:
            store_end(writer, result, error)
    result.stored_as = writer.session_id if writer is not None else None
    result.storage = writer.note if writer is not None else stored
    if writer is not None and writer.problem is not None:
        say(f"session: {writer.note}")
    update("done", result)
    return result


def _nothing(trial: Trial) -> None:
    pass


def open_writer(options: TuneOptions, engine: Engine | None, start: dict, load: str, *,
                wall_offset_s: float) -> tuple[store.SessionWriter | None, str]:
    """The writer into ``engine`` (``open_store``'s) of a session that starts now from the
    settings ``start`` under the load described by ``load``, and where it is stored;
    ``(None, why not)`` without a database to store it in."""
    if engine is None:
        return None, "not stored (no database given; --db URL stores it with its trials)"
    try:
        instance = options.instance_id or store.instance_for_url(engine, options.url,
                                                                 options.model)
        hardware = store.hardware_of(engine, instance) if instance else None
        writer = store.SessionWriter.begin(engine, store.SessionStart(
            model=options.model, url=options.url, instance_id=instance,
            objective=options.objective, slo_p99_ms=options.slo_p99_ms,
            target_rps=options.target_rps, budget_s=options.budget_s, load_kind=options.load,
            load_description=load, start_settings=dict(start),
            requested_by=options.requested_by, started_at=time.time(),
            hardware=hardware), wall_offset_s=wall_offset_s)
        return writer, writer.note
    except (SQLAlchemyError, OSError) as exc:
        where = engine.url.render_as_string(hide_password=True)
        engine.dispose()
        return None, f"not stored: writing to {where} failed ({type(exc).__name__}: {exc})"[:500]


def store_end(writer: store.SessionWriter | None, result: TuningResult | None,
              error: BaseException | None) -> None:
    """Write how the session ended (failed: ``error``, or no result) and let go of the
    database."""
    if writer is None:
        return
    if error is None and result is not None:
        writer.end(result, state=store.state_of(result), now=time.time())
    else:
        why = (f"{type(error).__name__}: {error}" if error is not None
               else "the session ended without a result")
        writer.end(result, state=store.SESSION_FAILED, now=time.time(), reason=why)
    writer.engine.dispose()


#: a backlog this small is never worth a pause
MIN_BACKLOG = 16


def drain_backlog(load: BackgroundLoad, *, slo_p99_ms: float, limit_s: float,
                  clock: Callable[[], float], wait: Callable[[float], bool]) -> str | None:
    """Pause an open-loop ``load`` until what it has in flight is answered (at most
    ``limit_s``) when it holds more than twice what a server meeting the SLO would hold at
    the load's rate (Little's law: rate x SLO); what was done, in words, or None.

    A trial whose setting cannot keep up leaves a queue behind it. Measured through that
    queue, the next trial's latency is the backlog's, not its own, and every later
    trial inherits a longer one; paused, the server works the queue off under the new
    setting and the trial starts from an empty one."""
    if not load.pausable or limit_s <= 0:
        return None
    now = clock()
    rate = load.rate or load.count(now - 1.0, now)
    allowed = max(MIN_BACKLOG, 2.0 * rate * slo_p99_ms / 1000.0)
    backlog = load.in_flight
    if backlog <= allowed:
        return None
    load.pause()
    try:
        while load.in_flight > 0 and clock() - now < limit_s:
            if wait(0.05):
                break
    finally:
        load.resume()
    left = load.in_flight
    return (f"paused the load for {clock() - now:.1f} s while the server worked off the "
            f"{backlog} requests an earlier trial left"
            + (f" ({left} still open after {limit_s:g} s)" if left else ""))


def drive(session: TuningSession, *, send: Callable[[dict], None], meter: Meter,
          clock: Callable[[], float], wait: Callable[[float], bool], min_requests: int = 0,
          say: Callable[[str], None] = lambda text: None,
          update: Callable[[str], None] = lambda message: None,
          done: Callable[[Trial], None] = lambda trial: None,
          drain: Callable[[], str | None] = lambda: None) -> None:
    """Run ``session``'s trials until it is over: send each trial's changes (a refusal
    makes it infeasible), wait ``settle_s``, let ``drain()`` work off a backlog (it says
    what it did), then measure windows until a verdict; on
    ``RESTORE`` send the starting settings at once. ``done(trial)`` follows each trial
    that ended (refused or measured). ``wait(seconds)`` sleeps and says whether the
    session was cancelled meanwhile (then it stops; so does Ctrl-C)."""

    def wait_window() -> bool:
        # window_s, longer (up to 3 x) while fewer than min_requests finished in it
        if wait(session.window_s):
            return True
        longest = clock() + 2 * session.window_s
        count = getattr(meter, "finished_since_mark", None)
        while count is not None and count(clock()) < min_requests and clock() < longest:
            if wait(session.window_s / 4):
                return True
        return False

    try:
        while (trial := session.next_trial(clock())) is not None:
            try:
                send(trial.changes)
            except SettingsRefused as exc:
                session.refused(trial, exc.message, clock())
                say(_trial_line(trial))
                done(trial)
                continue
            session.started(trial, clock())
            if wait(session.settle_s):
                session.cancel(clock())
                return
            drained = drain()
            if drained:
                say(f"trial {trial.number}: {drained}")
            meter.mark(clock())
            verdict = Verdict.MORE
            while verdict is Verdict.MORE:
                if wait_window():
                    session.cancel(clock())
                    return
                verdict = session.add_window(trial, meter.read(clock()), clock())
                update(f"trial {trial.number}: {len(trial.windows)} window(s)")
            if verdict is Verdict.RESTORE:
                send(session.restore_changes())
                session.restored()
            say(_trial_line(trial))
            done(trial)
    except KeyboardInterrupt:
        session.cancel(clock())


def finish(session: TuningSession, send: Callable[[dict], None], *, apply: bool, now: float,
           model: str = "") -> TuningResult:
    """The session's result, with the server left on the starting settings, or on the
    best point when ``apply`` (never after a cancel); ``result.outcome`` says which."""
    result = session.result(now, model=model)
    keep = apply and result.best is not None and session.stop_reason != "cancelled"
    target = result.best.point if keep and result.best is not None else session.start
    changes = changes_between(session.applied, target)
    try:
        send(changes)
    except TuningError as exc:
        result.outcome = (f"could not put the settings back ({exc.message}); set them by "
                          f"hand: {format_point(target)}")
        return result
    session.applied = dict(target)
    if not keep:
        result.outcome = "restored the starting settings"
    elif not changes_between(session.start, target):
        result.outcome = "kept the starting settings: they are the best found"
    else:
        result.outcome = f"applied {format_point(changes_between(session.start, target))}"
    return result


def _trial_line(trial: Trial) -> str:
    f = trial.figures
    figures = ("" if f is None else
               f"goodput {f.goodput_rps:.1f} req/s, p99 "
               f"{'-' if f.p99_ms is None else f'{f.p99_ms:.1f}'} ms, ")
    verdict = "feasible" if trial.feasible else (trial.problem or trial.status)
    return (f"trial {trial.number}: {format_point(trial.point)} -> {figures}"
            f"{len(trial.windows)} windows, {trial.status}: {verdict}")


class TuningJob:
    """A session on a thread of its own, for a UI that polls it: the latest
    ``progress``, then ``result`` or ``error`` (the message of what stopped it)."""

    def __init__(self, options: TuneOptions) -> None:
        self.options = options
        self.progress: Progress | None = None
        self.result: TuningResult | None = None
        self.error: str | None = None
        self.lines: list[str] = []
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchscope-tuning", daemon=True)

    def start(self) -> "TuningJob":
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Ask the session to stop; it puts the starting settings back."""
        self._cancel.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _update(self, progress: Progress) -> None:
        self.progress = progress

    def _run(self) -> None:
        name_native()
        try:
            self.result = run_tuning(self.options, cancel=self._cancel, on_update=self._update,
                                     say=self.lines.append)
        except (TuningError, LoadError) as exc:
            self.error = exc.message
        except Exception as exc:  # shown to the user; the trace goes to the log
            log.exception("the tuning session of %r failed", self.options.model)
            self.error = f"the session failed: {type(exc).__name__}: {exc}"
