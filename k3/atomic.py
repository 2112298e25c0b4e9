"""Atomic file writes: readers see the old file or the whole new one, never a part (a temp file beside the target,
fsynced, renamed over it, the directory fsynced)."""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the whole new one, never a part."""
    atomic_write(Path(path), lambda handle: handle.write(data))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temp_files(path: Path) -> list[Path]:
    """Delete the temp files that atomic writes of `path` by processes no longer running left behind (a save
    killed half-way): `.NAME.PID.*.tmp` with a dead PID. Other files, and those of live writers, stay."""
    removed = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = candidate.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)) and candidate.is_file() and not candidate.is_symlink():
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call write(handle) on a temp file beside `path`, fsync it, rename it over `path`, fsync the directory.
    Temp files of earlier writers of `path` that died mid-write are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary output files
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # The rename itself must reach the disk too, or a crash can bring back the old directory entry.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
