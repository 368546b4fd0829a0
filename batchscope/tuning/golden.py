"""The golden-parameter table: the best settings each stored tuning session found, on the
hardware it ran on, beside the published rules of thumb.

One row per stored session with a feasible best point (``golden_rows``): the hardware
(from the instance's registration and device telemetry), the model, the best
``max_batch_size`` and batching timeout (``max_queue_delay_ms`` under the dynamic
policy; work-conserving, that is no wait, counts as 0 ms; other policies set their wait
otherwise and have none), and that trial's throughput and p99.

The published rows (``ARTICLE_ROWS``) give a batch size and a timeout range per GPU:
T4 16–32 and 10–30 ms, A10G 32–64 and 5–20 ms, A100 64–128 and 1–10 ms. A session's
row is set against the row of its GPU: the one its hardware names, else the one whose
memory size is within ``MEMORY_TOLERANCE`` of the GPU's (said to be a guess: two GPU
models can have the same memory); a CPU has none.

``to_csv`` and ``to_markdown`` export the table (Markdown with the published rows).
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from batchscope.tuning.store import GIB, StoredSession, StoredTrial

#: how close a GPU's memory must be to a published GPU's for the row to be guessed
MEMORY_TOLERANCE = 0.08


@dataclass(frozen=True)
class ArticleRow:
    gpu: str
    batch: tuple[int, int]
    timeout_ms: tuple[float, float]
    #: the GPU's memory as NVML reports it, GiB (one entry per variant)
    memory_gib: tuple[float, ...]

    def batch_text(self) -> str:
        return f"{self.batch[0]}–{self.batch[1]}"

    def timeout_text(self) -> str:
        return f"{self.timeout_ms[0]:g}–{self.timeout_ms[1]:g}"


ARTICLE_ROWS: tuple[ArticleRow, ...] = (
    ArticleRow("T4", (16, 32), (10.0, 30.0), (15.0,)),
    ArticleRow("A10G", (32, 64), (5.0, 20.0), (22.5,)),
    ArticleRow("A100", (64, 128), (1.0, 10.0), (40.0, 80.0)),
)


def article_row(hardware: Optional[str], kind: Optional[str],
                memory_bytes: Optional[int]) -> tuple[Optional[ArticleRow], str]:
    """The published row for a session's hardware and how it was found (``named`` or
    ``guessed from N GiB``); ``(None, why not)`` when there is none."""
    text = (hardware or "").upper()
    for row in ARTICLE_ROWS:
        if re.search(rf"(?<![A-Z0-9]){row.gpu}(?![A-Z0-9])", text):
            return row, "named"
    if kind == "cpu" or text.startswith("CPU"):
        return None, "the published rows are for GPUs"
    if kind != "gpu" or not memory_bytes:
        return None, "the GPU's model is unknown"
    gib = memory_bytes / GIB
    for row in ARTICLE_ROWS:
        if any(abs(gib - m) <= MEMORY_TOLERANCE * m for m in row.memory_gib):
            return row, f"guessed from {gib:.0f} GiB of GPU memory"
    return None, f"no published GPU has {gib:.0f} GiB"


@dataclass(frozen=True)
class GoldenRow:
    session_id: int
    started_at: float
    hardware: str
    model: str
    policy: Optional[str]
    max_batch_size: Optional[int]
    #: the batching timeout, ms (0: work-conserving); None under another policy
    timeout_ms: Optional[float]
    throughput_rps: Optional[float]
    goodput_rps: Optional[float]
    p99_ms: Optional[float]
    slo_p99_ms: float
    objective: str
    article: Optional[ArticleRow]
    #: how the published row was found, or why there is none
    matched: str

    @property
    def comparison(self) -> str:
        """The row against its published one, in words."""
        a = self.article
        if a is None:
            return f"no published row ({self.matched})"
        parts = []
        if self.max_batch_size is not None:
            parts.append(f"batch {self.max_batch_size} {_against(self.max_batch_size, a.batch)} "
                         f"{a.batch_text()}")
        if self.timeout_ms is not None:
            parts.append(f"timeout {self.timeout_ms:g} ms {_against(self.timeout_ms, a.timeout_ms)} "
                         f"{a.timeout_text()} ms")
        elif self.policy:
            parts.append(f"no fixed timeout (policy {self.policy})")
        return f"{a.gpu} ({self.matched}): " + "; ".join(parts)


def _against(value: float, span: tuple[float, float]) -> str:
    return "below" if value < span[0] else "above" if value > span[1] else "within"


def _timeout(best: dict) -> Optional[float]:
    if best.get("policy", "dynamic") != "dynamic":
        return None
    delay = best.get("max_queue_delay_ms")
    if delay is None:
        return 0.0
    return float(delay) if isinstance(delay, (int, float)) and not isinstance(delay, bool) else None


def golden_rows(found: Iterable[StoredSession], best: dict[int, StoredTrial]) -> list[GoldenRow]:
    """One row per session of ``found`` with a best point (``best``: its best trial by
    session id, as ``store.best_trials`` reads them), in the order given."""
    rows = []
    for s in found:
        point = s.best_settings
        if point is None:
            continue
        trial = best.get(s.id)
        size = point.get("max_batch_size")
        article, matched = article_row(s.hardware, s.device_kind, s.device_memory_bytes)
        rows.append(GoldenRow(
            session_id=s.id, started_at=s.started_at, hardware=s.hardware or "unknown",
            model=s.model, policy=point.get("policy") if isinstance(point.get("policy"), str) else None,
            max_batch_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
            timeout_ms=_timeout(point),
            throughput_rps=trial.throughput_rps if trial else None,
            goodput_rps=trial.goodput_rps if trial else None,
            p99_ms=trial.p99_ms if trial else None, slo_p99_ms=s.slo_p99_ms,
            objective=s.objective, article=article, matched=matched))
    return rows


# -- export ---------------------------------------------------------------------------------
COLUMNS = ("session", "started (UTC)", "hardware", "model", "policy", "best batch size",
           "timeout ms", "throughput req/s", "goodput req/s", "p99 ms", "SLO p99 ms",
           "published GPU", "published batch", "published timeout ms", "comparison")


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(float(t), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _num(v: Optional[float], digits: int = 1) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def cells(row: GoldenRow) -> list[str]:
    """The row as text, one cell per ``COLUMNS`` entry."""
    a = row.article
    return [str(row.session_id), _when(row.started_at), row.hardware, row.model,
            row.policy or "", "" if row.max_batch_size is None else str(row.max_batch_size),
            "" if row.timeout_ms is None else f"{row.timeout_ms:g}",
            _num(row.throughput_rps), _num(row.goodput_rps), _num(row.p99_ms),
            f"{row.slo_p99_ms:g}", a.gpu if a else "", a.batch_text() if a else "",
            a.timeout_text() if a else "", row.comparison]


def article_cells() -> list[list[str]]:
    return [[a.gpu, a.batch_text(), a.timeout_text()] for a in ARTICLE_ROWS]


ARTICLE_COLUMNS = ("GPU", "batch size", "timeout ms")


def to_csv(rows: Iterable[GoldenRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(cells(r) for r in rows)
    return out.getvalue()


def _md_table(header: Iterable[str], body: Iterable[list[str]]) -> list[str]:
    def line(values: Iterable[str]) -> str:
        return "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in values) + " |"

    header = list(header)
    return [line(header), "|" + "---|" * len(header), *(line(b) for b in body)]


def to_markdown(rows: Iterable[GoldenRow]) -> str:
    """The table, then the published rows it is compared with."""
    rows = list(rows)
    lines = ["## Golden parameters (best settings per tuning session)", ""]
    lines += _md_table(COLUMNS, (cells(r) for r in rows)) if rows else \
        ["No stored tuning session found a setting that meets its SLO yet."]
    lines += ["", "## Published rules of thumb", ""]
    lines += _md_table(ARTICLE_COLUMNS, article_cells())
    return "\n".join(lines) + "\n"
