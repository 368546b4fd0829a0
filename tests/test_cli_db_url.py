"""``batchscope serve --db``: a path or a malformed URL ends in one line saying what to
write (exit 2), never a SQLAlchemy traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.tools.cli import UsageError, check_database_url

CLI = [sys.executable, "-m", "runtime.tools.cli"]


def test_a_path_gets_the_url_to_write(tmp_path):
    path = tmp_path / "file.db"
    with pytest.raises(UsageError) as info:
        check_database_url(str(path), "--db")
    assert f"write sqlite:///{path}" in str(info.value) and str(path).startswith("/")
    with pytest.raises(UsageError, match="is a path"):
        check_database_url("data/file.db", "--db")


@pytest.mark.parametrize("url, fragment", [
    ("sqlite:/x.db", "is not a database URL"),
    ("nosuchdb://host/db", "SQLAlchemy knows no database 'nosuchdb'"),
])
def test_malformed_urls_say_what_to_write(url, fragment):
    with pytest.raises(UsageError) as info:
        check_database_url(url, "--db")
    assert fragment in str(info.value) and "sqlite:////abs/path/file.db" in str(info.value)


def test_good_urls_pass(tmp_path):
    for url in (f"sqlite:///{tmp_path / 'x.db'}", "sqlite:///data/batchscope.db",
                "sqlite://"):
        assert check_database_url(url, "--db") == url


def test_serve_with_a_path_exits_2_with_one_line(tmp_path):
    path = tmp_path / "file.db"
    env = {k: v for k, v in os.environ.items() if k != "BATCHSCOPE_DB_URL"}
    r = subprocess.run(CLI + ["serve", "--db", str(path)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"sqlite:///{path}" in lines[0] and not path.exists()


def test_a_path_in_the_environment_is_named_as_such(tmp_path):
    env = {**os.environ, "BATCHSCOPE_DB_URL": str(tmp_path / "env.db")}
    r = subprocess.run(CLI + ["serve"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "$BATCHSCOPE_DB_URL" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
