"""The device sampler's PyTorch allocator figures with NVML and CUDA faked: unknown
(None) in a process that has not initialised CUDA, such as the serving process when
the models run in the device process, rather than a misleading 0."""

from __future__ import annotations

import types

import pynvml
import pytest
import torch

from batchscope.storage.records import ListRecorder
from batchscope.telemetry import DeviceSampler

GIB = 1 << 30


@pytest.fixture
def nvml(monkeypatch):
    """One healthy GPU through a fake NVML, and torch seeing CUDA available."""
    fake = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByIndex": lambda i: f"gpu{i}",
        "nvmlDeviceGetName": lambda h: "Fake H200",
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=37),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=20 * GIB, total=140 * GIB),
        "nvmlDeviceGetPowerUsage": lambda h: 350_000,
        "nvmlDeviceGetClockInfo": lambda h, kind: 1980,
        "nvmlDeviceGetTemperature": lambda h, kind: 55,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # what torch answers without a CUDA context in this process: nothing allocated
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    return monkeypatch


def test_without_a_cuda_context_here_the_torch_figures_are_unknown(nvml):
    nvml.setattr(torch.cuda, "is_initialized", lambda: False)
    sampler = DeviceSampler("inst", ListRecorder(), torch_device="cuda:0")
    assert sampler.kind == "gpu" and "Fake H200" in sampler.describe()
    [row] = sampler.sample()
    assert row.memory_used_bytes == 20 * GIB and row.utilization_pct == 37.0
    assert row.torch_allocated_bytes is None and row.torch_reserved_bytes is None
    sampler.stop()


def test_with_a_cuda_context_here_the_torch_figures_are_read(nvml):
    nvml.setattr(torch.cuda, "is_initialized", lambda: True)
    nvml.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * GIB)
    nvml.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * GIB)
    sampler = DeviceSampler("inst", ListRecorder(), torch_device="cuda:0")
    [row] = sampler.sample()
    assert (row.torch_allocated_bytes, row.torch_reserved_bytes) == (3 * GIB, 4 * GIB)
    sampler.stop()
