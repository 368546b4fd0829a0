"""Device sampler through its real code path on a machine without a usable GPU."""

from __future__ import annotations

import logging
import time

import pynvml
import pytest

from batchscope.storage.records import DeviceRow, ListRecorder
from batchscope.telemetry import DeviceSampler


def test_cpu_device_samples_cpu_figures(caplog):
    caplog.set_level(logging.INFO, logger="batchscope.telemetry")
    clock_values = iter([100.0, 101.0])
    sampler = DeviceSampler("inst-1", ListRecorder(), torch_device="cpu", clock=lambda: next(clock_values))
    assert sampler.kind == "cpu" and "torch device is cpu" in sampler.describe()
    sum(i * i for i in range(200_000))  # some CPU work between reads
    rows = sampler.sample()
    assert len(rows) == 1
    row = rows[0]
    assert isinstance(row, DeviceRow)
    assert (row.instance_id, row.at, row.device, row.kind) == ("inst-1", 100.0, "cpu", "cpu")
    assert row.utilization_pct is None or 0.0 <= row.utilization_pct <= 100.0
    assert 0 < row.memory_used_bytes < row.memory_total_bytes
    assert row.process_rss_bytes > 10_000_000       # a Python process with torch around
    assert row.power_w is None and row.torch_allocated_bytes is None
    assert sampler.sample()[0].at == 101.0
    assert len([r for r in caplog.records if r.name == "batchscope.telemetry"]) == 1


def test_cuda_without_nvml_falls_back_quietly(caplog):
    caplog.set_level(logging.DEBUG, logger="batchscope.telemetry")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine; the fallback test needs it absent")
    except pynvml.NVMLError:
        pass
    sampler = DeviceSampler("inst", ListRecorder(), torch_device="cuda:0")
    assert sampler.kind == "cpu"
    assert "NVML is unavailable for cuda:0" in sampler.describe()
    assert sampler.sample()[0].kind == "cpu"
    messages = [r for r in caplog.records if r.name == "batchscope.telemetry"]
    assert len(messages) == 1 and messages[0].levelno == logging.INFO


def test_nvml_init_failure_branch(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="batchscope.telemetry")

    def broken_init():
        raise RuntimeError("driver/library version mismatch")

    monkeypatch.setattr(pynvml, "nvmlInit", broken_init)
    sampler = DeviceSampler("inst", ListRecorder(), torch_device="cuda:1")
    assert sampler.kind == "cpu"
    assert "driver/library version mismatch" in sampler.describe()
    assert sampler.sample()[0].memory_total_bytes > 0
    assert [r.levelno for r in caplog.records if r.name == "batchscope.telemetry"] == [logging.INFO]


def test_thread_records_samples_until_stopped():
    rec = ListRecorder()
    sampler = DeviceSampler("inst", rec, interval_s=0.01)
    sampler.start()
    try:
        deadline = time.monotonic() + 10.0
        while len(rec.of(DeviceRow)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
    count = len(rec.of(DeviceRow))
    assert count >= 3 and sampler.samples == count
    time.sleep(0.05)
    assert len(rec.of(DeviceRow)) == count    # nothing after stop


def test_sampling_errors_do_not_escape_the_thread(caplog):
    caplog.set_level(logging.WARNING, logger="batchscope.telemetry")
    rec = ListRecorder()
    sampler = DeviceSampler("inst", rec, interval_s=0.01)
    calls = []

    def failing_read():
        calls.append(1)
        raise OSError("/proc unreadable")

    sampler.source.read = failing_read
    sampler.start()
    deadline = time.monotonic() + 10.0
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(calls) >= 3 and rec.records == []
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        DeviceSampler("inst", ListRecorder(), interval_s=0)
