"""Where a run's CPU time goes, and how close the run came to the machine's CPU bound.

On a machine whose cores are shared by the server and the load generator, the most a
server can serve is ``cores / (CPU seconds per request)``: the CPU each request costs
the serving process, its children (device process, database writer) and the load
generator together. The share of that bound a run reaches is the share of the cores
the three used over the run::

    with CpuShare(server_pid) as cpu:
        report = run_load(...)                  # in this process: the load generator
    cpu.summary(report.completed)               # CPU per request by part, share of the bound

Read from ``/proc`` (Linux); the load generator's time is this process's own
(``os.times``). Time stolen by other tenants of the host shows as CPU nobody used.

The serving process's time is also split by thread (``thread_cpu_s``: the nanosecond
``schedstat`` of each, by the name the kernel shows, which ``batchscope.threadnames``
gives the project's threads): a thread that costs the event loop shows there even when
the process's total barely moves. Its children's time is split by child the same way
(``children``: by the kernel's name of each, which ``batchscope.spawn`` gives its
children: ``otlp-spans``, ``db-writer``, ...).
"""

from __future__ import annotations

import os
import time
from typing import Any

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, user + system CPU seconds, the kernel's name) of ``pid``, None when
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    close = raw.rindex(b")")
    fields = raw[close + 2:].split()  # after "pid (comm) "
    name = raw[raw.index(b"(") + 1:close].decode(errors="replace")
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S, name


def tree_cpu_s(root: int, names: dict[int, str] | None = None) -> dict[int, float]:
    """CPU seconds of ``root`` and each process below it, by pid; each one's kernel name
    put into ``names`` where it is given."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    comm: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _stat(int(entry))
            if got is not None:
                parents[int(entry)], cpu[int(entry)], comm[int(entry)] = got
    out = {root: cpu.get(root, 0.0)}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in out and pid not in out:
                out[pid] = cpu[pid]
                grew = True
    if names is not None:
        names.update((pid, comm[pid]) for pid in out if pid in comm)
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds each thread of ``pid`` has used so far, summed by thread name (the
    kernel's ``comm``; threads of one pool share a name). Empty when the process is
    gone."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                used = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # the thread ended, or no schedstat
            continue
        out[name] = out.get(name, 0.0) + used
    return out


class CpuShare:
    """The CPU the processes of ``server_pid`` and this process used inside the block."""

    def __init__(self, server_pid: int, cores: int | None = None) -> None:
        self.server_pid = server_pid
        self.cores = cores or os.cpu_count() or 1
        self.used: dict[str, float] = {}
        #: the serving process's CPU seconds inside the block by thread name
        self.threads: dict[str, float] = {}
        #: its child processes' CPU seconds inside the block by the kernel's name of each
        self.children: dict[str, float] = {}
        self.wall_s = 0.0

    def __enter__(self) -> "CpuShare":
        self._threads = thread_cpu_s(self.server_pid)
        self._tree = tree_cpu_s(self.server_pid)
        times = os.times()
        self._self = times.user + times.system
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_s = time.perf_counter() - self._wall
        times = os.times()
        names: dict[int, str] = {}
        after = tree_cpu_s(self.server_pid, names)
        threads = thread_cpu_s(self.server_pid)
        self.threads = {name: used - self._threads.get(name, 0.0)
                        for name, used in threads.items()}
        before = self._tree
        self.children = {}
        for pid in after:
            if pid != self.server_pid:
                name = names.get(pid, str(pid))
                self.children[name] = (self.children.get(name, 0.0)
                                       + after[pid] - before.get(pid, 0.0))
        children = sum(self.children.values())
        self.used = {"serving process": after[self.server_pid] - before.get(self.server_pid, 0.0),
                     "its child processes": children,
                     "load generator": times.user + times.system - self._self}

    def summary(self, requests: int) -> dict[str, Any]:
        """CPU microseconds per request by part, in all, the bound they set on this
        machine (requests per second) and the share of it the run reached; the serving
        process's microseconds per request by thread (``serving_threads_us``), its
        children's by child (``children_us``)."""
        per = {k: v / max(requests, 1) * 1e6 for k, v in self.used.items()}
        by_thread = {k: v / max(requests, 1) * 1e6 for k, v in self.threads.items()}
        by_child = {k: v / max(requests, 1) * 1e6 for k, v in self.children.items()}
        total_us = sum(per.values())
        bound = self.cores / (total_us / 1e6) if total_us else float("inf")
        rate = requests / self.wall_s if self.wall_s else 0.0
        return {"cpu_us_per_request": per, "total_cpu_us_per_request": total_us,
                "serving_threads_us": by_thread, "children_us": by_child,
                "cores": self.cores, "cpu_bound_rps": bound, "rps": rate,
                "share_of_cpu_bound": rate / bound if bound else 0.0}
