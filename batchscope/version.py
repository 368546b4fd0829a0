"""The version of BatchScope: ``batchscope --version``, the dashboard's sidebar, snapshot
manifests and the ``runtime_instances`` rows all say the same.

It is the installed distribution's version (``pyproject.toml`` at install time). A
checkout run without installing reads ``pyproject.toml`` next to the package instead.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "batchscope"
#: what ``version()`` says when neither the installed metadata nor pyproject.toml is found
UNKNOWN = "unknown"
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_VERSION_LINE = re.compile(r'^version\s*=\s*"([^"]+)"\s*$', re.M)


def from_pyproject(path: Path | None = None) -> str | None:
    """The ``version = "..."`` of ``[project]`` in ``path`` (default: the checkout's
    pyproject.toml); None without one."""
    try:
        text = (path or _PYPROJECT).read_text(encoding="utf-8")
    except OSError:
        return None
    project = text.split("[project]", 1)[1] if "[project]" in text else ""
    project = project.split("\n[", 1)[0]  # up to the next table
    found = _VERSION_LINE.search(project)
    return found.group(1) if found else None


@functools.cache
def version() -> str:
    """``0.1.0``: the installed package's version, else the checkout's, else ``unknown``."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return from_pyproject() or UNKNOWN
