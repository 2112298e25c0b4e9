"""``AsyncSandbox``: the same sandbox for asyncio code.

Every call runs the synchronous ``Sandbox`` method in a worker thread (``asyncio.to_thread``), so
the event loop never blocks on a pipe or a mount. Calls to one sandbox are still served one at a
time; many sandboxes run concurrently.

    async with await AsyncSandbox.create() as box:
        result = await box.exec("python3 -c 'print(42)'")
"""

from __future__ import annotations

import asyncio

from k3.sandbox.api import ExecResult, Sandbox
from k3.sandbox.cgroups import Limits
from k3.sandbox.image import Image


class AsyncSandbox:
    """Async wrapper of one ``Sandbox`` (create it with ``await AsyncSandbox.create(...)``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sync = sandbox

    @classmethod
    async def create(
        cls, image: Image | str | None = None, limits: Limits | None = None, *, snapshot: str | None = None, **kwargs
    ) -> "AsyncSandbox":
        """Start a sandbox (arguments as for ``Sandbox``) without blocking the event loop."""
        return cls(await asyncio.to_thread(Sandbox, image, limits, snapshot=snapshot, **kwargs))

    @property
    def id(self) -> str:
        return self.sync.id

    async def exec(self, cmd: str | list[str], timeout: float | None = 60.0, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: bytes | str | None = None, **kwargs) -> ExecResult:
        """See ``Sandbox.exec``."""
        return await asyncio.to_thread(self.sync.exec, cmd, timeout, env, cwd, stdin, **kwargs)

    async def read_file(self, path: str) -> bytes:
        return await asyncio.to_thread(self.sync.read_file, path)

    async def write_file(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        await asyncio.to_thread(self.sync.write_file, path, data, mode)

    async def upload(self, local_path: str, sandbox_path: str) -> None:
        await asyncio.to_thread(self.sync.upload, local_path, sandbox_path)

    async def snapshot(self, memory: bool = False) -> str:
        return await asyncio.to_thread(self.sync.snapshot, memory)

    async def run_python(self, code: str, timeout: float | None = 30.0, name: str = "python"):
        """``Sandbox.repl(name).run(code, timeout)`` in a worker thread: a ``ReplResult``."""
        return await asyncio.to_thread(self.sync.repl(name).run, code, timeout)

    async def restore(self, snapshot: str) -> None:
        await asyncio.to_thread(self.sync.restore, snapshot)

    async def fork(self, snapshot: str | None = None, n: int = 1) -> list["AsyncSandbox"]:
        """``n`` sandboxes from ``snapshot``, started concurrently."""
        if snapshot is None:
            snapshot = await self.snapshot()
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs n >= 1 sandboxes, got {n!r}")
        started = await asyncio.gather(
            *(asyncio.to_thread(self.sync.fork, snapshot, 1) for _ in range(n)), return_exceptions=True
        )
        errors = [one for one in started if isinstance(one, BaseException)]
        if errors:
            for one in started:
                if not isinstance(one, BaseException):
                    one[0].close()
            raise errors[0]
        return [AsyncSandbox(one[0]) for one in started]

    async def pause(self) -> None:
        await asyncio.to_thread(self.sync.pause)

    async def resume(self) -> None:
        await asyncio.to_thread(self.sync.resume)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"
