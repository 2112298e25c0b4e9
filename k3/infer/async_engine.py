"""The engine for asyncio servers: one background thread runs `engine.step()` while there is work, and hands
each request's token events to the asyncio queue of the coroutine that streams it.

    aengine = AsyncEngine(engine, max_queue=256)
    async for event in aengine.stream(prompt_ids, params):   # TokenEvent
        ...
    aengine.shutdown()

The engine is not thread-safe; every call into it holds one lock, and a step holds it too, so requests are
added and aborted between steps. A stream that is closed early (client gone, task cancelled) aborts its
request at once, which frees its KDA slot and MLA pages.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

from k3.infer.engine import Engine, TokenEvent
from k3.infer.sampling import SamplingParams


class QueueFull(RuntimeError):
    """More requests are waiting than max_queue allows (an HTTP server answers 429)."""


class EngineDead(RuntimeError):
    """The engine loop raised; no further requests are served."""


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int = 256, idle_wait_s: float = 0.05) -> None:
        self.engine, self.max_queue, self.idle_wait_s = engine, max_queue, idle_wait_s
        self.lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    # --- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            with self.lock:
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        events = self.engine.step()
                    except BaseException as error:  # noqa: BLE001 - every waiting stream must hear of it
                        self.error = error
                        self._fail_all(error)
                        return
            if not busy:
                self._wakeup.wait(self.idle_wait_s)
                self._wakeup.clear()
                continue
            for event in events:
                listener = self._listeners.get(event.request_id)
                if listener is not None:
                    loop, queue = listener
                    loop.call_soon_threadsafe(queue.put_nowait, event)

    def _fail_all(self, error: BaseException) -> None:
        for loop, queue in list(self._listeners.values()):
            loop.call_soon_threadsafe(queue.put_nowait, error)

    # --- requests -----------------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
            queue: asyncio.Queue | None = None) -> str:
        """Add a request (raises QueueFull, ValueError for a bad prompt, EngineDead after a crash)."""
        if self.error is not None:
            raise EngineDead(f"the engine loop stopped: {self.error!r}")
        with self.lock:
            if len(self.engine.scheduler.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.engine.scheduler.waiting)} requests are already waiting "
                                f"(max_queue={self.max_queue}); retry later")
            request_id = self.engine.add_request(prompt, params, request_id)
            if queue is not None:
                self._listeners[request_id] = (asyncio.get_running_loop(), queue)
        self._wakeup.set()
        return request_id

    async def stream(self, prompt: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """Yield the request's TokenEvents until all n samples have finished."""
        queue: asyncio.Queue = asyncio.Queue()
        request_id = self.add(prompt, params, request_id, queue)
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine loop stopped: {item!r}") from item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            self._listeners.pop(request_id, None)
            if remaining:
                self.abort_now(request_id)

    def abort_now(self, request_id: str) -> bool:
        with self.lock:
            return self.engine.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        return self.abort_now(request_id)

    def stats(self) -> dict:
        with self.lock:
            return self.engine.stats()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)
