"""The request engine: where a request is admitted, dispatched and booked.

- ``engine``: ``Engine``, the asyncio facade the server, the CLI and the demo use.
- ``directory``: ``ModelDirectory``, settings and stats of every served model by name,
  request or generation alike (used by the control API and the live link).

The batching decisions themselves are made by the synchronous state machines in
``runtime.core``; the batches run where ``runtime.device`` puts them.
"""

from runtime.engine.engine import Engine

__all__ = ["Engine"]
