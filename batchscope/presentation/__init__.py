"""Showing recorded data: ``charts`` (Plotly figures), ``report`` (offline HTML) and
``snapshot`` (diagnostic zip export and checked import)."""
