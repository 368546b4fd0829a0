"""The Fleet page's MPS column: read from the device string each instance registered
with (``runtime.device.mps.describe``), so instances sharing a GPU are told apart."""

from __future__ import annotations

import pandas as pd
import pytest

from batchscope.analysis.fleet import TABLE_COLUMNS
from batchscope.dashboard.fleet import display_table, mps_label


@pytest.mark.parametrize("device, label", [
    ("cuda:0 · MPS 50% threads", "on · 50% threads"),
    ("cuda:1 · MPS", "on"),
    ("cuda:0", "off"),
    ("cpu", "–"),
    (None, "–"),
    (float("nan"), "–"),
])
def test_mps_label(device, label):
    assert mps_label(device) == label


def test_the_per_instance_table_has_an_mps_column():
    rows = pd.DataFrame([{c: 0 for c in TABLE_COLUMNS} for _ in range(3)])
    rows["instance_id"] = ["a", "b", "c"]
    rows["state"] = "live"
    rows["device"] = ["cuda:0 · MPS 25% threads", "cuda:0", None]
    table = display_table(rows)
    assert list(table["MPS"]) == ["on · 25% threads", "off", "–"]
    assert list(table.columns).index("MPS") == list(table.columns).index("state") + 1
    assert set(display_table(rows.drop(columns=["device"]))["MPS"]) == {"–"}
