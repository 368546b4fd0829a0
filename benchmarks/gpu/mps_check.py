"""The ``mps`` section of ``benchmarks.gpu_full``: two servers sharing the GPU under CUDA MPS.

When the machine runs an MPS daemon already, the servers use it. When it has none but
has ``nvidia-cuda-mps-control``, the section starts a private daemon: its pipe and log
folders are under the output folder, so only processes given that pipe folder reach it;
the device's settings (compute mode, MIG) are not touched, and the daemon is told to quit
at the end of the section, whatever happened. Two ``batchscope serve --device cuda``
instances then run at once with 30 % and 70 % of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). The claim holds when each registers its share in
its database (``cuda:0 · MPS 30% threads``), both answer under load, and the daemon lists
both servers' processes as clients of its MPS server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.harness import Context
from benchmarks.gpu.served import Server, _errors, _rows, drive

SHARES = (30, 70)


def _control(tool: str, env: dict[str, str], command: str, timeout_s: float) -> str:
    """One command to the daemon; its answer (empty when it did not answer)."""
    try:
        done = subprocess.run([tool], input=f"{command}\n", capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _tail(folder: Path, n: int = 400) -> str:
    parts = []
    for name in ("control.log", "server.log"):
        path = folder / name
        if path.exists():
            parts.append(f"{name}: {path.read_text(errors='replace')[-n:]}")
    return " | ".join(parts)


@contextlib.contextmanager
def private_daemon(ctx: Context, tool: str):
    """An MPS control daemon of this section's own; yields its environment variables."""
    pipe, logs = ctx.out_dir / "mps-pipe", ctx.out_dir / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    started = subprocess.run([tool, "-d"], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=ctx.seconds(15))
    if started.returncode != 0:
        raise RuntimeError(f"{tool} -d exit {started.returncode}: {started.stderr[-300:]}")
    try:
        deadline = time.monotonic() + 10.0
        while not (pipe / "control").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon made no control socket in 10 s; {_tail(logs)}")
            time.sleep(0.1)
        yield env
    finally:
        _control(tool, env, "quit", 15.0)


def mps(ctx: Context) -> dict[str, Any]:
    from runtime.device import mps as mps_info

    tool = shutil.which(mps_info.CONTROL)
    out: dict[str, Any] = {"control": tool, "daemon_found": mps_info.detect() is not None}
    if not out["daemon_found"] and tool is None:
        ctx.claim("mps.detected", None, "no MPS daemon and no nvidia-cuda-mps-control on "
                                        "this machine (start one: docs/gpu.md)")
        return out
    daemon = contextlib.nullcontext({}) if out["daemon_found"] else private_daemon(ctx, tool)
    try:
        with daemon as env:
            out.update(two_servers(ctx, env, tool))
    except RuntimeError as exc:  # the daemon or a server under it did not start
        logs = ctx.out_dir / "mps-log"
        ctx.claim("mps.detected", None, f"MPS could not be used here: {exc} {_tail(logs)}"[:900])
        out["error"] = str(exc)[:900]
        return out
    rows = out["servers"]
    ok = all(r["registered"] == f"{ctx.device} · MPS {r['share']}% threads" and r["ok"] > 0
             and r["errors"] == 0 for r in rows) and out["clients_listed"] is not False
    ctx.claim("mps.detected", ok, "; ".join(
        f"{r['registered']!r}: {r['throughput_rps']:.0f} req/s, errors {r['errors']}" for r in rows)
        + f"; MPS server clients {out['clients']} (servers {out['server_pids']})")
    return out


def two_servers(ctx: Context, env: dict[str, str], tool: str | None) -> dict[str, Any]:
    """Both servers up at once, each driven in turn; what the daemon lists meanwhile."""
    with contextlib.ExitStack() as stack:
        servers = []
        for share in SHARES:
            db_url = f"sqlite:///{ctx.out_dir / f'mps-{share}.db'}"
            srv = stack.enter_context(Server(
                ctx, "--device", ctx.device, "--model", "mlp", "--db", db_url,
                "--instance-id", f"mps-{share}",
                env={**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)}))
            servers.append((share, db_url, srv))
        reports = [drive(srv.url, "mlp", seconds=ctx.seconds(3.0, 20), connections=16)
                   for _, _, srv in servers]
        server_pids = _control(tool, env, "get_server_list", 5.0).split() if tool else []
        clients = sorted({c for pid in server_pids
                          for c in _control(tool, env, f"get_client_list {pid}", 5.0).split()})
        pids = [str(srv.proc.pid) for _, _, srv in servers]
    rows = []
    for (share, db_url, _), report in zip(servers, reports):
        registered = _rows(db_url, "SELECT device FROM runtime_instances")
        rows.append({"share": share, "registered": registered[0][0] if registered else None,
                     "ok": report.get("ok", 0), "errors": _errors(report),
                     "throughput_rps": report.get("throughput_rps", 0.0)})
    return {"servers": rows, "server_pids": server_pids, "clients": clients,
            # without the control tool (a daemon the machine runs) the clients go unlisted
            "clients_listed": all(p in clients for p in pids) if tool else None}
