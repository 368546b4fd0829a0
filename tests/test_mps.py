"""CUDA MPS detection against a fake daemon: its control socket in a pipe directory, and
an ``nvidia-cuda-mps-control`` on PATH that answers the thread percentage."""

from __future__ import annotations

import os
import socket

from runtime.device import mps


def fake_daemon(tmp_path, percentage: str | None = "50.0"):
    pipe = tmp_path / "mps"
    pipe.mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(pipe / "control"))
    tools = tmp_path / "bin"
    tools.mkdir()
    if percentage is not None:
        tool = tools / mps.CONTROL
        tool.write_text(f"#!/bin/sh\nread cmd\n[ \"$cmd\" = get_default_active_thread_percentage ] "
                        f"&& echo {percentage}\n")
        tool.chmod(0o755)
    return sock, {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "PATH": str(tools)}


def test_no_daemon_no_mps(tmp_path):
    assert mps.detect({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "PATH": ""}) is None
    (tmp_path / "control").write_text("a file, not a socket")
    assert mps.detect({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "PATH": ""}) is None
    assert mps.describe("cuda:0", None) == "cuda:0"


def test_the_daemon_and_its_default_thread_share_are_found(tmp_path):
    sock, env = fake_daemon(tmp_path)
    try:
        info = mps.detect(env)
        assert info == mps.MpsInfo(env["CUDA_MPS_PIPE_DIRECTORY"], 50.0, "daemon")
        assert mps.describe("cuda:0", info) == "cuda:0 · MPS 50% threads"
        assert mps.describe("cpu", info) == "cpu"
        own = mps.detect({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})
        assert own.active_thread_percentage == 25.0 and own.source == "env"
    finally:
        sock.close()


def test_a_daemon_without_its_control_tool_is_still_mps(tmp_path):
    sock, env = fake_daemon(tmp_path, percentage=None)
    try:
        info = mps.detect(env)
        assert info is not None and info.active_thread_percentage is None
        assert mps.describe("cuda:1", info) == "cuda:1 · MPS"
        assert os.path.exists(os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control"))
    finally:
        sock.close()
