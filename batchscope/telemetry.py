"""Device telemetry: periodic ``DeviceRow`` samples of the accelerator or the CPU.

With a CUDA device and NVML (package ``nvidia-ml-py``) each sample holds the GPU's
utilisation, memory used/total, power, SM clock and temperature, plus the PyTorch
allocator's allocated/reserved bytes. Those two are this process' allocator's: when
this process has not initialised CUDA (the models run in the device process,
``runtime.device.process``, and the sampler in the serving process) they are None
(unknown), not 0; NVML's memory used still covers every process on the GPU. Without a
GPU, or when NVML cannot start, the
sampler falls back to the CPU: system-wide CPU utilisation (from ``cpu_times`` deltas),
system memory used/total and the process' resident size. The fallback is announced
with one INFO line; nothing raises and nothing repeats in the log.

This module is part of ``batchscope`` and must not import ``runtime``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import psutil

from batchscope.storage.records import DeviceRow, RecorderLike
from batchscope.threadnames import name_native

log = logging.getLogger(__name__)


class CpuSource:
    """CPU utilisation since the previous read, system memory and this process' RSS."""

    kind = "cpu"

    def __init__(self) -> None:
        self.device = "cpu"
        self._process = psutil.Process()
        self._last = self._busy_total()

    @staticmethod
    def _busy_total() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = sum(t)
        return total - idle, total

    def read(self) -> dict[str, Any]:
        busy, total = self._busy_total()
        d_busy, d_total = busy - self._last[0], total - self._last[1]
        self._last = (busy, total)
        util = 100.0 * d_busy / d_total if d_total > 0 else None
        mem = psutil.virtual_memory()
        return {"utilization_pct": None if util is None else min(max(util, 0.0), 100.0),
                "memory_used_bytes": int(mem.total - mem.available),
                "memory_total_bytes": int(mem.total),
                "process_rss_bytes": int(self._process.memory_info().rss)}

    def close(self) -> None:
        pass


def _cuda_index(torch_device: str) -> int:
    _, _, idx = torch_device.partition(":")
    return int(idx) if idx else 0


def visible_devices(env: Any = None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: None when unset; else its entries up to
    the first invalid one (CUDA ignores the rest: ``-1`` or an empty value hides every
    device). An entry is a CUDA ordinal or a UUID (``GPU-...``, ``MIG-...``, possibly
    abbreviated to a unique prefix)."""
    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """One GPU through NVML (the one PyTorch uses), plus the PyTorch allocator's figures
    when this process has initialised CUDA (else they are left None: unknown)."""

    kind = "gpu"

    def __init__(self, torch_device: str) -> None:
        import pynvml

        self._nvml = pynvml
        self.index = _cuda_index(torch_device)
        self.device = f"cuda:{self.index}"
        self.mapping = ""
        pynvml.nvmlInit()
        try:
            self._handle = self._physical_handle(self.index)
            self.name = pynvml.nvmlDeviceGetName(self._handle)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        self._process = psutil.Process()
        self._torch = None
        try:
            import torch

            if torch.cuda.is_available():
                self._torch = torch
        except ImportError:
            pass
        self._missing: set[str] = set()

    def _physical_handle(self, index: int) -> Any:
        """The NVML device of torch's ``cuda:index``. NVML numbers every GPU of the machine
        in PCI bus order; CUDA numbers the visible ones, in ``CUDA_DEVICE_ORDER``. So: by
        UUID from torch when this process has a CUDA context (exact whatever the order);
        else through ``CUDA_VISIBLE_DEVICES`` (an ordinal entry is taken as the NVML index,
        which holds with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs; a UUID entry by
        UUID); else the same index. ``self.mapping`` says which."""
        uuid = self._torch_uuid(index)
        if uuid is not None:
            self.mapping = f"UUID {uuid} from torch"
            return self._by_uuid(uuid)
        visible = visible_devices()
        if visible is None:
            self.mapping = f"NVML index {index}"
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        if index >= len(visible):
            raise LookupError(f"cuda:{index} is not among the {len(visible)} device(s) "
                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} leaves")
        entry = visible[index]
        if entry.isdigit():
            self.mapping = f"NVML index {entry} (CUDA_VISIBLE_DEVICES entry {index})"
            if os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
                log.info("device telemetry: cuda:%d read as NVML index %s, which assumes PCI bus "
                         "order; set CUDA_DEVICE_ORDER=PCI_BUS_ID when the GPUs differ", index, entry)
            return self._nvml.nvmlDeviceGetHandleByIndex(int(entry))
        self.mapping = f"{entry} (CUDA_VISIBLE_DEVICES entry {index})"
        return self._by_uuid(entry)

    def _torch_uuid(self, index: int) -> str | None:
        """``GPU-...`` of ``cuda:index`` from torch, only where CUDA is initialised already
        (never creates a context in a process that has none)."""
        try:
            import torch

            if not torch.cuda.is_initialized():
                return None
            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except Exception:
            return None
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"

    def _by_uuid(self, entry: str) -> Any:
        """The device with UUID ``entry``, or the one whose UUID starts with it."""
        nv = self._nvml
        try:
            return nv.nvmlDeviceGetHandleByUUID(entry)
        except nv.NVMLError:
            pass
        found = []
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            if _text(nv.nvmlDeviceGetUUID(handle)).startswith(entry):
                found.append(handle)
        if len(found) != 1:
            raise LookupError(f"{len(found)} NVML devices match {entry!r}")
        return found[0]

    def _get(self, field: str, fn: Callable[[], Any]) -> Any:
        if field in self._missing:
            return None
        try:
            return fn()
        except self._nvml.NVMLError as exc:  # e.g. power readings unsupported on this board
            self._missing.add(field)
            log.info("device telemetry: %s not available from NVML on %s (%s)", field, self.device, exc)
            return None

    def read(self) -> dict[str, Any]:
        nv, h = self._nvml, self._handle
        util = self._get("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        mem = self._get("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power_mw = self._get("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        clock = self._get("sm_clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        temp = self._get("temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        row = {"utilization_pct": None if util is None else float(util),
               "memory_used_bytes": None if mem is None else int(mem.used),
               "memory_total_bytes": None if mem is None else int(mem.total),
               "power_w": None if power_mw is None else power_mw / 1000.0,
               "sm_clock_mhz": None if clock is None else float(clock),
               "temperature_c": None if temp is None else float(temp),
               "process_rss_bytes": int(self._process.memory_info().rss)}
        if self._torch is not None and self._torch.cuda.is_initialized():
            row["torch_allocated_bytes"] = int(self._torch.cuda.memory_allocated(self.index))
            row["torch_reserved_bytes"] = int(self._torch.cuda.memory_reserved(self.index))
        return row

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def open_source(torch_device: str) -> tuple[Any, str]:
    """The best source for ``torch_device`` and a sentence saying which and why."""
    if not torch_device.startswith("cuda"):
        return CpuSource(), f"CPU utilisation and process memory (torch device is {torch_device})"
    try:
        src = NvmlSource(torch_device)
    except Exception as exc:  # no library, no driver, no such device...
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return CpuSource(), (f"CPU utilisation and process memory: NVML is unavailable for "
                             f"{torch_device} ({reason})")
    return src, f"NVML on {src.device} ({src.name}; {src.mapping})"


class DeviceSampler:
    """Samples the device every ``interval_s`` on a daemon thread and ``put``s the rows."""

    def __init__(self, instance_id: str, recorder: RecorderLike, *, interval_s: float = 1.0,
                 torch_device: str = "cpu", clock: Callable[[], float] = time.time) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.instance_id = instance_id
        self.recorder = recorder
        self.interval_s = interval_s
        self.clock = clock
        self.source, self._description = open_source(str(torch_device))
        log.info("device telemetry: sampling %s", self._description)
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def describe(self) -> str:
        return self._description

    @property
    def kind(self) -> str:
        return self.source.kind

    def sample(self) -> list[DeviceRow]:
        """Read the device now (does not record)."""
        fields = self.source.read()
        return [DeviceRow(instance_id=self.instance_id, at=self.clock(), device=self.source.device,
                          kind=self.source.kind, **fields)]

    def tick(self) -> list[DeviceRow]:
        """Sample and hand the rows to the recorder."""
        rows = self.sample()
        for row in rows:
            self.recorder.put(row)
        self.samples += 1
        return rows

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="batchscope-device-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.source.close()

    def _loop(self) -> None:
        name_native()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # telemetry must never take serving down
                if not self._warned:
                    self._warned = True
                    log.warning("device telemetry: sampling %s failed (%s); will keep trying quietly",
                                self._description, exc)
            self._stop.wait(self.interval_s)
