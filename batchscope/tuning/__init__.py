"""Tuning sessions: find the settings that serve a model best under its SLO.

A session tunes a *running* server through its HTTP control API (no restart), so what
it measures is what will serve. The pieces, each one concept:

- ``space``: which settings are searched and their candidate values, read from the
  model's ``GET /v2/models/{name}/batching`` document and its metadata.
- ``session``: the synchronous state machine with time passed in: trial bookkeeping,
  the stability rule, the objective, early stopping, the live guard and the result
  sentence.
- ``search``: what to try next: Optuna's TPE sampler (seeded) or an exhaustive grid.
- ``client``: the control API over HTTP (settings, stats, metrics).
- ``measure``: measurement windows, client-side from a load, or the server's own
  figures for live traffic.
- ``runner``: the thin shell that runs a session end to end (used by ``batchscope
  tune`` and the dashboard), restoring the starting settings unless asked to apply.
- ``store``: sessions and their trials in the database, written as they run and read
  back for the Tuning page, snapshots and the offline report.
- ``golden``: the golden-parameter table (the best settings per stored session on its
  hardware, beside the published rules of thumb), as CSV or Markdown.

Nothing here imports ``runtime``.
"""
