"""BatchScope's observability library; it never imports ``runtime``.

- ``storage``: records, schema, recorder and writer process, retention, control table.
- ``analysis``: queries over recorded data, diagnosis rules.
- ``presentation``: Plotly charts, the offline HTML report, snapshots.
- ``telemetry``: device sampler (NVML, or CPU figures without a GPU).
- ``testing``: synthetic data for tests and benchmarks only.
"""
