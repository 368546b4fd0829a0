"""Read back the NVTX ranges a process sends, without Nsight Systems.

``nvtx_tool.c`` is a minimal NVTX tool (see its header): built as a shared library and
named in ``NVTX_INJECTION64_PATH``, it appends every domain range a process pushes and
pops to the file in ``BATCHSCOPE_NVTX_CAPTURE``. Nsight Systems attaches to NVTX the same
way, so what this reads is what a profiler gets: the domain, the message, the payload.

    lib = build(tmp_dir)                      # None without a C compiler
    env = capture_env(lib, tmp_dir / "ranges.tsv")
    ... run a process with env, BATCHSCOPE_NVTX=1 ...
    ranges = read_ranges(tmp_dir / "ranges.tsv")
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("nvtx_tool.c")


@dataclass(frozen=True, slots=True)
class Range:
    pid: int
    tid: int
    domain: str
    message: str
    #: NVTX's payload type (1 uint64, 2 int64, 4 uint32, 5 int32; 0 none) and value
    payload_type: int
    payload: int
    #: whether a pop on the same thread closed it
    closed: bool


def build(out_dir: Path, compiler: str | None = None) -> Path | None:
    """``libnvtx_tool.so`` built in ``out_dir``; None when no C compiler is found."""
    cc = compiler or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib = Path(out_dir) / "libnvtx_tool.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(SOURCE)], check=True,
                   capture_output=True, timeout=120)
    return lib


def capture_env(lib: Path, capture: Path) -> dict[str, str]:
    """The environment variables that attach the tool to a process (and its children)."""
    return {"NVTX_INJECTION64_PATH": str(lib), "BATCHSCOPE_NVTX_CAPTURE": str(capture)}


def read_ranges(capture: Path) -> list[Range]:
    """The ranges in ``capture`` in the order they were pushed, each paired with the pop
    on its thread (ranges nest per thread and domain)."""
    if not Path(capture).exists():
        return []
    ranges: list[dict] = []
    open_ranges: dict[tuple[int, int, str], list[int]] = {}
    for line in Path(capture).read_text().splitlines():
        parts = line.split("\t")
        if parts[0] == "push" and len(parts) == 7:
            pid, tid, domain = int(parts[1]), int(parts[2]), parts[3]
            open_ranges.setdefault((pid, tid, domain), []).append(len(ranges))
            ranges.append({"pid": pid, "tid": tid, "domain": domain, "message": parts[4],
                           "payload_type": int(parts[5]), "payload": int(parts[6]),
                           "closed": False})
        elif parts[0] == "pop" and len(parts) == 4:
            stack = open_ranges.get((int(parts[1]), int(parts[2]), parts[3]))
            if stack:
                ranges[stack.pop()]["closed"] = True
    return [Range(**r) for r in ranges]
