"""k3.atomic: a write that dies half-way leaves the old file whole and no temp file; temp files that dead writers
left are cleared, a live writer's are kept."""

import os

import pytest

from k3.atomic import atomic_write, atomic_write_bytes


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "out" / "result.json"
    atomic_write_bytes(target, b"old\n")

    def dies(handle):
        handle.write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="mid-write"):
        atomic_write(target, dies)
    assert target.read_bytes() == b"old\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["result.json"]


def test_temp_files_of_dead_writers_are_cleared_live_ones_kept(tmp_path):
    target = tmp_path / "result.json"
    dead_pid = 2 ** 22 + 1  # above the largest pid Linux allows (PID_MAX_LIMIT = 2**22): no such process
    dead = tmp_path / f".result.json.{dead_pid}.abc.tmp"
    live = tmp_path / f".result.json.{os.getpid()}.xyz.tmp"
    other = tmp_path / "notes.tmp"
    for path in (dead, live, other):
        path.write_bytes(b"x")
    atomic_write_bytes(target, b"new\n")
    assert target.read_bytes() == b"new\n"
    assert not dead.exists() and live.exists() and other.exists()
