"""The README and the guides in docs/ do what they say, and their links lead somewhere.

- Every ```python block runs. A block that defines a model (a ``ModelAPI`` subclass) is
  served a request by a real engine; a block that talks to ``127.0.0.1:8000`` (HTTP) or
  ``127.0.0.1:8001`` (gRPC) runs against one real server on ephemeral 127.0.0.1 ports that
  serves ``mlp``, ``encoder`` and ``decoder``. A block that cannot run (an outline of
  signatures) says so on the line before it with ``<!-- not run: why -->`` and is reported
  as skipped.
- Every command line of a ```bash block, and every ``python`` command in a table, is checked
  without running it: ``batchscope ...`` with the real parsers; ``python -m MODULE ...`` and
  ``python FILE.py ...`` with the program's own argparse parser, run up to its
  ``parse_args`` in a child interpreter; ``python -c`` code compiles; ``streamlit run`` and
  ``bash`` name files that exist; ``pip install`` names extras that exist.
- Every relative link and ``#anchor`` resolves (anchors by GitHub's heading slugs).
- The README stays short: the two quick-start commands ``.ci/run`` relies on, links to every
  guide. The diagnosis rules each have their row in docs/dashboard.md, and the changelog has
  a section for the package's version.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from runtime.api.config import ServerConfig
from runtime.api.model import ModelAPI, check_model
from runtime.engine import Engine
from runtime.server.service import Service, ServiceThread
from runtime.tools import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *GUIDES]
README_MAX_LINES = 250
#: the quick start's commands, exactly: .ci/run runs the second (through tests/run.sh)
INSTALL_AND_RUN = ('python3 -m venv .venv && .venv/bin/pip install "torch==2.13.0" '
                   '-e ".[dashboard]" && .venv/bin/streamlit run app.py')
TEST_COMMAND = "bash tests/run.sh"

FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:[^>]*-->\s*$")
HTTP, GRPC = "127.0.0.1:8000", "127.0.0.1:8001"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    body: str
    not_run: bool

    @property
    def id(self) -> str:
        return f"{rel(self.doc)}:{self.line}"


def blocks(lang: str, docs: list[Path] = DOCS) -> list[Block]:
    found = []
    for doc in docs:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(2) != lang:
                continue
            indent = m.group(1)
            body = "\n".join(line[len(indent):] for line in m.group(3).splitlines())
            before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
            found.append(Block(doc, text.count("\n", 0, m.start()) + 1, lang, body,
                               bool(NOT_RUN.search(before))))
    return found


def without_code_blocks(text: str) -> str:
    """``text`` with its fenced blocks blanked (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def without_code(text: str) -> str:
    """``text`` without fenced blocks and inline code."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", without_code_blocks(text))


# -- Python blocks ------------------------------------------------------------------------
PYTHON = blocks("python")


@pytest.fixture(scope="module")
def server():
    """One real server: mlp, encoder and decoder over HTTP, and gRPC."""
    models, generation = cli.load_models(["mlp", "encoder", "decoder"])
    service = Service(models, {}, ServerConfig(record=False, grpc_port=0),
                      generation=generation, instance_id="docs")
    runner = ServiceThread(service)
    url = runner.start()
    try:
        yield {HTTP: url.removeprefix("http://"), GRPC: f"127.0.0.1:{service.grpc_port}"}
    finally:
        runner.stop()


def sample_inputs(model: ModelAPI) -> dict[str, np.ndarray]:
    """Inputs of every declared shape (variable dimensions 5 long) and datatype."""
    dtypes = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}
    out = {}
    for spec in model.inputs:
        shape = tuple(5 if d == -1 else d for d in spec.shape)
        out[spec.name] = (np.arange(int(np.prod(shape))) % 7 + 1).astype(
            dtypes[spec.datatype]).reshape(shape)
    return out


def serve_once(model: ModelAPI, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    async def run() -> dict:
        engine = Engine({model.name: model})
        await engine.start()
        try:
            return await engine.infer(model.name, inputs)
        finally:
            await engine.stop()
    return asyncio.run(run())


def run_model_block(block: Block) -> None:
    namespace: dict = {"__name__": f"docs_{block.line}"}
    exec(compile(block.body, block.id, "exec"), namespace)
    classes = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, ModelAPI)
               and v is not ModelAPI and v.__module__ == namespace["__name__"]]
    assert classes, f"{block.id} imports ModelAPI but defines no model"
    for cls in classes:
        model = cls()
        check_model(model)
        inputs = sample_inputs(model)
        out = serve_once(model, inputs)
        assert sorted(out) == sorted(s.name for s in model.outputs), block.id
        for spec in model.outputs:
            assert all(d == -1 or d == n for d, n in zip(spec.shape, out[spec.name].shape)), \
                (block.id, spec.name, out[spec.name].shape)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_every_python_block_runs(block, request):
    if block.not_run:
        pytest.skip(f"{block.id} is marked not run")
    if "ModelAPI" in block.body:
        run_model_block(block)
        return
    code = block.body
    if HTTP in code or GRPC in code:
        addresses = request.getfixturevalue("server")
        for placeholder, real in addresses.items():
            code = code.replace(placeholder, real)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, block.id, "exec"), {"__name__": "docs"})


def test_the_doubler_doubles():
    [block] = [b for b in PYTHON if "class Doubler" in b.body]
    namespace: dict = {}
    exec(compile(block.body, block.id, "exec"), namespace)
    out = serve_once(namespace["Doubler"](), {"INPUT0": np.arange(4, dtype=np.float32)})
    np.testing.assert_array_equal(out["OUTPUT0"], np.arange(4, dtype=np.float32) * 2)


def test_the_tritonclient_example_prints_one_row_per_item(server):
    [block] = [b for b in PYTHON if b.doc.name == "protocols.md" and "tritonclient.http" in b.body]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.body.replace(HTTP, server[HTTP]), block.id, "exec"), {})
    assert printed.getvalue().strip().startswith("[["), printed.getvalue()


def test_only_signature_outlines_are_left_unrun():
    unrun = [b for b in PYTHON if b.not_run]
    assert all(b.doc.name == "architecture.md" for b in unrun), [b.id for b in unrun]


# -- command lines --------------------------------------------------------------------------
def shell_lines(body: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments dropped, each
    ``&&`` part on its own."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            out.extend(part.strip() for part in line.split("&&"))
    return out


def table_commands(doc: Path) -> list[str]:
    """The commands in the inline code of table rows (``python -m ...``: how to rerun a
    figure; a ``batchscope k8s`` there names a command, it is not a command line)."""
    found = []
    for line in without_code_blocks(doc.read_text()).splitlines():
        if line.startswith("|"):
            found += [c for c in re.findall(r"`([^`]+)`", line)
                      if c.startswith(("python -m ", "python benchmarks/"))]
    return found


def command_lines() -> list[tuple[str, str]]:
    lines = []
    for block in blocks("bash"):
        lines += [(block.id, line) for line in shell_lines(block.body)]
    for doc in DOCS:
        lines += [(rel(doc), line) for line in table_commands(doc)]
    return lines


COMMANDS = command_lines()


def argv_of(line: str) -> list[str]:
    argv = shlex.split(line)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # VAR=value cmd
        argv.pop(0)
    if argv:
        argv[0] = argv[0].removeprefix(".venv/bin/")
    return argv


def check_batchscope(argv: list[str]) -> None:
    if argv == ["--version"]:
        return
    if argv[:2] == ["snapshot", "export"]:
        from batchscope.presentation import snapshot
        snapshot.export_parser().parse_args(argv[2:])
    elif argv[:1] == ["k8s"]:
        from batchscope.deploy import k8s
        k8s.build_parser().parse_args(argv[1:])
    else:
        cli.build_parser().parse_args(cli._glued(argv))


#: a child interpreter runs each program up to its argparse ``parse_args`` and stops there
PARSE_ONLY = r"""
import argparse, contextlib, io, json, os, runpy, sys

class Parsed(BaseException):  # not an Exception: a program's `except Exception` lets it by
    pass

parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
inside = 0

def parse_args_then_stop(self, *args, **kwargs):
    global inside
    inside += 1
    try:
        parse_args(self, *args, **kwargs)  # unknown arguments are refused here
    finally:
        inside -= 1
    raise Parsed

def parse_known_args_then_stop(self, *args, **kwargs):
    result = parse_known_args(self, *args, **kwargs)
    if inside == 0:  # called by the program itself, not by parse_args or a subcommand
        raise Parsed
    return result

argparse.ArgumentParser.parse_args = parse_args_then_stop
argparse.ArgumentParser.parse_known_args = parse_known_args_then_stop
results = []
for kind, target, argv in json.load(sys.stdin):
    sys.argv = [target, *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:  # as `python FILE` runs it: its folder first on the path
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                try:
                    runpy.run_path(target, run_name="__main__")
                finally:
                    del sys.path[0]
        results.append("ran to its end without parsing arguments")
    except Parsed:
        results.append(None)
    except SystemExit as exc:
        results.append(None if exc.code in (0, None) else f"refused: {err.getvalue().strip()}")
    except Exception as exc:
        results.append(f"failed before its arguments were parsed: {exc!r}")
print(json.dumps(results))
"""


def uses_argparse(kind: str, target: str) -> bool:
    import importlib.util
    if kind == "path":
        return "ArgumentParser" in (ROOT / target).read_text()
    spec = importlib.util.find_spec(target)
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        spec = importlib.util.find_spec(f"{target}.__main__")
    return spec.origin is not None and "ArgumentParser" in Path(spec.origin).read_text()


def python_target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """("module", name, args), ("path", file, args), ("code", source, []) or None."""
    if len(argv) < 2:
        return None
    if argv[1] == "-m":
        return "module", argv[2], argv[3:]
    if argv[1] == "-c":
        return "code", argv[2], []
    return "path", argv[1], argv[2:]


@pytest.fixture(scope="module")
def parsed_programs() -> dict[tuple, str | None]:
    """What each documented ``python`` program's own parser says of its documented
    arguments (None: accepted), for those that parse with argparse."""
    import importlib.util
    checks = []
    for _, line in COMMANDS:
        argv = argv_of(line)
        if argv and argv[0] in ("python", "python3"):
            target = python_target(argv)
            if target and target[0] in ("module", "path"):
                kind, name, args = target
                found = (importlib.util.find_spec(name) is not None if kind == "module"
                         else (ROOT / name).is_file())
                if found and uses_argparse(kind, name):
                    checks.append([kind, name, args])
    unique = [json.loads(c) for c in dict.fromkeys(json.dumps(c) for c in checks)]
    proc = subprocess.run([sys.executable, "-c", PARSE_ONLY], input=json.dumps(unique),
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(k, n, tuple(a)): r for (k, n, a), r in zip(unique, results)}


def extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def test_the_docs_show_commands():
    names = {argv_of(line)[0] for _, line in COMMANDS}
    assert {"batchscope", "python", "bash", "streamlit"} <= names, names
    assert sum(argv_of(line)[0] == "batchscope" for _, line in COMMANDS) >= 20


@pytest.mark.parametrize("where, line", COMMANDS, ids=[f"{w}: {l[:60]}" for w, l in COMMANDS])
def test_every_command_line_is_right(where, line, parsed_programs):
    import importlib.util
    argv = argv_of(line)
    program = argv[0] if argv else ""
    if program == "batchscope":
        check_batchscope(argv[1:])
    elif program in ("python", "python3"):
        kind, target, args = python_target(argv)
        if kind == "code":
            compile(target, f"{where}: python -c", "exec")
        elif kind == "module":
            assert importlib.util.find_spec(target) is not None, f"no module {target}"
        else:
            assert (ROOT / target).is_file(), f"no file {target}"
        if kind != "code":
            problem = parsed_programs.get((kind, target, tuple(args)))
            assert problem is None, f"{line}: {problem}"
    elif program == "streamlit":
        assert argv[1] == "run" and (ROOT / argv[2]).is_file(), line
    elif program == "bash":
        assert (ROOT / argv[1]).is_file(), line
    elif program == "pip" and argv[1:2] == ["install"]:
        for spec in argv[2:]:
            named = re.search(r"\[([^\]]+)\]", spec)
            if named and not spec.startswith("torch"):
                assert set(named.group(1).split(",")) <= extras(), line


# -- links ----------------------------------------------------------------------------------
def heading_text(raw: str) -> str:
    """A heading's text as GitHub renders it: links as their text, no emphasis marks."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[*`]", "", text).strip()


def slugs(doc: Path) -> set[str]:
    """The anchors GitHub gives ``doc``'s headings (github-slugger: lower case, punctuation
    dropped, spaces to hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$",
                         without_code_blocks(doc.read_text()), re.M):
        base = "".join(ch for ch in heading_text(m.group(1)).lower()
                       if ch.isalnum() or ch in "_- ").replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_github_slugs():
    page = ROOT / "docs" / "tuning.md"
    assert {"the-slo-autopilot", "golden-parameters"} <= slugs(page)
    changelog = slugs(ROOT / "docs" / "CHANGELOG.md")
    assert {"unreleased", "changed", "changed-1"} <= changelog


def links(doc: Path) -> list[tuple[int, str]]:
    text = without_code(doc.read_text())
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)]


LINKS = [(doc, line, target) for doc in DOCS for line, target in links(doc)
         if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("doc, line, target", LINKS,
                         ids=[f"{rel(d)}:{n} {t}" for d, n, t in LINKS])
def test_every_relative_link_resolves(doc, line, target):
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    assert dest.exists(), f"{rel(doc)}:{line}: {path} does not exist"
    if anchor:
        assert dest.suffix == ".md", f"{rel(doc)}:{line}: an anchor into {path}"
        assert anchor in slugs(dest), \
            f"{rel(doc)}:{line}: no heading #{anchor} in {rel(dest)}: {sorted(slugs(dest))}"


# -- the README's promises ----------------------------------------------------------------
def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines"


def test_the_quick_start_keeps_its_two_commands():
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    found = [b.body.strip() for b in blocks("bash", [README])
             if b.body.strip() in quick]
    assert found == [INSTALL_AND_RUN, TEST_COMMAND]
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci.splitlines()


def test_the_readme_links_every_guide_and_both_screenshots():
    targets = {target.partition("#")[0] for _, target in links(README)}
    for guide in GUIDES:
        assert f"docs/{guide.name}" in targets, f"README.md does not link docs/{guide.name}"
    assert {"docs/images/live.png", "docs/images/timeline.png"} <= targets


def test_every_diagnosis_rule_has_its_row():
    from batchscope.analysis import diagnosis, fleet_rules
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|",
                                             (ROOT / "docs" / "dashboard.md").read_text(), re.M)}
    missing = (set(diagnosis.RULES) | set(fleet_rules.RULES)) - rows
    assert not missing, f"docs/dashboard.md has no row for {sorted(missing)}"


def test_the_changelog_has_the_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    text = (ROOT / "docs" / "CHANGELOG.md").read_text()
    assert "\n## [Unreleased]\n" in text
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M)
    sections = re.findall(r"^### (.+)$", text, re.M)
    assert set(sections) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
