"""Command-line programs built on the runtime.

- ``cli``: the ``batchscope`` console command (``serve``, ``load``, ...).
- ``loadgen``: closed- and open-loop HTTP load generator (``batchscope load``).
- ``demo``: the demo runtime with synthetic varying traffic that the dashboard starts.
"""
