"""Memory figures for the device a model runs on (CUDA allocator, or the process on CPU).

A batch's peak is read two ways: the device's absolute peak (``peak_bytes``: weights, KV
cache and everything else allocated included) and the batch's own increase over what was
allocated when it started (``reset_peak`` returns that baseline, ``peak_increase``).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def reset_peak(device: Any) -> int | None:
    """Start measuring a batch: reset the allocator's peak and return the bytes allocated
    now (the weights, caches and tensors the batch finds there), the baseline of its
    ``peak_increase``. None on CPU."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    return None


def peak_bytes(device: Any) -> int | None:
    """Peak allocated bytes since the last ``reset_peak`` (CUDA only; None on CPU)."""
    if _is_cuda(device):
        return int(torch.cuda.max_memory_allocated(device))
    return None


def peak_increase(peak: int | None, baseline: int | None) -> int | None:
    """What a batch allocated at its peak above the ``baseline`` it started from (its own
    memory need, unlike the device's absolute peak); None when either is unknown."""
    if peak is None or baseline is None:
        return None
    return max(peak - baseline, 0)


def figures(device: Any) -> dict[str, int | None]:
    """allocated / reserved / peak bytes and, on CPU, the process' resident size."""
    if _is_cuda(device):
        return {
            "allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "reserved_bytes": int(torch.cuda.memory_reserved(device)),
            "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
        }
    return {"allocated_bytes": None, "reserved_bytes": None, "peak_bytes": None,
            "rss_bytes": process_rss_bytes()}


def allocator_summary(device: Any) -> str | None:
    if _is_cuda(device):
        return torch.cuda.memory_summary(device, abbreviated=True)
    return None


def free_cached(device: Any) -> None:
    if _is_cuda(device):
        torch.cuda.empty_cache()


def process_rss_bytes() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
