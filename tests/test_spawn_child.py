"""``batchscope.spawn.spawn_child``: a child never runs the parent's main script, gets its
channel and its CPU priority; the device and database writer processes start this way."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import threading

from batchscope.spawn import BacklogPriority, child_priority, spawn_child

ROOT = Path(__file__).resolve().parent.parent

#: a script with side effects at import and no ``__main__`` guard, as a Streamlit page is
SCRIPT = '''
import asyncio
import os
import sys

marker, db = sys.argv[1], sys.argv[2]
with open(marker, "a") as f:
    f.write(f"{os.getpid()}\\n")

import numpy as np

from batchscope.storage.db import make_engine
from batchscope.storage.recorder import Recorder
from batchscope.storage.records import EventRow
from runtime.api.config import BatchingConfig
from runtime.device.process import DeviceProcess

rec = Recorder(make_engine(f"sqlite:///{db}"), writer_process=True)
rec.put(EventRow(instance_id="rt", model=None, at=1.0, kind="note", message="m"))
assert rec.flush() == 1, f"the writer process did not write: {rec.dropped} dropped"
writer_pid = rec.process.pid
rec.close()


async def one_batch():
    process = DeviceProcess(["double=runtime.models.toys:DoubleModel"], ["double"])
    await process.start()
    answers = []
    process.submit("double", BatchingConfig(max_batch_size=4), 1,
                   [np.full(4, 3.0, np.float32)], None, None, None, answers.append)
    for _ in range(600):
        if answers:
            break
        await asyncio.sleep(0.05)
    pid = process.pid
    await process.stop()
    return pid, answers


device_pid, answers = asyncio.run(one_batch())
assert answers and answers[0][0].outcome == "ok", answers
print("children", writer_pid, device_pid, float(answers[0][0].outputs[0]["OUTPUT0"][0]))
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["path", "module"])
def test_children_of_a_script_with_side_effects_do_not_rerun_it(tmp_path, how):
    """``python script.py`` and ``python -m script``: a spawn child would normally import
    the script again (as ``__mp_main__``); the marker shows it ran once, in the parent."""
    (tmp_path / "side_effects.py").write_text(textwrap.dedent(SCRIPT))
    marker, db = tmp_path / "marker.txt", tmp_path / "rows.db"
    target = [str(tmp_path / "side_effects.py")] if how == "path" else ["-m", "side_effects"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    out = subprocess.run([sys.executable, *target, str(marker), str(db)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    assert words[0] == "children" and float(words[3]) == 6.0
    parent_pid = marker.read_text().split()
    assert len(parent_pid) == 1, f"the script ran {len(parent_pid)} times: {parent_pid}"
    assert parent_pid[0] not in words[1:3]


# -- the helper alone ---------------------------------------------------------------------
def echo_child(conn, greeting: str) -> None:
    """A child target: answer one message with greeting, message, priority and whether
    the test module is its ``__main__``."""
    message = conn.recv_bytes()
    main = sys.modules.get("__main__")
    conn.send_bytes(b"|".join([greeting.encode(), message, child_priority().encode(),
                               str(getattr(main, "__file__", None)).encode()]))


def test_the_channel_the_name_and_the_priority():
    child = spawn_child(echo_child, ("hello",), name="batchscope-test-child", nice=3)
    try:
        assert child.process.name == "batchscope-test-child" and child.pid != os.getpid()
        child.conn.send_bytes(b"ping")
        assert child.conn.poll(60)
        greeting, message, priority, main_file = child.conn.recv_bytes().split(b"|")
        assert (greeting, message, priority) == (b"hello", b"ping", b"nice")
        assert main_file == b"None"   # no main script in the child
    finally:
        child.process.join(30)
        child.conn.close()
    assert child.process.exitcode == 0
    assert sys.modules["__main__"] is not None and "__main__" in sys.modules   # restored


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_an_idle_child_runs_under_sched_idle():
    child = spawn_child(echo_child, ("hi",), name="batchscope-test-idle", idle=True)
    try:
        child.conn.send_bytes(b"x")
        assert child.conn.poll(60)
        assert child.conn.recv_bytes().split(b"|")[2] == b"idle"
    finally:
        child.process.join(30)
        child.conn.close()
    assert os.sched_getscheduler(0) != os.SCHED_IDLE   # the parent is untouched


def thread_policies() -> list[tuple[int, int]]:
    """(policy, nice) of each thread of the calling process."""
    return [(os.sched_getscheduler(int(t)), os.getpriority(os.PRIO_PROCESS, int(t)))
            for t in os.listdir("/proc/self/task")]


def backlog_child(conn) -> None:
    """Starts a worker thread, as the span process's span and export threads, then
    follows an urgent and a calm backlog, sending every thread's (policy, nice) after
    each."""
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    prio = BacklogPriority(child_priority(), 5, urgent=0.25, calm=0.05)
    seen = [thread_policies()]
    prio.follow(1.0)
    seen.append((prio.state, thread_policies()))
    prio.follow(0.0)
    seen.append((prio.state, thread_policies()))
    stop.set()
    worker.join()
    conn.send(seen)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not hasattr(os, "SCHED_IDLE"),
                    reason="thread policies are read from Linux's /proc")
def test_a_backlog_moves_every_thread_of_an_idle_child_not_only_the_caller():
    child = spawn_child(backlog_child, name="batchscope-test-backlog", idle=True)
    try:
        assert child.conn.poll(60)
        started, (urgent_state, urgent), (calm_state, calm) = child.conn.recv()
    finally:
        child.process.join(30)
        child.conn.close()
    idle = os.SCHED_IDLE
    assert len(started) == 2 and all(policy == idle for policy, _ in started)
    if urgent_state != "nice":
        pytest.skip("this user may not leave SCHED_IDLE")
    assert all(policy == os.SCHED_OTHER and nice >= 5 for policy, nice in urgent), urgent
    assert calm_state == "idle" and all(policy == idle for policy, _ in calm), calm


def test_a_target_in_the_main_script_is_refused_with_a_reason():
    def local(conn):  # noqa: ARG001
        pass

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="importable module"):
        spawn_child(local, name="never")
