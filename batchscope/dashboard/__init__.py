"""The Streamlit dashboard behind ``streamlit run app.py``.

``app.py`` builds the sidebar into a :class:`~batchscope.dashboard.scope.Scope` and hands
it to the page ``st.navigation`` picks. Each page is a module with ``render(scope)``;
``pages/`` holds the three-line scripts ``st.navigation`` runs, which only call it.

- ``scope``: the ``Scope`` dataclass, the sidebar that builds it, engines, opened snapshots.
- ``demo``: the bundled demo runtime as a child process, and the "where the data comes
  from" notice.
- ``live``: the Live page (headline, charts, diagnosis), refreshed as a fragment.
- ``tuning``: the Tuning page (settings form, command status, history, revert).
- ``fleet``: the Fleet page (instances side by side, fleet diagnosis, resource
  recommendations with their evidence and manifests).
- ``settings_form``: the settings form generated from ``batchscope.settings``.
- ``snapshots``: the Snapshots page (export, open, compare).

This package may import streamlit, plotly, pandas and other ``batchscope`` modules, never
``runtime`` (the demo runtime is started by command line).
"""
