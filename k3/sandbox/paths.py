"""Where the sandbox keeps its images, layers and per-sandbox run directories.

``K3_SANDBOX_HOME`` overrides the default (``/var/lib/k3/sandbox`` for root, else
``~/.cache/k3/sandbox``); images are built there. Snapshot layers and the sandboxes' writable
upper directories go to ``K3_SANDBOX_SCRATCH`` (default: the home). Pointing the scratch at a
tmpfs (``/dev/shm/k3``) makes snapshots several times faster, at the price of RAM and of losing
snapshots at reboot. Overlay needs the upper and work directories on one filesystem that is not
itself an overlay.

The sandbox's other settings from the environment are read here too (the one place it reads it):
``K3_SANDBOX_SPARES`` and ``K3_SANDBOX_DEBUG``.
"""

from __future__ import annotations

import os


def sandbox_home() -> str:
    """The sandbox home directory, created if missing (with images/, layers/, run/ inside)."""
    home = os.environ.get("K3_SANDBOX_HOME")
    if not home:
        if os.geteuid() == 0:
            home = "/var/lib/k3/sandbox"
        else:
            home = os.path.join(os.path.expanduser("~"), ".cache", "k3", "sandbox")
    home = os.path.abspath(home)
    for sub in ("images",):
        os.makedirs(os.path.join(home, sub), mode=0o700, exist_ok=True)
    return home


def scratch_dir(home: str | None = None) -> str:
    """Where layers/, memory/ and run/ live (each mode 0700) (``K3_SANDBOX_SCRATCH``, default: the sandbox home)."""
    scratch = os.path.abspath(os.environ.get("K3_SANDBOX_SCRATCH") or home or sandbox_home())
    if any(c in scratch for c in ",:\\\n"):
        raise ValueError(f"the sandbox scratch directory must not contain ',', ':', '\\' or a newline "
                         f"(overlay's option syntax uses them); got {scratch!r}")
    # Snapshots and uppers hold what sandboxes wrote: no host user but root may even look inside.
    for sub in ("layers", "run", "memory"):
        path = os.path.join(scratch, sub)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    return scratch


def spare_supervisors() -> int:
    """How many idle supervisors to keep ready (``K3_SANDBOX_SPARES``, default 2; 0 disables)."""
    raw = os.environ.get("K3_SANDBOX_SPARES", "2")
    if not raw.isdigit():
        raise ValueError(f"K3_SANDBOX_SPARES must be a count of spare supervisors (0 or more), got {raw!r}")
    return int(raw)


def supervisor_debug() -> bool:
    """``K3_SANDBOX_DEBUG`` set (non-empty): supervisors keep their stderr, for debugging the sandbox itself."""
    return bool(os.environ.get("K3_SANDBOX_DEBUG"))


def path_environment() -> dict[str, str]:
    """The sandbox path variables set here (``K3_SANDBOX_HOME``, ``K3_SANDBOX_SCRATCH``), for worker processes
    elsewhere (Ray rollout workers) to use the same sandbox directories."""
    return {name: os.environ[name] for name in ("K3_SANDBOX_HOME", "K3_SANDBOX_SCRATCH") if name in os.environ}
