"""The batching core: synchronous state machines with time passed in.

``Batcher`` (queues, priorities, deadlines, buckets, dispatch policy) and
``FairArbiter`` (device sharing between models); ``runtime.engine.engine`` is the asyncio
shell that drives them with the real clock.
"""

from runtime.core.arbiter import FairArbiter
from runtime.core.batcher import Batch, Batcher
from runtime.core.request import PendingRequest

__all__ = ["Batch", "Batcher", "FairArbiter", "PendingRequest"]
