"""The device process: models run in a child process with its own interpreter lock.

In one process, the event loop (HTTP, codec, batching) and the device thread (torch)
take turns on the GIL, and each waits for the other. ``DeviceProcess`` starts a child
(``batchscope.spawn.spawn_child``: a fresh interpreter, safe with torch's thread pools,
that never re-imports the serving process' main script) that loads the same models
from their specs (``runtime.models.loader.load_model``), calls ``setup(device)`` and
then runs every batch it is sent with ``runtime.device.executor.run_batch`` (budget
check, collate, predict or CUDA-graph replay, split, out-of-memory split-and-retry,
peak memory). ``decode``/``length`` stay in the serving process.

Messages are pickle protocol 5 bytes in length-prefixed frames over a socket pair;
items and outputs travel packed (``runtime.device.executor.pack_items``/``pack_outputs``).
The child reads and writes its end blocking (``Connection.recv_bytes``/``send_bytes``).
The serving process never blocks on its end: answers are read on the event loop
(``add_reader``) by a ``FrameReader``, which keeps the bytes of a message that arrives
in pieces until it is whole (a large answer usually does), and batches are written by a
``FrameWriter``, which queues what the socket does not take at once and finishes it
from ``add_writer``, in order. So a finished batch is booked without a thread switch,
and only end of file (or a reset) on the socket means the child is gone. A batch
carries its model's ``BatchingConfig`` the first time after each settings change, so
``cuda_graphs``, ``memory_budget_mb``, ``oom_recovery`` and ``max_batch_size`` changes
reach the child at the next batch.

When the child dies, every batch sent to it fails (an ``error`` attempt: the engine
answers 500 and records a ``model_error`` event), ``on_exit`` is told, and a new child
is started; batches submitted meanwhile wait for it (or fail, if it cannot start).

Execution timeout. The child runs its batches in the order they were sent, so the
oldest batch not back is the one running; it started when it was sent to an idle
child or when the batch before it came back. One loop timer watches that batch
against its model's ``execution_timeout_ms`` (no message per batch: it is re-armed
only when it fires early or the next batch has an earlier deadline). A batch past
its timeout gets a ``timeout`` attempt (503, and a ``model_timeout`` event), the
child is killed, and a new one is started; the batches sent behind it had not
started, so they are not failed but sent again to the new child, in their order
(with the batches submitted meanwhile). ``on_exit`` is not told of this kill:
``timeouts`` counts them, ``restarts`` counts every new child.

CPU priority. A child runs ``nice`` levels nicer than the serving process (0 by default);
``renice`` makes the running child (and any later one) nicer still, which is how
``runtime.device.priority.LoopBound`` lets the serving process's event loop go first on
a CPU device once the loop is measured to be the pipeline's narrow part.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import signal
import socket
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from batchscope import gctune
from batchscope.spawn import FrameReader, FrameWriter, spawn_child
from runtime.core.clock import MonotonicClock
from runtime.api.config import BatchingConfig
from runtime.api.errors import ConfigError
from runtime.device.oom import Attempt

log = logging.getLogger("batchscope.device_process")

#: the longest a child may take to import, load and set up its models
START_TIMEOUT_S = 180.0
#: at stop, the child gets this long to exit after being asked before it is killed
STOP_TIMEOUT_S = 5.0
_PROTOCOL = 5
#: most socket reads in one readable callback before other callbacks get their turn
_READS_PER_WAKE = 64

OnDone = Callable[[list[Attempt]], None]


#: how much nicer than the serving process a device process on the CPU is made once its
#: model is cheaper per request than the event loop (``runtime.device.priority``; ``mlp``
#: at 64 clients on 2 cores: 1.08-1.13x the throughput of the same priority in four runs
#: of alternating slices; 4 levels: 1.03x; ``SCHED_BATCH`` at the same level: 1.02x)
DEVICE_NICE_CPU = 10


def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=_PROTOCOL)


# -- the child --------------------------------------------------------------------------
def _load_models(specs: Sequence[str], names: Sequence[str]) -> dict[str, Any]:
    from runtime.models.loader import is_generation_model, load_model

    found: dict[str, Any] = {}
    for spec in specs:
        model = load_model(spec)
        if model.name in names and not is_generation_model(model):
            found[model.name] = model
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigError(f"no model spec among {list(specs)} loads model(s) {missing}; the "
                          "device process loads models by spec, pass the spec of every model")
    return found


def current_device(device: str) -> Any:
    """``device`` as a ``torch.device``, made this process's current CUDA device first
    when it is ``cuda:N``: whatever a model or library then creates without naming a
    device (a cuBLAS handle, a stream, ``torch.cuda.current_device()``) lands on N, not
    on device 0, and so does what ``torch.cuda`` calls without an index measure."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def child_main(conn: Any, specs: Sequence[str], names: Sequence[str], device: str,
               torch_threads: int, log_level: int) -> None:
    """Entry point of the device process: set up, then run batches until told to stop
    or the pipe closes (the serving process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the serving process' to handle
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s[device]: %(message)s")
    import torch

    from runtime.device.executor import graph_runner, pack_outputs, run_batch, unpack_items

    torch.set_num_threads(torch_threads)
    dev = current_device(device)
    try:
        models = _load_models(specs, names)
        for model in models.values():
            model.setup(dev)
    except BaseException as exc:  # noqa: BLE001 - reported to the serving process
        conn.send_bytes(_dumps(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        return
    conn.send_bytes(_dumps(("ready", os.getpid())))
    gctune.settle()  # the models stay for the process's life
    clock = MonotonicClock()
    configs: dict[str, BatchingConfig] = {}
    graphs: dict[str, Any] = {}

    def graphs_for(name: str) -> Callable[[BatchingConfig], Any]:
        def get(cfg: BatchingConfig) -> Any:
            graphs[name] = graph_runner(graphs.get(name), models[name], dev, cfg.max_batch_size)
            return graphs[name]
        return get

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        received = clock.now()
        job_id = None
        try:
            msg = pickle.loads(data)
            if msg[0] == "stop":
                return
            _, job_id, name, cfg, packed, lengths, pad_to, bucket, seq, adapters = msg
            if cfg is not None:
                configs[name] = cfg
            model = models[name]
            items = unpack_items(packed)
            attempts = run_batch(model, items, lengths, pad_to, bucket, configs[name],
                                 bool(model.variable_length), dev, clock, graphs_for(name),
                                 seq=seq, name=name, adapters=adapters)
            for a in attempts:
                if a.outputs is not None:
                    a.outputs = pack_outputs(a.outputs)
            reply = _dumps(("done", job_id, received, attempts))
        except Exception as exc:  # noqa: BLE001 - a bad message or unpicklable outputs
            now = clock.now()
            # stop=-1: the whole batch (the serving process knows its size)
            reply = _dumps(("done", job_id, received, [Attempt(
                0, -1, "error", received, now, now - received,
                error=f"{type(exc).__name__}: {exc}"[:200], trace=traceback.format_exc())]))
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, OSError):
            return


# -- the serving side -------------------------------------------------------------------
@dataclass(slots=True)
class _Job:
    """A batch on its way to (or in) the child."""

    job_id: int
    name: str
    config: BatchingConfig
    version: int
    items: list
    lengths: list[int] | None
    pad_to: int | None
    bucket: int | None
    on_done: OnDone
    #: the batch id (NVTX ranges in the child)
    seq: int | None = None
    sent_s: float = 0.0
    #: the model's execution_timeout_ms in seconds (None: none)
    timeout_s: float | None = None
    #: the rows' adapter slots (``runtime.adapters.slots.AdapterPlan``; None: none)
    adapters: Any = None


class DeviceProcess:
    """A child process that runs batches for the models named ``names``, loaded from
    ``specs``. All methods are called on the event loop's thread."""

    def __init__(self, specs: Sequence[str], names: Sequence[str], device: str = "cpu", *,
                 torch_threads: int = 1, clock: Any = None,
                 on_exit: Callable[[str], None] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, nice: int = 0) -> None:
        if not specs:
            raise ConfigError("the device process loads models by spec; none were given "
                              "(pass model_specs, e.g. ['mlp', 'path/file.py:MyModel'])")
        self.specs = list(specs)
        self.names = list(names)
        self.device = str(device)
        self.torch_threads = int(torch_threads)
        self.on_exit = on_exit
        self.start_timeout_s = start_timeout_s
        #: how much nicer than this process the child runs (see the module doc)
        self.nice = min(19, max(0, int(nice)))
        self._clock = clock or MonotonicClock()
        #: child times are on this process' clock only when both read the monotonic clock
        self._same_clock = type(self._clock) is MonotonicClock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        #: the serving process' end of the pipe (non-blocking) and its frame reader/writer
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._writer = FrameWriter()
        #: whether ``_on_writable`` is registered (the writer holds unsent bytes)
        self._writing = False
        self._ready: asyncio.Future | None = None
        self._starting: asyncio.Task | None = None
        self._sent: dict[int, _Job] = {}
        self._held: deque[_Job] = deque()
        self._versions: dict[str, int] = {}
        #: model -> the compile mode the current child was last sent (it compiles on a change)
        self._compiling: dict[str, str] = {}
        self._next_id = 0
        self._stopping = False
        #: ``loop.time()`` when the oldest batch sent (the one running) started
        self._head_started = 0.0
        #: the timer watching that batch's timeout, and when it fires
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = math.inf
        self.restarts = 0
        #: children killed because a batch ran past its execution timeout
        self.timeouts = 0
        self.pid: int | None = None

    def renice(self, nice: int) -> None:
        """Run the child (and every later one) ``nice`` levels nicer than this process;
        never raises (a child that is gone gets the level when it is started anew)."""
        self.nice = min(19, max(self.nice, int(nice)))
        if self._proc is not None and self._proc.pid is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, self._proc.pid,
                               min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.nice))
            except OSError as exc:
                log.warning("could not lower the device process's priority: %s", exc)
                return
        log.info("the device process of %s now runs %d levels nicer than the serving "
                 "process: its model costs less per request than the event loop",
                 ", ".join(self.names), self.nice)

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the child and wait until its models are set up (ConfigError/RuntimeError
        with the child's reason when that fails)."""
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        loop = self._loop
        child = spawn_child(child_main, (self.specs, self.names, self.device, self.torch_threads,
                                         logging.getLogger().getEffectiveLevel()),
                            name="batchscope-device", nice=self.nice)
        proc, sock = child.process, child.socket()
        self._proc, self._sock = proc, sock
        self._reader, self._writer = FrameReader(), FrameWriter()
        self._versions.clear()
        self._compiling.clear()
        self._ready = loop.create_future()
        loop.add_reader(sock.fileno(), self._on_readable)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.start_timeout_s)
        except asyncio.TimeoutError:
            self._close_child(kill=True)
            raise RuntimeError(f"the device process did not set up its models within "
                               f"{self.start_timeout_s:.0f} s") from None
        except BaseException:
            if self._sock is sock:
                self._close_child(kill=True)
            raise
        self.pid = proc.pid
        log.info("device process %d serves %s on %s", proc.pid, self.names, self.device)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to exit (killed after ``timeout_s``); batches still held fail."""
        self._stopping = True
        if self._starting is not None:
            self._starting.cancel()
        proc = self._proc
        if self._sock is not None:
            self._write(_dumps(("stop",)))  # behind any batch still being written
        if proc is not None:
            await self._loop.run_in_executor(None, proc.join, timeout_s)
        self._close_child(kill=True)
        self._fail_all("the server is shutting down")

    def _close_child(self, kill: bool) -> None:
        sock, proc = self._sock, self._proc
        self._sock = self._proc = None
        self._unwatch()
        if sock is not None:
            try:
                self._loop.remove_reader(sock.fileno())
                if self._writing:
                    self._loop.remove_writer(sock.fileno())
            except (ValueError, OSError):
                pass
            self._writing = False
            self._writer.clear()
            sock.close()
        if proc is not None and kill and proc.is_alive():
            proc.kill()
            proc.join(1.0)

    # -- batches ------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Whether the child has no batch to run: none sent and not back, none held."""
        return not self._sent and not self._held

    def submit(self, name: str, config: BatchingConfig, version: int, items: list,
               lengths: list[int] | None, pad_to: int | None, bucket: int | None,
               on_done: OnDone, timeout_s: float | None | str = "config", *,
               seq: int | None = None, adapters: Any = None) -> None:
        """Run a batch in the child; ``on_done(attempts)`` is called on the loop exactly once.
        ``timeout_s``: its execution timeout (None: none; default: the config's
        ``execution_timeout_ms``)."""
        self._next_id += 1
        job = _Job(self._next_id, name, config, version, items, lengths, pad_to, bucket, on_done,
                   seq)
        if adapters is not None:  # the device needs the rows and slots, not the records
            job.adapters = adapters.part(0, len(items))
        if timeout_s == "config":
            timeout_ms = config.execution_timeout_ms
            timeout_s = None if timeout_ms is None else timeout_ms / 1000.0
        job.timeout_s = timeout_s
        if self._stopping:
            self._finish_failed(job, "the server is shutting down", "lost")
            return
        if self._sock is None or self._ready is None or not self._ready.done():
            self._held.append(job)
            self._ensure_restart()
            return
        self._send(job)

    def _send(self, job: _Job) -> None:
        from runtime.device.executor import pack_items

        cfg = None
        if self._versions.get(job.name) != job.version:
            cfg = job.config
            self._versions[job.name] = job.version
            if cfg.compile != "off" and self._compiling.get(job.name) != cfg.compile:
                job.timeout_s = None  # the child compiles the model before running it
            self._compiling[job.name] = cfg.compile
        job.sent_s = self._clock.now()
        try:
            payload = _dumps(("run", job.job_id, job.name, cfg, pack_items(job.items),
                              job.lengths, job.pad_to, job.bucket, job.seq, job.adapters))
        except Exception as exc:  # items that cannot be pickled fail this batch only
            self._versions.pop(job.name, None)
            self._finish_failed(job, f"its items cannot be sent to the device process "
                                     f"({type(exc).__name__}: {exc})")
            return
        sent = self._sent
        sent[job.job_id] = job
        if len(sent) == 1:  # the child is idle: it starts this one now
            self._head_started = self._loop.time()
            if job.timeout_s is not None:
                self._watch_head()
        self._write(payload)

    # -- the pipe -----------------------------------------------------------------------
    def _write(self, payload: bytes) -> None:
        """Send one message without blocking; what the socket does not take now is
        finished by ``_on_writable``, before any later message."""
        sock = self._sock
        try:
            if not self._writer.send(sock, payload) and not self._writing:
                self._loop.add_writer(sock.fileno(), self._on_writable)
                self._writing = True
        except OSError:  # the child is gone: end of file on the pipe fails its batches
            pass

    def _on_writable(self) -> None:
        sock = self._sock
        try:
            done = self._writer.flush(sock)
        except OSError:  # the child is gone; the reader sees it and fails its batches
            self._writer.clear()
            done = True
        if done:
            self._loop.remove_writer(sock.fileno())
            self._writing = False

    def _on_readable(self) -> None:
        """Read what has arrived; act on each whole message. A message in pieces waits
        in the reader for the rest; only end of file or an error on the socket (the
        child is gone) ends the child."""
        sock, reader = self._sock, self._reader
        for _ in range(_READS_PER_WAKE):
            try:
                frames = reader.receive(sock)
            except (BlockingIOError, InterruptedError):  # all read for now
                return
            except Exception as exc:  # a reset connection, or a corrupt stream
                if not isinstance(exc, OSError):
                    log.exception("unreadable bytes from the device process")
                frames = None
            if frames is None:
                self._on_child_exit()
                return
            for frame in frames:
                self._on_message(frame)
                if self._sock is not sock:  # the child was closed meanwhile
                    return
            if not reader.more:  # the socket is drained: wait for the next wake
                return

    def _on_message(self, frame: bytearray) -> None:
        try:
            msg = pickle.loads(frame)
        except Exception:
            log.exception("unreadable message from the device process")
            self._on_child_exit()
            return
        kind = msg[0]
        if kind == "done":
            self._on_done(msg[1], msg[2], msg[3])
        elif kind == "ready":
            if not self._ready.done():
                self._ready.set_result(msg[1])
        elif kind == "failed":
            log.error("the device process could not set up its models:\n%s", msg[2])
            if not self._ready.done():
                self._ready.set_exception(RuntimeError(
                    f"the device process could not set up its models: {msg[1]}"))

    def _on_done(self, job_id: int, received_s: float, attempts: list[Attempt]) -> None:
        from runtime.device.executor import unpack_outputs

        if job_id is None and self._sent:  # the child could not read it: the oldest one
            job_id = next(iter(self._sent))
        sent = self._sent
        head = next(iter(sent), None)
        job = sent.pop(job_id, None)
        if job is None:
            return
        if job_id == head and sent:  # the next one starts now
            self._head_started = self._loop.time()
            self._watch_head()
        shift = 0.0 if self._same_clock else job.sent_s - received_s
        for a in attempts:
            if a.stop < 0:
                a.stop = len(job.items)
            if shift:
                a.started_s += shift
                a.ended_s += shift
            if a.outputs is not None:
                a.outputs = unpack_outputs(a.outputs)
        job.on_done(attempts)

    # -- the execution timeout ----------------------------------------------------------
    def _watch_head(self) -> None:
        """Make sure the timer fires by the running batch's deadline."""
        head = next(iter(self._sent.values()), None)
        if head is None or head.timeout_s is None:
            return
        deadline = self._head_started + head.timeout_s
        if deadline < self._watch_at:
            if self._watch is not None:
                self._watch.cancel()
            self._watch_at = deadline
            self._watch = self._loop.call_at(deadline, self._on_watch)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._watch_at = math.inf

    def _on_watch(self) -> None:
        self._watch = None
        self._watch_at = math.inf
        head = next(iter(self._sent.values()), None)
        if head is None or head.timeout_s is None or self._sock is None:
            return
        ran_s = self._loop.time() - self._head_started
        if ran_s < head.timeout_s:
            self._watch_head()
            return
        self._on_timeout(head, ran_s)

    def _on_timeout(self, job: _Job, ran_s: float) -> None:
        """``job`` has run past its timeout: answer it, kill the child, start a new one
        and send it the batches that were waiting behind."""
        self.timeouts += 1
        pid = self.pid
        behind = [j for j in self._sent.values() if j is not job]
        self._sent.clear()
        self._close_child(kill=True)
        log.error("model %r ran a batch of %d for %.1f s in the device process (pid %s), past "
                  "its execution timeout of %g ms: the process is killed and restarted; %d "
                  "batch(es) waiting behind it are sent to the new one", job.name,
                  len(job.items), ran_s, pid, job.timeout_s * 1000.0, len(behind))
        self._held.extendleft(reversed(behind))
        now = self._clock.now()
        job.on_done([Attempt(0, len(job.items), "timeout", now - ran_s, now, ran_s,
                             error=("the device process running it was killed and is being "
                                    "restarted; retry in a moment, and fix the model or raise "
                                    "execution_timeout_ms"), timeout_s=job.timeout_s)])
        self._ensure_restart()

    # -- failures -----------------------------------------------------------------------
    def _finish_failed(self, job: _Job, why: str, outcome: str = "error") -> None:
        """``job`` ends without outputs: ``error`` (the model's or its items' fault),
        ``lost`` (the process went away under it) or ``refused`` (it never ran)."""
        now = self._clock.now()
        start = job.sent_s or now
        job.on_done([Attempt(0, len(job.items), outcome, start, now, now - start, error=why)])

    def _fail_all(self, why: str) -> None:
        jobs = list(self._sent.values()) + list(self._held)
        self._sent.clear()
        self._held.clear()
        for job in jobs:
            self._finish_failed(job, why, "lost")

    def _on_child_exit(self) -> None:
        proc = self._proc
        self._close_child(kill=True)
        if proc is not None:
            proc.join(0.5)
        code = None if proc is None else proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(
                f"the device process exited ({how}) while setting up its models; see the log"))
            return
        lost = list(self._sent.values())
        self._sent.clear()
        for job in lost:
            self._finish_failed(job, f"the device process exited ({how}) while running this "
                                     "batch; it is being restarted, send the request again", "lost")
        if self._stopping:
            return
        message = (f"the device process (pid {self.pid}) exited ({how}); {len(lost)} batch(es) "
                   "failed, starting a new one")
        log.error(message)
        if self.on_exit is not None:
            try:
                self.on_exit(message)
            except Exception:
                log.exception("the device process exit listener failed")
        self._ensure_restart()

    def _ensure_restart(self) -> None:
        if self._stopping or self._starting is not None or self._loop is None:
            return
        self._starting = self._loop.create_task(self._restart(), name="batchscope-device-restart")

    async def _restart(self) -> None:
        try:
            await self._spawn()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - held batches fail, the next one tries again
            log.error("restarting the device process failed: %s", exc)
            held = list(self._held)
            self._held.clear()
            for job in held:
                self._finish_failed(job, f"the device process could not be restarted ({exc}); "
                                         "retry later", "refused")
            return
        finally:
            self._starting = None
        self.restarts += 1
        while self._held and self._sock is not None:
            self._send(self._held.popleft())
