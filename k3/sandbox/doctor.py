"""``k3 sandbox doctor``: what this machine offers the sandbox, and what is missing.

Required: root, unshare(1), overlayfs, new namespaces, a usable cgroup hierarchy, and a scratch
directory on a filesystem that can hold an overlay upper. Optional: CRIU (``criu check``); where it
fails, memory snapshots use k3's own checkpoint of its Python REPLs (``memory.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from k3.sandbox import cgroups


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mount_point = fields[1]
            if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) >= len(best):
                best, kind = mount_point, fields[2]
    return kind


def run_checks() -> list[Check]:
    """Every check, required ones first; nothing here changes the machine beyond a probe."""
    checks = [Check("root", os.geteuid() == 0, f"euid {os.geteuid()}")]
    unshare = shutil.which("unshare")
    checks.append(Check("unshare(1)", unshare is not None, unshare or "missing: apt-get install util-linux"))
    if unshare:
        probe = subprocess.run([unshare, "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "true"],
                               capture_output=True, text=True)
        checks.append(Check("namespaces (mount, pid, net, ipc, uts)", probe.returncode == 0,
                            "can be created" if probe.returncode == 0 else probe.stderr.strip()))
    with open("/proc/filesystems") as f:
        overlay = "overlay" in f.read()
    checks.append(Check("overlayfs", overlay, "in /proc/filesystems" if overlay else "kernel has no overlay module"))
    version = cgroups.detect()
    detail = {"v2": "cgroup v2 (memory, pids, cpu; freeze, kill)",
              "v1": "cgroup v1 controllers memory, pids, cpu, freezer"}.get(version, "no usable hierarchy")
    checks.append(Check("cgroups", version is not None, detail))
    try:
        from k3.sandbox.paths import sandbox_home, scratch_dir

        home = sandbox_home()
        scratch = scratch_dir(home)
        kind = _fs_type(scratch)
        checks.append(Check("scratch directory", kind not in ("overlay", "?"), f"{scratch} on {kind}"))
    except OSError as error:
        checks.append(Check("scratch directory", False, str(error)))
    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    checks.append(Check("python3 for the default image", python is not None, python or "missing"))
    from k3.sandbox import criu, memory, seccomp

    checks.append(Check("seccomp filter", seccomp.filter_bpf() is not None, seccomp.status(), required=False))

    probe = criu.status()
    checks.append(Check("criu (memory snapshots)", probe.works, probe.detail, required=False))
    bwrap = shutil.which("bwrap")
    checks.append(Check("bubblewrap", bwrap is not None, (bwrap or "not installed") + " (not needed: unshare(1) is used)",
                        required=False))
    checks.append(Check("snapshot contents", True, "snapshot(): filesystem only; snapshot(memory=True): also the "
                        "sandbox's Python REPLs with their variables", required=False))
    checks.append(Check("memory snapshots", True, f"{memory.BACKEND}: k3 pickles each REPL's namespace into a memory image "
                        "beside the snapshot's layer" + (" (criu check passes, but k3 does not use CRIU)" if probe.works else " (CRIU is not used: its check fails here)")
                        + "; other processes are not saved", required=False))
    return checks


def report(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        mark = "ok  " if check.ok else ("FAIL" if check.required else "no  ")
        lines.append(f"[{mark}] {check.name}: {check.detail}")
    ready = all(check.ok for check in checks if check.required)
    lines.append("ready: sandboxes can run here" if ready else "not ready: fix the FAIL lines above")
    return "\n".join(lines)
