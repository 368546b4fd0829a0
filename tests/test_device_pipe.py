"""The device pipe: messages that arrive in pieces, and sends larger than the socket
buffer, are normal traffic, never a dead child.

Deterministic: the frame tests drive a socket pair from one thread (or a fixed random
seed), and the device process test asserts on counts and values, not on timing.
"""

from __future__ import annotations

import asyncio
import random
import select
import socket
import textwrap
import threading
from multiprocessing.connection import Connection

import numpy as np
import pytest

from batchscope.spawn import FrameError, FrameReader, FrameWriter, frame_header
from runtime.api.config import BatchingConfig
from runtime.device.process import DeviceProcess

#: floats per request in and out: 256 KiB of float32 each way
WIDE = 65536

WIDE_MODEL = f'''
import numpy as np
import torch
from runtime.api.model import ModelAPI, TensorSpec


class WideModel(ModelAPI):
    """x * 2 + 1 on {WIDE} floats: 256 KiB in and out per request."""
    name = "wide"
    inputs = (TensorSpec("INPUT0", "FP32", ({WIDE},)),)
    outputs = (TensorSpec("OUTPUT0", "FP32", ({WIDE},)),)

    def decode(self, inputs):
        return np.asarray(inputs["INPUT0"], dtype=np.float32).reshape({WIDE})

    def collate(self, items, pad_to):
        return torch.from_numpy(np.stack(items))

    def predict(self, batch):
        return batch * 2 + 1

    def split(self, output, n):
        out = output.numpy()
        return [{{"OUTPUT0": out[i]}} for i in range(n)]
'''


def frames_of(payloads: list[bytes]) -> bytes:
    return b"".join(frame_header(len(p)) + p for p in payloads)


def payloads() -> list[bytes]:
    rng = random.Random(7)
    sizes = [0, 1, 3, 4, 5, 12, 300, 16_384, 16_385, 70_000, 300_000, 1_100_000, 2, 0]
    return [bytes(rng.getrandbits(8) for _ in range(min(n, 64))) * (n // 64) +
            bytes(rng.getrandbits(8) for _ in range(n % 64)) for n in sizes]


def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


# -- (b) the frame reader ----------------------------------------------------------------
def test_frames_fed_whole_byte_by_byte_or_split_anywhere_are_the_same_messages():
    sent = payloads()
    stream = frames_of(sent)
    assert [bytes(f) for f in FrameReader().feed(stream)] == sent
    small = [p for p in sent if len(p) < 100_000]
    stream_small, reader = frames_of(small), FrameReader()
    one_by_one = [bytes(f) for i in range(len(stream_small))
                  for f in reader.feed(stream_small[i:i + 1])]
    assert one_by_one == small
    rng = random.Random(11)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 60)))
        reader = FrameReader()
        got = []
        for lo, hi in zip([0] + cuts, cuts + [len(stream)]):
            got.extend(bytes(f) for f in reader.feed(stream[lo:hi]))
        assert got == sent


def test_the_reader_reads_what_connection_send_bytes_writes():
    """The child writes with ``Connection.send_bytes``; the serving process parses it."""
    a, b = socket.socketpair()
    writer = Connection(a.detach())
    sent = payloads()
    thread = threading.Thread(target=lambda: [writer.send_bytes(p) for p in sent])
    thread.start()
    b.setblocking(False)
    reader, got = FrameReader(), []
    while len(got) < len(sent):
        select.select([b], [], [], 10.0)
        try:
            frames = reader.receive(b)
        except BlockingIOError:
            continue
        assert frames is not None
        got.extend(bytes(f) for f in frames)
    thread.join()
    assert got == sent
    writer.close()
    select.select([b], [], [], 10.0)
    assert reader.receive(b) is None   # end of file: the other end is gone
    b.close()


def test_a_partial_message_waits_and_only_end_of_file_ends_the_stream():
    a, b = socket_pair()
    message = bytes(range(256)) * 4096   # 1 MiB
    frame = frame_header(len(message)) + message
    reader = FrameReader()
    a.sendall(frame[:3])
    assert reader.receive(b) == []               # a piece of the header
    with pytest.raises(BlockingIOError):         # nothing more to read: not an error
        reader.receive(b)
    got = []
    rest = memoryview(frame)[3:]   # the rest in whatever pieces the socket takes
    while rest or not got:
        if rest:
            try:
                rest = rest[a.send(rest):]
            except BlockingIOError:
                pass
        try:
            frames = reader.receive(b)
        except BlockingIOError:
            continue
        assert frames is not None
        got.extend(frames)
    assert [bytes(f) for f in got] == [message]
    a.close()
    assert reader.receive(b) is None
    b.close()


def test_long_frame_headers_and_corrupt_headers():
    """Above 2 GiB a frame is marked -1 and has an 8-byte length (as in multiprocessing);
    a negative length of any other value is a corrupt stream."""
    assert frame_header(2**31) == b"\xff\xff\xff\xff" + (2**31).to_bytes(8, "big")
    reader = FrameReader()
    stream = b"\xff\xff\xff\xff" + (5).to_bytes(8, "big") + b"hello"
    assert [bytes(f) for b in stream for f in reader.feed(bytes([b]))] == [b"hello"]
    with pytest.raises(FrameError, match="corrupt"):
        FrameReader().feed(b"\xff\xff\xff\xfe")


# -- (c) sends larger than the socket buffer ---------------------------------------------
def test_a_send_that_fills_the_socket_buffer_completes_in_order():
    a, b = socket_pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sent = [bytes([i]) * (1_000_000 + i) if i % 3 == 0 else f"small {i}".encode()
            for i in range(30)]
    writer = FrameWriter()
    whole = [writer.send(a, p) for p in sent]
    assert whole[0] is False              # the first large frame did not fit ...
    assert not any(whole[1:])             # ... so every later one waits behind it
    assert writer.pending > 0
    reader, got = FrameReader(), []
    flushed = False
    while len(got) < len(sent):
        flushed = writer.flush(a)
        try:
            frames = reader.receive(b)
        except BlockingIOError:
            continue
        assert frames is not None
        got.extend(bytes(f) for f in frames)
    assert flushed and writer.pending == 0
    assert got == sent
    a.close()
    b.close()


def test_frames_written_without_blocking_read_back_with_recv_bytes():
    """The serving process writes with ``FrameWriter``; the child reads with
    ``Connection.recv_bytes``."""
    a, b = socket_pair()
    b.setblocking(True)
    conn = Connection(b.detach())
    sent = [bytes([i % 251]) * (300_000 * (i % 4)) for i in range(12)]
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.extend(conn.recv_bytes() for _ in sent))
    thread.start()
    writer = FrameWriter()
    for p in sent:
        writer.send(a, p)
    while not writer.flush(a):
        select.select([], [a], [], 10.0)
    thread.join(30)
    assert got == sent
    conn.close()
    a.close()


# -- (a) the device process with 256 KiB per request -------------------------------------
@pytest.mark.timeout(120)
def test_wide_outputs_over_many_batches_cost_no_restart(tmp_path):
    path = tmp_path / "wide_model.py"
    path.write_text(textwrap.dedent(WIDE_MODEL))
    batches, per_batch, in_flight = 40, 8, 4
    config = BatchingConfig(max_batch_size=per_batch)
    exits: list[str] = []

    async def run() -> dict[int, list]:
        process = DeviceProcess([f"{path}:WideModel"], ["wide"], on_exit=exits.append)
        await process.start()
        answers: dict[int, list] = {}
        room = asyncio.Semaphore(in_flight)
        try:
            for b in range(batches):
                await room.acquire()
                items = [np.arange(WIDE, dtype=np.float32) + (b * per_batch + i)
                         for i in range(per_batch)]

                def done(attempts, b=b):
                    answers[b] = attempts
                    room.release()

                process.submit("wide", config, 1, items, None, None, None, done)
            for _ in range(in_flight):
                await asyncio.wait_for(room.acquire(), 60)
            assert process.restarts == 0
        finally:
            await process.stop()
        return answers

    answers = asyncio.run(run())
    assert exits == [] and sorted(answers) == list(range(batches))
    for b, attempts in answers.items():
        assert [(a.outcome, a.start, a.stop, a.error) for a in attempts] == [("ok", 0, per_batch, None)]
        for i, out in enumerate(attempts[0].outputs):
            expected = (np.arange(WIDE, dtype=np.float32) + (b * per_batch + i)) * 2 + 1
            assert out["OUTPUT0"].dtype == np.float32 and np.array_equal(out["OUTPUT0"], expected)
