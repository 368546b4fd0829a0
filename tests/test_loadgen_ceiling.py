"""``batchscope load --ceiling``: the load generator's own ceiling against a trivial server
in a child started through ``batchscope.spawn``."""

from __future__ import annotations

import pytest

from batchscope.load.loadgen import measure_ceiling

pytestmark = pytest.mark.slow


def test_ceiling_run_answers_every_request_and_stops_its_child():
    report = measure_ceiling(duration_s=0.5, concurrency=4)
    assert report.ok > 0 and report.ok == report.sent
    assert not report.errors_by_status
