"""Memory snapshots: ``Sandbox.snapshot(memory=True)`` and their return on restore and fork.

CRIU cannot run on every kernel (``criu.py`` says why it fails here), so k3 checkpoints the
processes it starts itself, the Python REPLs of ``repl.py``, by a path of its own:

1. each running REPL pickles its namespace to ``/.k3/memory/<name>.pkl`` inside the sandbox
   (its own functions and classes by value, modules by name; see ``repl_server.py``);
2. a manifest (``/.k3/memory/manifest.json``) lists them, and the filesystem is snapshotted as
   usual, so the memory travels inside the layer: export/import between machines needs nothing new;
3. the files are removed from the live sandbox, so a later files-only snapshot holds no stale state.

On ``restore`` or ``fork`` from such a snapshot, the host reads the manifest through the layer chain
(no round trip into the sandbox when there is none), starts each REPL and loads its state, then
removes the files again. What is NOT kept: processes other than k3's REPLs (a server started with
``exec("server &")`` is gone after restore, as in a files-only snapshot), and values a REPL cannot
pickle (open files, sockets, threads, generators), which the manifest lists as skipped.
"""

from __future__ import annotations

import json
import os
import stat
import time

from k3.sandbox import criu

MEMORY_DIR = "/.k3/memory"
MANIFEST = MEMORY_DIR + "/manifest.json"
BACKEND = "k3-repl-checkpoint"
OPAQUE_XATTR = "trusted.overlay.opaque"


def backend() -> dict:
    """Which memory-snapshot path this machine uses, and why: {"backend", "criu", "processes"}."""
    probe = criu.status()
    return {"backend": BACKEND, "criu": probe.detail, "criu_works": probe.works,
            "processes": "the sandbox's Python REPLs (Sandbox.repl); other processes are not saved"}


def take(box) -> str:
    """Save every running REPL of ``box`` and snapshot the filesystem with it; return the id."""
    repls = [repl for repl in box._repls.values() if repl.alive]
    entries, files = [], [MANIFEST]
    try:
        for repl in repls:
            path = f"{MEMORY_DIR}/{repl.name}.pkl"
            files.append(path)
            saved = repl.dump(path)
            entries.append({"name": repl.name, "python": repl.python, "state": path, "bytes": saved["bytes"],
                            "names": saved["names"], "skipped": saved["skipped"]})
        manifest = {"backend": BACKEND, "created": time.time(), "repls": entries}
        box.write_file(MANIFEST, json.dumps(manifest, indent=1))
        return box.snapshot()
    finally:
        box._request({"op": "remove", "files": files, "dirs": [MEMORY_DIR, os.path.dirname(MEMORY_DIR)]})


def manifest_of(box) -> dict | None:
    """The memory manifest visible in ``box``'s layer chain now, read on the host, or None."""
    layers = os.path.join(box.scratch, "layers")
    parts = MANIFEST.strip("/").split("/")
    for layer in box.chain:  # top layer first, as overlay stacks them
        path = os.path.join(layers, layer)
        for depth, part in enumerate(parts):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break  # not in this layer: look below, unless a parent hid the lower ones
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return None  # a whiteout: removed in this layer
            if depth == len(parts) - 1:
                if not stat.S_ISREG(st.st_mode):
                    return None
                with open(path) as f:
                    return json.load(f)
            if not stat.S_ISDIR(st.st_mode):
                return None
            try:
                if os.getxattr(path, OPAQUE_XATTR) == b"y":
                    # An opaque directory hides the layers below; the file would be here.
                    child = os.path.join(layers, layer, *parts)
                    if not os.path.isfile(child):
                        return None
            except OSError:
                pass
    return None


def resume(box) -> list[str]:
    """Bring back the REPLs that the snapshot under ``box`` holds; return their names."""
    manifest = manifest_of(box)
    if manifest is None:
        return []
    if manifest.get("backend") != BACKEND:
        raise ValueError(f"snapshot memory was saved by {manifest.get('backend')!r}, this k3 restores {BACKEND!r}")
    names, files = [], [MANIFEST]
    try:
        for entry in manifest.get("repls", []):
            repl = box.repl(entry["name"], entry.get("python", "python3"))
            repl.close()
            repl.load(entry["state"])
            files.append(entry["state"])
            names.append(entry["name"])
    finally:
        box._request({"op": "remove", "files": files, "dirs": [MEMORY_DIR, os.path.dirname(MEMORY_DIR)]})
    return names
