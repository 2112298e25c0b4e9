"""``VmRepl``: the persistent Python REPL of a microVM sandbox (``VmSandbox.repl``), with the
local backend's ``Repl`` API and ``ReplResult``.

The REPL is the guest's ``python3`` running the same ``repl_server.py``, started and driven by
the guest agent (``agent.py``: ``repl_call``). It is a process in guest memory, so a snapshot
holds it as it is: restore and fork bring it back with every variable, picklable or not (open
files, threads, generators included), with no dump and no load. A call that finds no REPL of
that name running (never started, killed, or absent from the snapshot restored) starts one.
"""

from __future__ import annotations

import base64

from k3.sandbox.local import SandboxError
from k3.sandbox.repl import DEFAULT_MAX_OUTPUT, ReplResult, require_ok, server_source

# On top of a cell's own timeout: the agent interrupts it at the timeout and kills it 2 s later.
REPL_GRACE_S = 2.0


class VmRepl:
    """One named Python REPL in one microVM sandbox (get it with ``VmSandbox.repl(name)``)."""

    def __init__(self, sandbox, name: str = "python", python: str = "python3") -> None:
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a REPL name is letters, digits, '-' and '_'; got {name!r}")
        self.sandbox, self.name, self.python = sandbox, name, python

    @property
    def alive(self) -> bool:
        """True when its process is running in the guest now."""
        box = self.sandbox
        if box.closed:
            return False
        return bool(box._call({"op": "repl_alive", "name": self.name}, box.config.call_margin_s).get("alive"))

    def _message(self, message: dict, timeout: float | None, max_output: int) -> dict:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if not 0 <= max_output <= self.sandbox.config.max_reply_bytes // 3:
            raise ValueError(f"max_output must be between 0 and {self.sandbox.config.max_reply_bytes // 3} bytes, "
                             f"got {max_output}")
        box = self.sandbox
        request = {"op": "repl_call", "name": self.name, "message": message, "timeout": timeout,
                   "max_output": max_output, "pids": box.limits.pids}
        wait = (timeout if timeout is not None else 24 * 3600.0) + REPL_GRACE_S + box.config.call_margin_s
        answer = box._call(request, wait)
        if answer.get("missing"):  # not running in this guest: start it with the same call
            start = {"python": self.python, "code": server_source(), "cwd": box.image.workdir, "env": dict(box.image.env)}
            answer = box._call(dict(request, start=start), wait + 30.0)
        if not answer.get("ok"):
            raise SandboxError(f"the guest agent could not run REPL {self.name!r}: {answer.get('error')}")
        return answer

    def run(self, code: str, timeout: float | None = 30.0, max_output: int = DEFAULT_MAX_OUTPUT) -> ReplResult:
        """Run ``code`` in the REPL's namespace and wait for it (as ``Repl.run``)."""
        if not isinstance(code, str):
            raise ValueError(f"code must be a string of Python source, got {type(code).__name__}")
        answer = self._message({"op": "run", "code": code}, timeout, max_output)
        reply = answer.get("reply") or {}
        died = bool(answer.get("killed"))
        error = reply.get("error")
        if died and error is None:
            error = "the Python process died (killed by the memory limit, a timeout, or the cell itself)"
        return ReplResult(_text(answer.get("stdout")), _text(answer.get("stderr")), reply.get("value"), error,
                          float(answer.get("duration", 0.0)), bool(answer.get("timed_out")), died,
                          bool(answer.get("oom_killed")), bool(answer.get("truncated")))

    def dump(self, path: str, timeout: float | None = 120.0) -> dict:
        """Pickle the namespace to ``path`` in the guest (as ``Repl.dump``; a VM snapshot needs no dump)."""
        reply = self._message({"op": "dump", "path": path}, timeout, 1 << 16).get("reply")
        return require_ok(self.name, reply, "could not save its state")

    def load(self, path: str, timeout: float | None = 120.0) -> list[str]:
        """Load a namespace saved by ``dump``; return the names restored."""
        reply = self._message({"op": "load", "path": path}, timeout, 1 << 16).get("reply")
        return require_ok(self.name, reply, f"could not load {path}")["names"]

    def reset(self) -> None:
        """Throw the variables away: the next call runs in a fresh interpreter."""
        self.close()

    def close(self) -> None:
        """Stop the REPL's process (the guest keeps running)."""
        if not self.sandbox.closed:
            self.sandbox._call({"op": "repl_stop", "name": self.name}, self.sandbox.config.call_margin_s)

    def __repr__(self) -> str:
        return f"VmRepl(name={self.name!r}, sandbox={self.sandbox.id!r})"


def _text(value) -> str:
    return base64.b64decode(value or "").decode(errors="replace")
