"""The NVML device the sampler reads for torch's ``cuda:N``, with NVML faked: NVML numbers
every GPU in PCI bus order, CUDA only the visible ones, so ``CUDA_VISIBLE_DEVICES``
(ordinals or ``GPU-`` UUIDs, abbreviated or not) is followed, and torch's own UUID where
this process has a CUDA context."""

from __future__ import annotations

import types

import pynvml
import pytest
import torch

from batchscope.storage.records import ListRecorder
from batchscope.telemetry import DeviceSampler, visible_devices

UUIDS = ("GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000", "GPU-bbbc4444-0000")


@pytest.fixture
def nvml(monkeypatch):
    """Four GPUs through a fake NVML; each reports its NVML index as its utilisation."""
    def by_uuid(uuid):
        if uuid not in UUIDS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return UUIDS.index(uuid)

    def by_index(i):
        if not 0 <= i < len(UUIDS):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return i

    fake = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(UUIDS),
        "nvmlDeviceGetHandleByIndex": by_index, "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetUUID": lambda h: UUIDS[h].encode(),
        "nvmlDeviceGetName": lambda h: f"Fake GPU {h}",
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=h),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=1, total=2),
        "nvmlDeviceGetPowerUsage": lambda h: 1000, "nvmlDeviceGetClockInfo": lambda h, kind: 1,
        "nvmlDeviceGetTemperature": lambda h, kind: 1,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def nvml_index(device: str) -> int | None:
    """The NVML index the sampler read for ``device`` (None: it fell back to the CPU)."""
    sampler = DeviceSampler("inst", ListRecorder(), torch_device=device)
    try:
        if sampler.kind != "gpu":
            return None
        return int(sampler.sample()[0].utilization_pct)
    finally:
        sampler.stop()


@pytest.mark.parametrize("env, device, expected", [
    (None, "cuda:3", 3),
    ("2,0", "cuda:0", 2),
    ("2,0", "cuda:1", 0),
    (" 3 , 1", "cuda:1", 1),
    ("GPU-cccc3333-0000,0", "cuda:0", 2),
    ("1,GPU-aaaa", "cuda:1", 0),  # an abbreviated UUID: the one device it starts
    ("3,-1,0", "cuda:0", 3),
    ("3,-1,0", "cuda:1", None),   # CUDA stops at -1: only one device is visible
    ("", "cuda:0", None),         # set and empty: no device
    ("GPU-bbb", "cuda:0", None),  # ambiguous prefix
])
def test_cuda_index_is_mapped_through_the_visible_devices(nvml, env, device, expected):
    if env is not None:
        nvml.setenv("CUDA_VISIBLE_DEVICES", env)
    assert nvml_index(device) == expected


def test_torch_uuid_wins_where_cuda_is_initialised(nvml):
    """With a context here the exact UUID is known, whatever CUDA_DEVICE_ORDER did."""
    nvml.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    nvml.setattr(torch.cuda, "is_initialized", lambda: True)
    nvml.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    nvml.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    nvml.setattr(torch.cuda, "get_device_properties",
                 lambda i: types.SimpleNamespace(uuid="cccc3333-0000" if i == 1 else "aaaa1111-0000"))
    assert nvml_index("cuda:1") == 2
    sampler = DeviceSampler("inst", ListRecorder(), torch_device="cuda:1")
    assert "UUID GPU-cccc3333-0000 from torch" in sampler.describe()
    sampler.stop()


def test_fallback_says_which_device_was_not_visible(nvml):
    nvml.setenv("CUDA_VISIBLE_DEVICES", "1")
    sampler = DeviceSampler("inst", ListRecorder(), torch_device="cuda:1")
    assert sampler.kind == "cpu" and "not among the 1 device(s)" in sampler.describe()
    sampler.stop()


def test_visible_devices_reads_like_cuda():
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,GPU-ab,x,1"}) == ["0", "GPU-ab"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []
