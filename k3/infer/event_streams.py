"""Token events from the thread that receives them to the asyncio streams that wait for them: the part that
AsyncEngine (engine thread in this process) and EngineProcess (reader of a child's pipe) share.

A request's listener is its event loop and a sink(request_id, items) that runs there. A step's events reach
each listening loop in one call_soon_threadsafe for all of its requests (one per request cost the engine
thread a self-pipe write each, 10% of its time at 64 streams on CPU), where each request's sink takes its list
of events: TokenEvents of one step, or one exception (ValueError, RequestFailed, QueueFull, or why the engine
died).
"""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator, Callable, Iterable

Sink = Callable[[str, list], None]


class QueueFull(RuntimeError):
    """More requests are waiting than max_queue allows (an HTTP server answers 429)."""


class EngineDead(RuntimeError):
    """The engine loop raised; no further requests are served."""


class RequestFailed(RuntimeError):
    """A step running this request raised; the request ended, the engine serves on."""


class EventStreams:
    """Listeners by request id, step-wise delivery to their loops, and `stream` over `add`. Subclasses give
    add(prompt, params, request_id, events, prompt_embeds, sink) and abort_now(request_id)."""

    def __init__(self) -> None:
        # request id -> (its event loop, sink(request_id, items) run on that loop with each list of events)
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, Sink]] = {}

    def _listen(self, request_id: str, events: asyncio.Queue | None, sink: Sink | None) -> None:
        """Register where a request's events go (call on its event loop's thread, before queueing it)."""
        if events is not None:
            sink = functools.partial(put_all, events)
        if sink is not None:
            self._listeners[request_id] = (asyncio.get_running_loop(), sink)

    def deliver(self, by_request: Iterable[tuple[str, list]],
                convert: Callable[[str, list], list] | None = None) -> None:
        """One step's (request id, items) pairs: one wake-up per listening loop for all of its requests.
        convert(request_id, items) runs only for requests someone still listens to."""
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        listeners = self._listeners
        for request_id, items in by_request:
            listener = listeners.get(request_id)
            if listener is None:
                continue
            batch = per_loop.get(listener[0])
            if batch is None:
                batch = per_loop[listener[0]] = []
            batch.append((listener[1], request_id, items if convert is None else convert(request_id, items)))
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(run_sinks, batch)
            except RuntimeError:  # the listening loop has closed: nobody is waiting any more
                for _, request_id, _ in batch:
                    self._listeners.pop(request_id, None)
                    self._loop_closed(request_id)

    def deliver_to_all(self, error: BaseException) -> None:
        """The same error to every listening request (the engine died)."""
        self.deliver([(request_id, [error]) for request_id in list(self._listeners)])

    def _loop_closed(self, request_id: str) -> None:
        """A request whose listening loop has closed: abort it (nobody reads its events)."""
        self.abort_now(request_id)

    def abort_now(self, request_id: str) -> None:
        raise NotImplementedError

    def add(self, prompt: list[int], params, request_id: str | None = None, events: asyncio.Queue | None = None,
            prompt_embeds=None, sink: Sink | None = None) -> str:
        raise NotImplementedError

    async def stream(self, prompt: list[int], params, request_id: str | None = None,
                     prompt_embeds=None) -> AsyncIterator:
        """Yield the request's TokenEvents until all n samples have finished (prompt_embeds: see
        Engine.add_request); an early exit (client gone, task cancelled) aborts the request."""
        events: asyncio.Queue = asyncio.Queue()
        request_id = self.add(prompt, params, request_id, events, prompt_embeds)
        remaining = params.n
        try:
            while remaining:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise stream_error(item)
                remaining -= bool(item.finished)
                yield item
        finally:
            self._listeners.pop(request_id, None)
            if remaining:
                self.abort_now(request_id)

    def cancel(self, request_id: str) -> None:
        """Stop delivering this request's events and abort it at the next step boundary (if still running)."""
        self._listeners.pop(request_id, None)
        self.abort_now(request_id)


def stream_error(item: BaseException) -> BaseException:
    """What a stream raises for an error event: the request's own errors as they are, anything else as the
    engine's death."""
    if isinstance(item, (ValueError, RequestFailed, QueueFull, EngineDead)):
        return item
    error = EngineDead(f"the engine loop stopped: {item!r}")
    error.__cause__ = item
    return error


def put_all(events: asyncio.Queue, request_id: str, items: list) -> None:
    """A request's events into its queue (on the event loop's thread)."""
    for item in items:
        events.put_nowait(item)


def run_sinks(batch: list) -> None:
    """One step's events, delivered in one call on the event loop (not one call per token)."""
    for sink, request_id, items in batch:
        sink(request_id, items)
