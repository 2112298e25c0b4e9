"""Where the sandbox keeps its images, layers and per-sandbox run directories.

``K3_SANDBOX_HOME`` overrides the default (``/var/lib/k3/sandbox`` for root, else
``~/.cache/k3/sandbox``). Overlay needs each sandbox's upper and work directories on one real
filesystem (not itself an overlay), so the home must live on such a filesystem.
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
    for sub in ("images", "layers", "run"):
        os.makedirs(os.path.join(home, sub), mode=0o700, exist_ok=True)
    return home
