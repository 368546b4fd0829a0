"""``batchscope.gctune.settle``: what a long-running process holds leaves the collector's
scans and its young generation is collected every ``YOUNG_OBJECTS`` allocations; the
older generations keep their thresholds. Run in a child interpreter, so this test
process's collector is left as it is."""

from __future__ import annotations

import json
import subprocess
import sys

from batchscope.gctune import YOUNG_OBJECTS

_CHILD = """
import gc, json
before = gc.get_threshold()
held = [[i] for i in range(1000)]  # what a process keeps for its life
from batchscope import gctune
gctune.settle()
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(),
                  "held_tracked_young": sum(1 for o in gc.get_objects(0) if o in held)}))
"""


def test_settle_freezes_and_raises_the_young_generation():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["after"][0] == YOUNG_OBJECTS
    assert got["after"][1:] == got["before"][1:]
    assert got["frozen"] >= 1000  # the kept lists among them
    assert got["held_tracked_young"] == 0  # none of them is scanned by a young collection
