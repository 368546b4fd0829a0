"""What a change costs or saves: two builds of this repository side by side, same settings.

    python -m benchmarks.bench_builds --base 4dd04f0 --mode otel_1_in_100 --rounds 14 --slice-s 4
    python -m benchmarks.bench_builds --base ../other-checkout --mode off

Checks ``--base`` (a commit, or a directory holding another checkout of this repository)
out into a temporary git worktree, starts ``batchscope serve --model mlp`` from it and
from this checkout, each with its own SQLite database and both sending spans to one OTLP
receiver (``benchmarks.bench_tracing.Receiver``), puts both in the trace mode ``--mode``
(``benchmarks.bench_tracing.MODES``), and drives them in turn, a window of ``--slice-s``
seconds each with ``--clients`` closed-loop clients, the order turned every round. Both
servers run throughout: no restart and no settings change falls between the windows
compared, and the machine's drift cancels within a round. Prints each round's figures,
this build against the base paired round by round (throughput and p99, with bootstrap
95 % intervals, ``benchmarks.intervals``), and each build's CPU a request by part
(``benchmarks.cpu_share``).

Where ``bench_tracing`` compares settings on one build, this compares builds under one
setting (``drive``, two servers served in turn, is what ``bench_tracing --side-by-side``
uses for two settings on one build): a change whose cost hides in waiting (a thread that takes the interpreter lock
from the event loop, say) shows here even when instructions counted alone miss it.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from batchscope.load.loadgen import run_load  # noqa: E402
from benchmarks.bench_tracing import MODES, Receiver  # noqa: E402
from benchmarks.cpu_share import CpuShare  # noqa: E402
from benchmarks.intervals import Interval, paired_ratio  # noqa: E402
from benchmarks.reliability.server import Server  # noqa: E402

#: the two builds, in the order the first round serves them
BUILDS = ("base", "this")


@contextlib.contextmanager
def checkout(base: str) -> Iterator[Path]:
    """The root of the ``base`` build: a directory as it is, else a detached git worktree
    of the commit ``base`` names, removed afterwards."""
    given = Path(base).expanduser()
    if given.is_dir():
        if not (given / "runtime" / "__main__.py").is_file():
            raise SystemExit(f"{given} holds no checkout of this repository (no runtime/__main__.py)")
        yield given.resolve()
        return
    if shutil.which("git") is None:
        raise SystemExit("git is not installed: give --base a directory holding the other build")
    where = Path(tempfile.mkdtemp(prefix="batchscope-base-")) / "tree"
    made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), base],
                          capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(f"cannot check {base!r} out: {made.stderr.strip() or made.stdout.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       capture_output=True)
        shutil.rmtree(where.parent, ignore_errors=True)


def drive(servers: dict[str, tuple[Path, str]], rounds: int, slice_s: float, clients: int,
          model: str = "mlp", warm_s: float = 2.0, say=print,
          receiver: Receiver | None = None) -> dict[str, list[dict[str, Any]]]:
    """Serve ``model`` from two servers at once, each named by its key and started from
    its build root in its trace mode (``servers``: name -> (root, mode)), both sending
    spans to ``receiver`` (one of its own when None); ``rounds`` rounds of one
    ``slice_s`` window each, the order turned every round. Returns each server's
    windows: req/s, p99 ms, CPU microseconds a request by part."""
    import httpx

    if len(servers) != 2 or rounds < 1 or slice_s <= 0:
        raise ValueError("two servers, rounds at least 1 and slice_s above 0")
    names = list(servers)
    windows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    running: dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        if receiver is None:
            receiver = stack.enter_context(Receiver())
        try:
            for name, (root, mode) in servers.items():
                db = Path(tempfile.mkdtemp(prefix="batchscope-side-")) / "run.db"
                running[name] = Server([sys.executable, "-m", "runtime", "serve", "--model",
                                        model, "--port", "0", "--db", f"sqlite:///{db}",
                                        "--otlp-traces-endpoint", receiver.endpoint],
                                       cwd=root)
            for name, srv in running.items():
                mode = servers[name][1]
                got = httpx.post(f"{srv.url}/v2/trace/setting", json=MODES[mode], timeout=30)
                if got.status_code != 200:
                    raise RuntimeError(f"server {name} refused mode {mode}: {got.text}")
                run_load(srv.url, model, concurrency=clients, duration_s=warm_s)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    srv = running[name]
                    with CpuShare(srv.proc.pid) as cpu:
                        rep = run_load(srv.url, model, concurrency=clients, duration_s=slice_s)
                    windows[name].append({"rps": rep.throughput_rps,
                                          "p99_ms": rep.latency_p99_ms or 0.0,
                                          "cpu_us": cpu.summary(rep.ok)["cpu_us_per_request"]})
                say(f"round {r + 1:2d}  " + "  ".join(
                    f"{n} {windows[n][-1]['rps']:8.0f}" for n in names) + " req/s")
        finally:
            for srv in running.values():
                srv.stop()
    return windows


def paired(windows: dict[str, list[dict[str, Any]]]) -> dict[str, Interval]:
    """The second server's windows against the first's, round by round: throughput and
    p99 as ``Interval``s."""
    first, second = (windows[n] for n in windows)
    return {figure: paired_ratio([w[key] for w in first], [w[key] for w in second])
            for figure, key in (("rps", "rps"), ("p99", "p99_ms"))}


def medians(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's median req/s, p99 and CPU a request by part over its windows."""
    return {"rps": statistics.median(w["rps"] for w in windows),
            "p99_ms": statistics.median(w["p99_ms"] for w in windows),
            "cpu_us": {part: statistics.median(w["cpu_us"][part] for w in windows)
                       for part in windows[0]["cpu_us"]}}


def compare(roots: dict[str, Path], mode: str, rounds: int, slice_s: float, clients: int,
            model: str = "mlp", warm_s: float = 2.0, say=print) -> dict[str, Any]:
    """``drive`` of the two builds of ``roots`` (keys ``BUILDS``) in one ``mode``.
    Returns each build's windows, ``this`` against ``base`` paired round by round
    (``rps``, ``p99``: an ``Interval``), and each build's medians."""
    windows = drive({b: (roots[b], mode) for b in BUILDS}, rounds, slice_s, clients, model,
                    warm_s, say)
    return {"mode": mode, "model": model, "clients": clients, "rounds": rounds,
            "slice_s": slice_s, "windows": windows, "paired": paired(windows),
            "medians": {b: medians(windows[b]) for b in BUILDS}}


def report(got: dict[str, Any], base: str) -> str:
    """The comparison as printed."""
    parts = list(got["medians"]["base"]["cpu_us"])
    lines = [f"\n{got['model']}, {got['clients']} clients, mode {got['mode']}, "
             f"{got['rounds']} rounds of {got['slice_s']:g} s per build (this checkout "
             f"against {base})",
             f"this / base, paired: req/s {got['paired']['rps'].text()}, "
             f"p99 {got['paired']['p99'].text()}",
             f"{'build':6s} {'req/s':>8s} {'p99 ms':>8s}  CPU a request (µs): "
             + ", ".join(parts)]
    for b in BUILDS:
        m = got["medians"][b]
        lines.append(f"{b:6s} {m['rps']:8.0f} {m['p99_ms']:8.2f}  "
                     + ", ".join(f"{m['cpu_us'][p]:.1f}" for p in parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True,
                    help="a commit of this repository, or a directory holding another checkout")
    ap.add_argument("--mode", default="off", choices=sorted(MODES))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--slice-s", type=float, default=4.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--model", default="mlp")
    args = ap.parse_args(argv)
    with checkout(args.base) as root:
        got = compare({"base": root, "this": ROOT}, args.mode, args.rounds, args.slice_s,
                      args.clients, args.model)
    print(report(got, args.base), flush=True)


if __name__ == "__main__":
    main()
