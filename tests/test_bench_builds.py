"""``benchmarks.bench_builds``: two real servers, one per build root, served in turn under
the same trace settings; the base build checked out of git as a worktree and removed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.bench_builds import BUILDS, ROOT, checkout, compare, report

in_git = shutil.which("git") is not None and subprocess.run(
    ["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"],
    capture_output=True).returncode == 0


def test_two_builds_are_served_in_turn_and_compared():
    said = []
    got = compare({"base": ROOT, "this": ROOT}, "otel_1_in_100", rounds=2, slice_s=0.5,
                  clients=4, warm_s=0.3, say=said.append)
    assert len(said) == 2 and all(line.startswith("round ") for line in said)
    for build in BUILDS:
        assert len(got["windows"][build]) == 2
        assert all(w["rps"] > 0 and w["p99_ms"] > 0 for w in got["windows"][build])
        assert got["medians"][build]["cpu_us"]["serving process"] > 0
    assert got["paired"]["rps"].rounds == 2 and got["paired"]["rps"].low > 0
    text = report(got, "HEAD")
    assert "this / base, paired: req/s" in text and "mode otel_1_in_100" in text


def test_a_directory_without_the_repository_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no checkout of this repository"):
        with checkout(str(tmp_path)):
            pass


@pytest.mark.skipif(not in_git, reason="this checkout is not a git work tree")
def test_a_commit_is_checked_out_as_a_worktree_and_removed():
    with checkout("HEAD") as root:
        assert (root / "runtime" / "__main__.py").is_file()
        listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"],
                                capture_output=True, text=True, check=True).stdout
        assert str(root) in listed
    assert not root.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"],
                            capture_output=True, text=True, check=True).stdout
    assert str(root) not in listed


@pytest.mark.skipif(not in_git, reason="this checkout is not a git work tree")
def test_an_unknown_commit_is_refused_with_gits_reason():
    with pytest.raises(SystemExit, match="cannot check 'no-such-commit-xyz' out"):
        with checkout("no-such-commit-xyz"):
            pass


def test_tracings_side_by_side_drives_two_settings_of_one_build(capsys):
    from benchmarks.bench_tracing import Receiver, side_by_side

    with Receiver() as receiver:
        got = side_by_side("otel_1_in_100", rounds=2, slice_s=0.5, clients=4, model="mlp",
                           receiver=receiver)
    assert set(got["rps"]) == {"off", "otel_1_in_100"}
    assert all(len(v) == 2 and min(v) > 0 for v in got["rps"].values())
    assert got["paired"].rounds == 2 and got["cpu"]["off"] > 0
    assert "two servers side by side, 2 rounds" in capsys.readouterr().out
