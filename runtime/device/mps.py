"""Whether this process shares its GPU through CUDA MPS (the Multi-Process Service).

Under MPS several processes run kernels on one GPU at the same time instead of taking
turns by time slice. That is how several BatchScope instances (or one with small
models) fill a large GPU, and the active-thread percentage caps the SMs each client may
use. A client finds the daemon through its pipe directory: ``CUDA_MPS_PIPE_DIRECTORY``,
``/tmp/nvidia-mps`` by default, holds the daemon's ``control`` socket. The percentage
is the client's own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` when set, else the daemon's
default (``get_default_active_thread_percentage`` through ``nvidia-cuda-mps-control``).

``detect()`` says which (None: no daemon). ``describe(device)`` adds it to the device
string an instance registers with (``cuda:0 · MPS 50% threads``), which the Fleet and
Live pages show. Recipe: docs/gpu.md.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
CONTROL = "nvidia-cuda-mps-control"
#: how long asking the daemon may take
QUERY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class MpsInfo:
    pipe_directory: str
    #: the share of the GPU's SMs this client may use, percent (None: not known)
    active_thread_percentage: float | None
    #: where the percentage came from: env | daemon | None
    source: str | None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _number(text: str) -> float | None:
    try:
        value = float(text.strip().split()[-1])
    except (ValueError, IndexError):
        return None
    return value if 0 < value <= 100 else None


def detect(env: Mapping[str, str] | None = None,
           run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> MpsInfo | None:
    """The MPS daemon this process would use, or None when there is none."""
    env = os.environ if env is None else env
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
    if not _is_socket(os.path.join(pipe, "control")):
        return None
    own = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if own is not None and _number(own) is not None:
        return MpsInfo(pipe, _number(own), "env")
    tool = shutil.which(CONTROL, path=env.get("PATH"))
    if tool is not None:
        try:
            done = run([tool], input="get_default_active_thread_percentage\n",
                       capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
                       env={**env, "CUDA_MPS_PIPE_DIRECTORY": pipe})
            value = _number(done.stdout) if done.returncode == 0 else None
            if value is not None:
                return MpsInfo(pipe, value, "daemon")
        except (OSError, subprocess.SubprocessError):
            pass
    return MpsInfo(pipe, None, None)


def describe(device: str, info: MpsInfo | None) -> str:
    """``device`` with its MPS sharing, as an instance registers it."""
    if info is None or not str(device).startswith("cuda"):
        return str(device)
    share = (f" {info.active_thread_percentage:g}% threads"
             if info.active_thread_percentage is not None else "")
    return f"{device} · MPS{share}"
