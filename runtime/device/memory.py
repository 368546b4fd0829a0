"""Memory figures for the device a model runs on (CUDA allocator, or the process on CPU)."""

from __future__ import annotations

import os
from typing import Any

import torch


def _is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def reset_peak(device: Any) -> None:
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: Any) -> int | None:
    """Peak allocated bytes since the last ``reset_peak`` (CUDA only; None on CPU)."""
    if _is_cuda(device):
        return int(torch.cuda.max_memory_allocated(device))
    return None


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
