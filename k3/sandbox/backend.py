"""What both sandbox backends (local namespaces in api.py, the microVM in vm/) share: a command's result, the
checks of a request's arguments, so they refuse the same inputs with the same words, and what an upload sends."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_MAX_OUTPUT = 16 << 20


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``exit_code`` is 128 + N when killed by signal N (as in a shell).

    timed_out: the timeout passed and the command's whole process tree was killed.
    oom_killed: the memory limit was hit during the command and the kernel killed a process.
    truncated: stdout or stderr went over ``max_output`` bytes and was cut.
    """

    stdout_bytes: bytes
    stderr_bytes: bytes
    exit_code: int
    duration_s: float
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode(errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def command_argv(cmd: str | list[str], timeout: float | None) -> list[str]:
    """The argv an exec runs (a shell string goes through /bin/sh -c), after checking cmd and timeout; both
    backends call it, so they refuse the same inputs with the same words."""
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    if not (isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd)):
        raise ValueError(f"cmd must be a shell string or a non-empty list of strings, got {cmd!r}")
    return list(cmd)


def check_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"sandbox paths must be absolute, like /work/main.py; got {path!r}")
    return os.path.normpath(path)


def upload_entries(local_path: str, target: str) -> list[dict]:
    """The ``write`` entries that copy the host file or directory tree ``local_path`` to the sandbox path
    ``target``: a file gives one entry; a tree one per directory ({"path", "dir": True, "mode"}) and one per
    regular file ({"path", "data": bytes, "mode"}), its links skipped. Modes keep their permission bits."""
    local_path = os.path.abspath(local_path)
    if os.path.isfile(local_path):
        with open(local_path, "rb") as f:
            return [{"path": target, "data": f.read(), "mode": os.stat(local_path).st_mode & 0o7777}]
    if not os.path.isdir(local_path):
        raise ValueError(f"upload needs an existing file or directory on the host, got {local_path!r}")
    entries = []
    for directory, _, filenames in os.walk(local_path):
        rel = os.path.relpath(directory, local_path)
        base = target if rel == "." else os.path.join(target, rel)
        entries.append({"path": base, "dir": True, "mode": os.stat(directory).st_mode & 0o7777})
        for name in filenames:
            source = os.path.join(directory, name)
            if os.path.islink(source) or not os.path.isfile(source):
                continue
            with open(source, "rb") as f:
                entries.append({"path": os.path.join(base, name), "data": f.read(),
                                "mode": os.stat(source).st_mode & 0o7777})
    return entries
