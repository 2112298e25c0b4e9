"""Memory files of VM snapshots, without a VM: a private mapping stands in for QEMU's guest RAM.

The incremental snapshot reads exactly the pages written through a private mapping (found in
/proc/<pid>/pagemap), never the pages only read; sparse copies keep holes; the file under a
private mapping never changes."""

import mmap
import os

import pytest

from k3.sandbox.vm import snapshots

PAGE = snapshots.PAGE


@pytest.fixture
def memory_file(tmp_path):
    path = tmp_path / "memory"
    with open(path, "wb") as f:
        f.truncate(64 * PAGE)
        f.seek(3 * PAGE)
        f.write(b"A" * PAGE)  # one page of data; the rest are holes
    return str(path)


def test_private_pages_are_exactly_the_written_ones(memory_file):
    if not os.access("/proc/self/pagemap", os.R_OK):
        pytest.skip("no /proc/self/pagemap here")
    with open(memory_file, "r+b") as f:
        ram = mmap.mmap(f.fileno(), 64 * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        assert ram[3 * PAGE] == ord("A") and ram[10 * PAGE] == 0  # read only: stays the file's page
        ram[5 * PAGE : 5 * PAGE + 4] = b"five"
        ram[6 * PAGE] = ord("6")
        ram[40 * PAGE + 100] = ord("x")
        runs = snapshots.read_private_pages(os.getpid(), memory_file)
        assert [(offset // PAGE, len(data) // PAGE) for offset, data in runs] == [(5, 2), (40, 1)]
        assert runs[0][1][:4] == b"five" and runs[0][1][PAGE] == ord("6") and runs[1][1][100] == ord("x")
        with open(memory_file, "rb") as f:  # the file under a private mapping is untouched
            assert f.read(6 * PAGE)[5 * PAGE : 5 * PAGE + 4] == b"\0\0\0\0"
    finally:
        ram.close()


def test_snapshot_file_is_parent_plus_private_pages(memory_file, tmp_path):
    target = str(tmp_path / "child")
    snapshots.clone_or_copy(memory_file, target)
    written = snapshots.write_pages(target, [(5 * PAGE, b"five".ljust(PAGE, b"\0"))])
    assert written == PAGE
    with open(target, "rb") as f:
        data = f.read()
    assert len(data) == 64 * PAGE
    assert data[3 * PAGE : 4 * PAGE] == b"A" * PAGE and data[5 * PAGE : 5 * PAGE + 4] == b"five"


def test_sparse_copy_keeps_holes(memory_file, tmp_path):
    target = str(tmp_path / "copy")
    copied = snapshots.copy_sparse(memory_file, target)
    assert copied < 64 * PAGE  # only the data segments were copied
    with open(memory_file, "rb") as a, open(target, "rb") as b:
        assert a.read() == b.read()


def test_snapshot_ids_are_checked():
    with pytest.raises(ValueError, match="24 lowercase hex"):
        snapshots.check_id("../../etc")
