"""Test and benchmark helpers; nothing in the runtime or the dashboard uses them.

- ``synthetic``: writes plausible recorded data (batches, requests, events, device
  samples) straight into a database, for tests and the dashboard benchmark.
"""
