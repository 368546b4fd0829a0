"""The README's code blocks do what the README says.

Python blocks run for real: the model class is served by a real engine, and the
``tritonclient`` example runs against a real server on an ephemeral 127.0.0.1 port.
Every ``batchscope ...`` command line in a shell block must parse with the real
command-line parser (they are not run: they serve forever or need a database server).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from runtime.api.config import ServerConfig
from runtime.api.model import check_model
from runtime.engine import Engine
from runtime.models.loader import load_model
from runtime.server.service import Service, ServiceThread
from runtime.tools.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)


def blocks(lang: str) -> list[str]:
    found = []
    for indent, kind, body in FENCE.findall(README.read_text()):
        if kind == lang:
            found.append("\n".join(line[len(indent):] for line in body.splitlines()))
    return found


def block_with(lang: str, needle: str) -> str:
    matches = [b for b in blocks(lang) if needle in b]
    assert len(matches) == 1, f"expected one {lang} block with {needle!r} in the README"
    return matches[0]


def test_the_model_example_serves_requests():
    namespace: dict = {}
    exec(compile(block_with("python", "class Doubler"), "README:Doubler", "exec"), namespace)
    model = namespace["Doubler"]()
    check_model(model)

    async def run() -> dict:
        engine = Engine({"doubler": model})
        await engine.start()
        try:
            return await engine.infer("doubler", {"INPUT0": np.arange(4, dtype=np.float32)})
        finally:
            await engine.stop()

    out = asyncio.run(run())
    np.testing.assert_array_equal(out["OUTPUT0"], np.arange(4, dtype=np.float32) * 2)


@pytest.mark.slow
def test_the_tritonclient_example_runs_against_a_real_server(tmp_path):
    code = block_with("python", "tritonclient.http")
    service = Service({"mlp": load_model("mlp")}, {},
                      ServerConfig(database_url=f"sqlite:///{tmp_path / 'bs.db'}"),
                      instance_id="readme")
    runner = ServiceThread(service)
    url = runner.start()
    try:
        code = code.replace("127.0.0.1:8000", url.removeprefix("http://"))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README:tritonclient", "exec"), {})
    finally:
        runner.stop()
    assert printed.getvalue().strip().startswith("[["), printed.getvalue()


def command_lines() -> list[str]:
    lines = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("batchscope "):
                lines.append(line)
    return lines


def test_the_readme_shows_commands():
    assert len(command_lines()) >= 5


@pytest.mark.parametrize("line", command_lines())
def test_every_batchscope_command_line_parses(line):
    argv = shlex.split(line)[1:]
    if argv[0] == "snapshot":  # has its own parser, reached through main()
        pytest.skip("snapshot subcommands are parsed by batchscope.presentation.snapshot")
    build_parser().parse_args(argv)
