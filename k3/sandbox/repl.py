"""A persistent Python REPL per sandbox: variables survive across calls, output is captured per call.

    with Sandbox() as box:
        repl = box.repl()                       # the sandbox's default REPL, started on first use
        repl.run("x = 21")
        repl.run("x * 2").value                 # '42' (repr of a last bare expression)
        repl.run("print(x)").stdout             # '21\\n'
        repl.run("while True: pass", timeout=1) # timed_out=True; x is still 21 afterwards

The REPL is the image's ``python3`` running ``repl_server.py`` inside the sandbox, with no
capabilities, in the sandbox's cgroup (its memory counts against the sandbox's limit). A cell past
its timeout is interrupted (KeyboardInterrupt); one that ignores that is killed with its process
group after a grace period, and only the REPL's state is lost, never the sandbox. A REPL killed by
the memory limit is reported (``oom_killed``) and the next call starts a fresh one.

A sandbox restore (or fork) starts new processes: the REPL comes back with its variables only from
a snapshot taken with ``snapshot(memory=True)`` (see ``memory.py``), and fresh otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from k3.sandbox.local import SandboxError, supervisor_python

SERVER_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repl_server.py")
DEFAULT_MAX_OUTPUT = 1 << 20
_server_source: str | None = None


def server_source() -> str:
    global _server_source
    if _server_source is None:
        with open(SERVER_SOURCE_PATH) as f:
            _server_source = f.read()
    return _server_source


_same_python: dict[str, bool] = {}


def image_runs_supervisor_python(image_path: str) -> bool:
    """True when the image's ``python3`` (on its PATH, links followed inside the image) is the very
    interpreter that runs the supervisors (same size and mtime), as in the default image: the REPL
    can then be a fork of PID 1 instead of a new process start."""
    if image_path not in _same_python:
        _same_python[image_path] = _resolve_in_image(image_path, "python3") == _signature(os.path.realpath(supervisor_python()))
    return _same_python[image_path]


def _signature(path: str | None) -> tuple | None:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (st.st_size, st.st_mtime_ns)


def _resolve_in_image(image_path: str, name: str) -> tuple | None:
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        inside = os.path.join(directory, name)
        for _ in range(8):  # follow links, resolving absolute targets inside the image
            host = os.path.join(image_path, inside.lstrip("/"))
            if not os.path.islink(host):
                break
            target = os.readlink(host)
            inside = target if target.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(inside), target))
        host = os.path.join(image_path, inside.lstrip("/"))
        if os.path.isfile(host):
            return _signature(host)
    return None


@dataclass(frozen=True)
class ReplResult:
    """What one REPL call did.

    stdout / stderr: everything the cell (and the processes it started) printed during the call;
    a traceback goes to stderr. value: repr of the cell's last bare expression, or None.
    error: "ExceptionType: message" when the cell raised, else None.
    timed_out: the timeout passed and the cell was interrupted. died: the REPL process ended during
    the call (killed after the timeout's grace period, by the memory limit, or by the cell itself):
    its variables are gone and the next call starts a fresh REPL. oom_killed: the memory limit was
    hit during the call.
    """

    stdout: str
    stderr: str
    value: str | None
    error: str | None
    duration_s: float
    timed_out: bool = False
    died: bool = False
    oom_killed: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and not self.died

    def as_text(self) -> str:
        """One string for a model to read: output, then the value or the error."""
        parts = [self.stdout, self.stderr]
        if self.value is not None:
            parts.append(self.value + "\n")
        if self.timed_out:
            parts.append("[the cell timed out and was interrupted]\n")
        if self.died:
            parts.append("[the Python process died; its variables are lost]\n")
        return "".join(parts)


def require_ok(name: str, reply: dict | None, failure: str) -> dict:
    """A REPL's reply to dump / load (either backend), or SandboxError saying what failed."""
    if not reply or not reply.get("ok"):
        raise SandboxError(f"REPL {name!r} {failure}: {(reply or {}).get('error', 'it died')}")
    return reply


class Repl:
    """One named Python REPL in one sandbox (get it with ``Sandbox.repl(name)``)."""

    def __init__(self, sandbox, name: str = "python", python: str = "python3") -> None:
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a REPL name is letters, digits, '-' and '_'; got {name!r}")
        self.sandbox = sandbox
        self.name = name
        self.python = python
        self._generation: int | None = None  # the sandbox generation its process lives in
        self.python_version: str | None = None

    @property
    def alive(self) -> bool:
        """True when its process is running in the sandbox's current generation."""
        return self._generation == self.sandbox._generation and not self.sandbox.closed

    def _ensure(self, timeout: float = 30.0) -> None:
        if self.alive:
            return
        box = self.sandbox
        answer = box._request({"op": "repl_start", "name": self.name, "python": self.python, "code": server_source(),
                               "cwd": box.image.workdir, "env": dict(box.image.env), "timeout": timeout,
                               "fork_server": self.python == "python3" and image_runs_supervisor_python(box.image.path)})
        if not answer["ok"] or answer["reply"] is None:
            detail = answer.get("error") or (answer.get("stderr", b"") or b"").decode(errors="replace").strip()
            raise SandboxError(f"could not start the Python REPL {self.python!r} in sandbox {box.id}: "
                               f"{detail or 'it exited at start'} (does the image have python3 on PATH?)")
        self.python_version = answer["reply"].get("python")
        self._generation = box._generation

    def _message(self, message: dict, timeout: float | None, max_output: int) -> dict:
        box = self.sandbox
        oom_before = box.cgroup.oom_kills()
        answer = box._request({"op": "repl_call", "name": self.name, "message": message, "timeout": timeout,
                               "max_output": max_output})
        if not answer["ok"]:
            raise SandboxError(answer["error"])
        answer["oom_killed"] = box.cgroup.oom_kills() > oom_before
        if answer["killed"]:
            self._generation = None  # the next call starts a fresh interpreter
        return answer

    def run(self, code: str, timeout: float | None = 30.0, max_output: int = DEFAULT_MAX_OUTPUT) -> ReplResult:
        """Run ``code`` (one or more statements) in the REPL's namespace and wait for it.

        timeout: seconds (None: no limit); then the cell gets KeyboardInterrupt, and the REPL is
        killed if it still does not answer within 2 s. max_output: bytes kept of stdout and of stderr.
        """
        if not isinstance(code, str):
            raise ValueError(f"code must be a string of Python source, got {type(code).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self._ensure()
        answer = self._message({"op": "run", "code": code}, timeout, max_output)
        reply = answer["reply"] or {}
        died = answer["killed"]
        error = reply.get("error")
        if died and error is None:
            error = "the Python process died (killed by the memory limit, a timeout, or the cell itself)"
        return ReplResult(answer["stdout"].decode(errors="replace"), answer["stderr"].decode(errors="replace"),
                          reply.get("value"), error, answer["duration"], answer["timed_out"], died,
                          answer["oom_killed"], answer["truncated"])

    def dump(self, path: str, timeout: float | None = 120.0) -> dict:
        """Pickle the namespace to ``path`` inside the sandbox: {"names", "skipped", "bytes"}."""
        self._ensure()
        reply = self._message({"op": "dump", "path": path}, timeout, 1 << 16)["reply"]
        return require_ok(self.name, reply, "could not save its state")

    def load(self, path: str, timeout: float | None = 120.0) -> list[str]:
        """Load a namespace saved by ``dump`` into this REPL; return the names restored."""
        self._ensure()
        reply = self._message({"op": "load", "path": path}, timeout, 1 << 16)["reply"]
        return require_ok(self.name, reply, f"could not load {path}")["names"]

    def reset(self) -> None:
        """Throw the variables away: the next call runs in a fresh interpreter."""
        self.close()

    def close(self) -> None:
        """Stop the REPL's process (the sandbox keeps running)."""
        if self.alive:
            self.sandbox._request({"op": "repl_stop", "name": self.name})
        self._generation = None

    def __repr__(self) -> str:
        return f"Repl(name={self.name!r}, sandbox={self.sandbox.id!r}, {'running' if self.alive else 'not started'})"
