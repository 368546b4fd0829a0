"""Storage faults under load: serving goes on, the loss is counted, recording comes back.

    sudo python -m benchmarks.reliability.storage_faults [--rate 1500] [--fault-s 10]

Needs root (it mounts a tmpfs and changes file attributes). For each fault, on a fresh
size-limited tmpfs holding the SQLite database, ``batchscope serve`` (defaults: the
writer process and the device process on) takes open-loop load on ``mlp`` from
``batchscope load``; after ``--warm-s`` the fault is made, ``--fault-s`` later it is
undone:

* ``full``: the tmpfs filled to its last byte (``ENOSPC``; SQLite's mapped WAL index
  can no longer be backed);
* ``immutable``: ``chattr +i`` on the database, its ``-wal`` and its ``-shm``;
* ``readonly``: the folder holding them made read-only (``chattr +i`` on it: root is
  not stopped by permission bits, and the kernel refuses ``mount -o remount,ro`` while
  files are open for writing, as they are here).

Printed per fault: answers by status (every one must be 200), whether the server lived
through it, the request rows missing from the database against the request rows the
recorder says it dropped (its ``recorder_drops`` event, written once storage returns),
and how long after the fault was undone rows were recorded again at the offered rate
(per 0.5 s of arrival time, at least 90 % of the requests that arrived).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.reliability.server import ROOT, Server

FAULTS = ("full", "immutable", "readonly")
BUCKET_S = 0.5


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def make_fault(kind: str, mount: Path, db: Path) -> None:
    if kind == "full":
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for size in (1 << 20, 4096, 1):  # to the last byte
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError:
                    pass
        finally:
            os.close(fd)
    elif kind == "immutable":
        _run("chattr", "+i", *[str(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))
                               if p.exists()])
    else:
        _run("chattr", "+i", str(mount))


def undo_fault(kind: str, mount: Path, db: Path) -> None:
    if kind == "full":
        os.remove(mount / "filler")
    elif kind == "immutable":
        _run("chattr", "-i", *[str(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))
                               if p.exists()])
    else:
        _run("chattr", "-i", str(mount))


def recorded(db: Path) -> tuple[list[float], dict]:
    """Arrival times of the recorded requests, and the recorder's last drop report."""
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        arrivals = [r[0] for r in conn.execute("SELECT arrived_at FROM requests")]
        row = conn.execute("SELECT details_json FROM events WHERE kind = 'recorder_drops' "
                           "ORDER BY at DESC LIMIT 1").fetchone()
    finally:
        conn.close()
    return arrivals, (json.loads(row[0]) if row and row[0] else {})


def recovery_s(arrivals: list[float], warm: tuple[float, float], fixed_at: float,
               end: float) -> float | None:
    """Seconds after ``fixed_at`` from which every ``BUCKET_S`` of arrival time holds at
    least 3/4 of the median count of the warm-up's buckets (``warm``: its span); None
    when that never happens before ``end``."""
    def counts(start: float, stop: float) -> list[int]:
        n = max(0, int((stop - start) / BUCKET_S))
        out = [0] * n
        for t in arrivals:
            k = int((t - start) / BUCKET_S)
            if start <= t and k < n:
                out[k] += 1
        return out

    before = sorted(counts(*warm))
    if not before:
        return None
    need = 0.75 * before[len(before) // 2]
    good_from = None
    for k, count in enumerate(counts(fixed_at, end)):
        if count >= need:
            if good_from is None:
                good_from = k
        else:
            good_from = None
    return None if good_from is None else good_from * BUCKET_S


def run_fault(kind: str, args: argparse.Namespace) -> dict:
    # a tmpfs can be filled; attributes are checked on an ordinary filesystem (tmpfs
    # keeps writes through files already open going past chattr +i)
    mount = Path(tempfile.mkdtemp(prefix="batchscope-storage-"))
    if kind == "full":
        _run("mount", "-t", "tmpfs", "-o", f"size={args.tmpfs_mb}m", "tmpfs", str(mount))
    db = mount / "bs.db"
    server = None
    try:
        server = Server([sys.executable, "-m", "runtime", "serve", "--port", "0",
                         "--db", f"sqlite:///{db}", "--model", "mlp"])
        total_s = args.warm_s + args.fault_s + args.after_s
        load = subprocess.Popen([sys.executable, "-m", "runtime", "load", "--url", server.url,
                                 "--model", "mlp", "--rate", str(args.rate), "--duration-s",
                                 str(total_s), "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True)
        load_at = time.time()
        time.sleep(args.warm_s)
        faulted_at = time.time()
        make_fault(kind, mount, db)
        time.sleep(args.fault_s)
        undo_fault(kind, mount, db)
        fixed_at = time.time()
        out, _ = load.communicate(timeout=total_s + 60)
        report = json.loads(out.strip().splitlines()[-1])
        alive = server.proc.poll() is None
        server.stop()
        arrivals, drops = recorded(db)
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop()
        if kind == "full":
            subprocess.run(["umount", str(mount)], check=False)
        log_tail = "".join(server.tail[-6:]) if server is not None else ""
        shutil.rmtree(mount, ignore_errors=True)
    missing = report["ok"] - len(arrivals)
    # the load's last full half second: its arrivals stop at its duration
    end = min(fixed_at + args.after_s - BUCKET_S, max(arrivals, default=fixed_at))
    by_kind = drops.get("by_kind", {})
    return {
        "fault": kind, "sent": report["sent"], "ok": report["ok"],
        "errors_by_status": report["errors_by_status"], "server_alive": alive,
        "request_rows": len(arrivals), "request_rows_missing": missing,
        "request_rows_reported_dropped": by_kind.get("requests", 0),
        "rows_reported_dropped": drops.get("dropped_total", 0),
        "recording_back_after_s": recovery_s(arrivals, (load_at + 1.0, faulted_at), fixed_at,
                                             end),
        "fault_s": round(fixed_at - faulted_at, 1),
        "log_tail": log_tail,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1500.0)
    p.add_argument("--fault-s", type=float, default=10.0)
    p.add_argument("--warm-s", type=float, default=5.0)
    p.add_argument("--after-s", type=float, default=8.0)
    p.add_argument("--tmpfs-mb", type=int, default=256)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("storage_faults needs root (it mounts a tmpfs and runs chattr)", file=sys.stderr)
        return 2
    results = [run_fault(kind, args) for kind in args.faults.split(",")]
    ok = all(r["ok"] == r["sent"] and r["server_alive"]
             and r["request_rows_missing"] == r["request_rows_reported_dropped"]
             and r["recording_back_after_s"] is not None and r["recording_back_after_s"] <= 2.0
             for r in results)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(" ".join(f"{k}={v}" for k, v in r.items() if k != "log_tail"))
            print("  server log:", r["log_tail"].strip().replace("\n", "\n  "))
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
