"""``batchscope.threadnames``: the project's threads and children carry their names where
the operating system shows them (``/proc/<pid>/task/<tid>/comm``), read back from the
kernel; naming never raises."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from batchscope.spawn import spawn_child, stop_child
from batchscope.threadnames import NATIVE_NAME_BYTES, name_native, native_name

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names are read from /proc")


def comm(pid: int | str = "self", tid: int | None = None) -> str:
    path = Path(f"/proc/{pid}/comm") if tid is None else Path(f"/proc/{pid}/task/{tid}/comm")
    return path.read_text().strip()


def test_the_prefix_is_dropped_and_the_name_cut_to_the_kernels_length():
    assert native_name("batchscope-recorder") == b"recorder"
    assert native_name("otlp-spans-sender") == b"otlp-spans-send"
    assert len(native_name("x" * 40)) == NATIVE_NAME_BYTES
    assert native_name("batchscope-") == b"batchscope-"
    # a character cut in two is dropped whole, never left as half a UTF-8 sequence
    cut = native_name("abcdefghijklmn\u00e9")
    assert cut == b"abcdefghijklmn" and cut.decode("utf-8")


@linux
def test_a_thread_is_named_after_its_python_name():
    seen = {}

    def run() -> None:
        seen["given"] = name_native()
        seen["comm"] = comm("self", threading.get_native_id())

    worker = threading.Thread(target=run, name="batchscope-test-worker")
    worker.start()
    worker.join(10)
    assert seen == {"given": True, "comm": "test-worker"}


@linux
def test_the_projects_threads_name_themselves(tmp_path):
    from sqlalchemy import create_engine

    from batchscope.storage.recorder import Recorder

    recorder = Recorder(create_engine(f"sqlite:///{tmp_path / 'x.db'}"))
    recorder.start()
    try:
        names = set()
        for _ in range(200):  # the thread names itself as it starts
            names = {comm("self", t.native_id) for t in threading.enumerate()
                     if t.name == "batchscope-recorder"}
            if names == {"recorder"}:
                break
            threading.Event().wait(0.01)
        assert names == {"recorder"}
    finally:
        recorder.close()


def _child(conn) -> None:
    conn.send_bytes(Path("/proc/self/comm").read_bytes().strip())
    conn.recv_bytes()


@linux
def test_a_spawned_child_is_named_after_itself():
    child = spawn_child(_child, name="batchscope-test-child")
    try:
        assert child.conn.poll(60)
        assert child.conn.recv_bytes() == b"test-child"
        assert comm(child.process.pid) == "test-child"
    finally:
        stop_child(child.process, child.conn, b"stop")


def test_naming_never_raises():
    assert name_native("") is False
    assert isinstance(name_native("\x00bad"), bool)
