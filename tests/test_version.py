"""One version everywhere: ``batchscope --version``, the dashboard's sidebar, snapshot
manifests and the instances' rows all say the package's version (pyproject.toml)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from batchscope import version as version_module
from batchscope.analysis import queries
from batchscope.presentation import snapshot
from batchscope.storage.db import make_engine
from batchscope.testing import synthetic
from batchscope.version import from_pyproject, version
from runtime.tools import cli
from tests.factories import run_app
from tests.test_snapshot_files import edit_json

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
PACKAGE_VERSION = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
END = 2_000_000_000.0


def test_the_version_is_the_package_version():
    assert version() == PACKAGE_VERSION == from_pyproject()


def test_batchscope_version_prints_it(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"batchscope {PACKAGE_VERSION}\n"
    with pytest.raises(SystemExit) as stopped:  # anywhere among the options
        cli.build_parser().parse_args(["--log-level", "INFO", "--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"batchscope {PACKAGE_VERSION}\n"


def test_without_installed_metadata_the_checkout_says_it(monkeypatch, tmp_path):
    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(version_module.metadata, "version", missing)
    version.cache_clear()
    try:
        assert version() == PACKAGE_VERSION
        monkeypatch.setattr(version_module, "_PYPROJECT", tmp_path / "absent.toml")
        version.cache_clear()
        assert version() == version_module.UNKNOWN
    finally:
        monkeypatch.undo()
        version.cache_clear()
    assert version() == PACKAGE_VERSION


def test_from_pyproject_reads_the_project_table_only(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[tool.other]\nversion = "9.9"\n\n[project]\nname = "x"\nversion = "1.2.3"\n'
                    '\n[tool.more]\nversion = "7"\n')
    assert from_pyproject(path) == "1.2.3"
    path.write_text('[project]\nname = "x"\n\n[tool.more]\nversion = "7"\n')
    assert from_pyproject(path) is None


def test_instances_register_with_it():
    from runtime.server.service import VERSION
    assert VERSION == PACKAGE_VERSION


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> bytes:
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('version') / 'v.db'}")
    synthetic.generate(engine, synthetic.SCENARIOS["oom"].with_(duration_s=30, batches_per_s=2),
                       end_s=END)
    try:
        return snapshot.export_bytes(engine, queries.Window(END - 30, END + 1, "mlp"))
    finally:
        engine.dispose()


def test_snapshots_say_which_version_wrote_them(exported):
    snap = snapshot.load_snapshot(exported)
    try:
        assert snap.manifest["batchscope_version"] == PACKAGE_VERSION
        assert snap.manifest["environment"]["versions"]["batchscope"] == PACKAGE_VERSION
        assert snap.written_by == PACKAGE_VERSION
    finally:
        snap.close()


def test_an_older_snapshot_is_read_from_its_environment(exported):
    older = edit_json(exported, snapshot.MANIFEST, lambda m: m.pop("batchscope_version"))
    snap = snapshot.load_snapshot(older)
    try:
        assert snap.written_by == PACKAGE_VERSION
    finally:
        snap.close()
    assert snapshot.written_by({"environment": {"versions": {"batchscope": None}}}) is None


def test_a_version_that_is_not_a_string_is_refused(exported):
    bad = edit_json(exported, snapshot.MANIFEST, lambda m: m.update(batchscope_version=[1]))
    with pytest.raises(snapshot.SnapshotError, match="batchscope_version"):
        snapshot.load_snapshot(bad)


def test_the_dashboard_sidebar_ends_with_it(app_db):
    at = run_app()
    captions = [c.value for c in at.sidebar.caption]
    assert captions and captions[-1] == f"BatchScope {PACKAGE_VERSION}", captions
