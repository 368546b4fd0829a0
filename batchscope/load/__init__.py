"""Load for a running server: the generator behind ``batchscope load`` and the tuner.

- ``loadgen``: closed- and open-loop HTTP load for the KServe v2 API, bounded runs
  (``run_load``) and its own error type ``LoadError``.
- ``background``: the same loops running until stopped on a thread of their own, with
  every completion timed, so a caller can read figures for any time window.
- ``replay``: recorded traffic (arrival times, input lengths, priorities) read back from
  a BatchScope database as an arrival schedule.

Nothing here imports ``runtime``: the load speaks to a server only over HTTP.
"""
