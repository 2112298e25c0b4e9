"""What a crashed owner leaves behind, and ``collect``, which removes it (``k3 sandbox gc``).

Every supervisor records its owner (the host process that started it: pid and start time, so a
reused pid is not mistaken for it) in ``<tmp>/.k3-sandbox-owners/<name>``, and every sandbox in
``run/<id>/owner`` (a group without a record, from an older k3, belongs to the live parent of its
processes, if any). When the owner dies, a sandbox's PID 1 notices (its request pipe closes, even
in the middle of a command or a REPL cell) and exits, which ends every process of the sandbox;
only a paused (frozen) sandbox cannot notice. ``collect`` then finds, by their dead owners, the
cgroups (killing what is still in them, frozen or not), run directories, staging directories and
owner records, and removes those older than its age limit.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

from k3.sandbox import cgroups, untrusted

OWNER_FILE = "owner"  # in run/<sandbox id>/


def owners_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), ".k3-sandbox-owners")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def identity(pid: int) -> str | None:
    """``pid:start-ticks`` of a live process, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return f"{pid}:{int(stat[stat.rindex(b')') + 2 :].split()[19])}"


_me: tuple[int, str] | None = None


def me() -> str:
    """This process's identity (recomputed after a fork)."""
    global _me
    if _me is None or _me[0] != os.getpid():
        _me = (os.getpid(), identity(os.getpid()) or str(os.getpid()))
    return _me[1]


def record_owner(path: str) -> None:
    """Write this process's identity to ``path`` (atomically)."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        f.write(me())
    os.rename(tmp, path)


def owner_alive(path: str) -> bool | None:
    """True when the owner recorded in ``path`` still runs, False when it is gone, None without a record."""
    try:
        with open(path) as f:
            recorded = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    pid = recorded.split(":")[0]
    return pid.isdigit() and identity(int(pid)) == recorded


def _parent_alive(pids: list[int]) -> bool:
    """True when a process of the group has a live parent outside it other than init: the owner
    of a sandbox started before owners were recorded."""
    inside = set(pids)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
        if parent not in inside and parent > 1 and identity(parent) is not None:
            return True
    return False


def _old(path: str, min_age_s: float, now: float) -> bool:
    try:
        return now - os.lstat(path).st_mtime >= min_age_s
    except FileNotFoundError:
        return False


def collect(scratch: str, min_age_s: float = 3600.0) -> dict:
    """Remove what sandboxes of dead owners left: return counts of what went.

    {"processes": killed, "cgroups": removed, "run_dirs": removed, "staging": removed directories
    and temporary files, "owner_records": removed}. Nothing of a live owner is touched, nor
    anything younger than ``min_age_s`` seconds."""
    now = time.time()
    counts = {"processes": 0, "cgroups": 0, "run_dirs": 0, "staging": 0, "owner_records": 0}
    owners = owners_dir()
    names = {os.path.basename(path): path for path in cgroups.leftover_groups()}
    for name, path in sorted(names.items()):
        if not _old(path, min_age_s, now):
            continue
        alive = owner_alive(os.path.join(owners, name))
        group = cgroups.Cgroup.create(name)
        pids = group.pids()
        if alive or (alive is None and _parent_alive(pids)):
            continue  # a live owner, recorded or (for a group without a record) found as a parent
        counts["processes"] += len(pids)
        group.thaw()  # a frozen task cannot die
        group.remove()  # kills what is left (freeze, SIGKILL), waits for it, removes the group
        counts["cgroups"] += 1
        if alive is False:
            os.unlink(os.path.join(owners, name))
            counts["owner_records"] += 1
    for name in os.listdir(owners):
        record = os.path.join(owners, name)
        if name not in names and not owner_alive(record) and _old(record, min_age_s, now):
            os.unlink(record)
            counts["owner_records"] += 1
    run = os.path.join(scratch, "run")
    for name in os.listdir(run) if os.path.isdir(run) else ():
        path = os.path.join(run, name)
        if owner_alive(os.path.join(path, OWNER_FILE)) or not _old(path, min_age_s, now):
            continue
        untrusted.remove_tree(path)
        counts["run_dirs"] += 1
    # Half-written layers and memory images of a crashed snapshot, import or squash.
    for directory, is_staging in ((os.path.join(scratch, "layers"), lambda n: n.startswith(".")),
                                  (os.path.join(scratch, "memory"), lambda n: n.endswith(".staging"))):
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            path = os.path.join(directory, name)
            if is_staging(name) and _old(path, min_age_s, now):
                untrusted.remove_tree(path)
                counts["staging"] += 1
    return counts
