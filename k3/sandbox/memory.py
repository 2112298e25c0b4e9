"""Memory snapshots: ``Sandbox.snapshot(memory=True)`` and their return on restore and fork.

CRIU cannot run on every kernel (``criu.py`` says why it fails here), so k3 checkpoints the
processes it starts itself, the Python REPLs of ``repl.py``, by a path of its own:

1. each running REPL pickles its namespace to ``/.k3/memory/<name>.pkl`` inside the sandbox
   (its own functions and classes by value, modules by name; see ``repl_server.py``);
2. the host copies each file out of the sandbox's upper directory into a *memory image*,
   ``<scratch>/memory/<image id>/root/.k3/memory/<name>.pkl``, opening it as untrusted input
   (``untrusted.py``: no link followed, a regular file of bounded size, holes kept, mode 0600):
   a copy, because a hard link or an open descriptor kept inside the sandbox would let it change
   the snapshot later. The manifest records each copy's SHA-256, checked before a restore mounts
   it; beside ``root`` the image keeps the SHA-256 of the one manifest allowed to mount it, so a
   manifest forged inside a sandbox cannot name another's image;
3. a small manifest naming the image (``/.k3/memory/manifest.json``) is written and the
   filesystem is snapshotted as usual (so the layer holds only the manifest), then the manifest is
   removed from the live sandbox, so a later files-only snapshot holds no stale state.

On ``restore`` or ``fork`` from such a snapshot the host finds the manifest through the layer chain
(a few ``lstat``, no round trip when there is none), mounts the memory image as the topmost
read-only layer of the new root, starts each REPL and loads its file, then removes the files from
view again. Memory images live as long as a layer names them: ``collect`` (run by the snapshot
GC) removes the others; ``export_images`` / ``import_images`` ship them with a snapshot.

Services started with ``Sandbox.start_service`` are recorded in the manifest and started again
from their command on restore/fork (so a server listens again; its own memory is not kept).
What is NOT kept: other processes (a server started with ``exec("server &")`` is gone after
restore, as in a files-only snapshot), and values a REPL cannot pickle (open files, sockets,
threads, generators), which the manifest lists as skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
import uuid

from k3.sandbox import criu, untrusted
from k3.sandbox.local import SandboxError

MEMORY_DIR = "/.k3/memory"
MANIFEST = MEMORY_DIR + "/manifest.json"
BACKEND = "k3-repl-checkpoint"
OPAQUE_XATTR = "trusted.overlay.opaque"
IMAGES = "memory"  # under the scratch directory, beside layers/
SEAL = "manifest.sha256"  # in an image: the hash of the one manifest allowed to mount it
MAX_MANIFEST_BYTES = 1 << 20  # a manifest names an image and a few REPLs: a megabyte is absurd already
# A REPL's pickled namespace cannot be much larger than the memory it lived in.
STATE_BYTES_PER_MEMORY_BYTE = 2
MAX_STATE_BYTES = 8 << 30  # for sandboxes without a memory limit


def backend() -> dict:
    """Which memory-snapshot path this machine uses, and why: {"backend", "criu", "processes"}."""
    probe = criu.status()
    return {"backend": BACKEND, "criu": probe.detail, "criu_works": probe.works,
            "processes": "the sandbox's Python REPLs (Sandbox.repl); other processes are not saved"}


def image_dir(scratch: str, image_id: str) -> str:
    if not image_id or not all(c in "0123456789abcdef" for c in image_id):
        raise ValueError(f"a memory image id is hexadecimal, got {image_id!r}")
    return os.path.join(scratch, IMAGES, image_id)


def _remove_in_box(box, files: list[str]) -> None:
    box._request({"op": "remove", "files": files, "dirs": [MEMORY_DIR, os.path.dirname(MEMORY_DIR)]})


def max_state_bytes(box) -> int:
    """The largest REPL state file a snapshot of ``box`` takes (bounded by its memory limit)."""
    if box.limits.memory_mb is None:
        return MAX_STATE_BYTES
    return STATE_BYTES_PER_MEMORY_BYTE * (box.limits.memory_mb << 20)


def _copy_state(box, path: str, target: str) -> tuple[int, str]:
    """Copy the state file ``path`` (just written through the overlay, so in the upper directory)
    to ``target`` as untrusted input; return (bytes, sha256)."""
    try:
        fd, st = untrusted.open_beneath(box._upper, path, max_state_bytes(box))
    except (OSError, ValueError) as error:
        raise SandboxError(f"the REPL state file {path} cannot be saved: {error} (it must be a regular file, "
                           f"not a link, a FIFO or a file below a linked directory)") from None
    try:
        return st.st_size, untrusted.copy_fd(fd, st.st_size, target)
    finally:
        os.close(fd)


def take(box) -> str:
    """Save every running REPL of ``box`` and snapshot the filesystem with it; return the id."""
    repls = [repl for repl in box._repls.values() if repl.alive]
    image_id = uuid.uuid4().hex
    staging = image_dir(box.scratch, image_id) + ".staging"
    target = os.path.join(staging, "root", MEMORY_DIR.lstrip("/"))
    entries, files = [], [MANIFEST]
    try:
        os.makedirs(os.path.join(box.scratch, IMAGES), mode=0o700, exist_ok=True)
        os.makedirs(target, mode=0o700)
        for repl in repls:
            path = f"{MEMORY_DIR}/{repl.name}.pkl"
            files.append(path)
            saved = repl.dump(path)
            size, digest = _copy_state(box, path, os.path.join(target, f"{repl.name}.pkl"))
            entries.append({"name": repl.name, "python": repl.python, "state": path, "bytes": size,
                            "sha256": digest, "names": saved["names"], "skipped": saved["skipped"]})
        _remove_in_box(box, files[1:])  # the layer must not copy (and hash) the state files
        manifest = {"backend": BACKEND, "image": image_id, "created": time.time(), "repls": entries,
                    "services": dict(box._services)}
        data = json.dumps(manifest, indent=1).encode()
        # The image accepts only this very manifest: one written by a process in a sandbox that
        # names another sandbox's image cannot mount it (see lower_for).
        with open(os.path.join(staging, SEAL), "w") as f:
            f.write(hashlib.sha256(data).hexdigest())
        os.rename(staging, image_dir(box.scratch, image_id))
        box.write_file(MANIFEST, data)
        return box.snapshot()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_in_box(box, files)


def manifest_in_chain(scratch: str, chain: list[str]) -> dict | None:
    """The memory manifest visible through the layer ``chain`` (top first), read on the host, or None."""
    layers = os.path.join(scratch, "layers")
    parts = MANIFEST.strip("/").split("/")
    for layer in chain:  # top layer first, as overlay stacks them
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
                try:
                    raw = untrusted.read_beneath(os.path.join(layers, layer), MANIFEST, MAX_MANIFEST_BYTES)
                except OSError:
                    return None  # swapped, too big: no manifest k3 wrote
                try:
                    manifest = json.loads(raw)
                except ValueError:
                    return None
                if isinstance(manifest, dict):
                    manifest["_sha256"] = hashlib.sha256(raw).hexdigest()
                    return manifest
                return None
            if not stat.S_ISDIR(st.st_mode):
                return None
            try:
                if os.getxattr(path, OPAQUE_XATTR) == b"y":
                    # An opaque directory hides the layers below; the file would be here.
                    try:
                        if not stat.S_ISREG(os.lstat(os.path.join(layers, layer, *parts)).st_mode):
                            return None
                    except FileNotFoundError:
                        return None
            except OSError:
                pass
    return None


def manifest_of(box) -> dict | None:
    """The memory manifest of the layers under ``box`` now (None when they hold no memory)."""
    return manifest_in_chain(box.scratch, box.chain)


def lower_for(scratch: str, chain: list[str]) -> list[str]:
    """Extra lower directories (relative to ``scratch``) that a root over ``chain`` needs: the
    memory image its manifest names, so the REPLs can load their files from inside."""
    manifest = manifest_in_chain(scratch, chain)
    if manifest is None or not manifest.get("image"):
        return []
    directory = image_dir(scratch, manifest["image"])
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"memory image {manifest['image']} of this snapshot is missing from "
                                f"{os.path.join(scratch, IMAGES)} (collected, or not imported with the snapshot)")
    try:
        with open(os.path.join(directory, SEAL)) as f:
            seal = f.read().strip()
    except FileNotFoundError:
        seal = None
    if seal != manifest.get("_sha256"):
        raise PermissionError(f"the memory manifest in this snapshot does not match memory image {manifest['image']}: "
                              f"it was not written by k3's snapshot(memory=True) (a process in the sandbox wrote it?)")
    _verify_image(directory, manifest)
    return [os.path.join(IMAGES, manifest["image"], "root")]  # the seal beside it stays out of view


# Files whose content hash was checked, by (path, inode, size, mtime, ctime): any write to a file
# changes its ctime (which no one can set back), so an unchanged signature means unchanged content.
_verified: dict[str, tuple] = {}


def _verify_image(directory: str, manifest: dict) -> None:
    """PermissionError unless every state file of the image has the SHA-256 its manifest recorded."""
    for entry in manifest.get("repls", []):
        name = entry.get("name")
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise PermissionError(f"bad REPL name {name!r} in the memory manifest of image {manifest['image']}")
        path = os.path.join(directory, "root", MEMORY_DIR.lstrip("/"), name + ".pkl")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise PermissionError(f"memory image {manifest['image']} lacks the state of REPL {name!r}") from None
        signature = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, entry.get("sha256"))
        if _verified.get(path) == signature:
            continue
        if not stat.S_ISREG(st.st_mode) or untrusted.hash_file(path, MAX_STATE_BYTES) != entry.get("sha256"):
            raise PermissionError(f"the state of REPL {name!r} in memory image {manifest['image']} changed after the "
                                  f"snapshot was taken (its content hash differs): the snapshot cannot be restored")
        _verified[path] = signature


def resume(box) -> list[str]:
    """Bring back the REPLs that the snapshot under ``box`` holds; return their names."""
    manifest = manifest_of(box)
    if manifest is None:
        box._services = {}  # a files-only snapshot restarts no service
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
        _remove_in_box(box, files)
    box._services = dict(manifest.get("services", {}))
    for name, command in box._services.items():
        launch_service(box, name, command)
        names.append(name)
    return names


def launch_service(box, name: str, command: str) -> None:
    """Start a recorded service in the background (its exec returns at once)."""
    import shlex

    log = f"/tmp/k3-service-{name}.log"
    result = box.exec(f"/bin/sh -c {shlex.quote(command)} >> {log} 2>&1 < /dev/null &", timeout=30)
    if result.exit_code != 0:
        raise RuntimeError(f"service {name!r} did not start: {result.stderr.strip()}")


def referenced_images(scratch: str) -> set[str]:
    """Memory images named by a layer of the store (the layers of running sandboxes included)."""
    found = set()
    layers = os.path.join(scratch, "layers")
    for name in os.listdir(layers) if os.path.isdir(layers) else ():
        if name.endswith(".json") or name.startswith("."):
            continue
        try:
            image = json.loads(untrusted.read_beneath(os.path.join(layers, name), MANIFEST, MAX_MANIFEST_BYTES)).get("image")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(image, str) and image:
            found.add(image)
    return found


def collect(scratch: str, min_age_s: float = 0.0) -> list[str]:
    """Remove memory images that no layer names any more; return their ids."""
    root = os.path.join(scratch, IMAGES)
    keep = referenced_images(scratch)
    removed = []
    now = time.time()
    for name in os.listdir(root) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        if name.endswith(".staging") or name in keep or now - os.stat(path).st_mtime < min_age_s:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def export_images(scratch: str, chain: list[str]) -> dict:
    """The memory image a snapshot's chain needs, as {image id: {file name: bytes}} (maybe empty)."""
    manifest = manifest_in_chain(scratch, chain)
    if manifest is None or not manifest.get("image"):
        return {}
    root = image_dir(scratch, manifest["image"])
    directory = os.path.join(root, "root", MEMORY_DIR.lstrip("/"))
    lower_for(scratch, chain)  # the seal and every file's hash, as a restore would check them
    files = {}
    for entry in manifest.get("repls", []):
        name = entry["name"] + ".pkl"
        files[name] = untrusted.read_beneath(directory, name, MAX_STATE_BYTES)
    files[SEAL] = untrusted.read_beneath(root, SEAL, MAX_MANIFEST_BYTES)
    return {manifest["image"]: files}


def import_images(scratch: str, images: dict) -> None:
    """Store memory images made by ``export_images`` (on this or another machine)."""
    for image_id, files in images.items():
        final = image_dir(scratch, image_id)
        if os.path.isdir(final):
            continue
        if not isinstance(files, dict) or not all(isinstance(d, bytes) for d in files.values()):
            raise ValueError(f"memory image {image_id} of the export is not a dict of file name -> bytes")
        for name in files:
            if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or "\0" in name:
                raise ValueError(f"bad file name {name!r} in memory image {image_id}")
        os.makedirs(os.path.join(scratch, IMAGES), mode=0o700, exist_ok=True)
        staging = final + f".{uuid.uuid4().hex[:8]}.staging"
        target = os.path.join(staging, "root", MEMORY_DIR.lstrip("/"))
        os.makedirs(target, mode=0o700)
        try:
            for name, data in files.items():
                fd = os.open(os.path.join(staging if name == SEAL else target, name),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            os.rename(staging, final)  # the state files' hashes are checked when a restore mounts it
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
