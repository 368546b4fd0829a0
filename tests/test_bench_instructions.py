"""``benchmarks.bench_tracing_instructions``: the instruction totals it reads from
callgrind's dumps are the ones Valgrind's own ``callgrind_annotate`` reports, and a
program counted twice gives the same total (what the benchmark's resolution rests on)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from benchmarks.bench_tracing_instructions import _total

pytestmark = pytest.mark.skipif(shutil.which("valgrind") is None,
                                reason="valgrind is not installed (apt-get install valgrind)")


def counted(out) -> int:
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    "/bin/true"], check=True, capture_output=True, timeout=120)
    return _total(str(out))


def test_the_total_is_callgrinds_own_and_repeats(tmp_path):
    first, second = counted(tmp_path / "a"), counted(tmp_path / "b")
    shown = subprocess.run(["callgrind_annotate", str(tmp_path / "a")], check=True,
                           capture_output=True, text=True, timeout=120).stdout
    program = re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", shown)
    assert program and int(program.group(1).replace(",", "")) == first > 0
    assert second == first


def test_a_file_without_a_total_is_refused(tmp_path):
    (tmp_path / "empty").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no instruction total"):
        _total(str(tmp_path / "empty"))
