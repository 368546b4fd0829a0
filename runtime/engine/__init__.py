"""The request engine: where a request is admitted, dispatched and booked.

    engine.py      Engine: the asyncio facade the server, the CLI and the demo use
    served.py      ServedModel: one model's batcher, OOM governor and counts
    admission.py   priority and timeout checks, defaults, deadlines (generation uses them too)
    dispatch.py    Dispatcher: one model's dispatch loop (batches out, back, answered)
    turns.py       DeviceTurns: the asyncio side of the FairArbiter's device turns
    executors.py   where batches run: ThreadExecutor (device thread), ProcessExecutor
    booking.py     Booking: a batch's attempts become records, events, governor moves, outcomes
    directory.py   ModelDirectory: settings and stats of every served model by name,
                   request or generation alike (used by the control API and the live link)

The batching decisions themselves are made by the synchronous state machines in
``runtime.core``; the batches run where ``runtime.device`` puts them.
"""

from runtime.engine.engine import Engine

__all__ = ["Engine"]
