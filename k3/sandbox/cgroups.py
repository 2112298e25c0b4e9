"""Resource limits and freezing through cgroups, v2 where the kernel offers it, v1 otherwise.

One ``Cgroup`` per sandbox, named ``k3-sandbox/<sandbox id>`` in every hierarchy it uses. The
supervisor and, through inheritance, every process of the sandbox live in it, which gives:

- limits: memory (the OOM killer acts inside the group), pids (fork bombs stop at the limit), cpu;
- pause/resume: the freezer stops every task at once;
- cleanup: the group lists every process that must be gone before it can be removed.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
PARENT = "k3-sandbox"
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
FREEZE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Limits:
    """Per-sandbox resource limits. ``None`` means no limit.

    memory_mb: hard memory limit (RSS + page cache + tmpfs) in MiB; the OOM killer acts beyond it.
    pids: most tasks (processes and threads) at once; stops fork bombs.
    cpus: CPU time as a number of cores (0.5 = half a core), enforced by CFS quota.
    disk_mb: size of the writable layer in MiB (a tmpfs of that size, so what the sandbox writes
        also counts against memory_mb); None puts it on the scratch directory's disk, unbounded.
    inodes: most files and directories in the writable layer (with disk_mb only).
    open_files: RLIMIT_NOFILE of every process; with ``pids`` it bounds the sandbox's open files.
    """

    memory_mb: int | None = 512
    pids: int | None = 256
    cpus: float | None = 1.0
    disk_mb: int | None = 1024
    inodes: int | None = 65536
    open_files: int | None = 1024

    def __post_init__(self) -> None:
        if self.memory_mb is not None and self.memory_mb < 16:
            raise ValueError(f"Limits.memory_mb must be at least 16 (MiB) or None, got {self.memory_mb}")
        if self.pids is not None and self.pids < 8:
            raise ValueError(f"Limits.pids must be at least 8 or None, got {self.pids}")
        if self.cpus is not None and not self.cpus > 0:
            raise ValueError(f"Limits.cpus must be a positive number of cores or None, got {self.cpus}")
        if self.disk_mb is not None and not (isinstance(self.disk_mb, int) and self.disk_mb >= 1):
            raise ValueError(f"Limits.disk_mb must be a whole number of MiB >= 1 or None, got {self.disk_mb!r}")
        if self.inodes is not None and not (isinstance(self.inodes, int) and self.inodes >= 64):
            raise ValueError(f"Limits.inodes must be at least 64 or None, got {self.inodes!r}")
        if self.open_files is not None and not (isinstance(self.open_files, int) and self.open_files >= 16):
            raise ValueError(f"Limits.open_files must be at least 16 or None, got {self.open_files!r}")


def cgroup2_mount() -> str | None:
    """Where a cgroup v2 hierarchy is mounted (the root, or /sys/fs/cgroup/unified beside v1)."""
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[2] == "cgroup2":
                return fields[1]
    return None


def detect() -> str | None:
    """'v2' when the unified hierarchy at /sys/fs/cgroup has memory and pids, 'v1' when the v1
    controllers are mounted, None when neither is usable (not root, or no cgroupfs)."""
    controllers = os.path.join(CGROUP_ROOT, "cgroup.controllers")
    if os.path.exists(controllers):
        with open(controllers) as f:
            available = f.read().split()
        if {"memory", "pids"} <= set(available) and os.access(CGROUP_ROOT, os.W_OK):
            return "v2"
    if all(os.path.isdir(os.path.join(CGROUP_ROOT, c)) for c in V1_CONTROLLERS) and os.access(
        os.path.join(CGROUP_ROOT, "memory"), os.W_OK
    ):
        return "v1"
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _rmdir_when_empty(path: str, attempts: int = 2000) -> None:
    # The kernel refuses (EBUSY) until the last task is gone; tasks killed a moment ago may
    # still be exiting, so wait for them rather than leave the group behind.
    for _ in range(attempts):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
            time.sleep(0.005)
    raise RuntimeError(f"cgroup {path} still has tasks after they were killed")


class Cgroup:
    """The cgroup(s) of one sandbox. Use ``Cgroup.create(name, limits)``."""

    version: str

    @staticmethod
    def create(name: str) -> "Cgroup":
        """A new, empty group with no limits yet (see ``set_limits``)."""
        version = detect()
        if version == "v2":
            return CgroupV2(name)
        if version == "v1":
            return CgroupV1(name)
        raise RuntimeError(
            "no usable cgroup hierarchy: the sandbox needs root and either cgroup v2 with the memory and "
            "pids controllers at /sys/fs/cgroup or the v1 memory, pids, cpu and freezer controllers"
        )

    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join this group (one per hierarchy)."""
        raise NotImplementedError

    def set_limits(self, limits: Limits) -> None:
        raise NotImplementedError

    def add(self, pid: int) -> None:
        for path in self.procs_files():
            _write(path, str(pid))

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> None:
        """Stop every task of the group; TimeoutError when they are not all stopped in ``timeout`` s."""
        raise NotImplementedError

    def thaw(self) -> None:
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def memory_bytes(self) -> int:
        raise NotImplementedError

    def oom_kills(self) -> int:
        raise NotImplementedError

    def pids_max_hits(self) -> int:
        raise NotImplementedError

    def kill_all(self) -> None:
        """SIGKILL every task, freezing first so that none can fork while it is being killed."""
        try:
            self.freeze()
        except TimeoutError:
            pass  # kill what can be killed; the caller waits for the group to empty
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.thaw()

    def remove(self) -> None:
        raise NotImplementedError


class CgroupV1(Cgroup):
    version = "v1"

    def __init__(self, name: str):
        self.paths = {c: os.path.join(CGROUP_ROOT, c, PARENT, name) for c in V1_CONTROLLERS}
        for path in self.paths.values():
            os.makedirs(path, exist_ok=True)

    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in self.paths.values()]

    def set_limits(self, limits: Limits) -> None:
        memory = self.paths["memory"]
        if limits.memory_mb is not None:
            limit = limits.memory_mb << 20
            files = [os.path.join(memory, "memory.limit_in_bytes")]
            memsw = os.path.join(memory, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # with swap accounting, swap must not become a way around
                # The kernel refuses (EINVAL) a memory limit above memsw's: raise memsw first, lower it last.
                raising = limit > int(_read(files[0]))
                files = [memsw, files[0]] if raising else [files[0], memsw]
            for path in files:
                _write(path, str(limit))
        if limits.pids is not None:
            _write(os.path.join(self.paths["pids"], "pids.max"), str(limits.pids))
        if limits.cpus is not None:
            period = 100_000
            _write(os.path.join(self.paths["cpu"], "cpu.cfs_period_us"), str(period))
            _write(os.path.join(self.paths["cpu"], "cpu.cfs_quota_us"), str(int(limits.cpus * period)))

    def _freezer_state(self) -> str:
        return _read(os.path.join(self.paths["freezer"], "freezer.state")).strip()

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> None:
        _write(os.path.join(self.paths["freezer"], "freezer.state"), "FROZEN")
        deadline = time.monotonic() + timeout
        while self._freezer_state() != "FROZEN":  # FREEZING until every task has stopped
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.paths['freezer']} did not freeze within {timeout} s "
                                   f"(a task in uninterruptible sleep?)")
            time.sleep(0.0005)

    def thaw(self) -> None:
        _write(os.path.join(self.paths["freezer"], "freezer.state"), "THAWED")

    def pids(self) -> list[int]:
        return [int(line) for line in _read(os.path.join(self.paths["pids"], "cgroup.procs")).split()]

    def memory_bytes(self) -> int:
        return int(_read(os.path.join(self.paths["memory"], "memory.usage_in_bytes")))

    def oom_kills(self) -> int:
        for line in _read(os.path.join(self.paths["memory"], "memory.oom_control")).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids_max_hits(self) -> int:
        return _events(os.path.join(self.paths["pids"], "pids.events"), "max")

    def remove(self) -> None:
        if self.pids():
            self.kill_all()
        for path in self.paths.values():
            _rmdir_when_empty(path)


class CgroupV2(Cgroup):
    version = "v2"

    def __init__(self, name: str, root: str | None = None):
        root = root or CGROUP_ROOT
        parent = os.path.join(root, PARENT)
        os.makedirs(parent, exist_ok=True)
        self.controllers = {"memory", "pids", "cpu"} & set(_read(os.path.join(root, "cgroup.controllers")).split())
        if self.controllers:
            for directory in (root, parent):
                _write(os.path.join(directory, "cgroup.subtree_control"), " ".join("+" + c for c in sorted(self.controllers)))
        self.path = os.path.join(parent, name)
        os.makedirs(self.path, exist_ok=True)

    def procs_files(self) -> list[str]:
        return [os.path.join(self.path, "cgroup.procs")]

    def set_limits(self, limits: Limits) -> None:
        # detect() only picks v2 when memory and pids are available; cpu may be missing.
        if limits.memory_mb is not None and "memory" in self.controllers:
            _write(os.path.join(self.path, "memory.max"), str(limits.memory_mb << 20))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                _write(os.path.join(self.path, "memory.swap.max"), "0")
        if limits.pids is not None and "pids" in self.controllers:
            _write(os.path.join(self.path, "pids.max"), str(limits.pids))
        if limits.cpus is not None and "cpu" in self.controllers:
            _write(os.path.join(self.path, "cpu.max"), f"{int(limits.cpus * 100_000)} 100000")

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> None:
        _write(os.path.join(self.path, "cgroup.freeze"), "1")
        deadline = time.monotonic() + timeout
        while "frozen 1" not in _read(os.path.join(self.path, "cgroup.events")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.path} did not freeze within {timeout} s")
            time.sleep(0.0005)

    def thaw(self) -> None:
        _write(os.path.join(self.path, "cgroup.freeze"), "0")

    def pids(self) -> list[int]:
        return [int(line) for line in _read(os.path.join(self.path, "cgroup.procs")).split()]

    def memory_bytes(self) -> int:
        return int(_read(os.path.join(self.path, "memory.current")))

    def oom_kills(self) -> int:
        return _events(os.path.join(self.path, "memory.events"), "oom_kill")

    def pids_max_hits(self) -> int:
        return _events(os.path.join(self.path, "pids.events"), "max")

    def kill_all(self) -> None:
        kill = os.path.join(self.path, "cgroup.kill")
        if os.path.exists(kill):  # one write kills the whole group, forks included
            _write(kill, "1")
        else:
            super().kill_all()

    def remove(self) -> None:
        if self.pids():
            self.kill_all()
        _rmdir_when_empty(self.path)


def _events(path: str, key: str) -> int:
    try:
        text = _read(path)
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def leftover_groups() -> list[str]:
    """Sandbox cgroups that still exist (for tests and ``k3 sandbox doctor``)."""
    found = []
    for base in [os.path.join(CGROUP_ROOT, c, PARENT) for c in V1_CONTROLLERS] + [os.path.join(CGROUP_ROOT, PARENT)]:
        if os.path.isdir(base):
            found += [os.path.join(base, name) for name in os.listdir(base) if os.path.isdir(os.path.join(base, name))]
    return found
