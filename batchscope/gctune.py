"""The garbage collector's settings of BatchScope's long-running processes.

CPython collects its youngest generation each time 700 more tracked objects (lists,
dicts, tuples, instances, closures) were allocated than freed, and each collection
traverses every young object still alive. A busy server keeps thousands alive at any
moment: each request in flight holds a few dozen (its parsed body, queue entry,
callbacks, trace), and the database writer and the span process hold a message's rows
and traces while they work on them. At the default, the serving process with 64
requests in flight, every one traced, collected about every 36 requests (some 500
times in 6 s), each collection traversing the same requests in flight again; the span
process and the database writer each collected a few times a second, a few
milliseconds each.

``settle()`` is called once a process has loaded what it keeps for its life (modules,
models, the database engine): it moves all of that out of the collector's scans
(``gc.freeze``) and raises the young generation to ``YOUNG_OBJECTS``, so a collection
comes every few thousand requests, and costs no more, since the objects alive are the
same work in flight. Reference cycles are still collected (and a full collection still
runs as the older generations fill), only less often; what waits for them is garbage of
at most that many objects. Only processes BatchScope owns call it (``batchscope serve``
and the child processes it starts); a service embedded in another program leaves that
program's collector as it is.
"""

from __future__ import annotations

import gc

#: tracked objects allocated (net) between two collections of the young generation
YOUNG_OBJECTS = 20_000


def settle(young_objects: int = YOUNG_OBJECTS) -> None:
    """Freeze what the process holds now and collect the young generation every
    ``young_objects`` allocations (the older generations' thresholds are kept)."""
    gc.freeze()
    gc.set_threshold(young_objects, *gc.get_threshold()[1:])
