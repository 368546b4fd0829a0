"""Threads and child processes named for the operating system, as they are for Python.

Python names its threads (``batchscope-recorder``, ``otlp-spans-sender``) but, before
3.14, not the threads the kernel sees: ``top -H``, ``perf``, ``/proc/<pid>/task/*/comm``
and a benchmark reading each thread's CPU (``benchmarks.cpu_share.thread_cpu_s``) show
every one of them, and every spawned child, as ``python``. ``name_native`` gives the
calling thread its name there too; the project's threads call it first thing, thread
pools pass it as their ``initializer``, and ``batchscope.spawn`` children name their
main thread (and so the process, in ``ps`` and ``top``) after the child.

The kernel keeps 15 bytes of a name; ``native_name`` drops a leading ``batchscope-``
first (every such thread is the project's) and cuts the rest there. Linux only, through
``prctl(PR_SET_NAME)``; elsewhere, and wherever the call fails, nothing happens: naming
never raises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

#: the bytes of a thread's name the kernel keeps (16 with the terminating NUL)
NATIVE_NAME_BYTES = 15
#: what ``native_name`` drops from the front of a name
PREFIX = "batchscope-"
_PR_SET_NAME = 15

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        _prctl = None


def native_name(name: str) -> bytes:
    """The name the kernel is given for ``name``: ``PREFIX`` dropped, UTF-8, at most
    ``NATIVE_NAME_BYTES`` bytes (a character cut in two is dropped whole)."""
    if name.startswith(PREFIX) and len(name) > len(PREFIX):
        name = name[len(PREFIX):]
    raw = name.encode("utf-8", "replace")[:NATIVE_NAME_BYTES]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def name_native(name: str | None = None) -> bool:
    """Give the calling thread ``name`` (its Python name when None) where the operating
    system shows it; True when it was given. Never raises."""
    if _prctl is None:
        return False
    try:
        given = native_name(name if name is not None else threading.current_thread().name)
        return bool(given) and _prctl(_PR_SET_NAME, given, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - naming is a courtesy to tools, never a failure
        return False
