"""Whether CRIU can checkpoint processes on this machine, and why not when it cannot.

CRIU (Checkpoint/Restore In Userspace) would give memory snapshots of any process. On kernels whose
vDSO layout is newer than the installed CRIU knows (Debian 12's criu 3.17.1 on kernel 6.18 says
"vdso: Unexpected rt vDSO area bounds"), every criu command fails at start, ``criu check``
included: nothing can be dumped. k3 then uses its own checkpoint of the processes it starts (the
Python REPLs, ``memory.py``). This module only probes; it never changes the machine.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class CriuStatus:
    """installed: a criu binary is on PATH. works: ``criu check`` passed. detail: its version, or
    the last error line it printed."""

    installed: bool
    works: bool
    detail: str


_status: CriuStatus | None = None


def status(refresh: bool = False) -> CriuStatus:
    """Probe ``criu --version`` and ``criu check`` once per process (cached)."""
    global _status
    if _status is not None and not refresh:
        return _status
    criu = shutil.which("criu") or shutil.which("criu", path="/usr/sbin:/sbin:/usr/local/sbin")
    if criu is None:
        _status = CriuStatus(False, False, "not installed (apt-get install criu)")
        return _status
    version = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=30)
    version_line = (version.stdout.strip().splitlines() or ["?"])[0]
    try:
        probe = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        _status = CriuStatus(True, False, f"{version_line}: criu check did not finish in 60 s")
        return _status
    lines = [line for line in (probe.stdout + probe.stderr).strip().splitlines() if line.strip()]
    if probe.returncode == 0:
        _status = CriuStatus(True, True, f"{version_line}: criu check passes")
    else:
        # The first error names the cause; later ones are its consequences.
        errors = [line for line in lines if "Error" in line and "exited, status" not in line]
        reason = (errors or lines or ["exit status %d" % probe.returncode])[0]
        _status = CriuStatus(True, False, f"{version_line}: criu check fails: {reason}")
    return _status
