"""Host-side access to files a sandbox wrote: never follow its links, never trust its file types.

Anything under a sandbox's upper directory (and so in the layers and memory images made from it)
was written by code that may be hostile. On the host it is opened one path component at a time,
relative to a directory descriptor the host trusts, with ``O_NOFOLLOW`` at every step: a symlink
anywhere on the way (``/.k3/memory -> /etc``) fails instead of leading out. The last component is
opened with ``O_NONBLOCK`` so a FIFO cannot hold the host, then checked to be a regular file of a
bounded size. What the host keeps is a copy (holes kept as holes, set-id bits dropped, mode 0600),
never a link to an inode the sandbox could still reach.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UntrustedFileError(OSError):
    """A sandbox-written path is not a plain file the host may read (a link, a FIFO, too big...)."""


def open_beneath(root: str, relative: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """Open ``root/relative`` for reading without following any symlink below ``root``.

    Returns (fd, fstat of it). Raises FileNotFoundError when a component is missing and
    UntrustedFileError when a component is a link or not a directory, when the file is not a
    regular file, or when it is larger than ``max_bytes``."""
    parts = [part for part in relative.split("/") if part]
    if not parts or any(part in (".", "..") for part in parts):
        raise ValueError(f"a relative path without '.' or '..' is needed, got {relative!r}")
    fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the root is the host's own (maybe /proc/PID/fd/N)
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UntrustedFileError(error.errno, "a component of the path is a link or not a directory",
                                             os.path.join(root, relative)) from None
                raise
            os.close(fd)
            fd = next_fd
        try:
            file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UntrustedFileError(error.errno, "the file is a symbolic link", os.path.join(root, relative)) from None
            raise
    finally:
        os.close(fd)
    try:
        st = os.fstat(file_fd)
        check_regular(st, max_bytes, os.path.join(root, relative))
    except BaseException:
        os.close(file_fd)
        raise
    return file_fd, st


def check_regular(st: os.stat_result, max_bytes: int, shown: str) -> None:
    """UntrustedFileError unless ``st`` is a regular file of at most ``max_bytes`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(errno.EINVAL, f"not a regular file (mode {st.st_mode:o})", shown)
    if st.st_size > max_bytes:
        raise UntrustedFileError(errno.EFBIG, f"{st.st_size} bytes, more than the {max_bytes} allowed", shown)


def read_beneath(root: str, relative: str, max_bytes: int) -> bytes:
    """The content of ``root/relative`` (see ``open_beneath``), at most ``max_bytes`` bytes."""
    fd, st = open_beneath(root, relative, max_bytes)
    try:
        return read_fd(fd, st.st_size, max_bytes)
    finally:
        os.close(fd)


def read_fd(fd: int, size: int, max_bytes: int) -> bytes:
    """Read an open regular file to its end, refusing to go past ``max_bytes`` (it may grow)."""
    data = bytearray()
    while True:
        chunk = os.read(fd, min(CHUNK, max_bytes + 1 - len(data)))
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > max_bytes:
            raise UntrustedFileError(errno.EFBIG, f"grew past the {max_bytes} bytes allowed", f"fd {fd}")


def copy_fd(source_fd: int, size: int, target: str, want_hash: bool = True) -> str | None:
    """Copy ``size`` bytes of the open regular file ``source_fd`` into the new file ``target``
    (mode 0600, holes kept as holes); return the SHA-256 of the content (hex) if ``want_hash``."""
    digest = hashlib.sha256() if want_hash else None
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        position = 0
        while position < size:
            try:
                data_at = os.lseek(source_fd, position, os.SEEK_DATA)
            except OSError as error:
                if error.errno != errno.ENXIO:  # ENXIO: only a hole is left
                    raise
                data_at = size
            data_at = min(data_at, size)
            if digest is not None:
                _hash_zeros(digest, data_at - position)
            if data_at >= size:
                break
            hole_at = min(os.lseek(source_fd, data_at, os.SEEK_HOLE), size)
            os.lseek(source_fd, data_at, os.SEEK_SET)
            os.lseek(out, data_at, os.SEEK_SET)
            left = hole_at - data_at
            while left:
                chunk = os.read(source_fd, min(CHUNK, left))
                if not chunk:  # the file shrank while being read: copy what there was
                    size = hole_at - left
                    break
                if digest is not None:
                    digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
                left -= len(chunk)
            position = hole_at
        os.ftruncate(out, size)
    except BaseException:
        os.close(out)
        os.unlink(target)
        raise
    os.close(out)
    return None if digest is None else digest.hexdigest()


def hash_fd(fd: int, size: int) -> str:
    """SHA-256 (hex) of the first ``size`` bytes of an open regular file; holes are hashed as the
    zeros they read as, without reading them."""
    digest = hashlib.sha256()
    position = 0
    while position < size:
        try:
            data_at = min(os.lseek(fd, position, os.SEEK_DATA), size)
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
            data_at = size
        _hash_zeros(digest, data_at - position)
        if data_at >= size:
            break
        hole_at = min(os.lseek(fd, data_at, os.SEEK_HOLE), size)
        os.lseek(fd, data_at, os.SEEK_SET)
        left = hole_at - data_at
        while left:
            chunk = os.read(fd, min(CHUNK, left))
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)
            left -= len(chunk)
        position = hole_at
    return digest.hexdigest()


_ZEROS = bytes(CHUNK)


def _hash_zeros(digest, n: int) -> None:
    while n > 0:
        step = min(n, CHUNK)
        digest.update(_ZEROS[:step] if step < CHUNK else _ZEROS)
        n -= step


def hash_file(path: str, max_bytes: int) -> str:
    """SHA-256 (hex) of a host-owned file, read without following a link at its last component."""
    fd = os.open(path, _FILE_FLAGS)
    try:
        st = os.fstat(fd)
        check_regular(st, max_bytes, path)
        return hash_fd(fd, st.st_size)
    finally:
        os.close(fd)


def safe_mode(mode: int) -> int:
    """Permission bits a file copied out of a sandbox may keep: no setuid, no setgid."""
    return stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID)


def walk(top: str):
    """``os.walk(top)`` top-down with sorted names, without recursion (a sandbox can nest thousands
    of directories) and without following links. Pruning ``dirnames`` in place works as in os.walk."""
    stack = [top]
    while stack:
        directory = stack.pop()
        dirnames, filenames = [], []
        with os.scandir(directory) as entries:
            for entry in entries:
                (dirnames if entry.is_dir(follow_symlinks=False) else filenames).append(entry.name)
        dirnames.sort()
        filenames.sort()
        yield directory, dirnames, filenames
        stack.extend(os.path.join(directory, name) for name in reversed(dirnames))


def remove_tree(path: str) -> None:
    """Remove the directory tree ``path`` (or a file), however deep: one directory descriptor
    open at a time, names relative to it (no path grows past PATH_MAX), links never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    names: list[str] = []  # the path from ``path`` down to the current directory
    current = os.open(path, _DIR_FLAGS)
    try:
        while True:
            child = None
            os.lseek(current, 0, os.SEEK_SET)
            with os.scandir(current) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=current)
            if child is not None:
                below = os.open(child, _DIR_FLAGS, dir_fd=current)
                os.close(current)
                current, names = below, names + [child]
                continue
            if not names:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=current)
            os.close(current)
            current = parent
            os.rmdir(names.pop(), dir_fd=current)
    finally:
        os.close(current)
    os.rmdir(path)
