"""The Snapshots page's uploads (``batchscope.dashboard.snapshots.take_uploads``): each
upload opened once, told apart by upload rather than by file name, and a failed upload's
error kept only while it stays uploaded."""

from __future__ import annotations

from dataclasses import dataclass

from batchscope.dashboard.snapshots import take_uploads
from batchscope.presentation.snapshot import SnapshotError


@dataclass
class Upload:
    """What Streamlit's uploader gives: an id per upload, the file's name and bytes."""

    file_id: str
    name: str
    data: bytes

    def getvalue(self) -> bytes:
        return self.data


def load(data: bytes) -> str:
    if data == b"broken":
        raise SnapshotError("it is not a zip archive")
    return data.decode()


def test_a_second_file_of_a_name_already_open_opens_beside_it():
    snaps, seen, errors = {}, {}, {}
    first = Upload("u1", "batchscope-snapshot.zip", b"monday")
    assert take_uploads([first], snaps, seen, errors, load) == "batchscope-snapshot.zip"
    second = Upload("u2", "batchscope-snapshot.zip", b"tuesday")
    assert take_uploads([first, second], snaps, seen, errors, load) \
        == "batchscope-snapshot.zip (2)"
    assert snaps == {"batchscope-snapshot.zip": "monday", "batchscope-snapshot.zip (2)": "tuesday"}
    # each upload once: the next run of the page opens nothing again
    assert take_uploads([first, second], snaps, seen, errors, load) is None


def test_a_failed_upload_keeps_its_error_until_removed_and_its_name_is_free_again():
    snaps, seen, errors = {}, {}, {}
    bad = Upload("u1", "corrupt.zip", b"broken")
    assert take_uploads([bad], snaps, seen, errors, load) is None
    assert errors == {"u1": ("corrupt.zip", "it is not a zip archive")}
    assert take_uploads([bad], snaps, seen, errors, load) is None and "u1" in errors
    good = Upload("u2", "corrupt.zip", b"fine after all")  # removed, then a good one
    assert take_uploads([good], snaps, seen, errors, load) == "corrupt.zip"
    assert errors == {} and snaps == {"corrupt.zip": "fine after all"}


def test_an_unexpected_failure_is_said_too():
    def boom(data: bytes) -> str:
        raise MemoryError("no room")

    errors: dict = {}
    assert take_uploads([Upload("u1", "big.zip", b"x")], {}, {}, errors, boom) is None
    assert "opening it failed unexpectedly (MemoryError: no room)" in errors["u1"][1]
