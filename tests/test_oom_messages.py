"""``is_oom`` on the ways a GPU says it ran out of memory: the caching allocator's
``torch.OutOfMemoryError``, and the CUDA libraries' allocation failures, which reach
Python as plain RuntimeErrors (or ``torch.AcceleratorError``) with a status in the
text. An unrecognised one would be a model error (500, error isolation) instead of an
OOM (507, split and retry, effective max batch size lowered)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.api.config import BatchingConfig
from runtime.core.clock import MonotonicClock
from runtime.device.executor import run_batch
from runtime.device.oom import is_oom
from runtime.models.toys import DoubleModel

OOMS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                           "total capacity of 139.80 GiB of which 1.12 GiB is free."),
    torch.cuda.OutOfMemoryError("CUDA out of memory."),
    torch.OutOfMemoryError(""),
    torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    torch.AcceleratorError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                           "`cublasLtMatmul( ltHandle, computeDesc.descriptor(), ...)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you "
                 "passed in a non-contiguous input."),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling "
                 "`cusolverDnCreate(handle)`"),
    RuntimeError("CUDA error: CUSPARSE_STATUS_ALLOC_FAILED when calling `cusparseCreate(handle)`"),
]

NOT_OOMS = [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"),
    ValueError("CUBLAS_STATUS_ALLOC_FAILED"),          # not from torch: the model's own text
]


@pytest.mark.parametrize("exc", OOMS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_every_way_of_running_out_of_memory_is_an_oom(exc):
    assert is_oom(exc)


@pytest.mark.parametrize("exc", NOT_OOMS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_other_errors_are_not(exc):
    assert not is_oom(exc)


def raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def test_an_error_raised_while_handling_an_oom_is_one():
    """Ending a CUDA-graph capture that an OOM interrupted fails in its turn: that error
    is what reaches the caller, with the OOM as its context."""
    def capture():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    exc = raised(capture)
    assert "previous error" in str(exc) and is_oom(exc)

    def wrapped():
        try:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
        except RuntimeError as inner:
            raise ValueError("the model gave up") from inner

    assert is_oom(raised(wrapped))

    def replaced():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError:
            raise ValueError("bad input") from None     # the model says it is something else

    assert not is_oom(raised(replaced))


def test_a_cublas_allocation_failure_is_booked_as_an_oom_and_split():
    class Cublas(DoubleModel):
        def predict(self, batch):
            if batch.shape[0] > 2:
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                   "`cublasCreate(handle)`")
            return super().predict(batch)

    items = [np.full(4, float(i), np.float32) for i in range(4)]
    attempts = run_batch(Cublas(), items, None, None, None, BatchingConfig(), False,
                         torch.device("cpu"), MonotonicClock())
    assert [(a.size, a.outcome, a.split) for a in attempts] == [
        (4, "oom", True), (2, "ok", False), (2, "ok", False)]
