"""``python -m runtime.tools.screenshots`` makes the docs' screenshots from the real app:
the demo runtime, ``streamlit run app.py`` and Debian's chromium, into a folder of our own."""

from __future__ import annotations

import struct
import subprocess
import sys

from tests.browser import MARKS, ROOT

pytestmark = MARKS


def png_header(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, read from its signature and IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, "the first chunk is not IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_script_saves_both_pages(tmp_path):
    out = tmp_path / "images"
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.tools.screenshots", "--out", str(out),
         "--min-data-s", "5", "--intensity", "0.5", "--timeout-s", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["live.png", "timeline.png"]
    for name in ("live.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert png_header(data) == (1400, 900), name
        assert 20_000 < len(data) < 1_500_000, (name, len(data))
        assert data.endswith(b"IEND\xaeB`\x82"), f"{name} is cut short"
    assert "wrote" in proc.stdout


def test_the_docs_screenshots_are_there():
    for name in ("live.png", "timeline.png"):
        data = (ROOT / "docs" / "images" / name).read_bytes()
        assert png_header(data) == (1400, 900), name
