"""Whole-machine snapshots: device state plus a memory file, restored by mapping it privately.

A snapshot is a directory ``<scratch>/vm/snapshots/<id>/``::

    state        CPU and device state (QEMU ``xen-save-devices-state``: no RAM in it)
    memory       the guest's RAM, byte for byte (sparse: pages the guest never touched are holes)
    meta.json    {"id", "parent", "machine", "created", "memory_bytes", "dirty_bytes"}

How the memory file is made, as Firecracker does it:

- a guest that booted here runs on its own memory file, mapped shared: the file *is* its RAM, so
  the snapshot is a copy of that file (holes skipped);
- a guest restored from snapshot P runs on P's file mapped private (``share=off``): pages it
  reads come from P's page cache, shared by every guest restored from P; pages it writes become
  private copies in its QEMU process, and P's file is never written. Its snapshot is P's file
  (a reflink where the filesystem has them, else a copy) with only those private pages written
  over it, read from QEMU's memory through ``/proc/<pid>/pagemap`` and ``/proc/<pid>/mem``.

Restore and fork start QEMU on the snapshot's memory file mapped private and load the device
state: nothing of the RAM is read up front, pages fault in as the guest touches them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
import uuid

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
FICLONE = 0x40049409
PAGEMAP_PRESENT, PAGEMAP_SWAPPED, PAGEMAP_FILE = 1 << 63, 1 << 62, 1 << 61
ID_CHARS = 24


def check_id(snapshot: str) -> None:
    if not isinstance(snapshot, str) or len(snapshot) != ID_CHARS or any(c not in "0123456789abcdef" for c in snapshot):
        raise ValueError(f"a VM snapshot id is {ID_CHARS} lowercase hex digits, got {snapshot!r}")


class SnapshotDir:
    """The store of VM snapshots under ``<scratch>/vm/snapshots``."""

    def __init__(self, scratch: str) -> None:
        self.root = os.path.join(scratch, "vm", "snapshots")
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def path(self, snapshot: str) -> str:
        check_id(snapshot)
        return os.path.join(self.root, snapshot)

    def exists(self, snapshot: str) -> bool:
        return os.path.exists(os.path.join(self.path(snapshot), "meta.json"))

    def meta(self, snapshot: str) -> dict:
        try:
            with open(os.path.join(self.path(snapshot), "meta.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise ValueError(f"unknown VM snapshot {snapshot!r}: none in {self.root}") from None

    def staging(self) -> str:
        path = os.path.join(self.root, f".staging-{uuid.uuid4().hex}")
        os.mkdir(path)
        return path

    def commit(self, staging: str, snapshot: str, meta: dict) -> None:
        with open(os.path.join(staging, "meta.json"), "w") as f:
            json.dump(meta, f)
        for name in ("state", "memory"):
            os.chmod(os.path.join(staging, name), 0o400)  # never written again: guests map it private
        try:
            os.rename(staging, self.path(snapshot))
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(staging)  # another process made the same (deterministic) snapshot first

    def list(self) -> list[str]:
        """The ids of the snapshots this store made (a directory with its meta.json, never a link)."""
        return sorted(name for name in os.listdir(self.root) if len(name) == ID_CHARS and _is_hex(name)
                      and not os.path.islink(os.path.join(self.root, name))
                      and os.path.isfile(os.path.join(self.root, name, "meta.json")))

    def gc(self, keep=(), min_age_s: float = 0.0, include_boot: bool = False) -> list[str]:
        """Remove the snapshots not in ``keep``, not the parent of a guest running from this
        scratch directory (its memory file is read by the guest's next snapshot), not younger than
        ``min_age_s`` and, unless ``include_boot``, not a boot snapshot (the cache every create
        restores); also staging directories of dead snapshots. Only directories this store made
        are touched (a snapshot id with its meta.json, or ``.staging-<hex>``); a link is never
        followed. Returns the removed ids."""
        keep = set(keep) | parents_in_use(os.path.join(os.path.dirname(self.root), "run"))
        now = time.time()
        removed = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            if name.startswith(".staging-"):
                if _is_hex(name.removeprefix(".staging-")) and now - os.lstat(path).st_mtime >= max(min_age_s, 3600.0):
                    shutil.rmtree(path, ignore_errors=True)  # an hour: no snapshot takes that long to write
                continue
            try:
                check_id(name)
                meta = self.meta(name)
            except (ValueError, OSError):
                continue  # not one of ours
            if name in keep or (meta.get("boot") and not include_boot):
                continue
            if now - float(meta.get("created", now)) < min_age_s:
                continue
            self.remove(name)
            removed.append(name)
        return sorted(removed)

    def remove(self, snapshot: str) -> None:
        """Delete a snapshot; guests running on its memory keep their mapping (the inode lives on)."""
        path = self.path(snapshot)
        try:
            os.unlink(os.path.join(path, "meta.json"))
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=True)


def export(store: SnapshotDir, snapshot: str) -> dict:
    """A snapshot as plain data for another process or node (``import_``): its meta, its device
    state and its memory file's data runs (holes stay holes)."""
    path = store.path(snapshot)
    with open(os.path.join(path, "state"), "rb") as f:
        state = f.read()
    with open(os.path.join(path, "memory"), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        runs = [(start, os.pread(f.fileno(), end - start, start)) for start, end in data_runs(f.fileno(), size)]
    return {"backend": "vm", "id": snapshot, "meta": store.meta(snapshot), "state": state, "memory_size": size,
            "memory": runs}


def import_(store: SnapshotDir, exported: dict, machine: dict) -> str:
    """Store an exported snapshot here (kept as is when this store has it already); ``machine`` is
    the importing sandbox's machine key: a snapshot of another machine shape is refused."""
    if not isinstance(exported, dict) or exported.get("backend") != "vm":
        raise ValueError("not an exported VM snapshot (export it with k3.sandbox.vm.snapshots.export)")
    snapshot = exported["id"]
    check_id(snapshot)
    if exported["meta"].get("machine") != machine:
        raise ValueError(f"VM snapshot {snapshot} was taken on machine {exported['meta'].get('machine')}, this node "
                         f"runs {machine} (same kernel, initramfs, root disk, RAM, vCPUs and accelerator needed)")
    if store.exists(snapshot):
        return snapshot
    size = int(exported["memory_size"])
    staging = store.staging()
    try:
        with open(os.path.join(staging, "state"), "wb") as f:
            f.write(exported["state"])
        with open(os.path.join(staging, "memory"), "wb") as f:
            for offset, data in exported["memory"]:
                if not (0 <= offset and offset + len(data) <= size):
                    raise ValueError(f"VM snapshot {snapshot}: a memory run past the file's {size} bytes")
                os.pwrite(f.fileno(), data, offset)
            os.ftruncate(f.fileno(), size)
        store.commit(staging, snapshot, dict(exported["meta"], boot=False))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return snapshot


def parents_in_use(run_root: str) -> set[str]:
    """Snapshots whose memory running guests map (each generation directory names its parent;
    a sandbox whose owner process is gone runs no guest: PDEATHSIG killed its QEMU)."""
    parents: set[str] = set()
    for sandbox_id in os.listdir(run_root) if os.path.isdir(run_root) else ():
        directory = os.path.join(run_root, sandbox_id)
        try:
            with open(os.path.join(directory, "owner")) as f:
                if not os.path.exists(f"/proc/{int(f.read().strip())}"):
                    continue
        except (OSError, ValueError):
            pass  # no owner written yet: a sandbox being created; keep what it names
        for generation in os.listdir(directory) if os.path.isdir(directory) else ():
            try:
                with open(os.path.join(directory, generation, "parent")) as f:
                    parents.add(f.read().strip())
            except (FileNotFoundError, NotADirectoryError):
                continue
    return parents


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text)


def new_id() -> str:
    return uuid.uuid4().hex[:ID_CHARS]


def copy_sparse(source: str, target: str) -> int:
    """Copy ``source`` to a new ``target``, skipping holes; return the bytes of data copied."""
    copied = 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        for start, end in data_runs(src.fileno(), size):
            copied += _copy_range(src.fileno(), dst.fileno(), start, end - start)
        os.ftruncate(dst.fileno(), size)
    return copied


def data_runs(fd: int, size: int):
    """The (start, end) byte ranges of a sparse file that hold data, in order (holes skipped)."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:
                return  # only a hole is left
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        offset = end


def _copy_range(src: int, dst: int, start: int, length: int) -> int:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, start + done, start + done)
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            chunk = os.pread(src, min(length - done, 8 << 20), start + done)
            n = os.pwrite(dst, chunk, start + done)
        if n == 0:
            break
        done += n
    return done


def clone_or_copy(source: str, target: str) -> bool:
    """``target`` as a reflink of ``source`` (True) or, where the filesystem has none, a sparse copy."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
            return True
        except OSError:
            pass
    copy_sparse(source, target)
    return False


def private_mapping(pid: int, memory_path: str) -> tuple[int, int]:
    """Start and length of the mapping of ``memory_path`` in process ``pid`` (QEMU's guest RAM)."""
    wanted = os.path.realpath(memory_path)
    with open(f"/proc/{pid}/maps") as f:
        best = None
        for line in f:
            fields = line.split(maxsplit=5)
            # " (deleted)": gc removed the snapshot while this guest runs on it (the inode lives)
            if len(fields) == 6 and fields[5].strip() in (wanted, wanted + " (deleted)"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if best is None or end - start > best[1]:
                    best = (start, end - start)
    if best is None:
        raise RuntimeError(f"QEMU (pid {pid}) has no mapping of {wanted}")
    return best


def read_private_pages(pid: int, memory_path: str) -> list[tuple[int, bytes]]:
    """The pages QEMU ``pid`` holds privately over its mapping of ``memory_path`` (the guest's
    writes since restore), as (offset in the file, bytes) runs. The guest must be stopped."""
    start, length = private_mapping(pid, memory_path)
    runs = []
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap_file, open(f"/proc/{pid}/mem", "rb") as mem:
        raw = os.pread(pagemap_file.fileno(), (length // PAGE) * 8, (start // PAGE) * 8)
        entries = np.frombuffer(raw, dtype=np.uint64)
        private = ((entries & np.uint64(PAGEMAP_PRESENT | PAGEMAP_SWAPPED)) != 0) & ((entries & np.uint64(PAGEMAP_FILE)) == 0)
        edges = np.flatnonzero(np.diff(np.concatenate(([False], private, [False])).astype(np.int8)))
        for first, end in zip(edges[0::2].tolist(), edges[1::2].tolist()):  # runs of private pages
            offset, size = first * PAGE, (end - first) * PAGE
            runs.append((offset, os.pread(mem.fileno(), size, start + offset)))
    return runs


def write_pages(target: str, runs: list[tuple[int, bytes]]) -> int:
    """Write ``runs`` from ``read_private_pages`` over ``target``; return the bytes written."""
    with open(target, "r+b") as out:
        for offset, data in runs:
            os.pwrite(out.fileno(), data, offset)
    return sum(len(data) for _, data in runs)


def allocated_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def meta_for(snapshot: str, parent: str | None, machine: dict, memory: str, dirty: int, boot: bool = False) -> dict:
    return {"id": snapshot, "parent": parent, "machine": machine, "created": time.time(),
            "memory_bytes": allocated_bytes(memory), "dirty_bytes": dirty, "boot": boot}
