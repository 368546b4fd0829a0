"""``batchscope serve`` in a child process for the reliability runs: its URL, what it
logs (line count, the last lines, how often given phrases appear) and its memory."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence

from benchmarks.bench_serving import URL_RE, wait_ready

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """Starts ``cmd`` in ``cwd`` (this checkout's root by default: ``python -m runtime``
    runs the code there; ``code``: the checkout whose code runs wherever ``cwd`` is) and
    waits until it serves; ``marks``: phrases to count in the log."""

    def __init__(self, cmd: Sequence[str], timeout_s: float = 120.0,
                 marks: Sequence[str] = (), cwd: Path | str = ROOT,
                 code: Path | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if code is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines = 0
        self.tail: list[str] = []
        self.marks: dict[str, int] = {}
        self.url: str | None = None
        self._lock = threading.Lock()
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                with self._lock:
                    self.lines += 1
                    self.tail = (self.tail + [line])[-40:]
                    for key in marks:
                        if key in line:
                            self.marks[key] = self.marks.get(key, 0) + 1
                match = URL_RE.search(line)
                if self.url is None and "serving" in line and match:
                    self.url = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        if not found.wait(timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.tail[-20:]))
        wait_ready(self.url, deadline)

    def counts(self) -> tuple[int, dict[str, int]]:
        """Log lines so far and how often each mark appeared."""
        with self._lock:
            return self.lines, dict(self.marks)

    def rss_mb(self) -> float:
        """Resident memory of the server and its child processes, in MiB."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return float("nan")
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
