"""Where a batch is recorded, and the control table running runtimes read.

- ``records``: the plain row types the runtime hands over (``BatchRow``, ``RequestRow``,
  ``RequestBatch``, ...) and the ``RecorderLike`` protocol.
- ``schema``: the SQLAlchemy tables; ``db``: making an engine and bringing the schema up
  to date (``migrations``: the Alembic revisions, run under a lock).
- ``recorder``: bounded buffer and background bulk writer, drop counting.
- ``inserts``: the bulk inserts (SQLite multi-row statements, SQLAlchemy Core otherwise)
  used by the recorder's thread and the writer process alike.
- ``writer_process``: the optional child process that runs the recorder's inserts.
- ``summaries``: per-second counts and 5-second latency histograms, written with the rows,
  that the live dashboard reads.
- ``retention``: raw rows rolled into per-interval summaries, then deleted.
- ``control``: instances and heartbeats, published settings, control commands.
"""
