"""BatchScope's observability library; it never imports ``runtime``.

- ``storage``: records, schema, recorder and writer process, retention, control table.
- ``analysis``: queries over recorded data, diagnosis rules.
- ``presentation``: Plotly charts, the offline HTML report, snapshots.
- ``settings``: the settings schema (validation, CLI flags, dashboard forms, the
  tables of docs/batching.md).
- ``version``: the installed BatchScope's version (``batchscope --version``).
- ``spawn``: starting child processes (the parent's main script hidden, a socket channel,
  CPU priority) and the channel's frame reader and writer.
- ``telemetry``: device sampler (NVML, or CPU figures without a GPU).
- ``dashboard``: the Streamlit pages that ``app.py`` puts together.
- ``testing``: synthetic data for tests and benchmarks only.
"""
