"""Images: the read-only directory tree at the bottom of every sandbox.

Any directory can be an image (``Image.from_dir``); it is mounted read-only as the lowest overlay
layer and must not change while sandboxes use it. ``default_image()`` assembles a small one from
the host's own binaries (a shell, coreutils and a few text tools, python3 with its standard
library, and the shared libraries they load), hard-linked where the filesystem allows, so it costs
almost no disk and is built once per set of host binaries.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

from k3.sandbox.paths import sandbox_home

SHELLS = ("sh", "bash")
TOOLS = (
    # coreutils
    "ls cat cp mv rm mkdir rmdir ln touch chmod chown echo printf true false pwd env sleep date head tail "
    "wc sort uniq cut tr tee basename dirname readlink realpath seq test expr yes stat du df id whoami "
    "md5sum sha256sum mktemp nproc uname timeout nl od fold split join paste comm tac "
    # the usual companions of a coding task
    "grep sed find xargs diff cmp patch"
).split()
PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class Image:
    """A directory tree used as a sandbox's read-only base.

    path: the directory (absolute). workdir: the default cwd of ``exec``. env: default environment.
    """

    path: str
    workdir: str = "/"
    env: dict = field(default_factory=lambda: dict(DEFAULT_ENV))

    @staticmethod
    def from_dir(path: str, workdir: str | None = None, env: dict | None = None) -> "Image":
        """Use the directory ``path`` as an image. ``workdir`` defaults to /work when it exists."""
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"an image must be an existing directory, got {path!r}")
        if any(c in path for c in ",:\\\n"):
            raise ValueError(f"an image path must not contain ',', ':', '\\' or a newline (overlay's option "
                             f"syntax uses them); got {path!r}: move or link the directory elsewhere")
        if workdir is None:
            workdir = "/work" if os.path.isdir(os.path.join(path, "work")) else "/"
        if not workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path inside the image, like /work, got {workdir!r}")
        return Image(path, workdir, dict(DEFAULT_ENV) if env is None else dict(env))


_default_images: dict[str, Image] = {}


def tree_bytes(root: str) -> int:
    """Bytes of the files under ``root``, links neither followed nor counted."""
    total = 0
    for directory, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                total += os.lstat(path).st_size
    return total


def default_image(home: str | None = None) -> Image:
    """The minimal image built from host binaries (built on first use, then reused)."""
    home = home or sandbox_home()
    if home in _default_images:
        return _default_images[home]
    # The name depends on the host binaries and the stdlib directory: an upgrade gives a new image.
    python = _find_python()
    key = hashlib.sha256()
    for path in _executables() + [python, os.path.dirname(os.path.realpath(python))]:
        st = os.stat(path)
        key.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    key.update(_stdlib(python).encode() + str(os.stat(_stdlib(python)).st_mtime_ns).encode())
    target = os.path.join(home, "images", "default-" + key.hexdigest()[:16])
    build_once(target, lambda staging: _assemble(staging, _host_files()))
    image = Image(target, "/work", dict(DEFAULT_ENV))
    _default_images[home] = image
    return image


def build_once(target: str, build) -> None:
    """Run ``build(staging_dir)`` and move the result to ``target`` unless a complete ``target``
    exists. A lock file serialises builders (several processes may start at once), and a complete
    image is never replaced: sandboxes may be running on it."""
    marker = os.path.join(target, ".k3-image-complete")
    if os.path.exists(marker):
        return
    with open(os.path.join(os.path.dirname(target), ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(marker):
            return
        staging = target + f".staging-{uuid.uuid4().hex[:8]}"
        try:
            build(staging)
            open(os.path.join(staging, ".k3-image-complete"), "w").close()
            if os.path.exists(target):  # left half-built by a crash; nothing can be using it
                shutil.rmtree(target)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _find_python() -> str:
    for candidate in PYTHON_CANDIDATES:
        if os.path.exists(candidate):
            return candidate
    found = shutil.which("python3")
    if not found:
        raise RuntimeError("no python3 on this host to put in the default image")
    return found


def _executables() -> list[str]:
    found = [shutil.which(name, path="/usr/bin:/bin") for name in SHELLS + tuple(TOOLS)]
    found = [path for path in found if path]
    if not any(os.path.basename(p) == "sh" for p in found):
        raise RuntimeError("no /bin/sh on this host to put in the default image")
    return found


def _stdlib(python: str) -> str:
    return subprocess.run(
        [python, "-I", "-S", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()


def _host_files() -> list[str]:
    """Every host path that goes into the default image (binaries, libraries, stdlib)."""
    executables = _executables()
    python = _find_python()
    files = executables + [python]
    extensions = []
    for directory, dirnames, filenames in os.walk(_stdlib(python)):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP)
        for name in sorted(filenames):
            path = os.path.join(directory, name)
            files.append(path)
            if name.endswith(".so"):
                extensions.append(path)
    files += _shared_libraries(executables + [python] + extensions)
    return sorted(set(files))


def _shared_libraries(binaries: list[str]) -> list[str]:
    libraries = set()
    pattern = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")
    for start in range(0, len(binaries), 64):
        batch = binaries[start : start + 64]
        output = subprocess.run(["ldd", *batch], capture_output=True, text=True).stdout
        libraries.update(match.group(1) for match in pattern.finditer(output))
    return sorted(path for path in libraries if os.path.exists(path))


def _place(root: str, host_path: str) -> None:
    """Put ``host_path`` at the same path under ``root``, recreating symlinks on the way."""
    seen = 0
    path = host_path
    while True:
        parent = os.path.realpath(os.path.dirname(path))
        inside = os.path.join(root, parent.lstrip("/"), os.path.basename(path))
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if os.path.lexists(inside):
            return
        if os.path.islink(path):
            link = os.readlink(path)
            os.symlink(link, inside)
            path = os.path.join(parent, link)
            seen += 1
            if seen > 16:
                return
            continue
        try:
            os.link(path, inside)  # same filesystem: no copy, and the image stays read-only anyway
        except OSError:
            shutil.copy2(path, inside)
        return


def _assemble(root: str, files: list[str]) -> None:
    os.makedirs(root)
    # Merged-/usr hosts have /bin -> usr/bin and friends; the image keeps the same shape.
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = os.path.join("/", top)
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, top))
    for path in files:
        _place(root, path)
    python = _find_python()
    for alias in ("usr/bin/python3", "usr/bin/python"):
        if not os.path.lexists(os.path.join(root, alias)):
            os.symlink(os.path.realpath(python), os.path.join(root, alias))
    sh = os.path.join(root, "bin", "sh")
    if not os.path.lexists(sh):
        os.makedirs(os.path.dirname(sh), exist_ok=True)
        os.symlink(shutil.which("sh"), sh)
    for directory, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("root", 0o700), ("work", 0o755), ("home", 0o755), ("proc", 0o555), ("dev", 0o755), ("etc", 0o755)):
        os.makedirs(os.path.join(root, directory), exist_ok=True)
        os.chmod(os.path.join(root, directory), mode)
    etc = {
        "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        "group": "root:x:0:\nnogroup:x:65534:\n",
        "hostname": "sandbox\n",
        "hosts": "127.0.0.1 localhost sandbox\n",
        "os-release": 'NAME="k3 sandbox"\nID=k3-sandbox\n',
    }
    for name, text in etc.items():
        with open(os.path.join(root, "etc", name), "w") as f:
            f.write(text)
    with open(os.path.join(root, "etc", "k3-image.json"), "w") as f:
        json.dump({"workdir": "/work", "env": DEFAULT_ENV}, f)
