"""Where a batch is recorded, and the control table running runtimes read.

- ``records``: the plain row types the runtime hands over (``BatchRow``, ``RequestRow``,
  ``RequestBatch``, ...) and the ``RecorderLike`` protocol.
- ``schema``: the SQLAlchemy tables; ``db``: making an engine and the schema.
- ``recorder``: bounded buffer and background bulk writer, drop counting.
- ``inserts``: the bulk inserts (SQLite multi-row statements, SQLAlchemy Core otherwise)
  used by the recorder's thread and the writer process alike.
- ``writer_process``: the optional child process that runs the recorder's inserts.
- ``retention``: raw rows rolled into per-interval summaries, then deleted.
- ``control``: instances and heartbeats, published settings, control commands.
"""
