"""Opening a large snapshot: wall time and peak memory of ``load_snapshot``.

``python -m benchmarks.reliability.snapshot_import`` writes synthetic traffic (one
healthy model, about 1.7 million requests for the default 60 MB) into a temporary
database, exports it as a snapshot, then opens the snapshot in a fresh child process
and reports how long that took and the child's peak resident memory (its ``VmHWM``, with the same
figure for a child that only imports BatchScope, for reference). Nothing is served;
no network is used. A run takes about a minute or two on a 2-core box, most of it
writing the file.

``--impl path/to/checkout`` opens it with another checkout's snapshot package, and
``--impl path/to/snapshot.py`` with a single-file snapshot module (an older checkout's,
from before it became a package), to compare; ``--file`` reuses a snapshot made before,
``--keep`` keeps the one made.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
END = 2_000_000_000.0
#: seconds of synthetic healthy traffic per MB of snapshot (measured: ~35 MB per 3000 s)
SECONDS_PER_MB = 86.0
#: the longest one load may take before the run is called off
CHILD_TIMEOUT_S = 300.0

CHILD = r"""
import importlib.util, json, os, sys, time
root, impl, path = sys.argv[1:4]
if impl != "-" and os.path.isdir(impl):  # another checkout: its batchscope, not this one's
    root, impl = impl, "-"
sys.path.insert(0, root)
if impl == "-":
    from batchscope.presentation import snapshot
else:
    spec = importlib.util.spec_from_file_location("snapshot_under_test", impl)
    snapshot = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = snapshot
    spec.loader.exec_module(snapshot)

def peak_rss_mb():  # this process's high-water mark since exec (ru_maxrss would include
    with open("/proc/self/status") as fh:  # the parent's memory, inherited through fork)
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

if path == "-":
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))
    raise SystemExit
t0 = time.perf_counter()
snap = snapshot.load_snapshot(path)
wall = time.perf_counter() - t0
with snap.engine.connect() as conn:
    n = conn.exec_driver_sql("SELECT COUNT(*) FROM requests").scalar()
snap.close()
print(json.dumps({"wall_s": wall, "requests": n, "peak_rss_mb": peak_rss_mb()}))
"""


def make_snapshot(path: Path, target_mb: float) -> dict:
    from batchscope.analysis.queries import Window
    from batchscope.presentation import snapshot
    from batchscope.storage.db import make_engine
    from batchscope.testing import synthetic

    duration = target_mb * SECONDS_PER_MB
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-") as tmp:
        engine = make_engine(f"sqlite:///{tmp}/source.db")
        t0 = time.perf_counter()
        synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(
            duration_s=duration, batches_per_s=20), end_s=END)
        t1 = time.perf_counter()
        manifest = snapshot.export_snapshot(engine, Window(END - duration, END + 1, None), path)
        t2 = time.perf_counter()
        engine.dispose()
    print(f"made {path}: {path.stat().st_size / 1e6:.1f} MB, "
          f"{manifest['tables']['requests']['rows']} requests, "
          f"{manifest['tables']['batches']['rows']} batches "
          f"(generated in {t1 - t0:.1f} s, exported in {t2 - t1:.1f} s)")
    return manifest


def measure(impl: str, path: str) -> dict:
    """Run the loading child; what it printed (wall time, rows, its peak RSS in MB)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), impl, path],
                          stdout=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"the loading child failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=60.0, help="snapshot size to make (MB)")
    parser.add_argument("--file", type=Path, help="open this snapshot instead of making one")
    parser.add_argument("--keep", type=Path, help="keep the snapshot made here")
    parser.add_argument("--impl", default="-",
                        help="a checkout, or a single-file snapshot.py, to open it with")
    parser.add_argument("--runs", type=int, default=1, help="loads to time (default 1)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    tmp = tempfile.TemporaryDirectory(prefix="bench-snapshot-")
    try:
        path = args.file or args.keep or Path(tmp.name) / "snapshot.zip"
        if args.file is None:
            make_snapshot(path, args.mb)
        size_mb = path.stat().st_size / 1e6
        base = measure(args.impl, "-")
        print(f"import only: peak RSS {base['peak_rss_mb']:.0f} MB")
        for run in range(max(1, args.runs)):
            r = measure(args.impl, str(path))
            print(f"open {size_mb:.1f} MB snapshot ({r['requests']} requests): "
                  f"{r['wall_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"({r['peak_rss_mb'] - base['peak_rss_mb']:.0f} MB over import)")
    finally:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
