"""Fixtures shared by the whole suite.

Plain helpers (row factories, read-back helpers, bounded waits, toy model sources)
live in ``tests/factories.py``; test modules import from there, never from each other.
"""

from __future__ import annotations

import pytest

from batchscope.storage.db import make_engine


@pytest.fixture
def db_url(tmp_path) -> str:
    """A SQLAlchemy URL of a fresh SQLite file in the test's own temporary folder."""
    return f"sqlite:///{tmp_path / 'bs.db'}"


@pytest.fixture
def db(db_url):
    """A SQLAlchemy engine on ``db_url`` with the BatchScope schema, disposed afterwards."""
    eng = make_engine(db_url)
    yield eng
    eng.dispose()
