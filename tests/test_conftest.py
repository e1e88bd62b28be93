"""The suite's own setup (tests/conftest.py): where its folders go."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import RAM_DISK, ram_disk_has_room


def test_a_folder_with_room_is_the_ram_disk_and_a_full_or_missing_one_is_not(tmp_path):
    assert ram_disk_has_room(tmp_path, room=1)
    assert not ram_disk_has_room(tmp_path, room=1 << 60)  # an exbibyte free: no disk here
    assert not ram_disk_has_room(tmp_path / "missing", room=1)
    (tmp_path / "file").write_text("")
    assert not ram_disk_has_room(tmp_path / "file", room=1)


def test_the_tests_folders_are_on_the_ram_disk_where_it_has_room(tmp_path, pytestconfig):
    """Unless --basetemp or PYTEST_DEBUG_TEMPROOT named another place (the env var is then the caller's own)."""
    root = os.environ.get("PYTEST_DEBUG_TEMPROOT")
    if root is None:  # --basetemp given, or no RAM disk with room: pytest's default place
        assert not ram_disk_has_room() or pytestconfig.option.basetemp is not None
    elif Path(root) == RAM_DISK:
        assert tmp_path.resolve().is_relative_to(RAM_DISK.resolve())
