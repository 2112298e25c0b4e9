"""What a microVM boots: an initramfs made here and a read-only root disk made from an image.

- The initramfs holds busybox (static), the guest kernel's virtio and overlay modules and the
  agent (``agent.py``). Its ``/init`` mounts the root disk read-only, puts a tmpfs-backed overlay
  over it (so every write the guest makes lives in guest RAM, and a memory snapshot holds the
  files too), and switches into it with the agent as PID 1.
- The root disk is an ext4 image of the same image directory the local backend mounts as its
  bottom layer (``mkfs.ext4 -d``), built once per image and shared read-only by every guest.

Both are built once and kept under ``<home>/vm`` (a name derived from what went into them).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import subprocess
import uuid

from k3.sandbox.image import Image, tree_bytes
from k3.sandbox.vm.config import GUEST_MODULES, VmConfig, VmUnavailable, modules_dir

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")

INIT = """#!/bin/busybox sh
B=/bin/busybox
fail() { echo "k3 init: $*"; $B sleep 1; echo o > /proc/sysrq-trigger; }
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
for module in {modules}; do $B insmod /lib/k3/$module || fail "insmod $module"; done
$B mount -t ext4 -o ro /dev/vda /lower || fail "cannot mount the root disk"
$B mount -t tmpfs -o mode=0755 tmpfs /rw || fail "tmpfs"
$B mkdir -p /rw/upper /rw/work
$B mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || fail "overlay"
$B mkdir -p /newroot/.k3 /newroot/proc /newroot/sys /newroot/dev /newroot/tmp
$B cp /k3/agent.py /newroot/.k3/agent.py
for fs in proc sys dev; do $B mount --move /$fs /newroot/$fs; done
$B mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup || fail "cgroup2"
exec $B switch_root /newroot /usr/bin/python3 -I -S /.k3/agent.py
"""


def vm_home(home: str) -> str:
    path = os.path.join(home, "vm")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def initramfs(config: VmConfig, home: str) -> str:
    """The initramfs for ``config.kernel`` (built on first use); returns its path."""
    modules = modules_dir(config.kernel)
    sources = [os.path.join(modules, module) for module in GUEST_MODULES] + [AGENT, config.busybox]
    for path in sources:
        if not os.path.isfile(path):
            hint = "apt-get install busybox-static" if path == config.busybox else "reinstall the kernel package"
            raise VmUnavailable(f"the guest initramfs needs {path}, which is missing ({hint}); "
                                "or use the local backend (backend='local')")
    key = hashlib.sha256(INIT.encode())
    for path in sources:
        with open(path, "rb") as f:
            key.update(hashlib.sha256(f.read()).digest())
    target = os.path.join(vm_home(home), f"initramfs-{key.hexdigest()[:16]}.cpio.gz")
    if os.path.exists(target):
        return target
    entries = [("bin", None, 0o755), ("lib", None, 0o755), ("lib/k3", None, 0o755), ("k3", None, 0o755)]
    entries += [(d, None, 0o755) for d in ("proc", "sys", "dev", "lower", "rw", "newroot")]
    entries.append(("bin/busybox", config.busybox, 0o755))
    entries += [(f"lib/k3/{os.path.basename(m)}", os.path.join(modules, m), 0o644) for m in GUEST_MODULES]
    entries.append(("k3/agent.py", AGENT, 0o644))
    init = INIT.replace("{modules}", " ".join(os.path.basename(m) for m in GUEST_MODULES)).encode()
    _write_atomic(target, gzip.compress(_cpio(entries, init), compresslevel=1))
    return target


def root_disk(image: Image, home: str) -> str:
    """An ext4 image of ``image.path`` (built on first use with ``mkfs.ext4 -d``); returns its path."""
    mkfs = shutil.which("mkfs.ext4") or shutil.which("mkfs.ext4", path="/sbin:/usr/sbin")
    if mkfs is None:
        raise VmUnavailable("mkfs.ext4 is missing (apt-get install e2fsprogs); or use the local backend")
    st = os.stat(image.path)
    key = hashlib.sha256(f"{image.path}\0{st.st_ino}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = os.path.join(vm_home(home), f"root-{os.path.basename(image.path)}-{key}.ext4")
    if os.path.exists(target):
        return target
    size_mb = tree_bytes(image.path) * 13 // 10 // (1 << 20) + 64
    staging = f"{target}.{uuid.uuid4().hex[:8]}.staging"
    try:
        done = subprocess.run([mkfs, "-q", "-F", "-O", "^has_journal", "-m", "0", "-L", "k3root", "-d", image.path,
                               staging, f"{size_mb}M"], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise VmUnavailable(f"mkfs.ext4 -d {image.path} failed: {done.stderr.strip()}")
        os.chmod(staging, 0o444)
        os.rename(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _write_atomic(target: str, data: bytes) -> None:
    staging = f"{target}.{uuid.uuid4().hex[:8]}.staging"
    with open(staging, "wb") as f:
        f.write(data)
    os.rename(staging, target)


def _cpio(entries: list[tuple[str, str | None, int]], init: bytes) -> bytes:
    """A newc cpio archive: directories (source None), files copied from the host, and /init."""
    out = io.BytesIO()
    inode = 1

    def add(name: str, mode: int, data: bytes) -> None:
        nonlocal inode
        header = "070701" + "".join(f"{v:08x}" for v in (inode, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0,
                                                            len(name) + 1, 0))
        out.write(header.encode() + name.encode() + b"\0")
        out.write(b"\0" * (-out.tell() % 4))
        out.write(data)
        out.write(b"\0" * (-out.tell() % 4))
        inode += 1

    for name, source, perm in entries:
        if source is None:
            add(name, 0o040000 | perm, b"")
        else:
            with open(source, "rb") as f:
                add(name, 0o100000 | perm, f.read())
    add("init", 0o100755, init)
    add("TRAILER!!!", 0, b"")
    return out.getvalue()
