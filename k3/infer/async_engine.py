"""The engine for asyncio servers: one background thread owns the engine, runs `engine.step()` while there is
work, and hands each request's token events to the asyncio queue of the coroutine that streams it.

    aengine = AsyncEngine(engine, max_queue=256)
    async for event in aengine.stream(prompt_ids, params):   # TokenEvent
        ...
    aengine.shutdown()

The event loop never waits for a step: new requests and aborts go into an inbox that the engine thread drains
between steps (a prompt is validated before it is queued, so a bad one still fails at once). A stream that is
closed early (client gone, task cancelled) aborts its request, which frees its KDA slot and MLA pages at the
next step boundary. A step's events reach each listening event loop in one wake-up (k3.infer.event_streams).

A step that raises fails the requests it was running (each stream raises RequestFailed) and the loop goes on
with the rest. The loop itself stops only when failing those requests fails too, after MAX_FAILED_STEPS failed
steps in a row, or on a BaseException; then `error` holds why, it is logged, and every stream and later
request raises EngineDead.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import queue
import threading
import time
from typing import Callable

from k3.infer.engine import Engine, TokenEvent
from k3.infer.event_streams import EngineDead, EventStreams, QueueFull, RequestFailed, Sink  # noqa: F401
from k3.infer.sampling import SamplingParams
from k3.infer.structured import import_ahead

log = logging.getLogger("k3.engine")
MAX_FAILED_STEPS = 3  # failed steps in a row that mean the engine itself is broken, not one request


class AsyncEngine(EventStreams):
    def __init__(self, engine: Engine, max_queue: int = 256, idle_wait_s: float = 0.05,
                 warmup: Callable[[], object] | None = None, freeze_gc: bool = False) -> None:
        """warmup: run on the engine thread before the first step (Engine.warmup: graphs, compiles, kernel
        autotuning), so the first requests do not pay for it; until it returns `ready` is unset (a server's
        /health answers 503) and requests wait in the inbox. It raising stops the engine (see `error`).
        freeze_gc: once warm, put every object alive then out of the cyclic garbage collector's reach
        (gc.freeze, process-wide; for servers): a full collection walks the model's and the compiler's objects
        and stalled every step, hence every stream, for about 0.25 s on CPU with the debug model."""
        super().__init__()
        self.engine, self.max_queue, self.idle_wait_s = engine, max_queue, idle_wait_s
        self._freeze_gc = freeze_gc
        self._warmup = warmup
        self.ready = threading.Event()
        self.warmup_s: float | None = None  # how long the warm-up took, once it is done
        self.lock = threading.Lock()  # held by every step (the engine is not thread-safe)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", id, prompt, params) / ("abort", id)
        self._queued = 0  # requests in the inbox, not yet handed to the engine
        self._count_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self.error: BaseException | None = None
        # The engine's counters as of the last step, for readers on other threads: a reader waiting for the lock
        # would starve (the loop takes it again at once) and a /health call would hang for a whole request.
        self._stats = engine.stats()
        import_ahead()  # here, before the loop's thread: k3.infer.structured.import_ahead says why
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    # --- the loop (engine thread) -------------------------------------------------------------------
    def _drain_inbox(self) -> int:
        """Hand queued adds and aborts to the engine; returns how many adds moved (they stay counted as
        queued until the next stats snapshot shows them)."""
        moved = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return moved
            if item[0] == "add":
                _, request_id, prompt, params, embeds = item
                moved += 1
                try:
                    self.engine.add_request(prompt, params, request_id, prompt_embeds=embeds)
                except ValueError as error:  # validated before queueing; a late refusal still reaches the stream
                    self._deliver(request_id, [error])
                except Exception as error:  # noqa: BLE001 - fails this request, not the loop
                    log.error("adding request %s failed", request_id, exc_info=error)
                    self._deliver(request_id, [RequestFailed(f"the engine could not take this request: "
                                                             f"{type(error).__name__}: {error}")])
            else:
                self.engine.abort(item[1])

    def _deliver(self, request_id: str, items: list) -> None:
        self.deliver([(request_id, items)])

    def _loop_closed(self, request_id: str) -> None:
        self.engine.abort(request_id)  # on the engine thread, between steps

    def _fail_running(self, error: Exception) -> None:
        """End every request the failed step was running, telling each stream why."""
        failed = RequestFailed(f"the engine step running this request failed: {type(error).__name__}: {error}")
        scheduler = self.engine.scheduler
        # Nothing running: the step failed admitting the queue's head, so that request is the one to fail.
        culprits = list(scheduler.running) or list(scheduler.waiting)[:1]
        for request in culprits:
            self.engine.abort(request.request_id)
            self._deliver(request.request_id, [failed])

    def _die(self, error: BaseException) -> None:
        self.error = error
        log.error("the engine loop stopped; no further requests are served", exc_info=error)
        self.deliver_to_all(error)

    def _warm_up(self) -> bool:
        """Run the warm-up (if any) and set `ready`; False when it raised (the engine is then dead)."""
        if self._warmup is not None:
            start = time.perf_counter()
            try:
                with self.lock:
                    self._warmup()
            except BaseException as error:  # noqa: BLE001 - every waiting stream must hear of it
                self._die(error)
                return False
            self.warmup_s = time.perf_counter() - start
            log.info("warm-up took %.2f s; ready", self.warmup_s)
        if self._freeze_gc:
            freeze_long_lived_objects()
        self.ready.set()
        return True

    def _loop(self) -> None:
        if not self._warm_up():
            return
        failed_steps = 0
        while not self._stopping:
            with self.lock:
                moved = 0
                try:
                    moved = self._drain_inbox()
                    busy = self.engine.has_unfinished()
                    events = self.engine.step() if busy else []
                    failed_steps = 0 if busy else failed_steps
                except Exception as error:  # noqa: BLE001 - one request's failure must not end the others
                    failed_steps += 1
                    if failed_steps >= MAX_FAILED_STEPS:
                        self._die(error)
                        return
                    log.error("an engine step failed; its requests end with an error", exc_info=error)
                    try:
                        self._fail_running(error)
                    except BaseException as cleanup_error:  # noqa: BLE001
                        self._die(cleanup_error)
                        return
                    events, busy = [], True
                except BaseException as error:  # noqa: BLE001 - every waiting stream must hear of it
                    self._die(error)
                    return
                by_request: dict[str, list[TokenEvent]] = {}
                for event in events:
                    by_request.setdefault(event.request_id, []).append(event)
                self.deliver(by_request.items())
                stats = self.engine.stats()
                with self._count_lock:  # the snapshot and the inbox count change together
                    self._stats = stats
                    self._queued -= moved
            gathering = busy and not events and self.engine.gather_wait_s()
            if not busy or gathering:  # idle, or new prompts waiting for more to arrive (woken by each one)
                self._wakeup.wait(min(gathering or self.idle_wait_s, self.idle_wait_s))
                self._wakeup.clear()

    # --- requests (any thread) ----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests not yet running: in the inbox, or in the engine's queue as of its last step."""
        return self._queued + self._stats["waiting"]

    def add(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
            events: asyncio.Queue | None = None, prompt_embeds=None, sink: Sink | None = None) -> str:
        """Queue a request (raises QueueFull, ValueError for a prompt the engine cannot run, EngineDead after a
        crash); its events go to `events` on the calling loop, or in lists to sink(request_id, items) there
        (items: TokenEvents of one step, or one exception: ValueError, RequestFailed, or why the engine died).
        A request added with a sink is let go with `cancel`."""
        if self.error is not None:
            raise EngineDead(f"the engine loop stopped: {self.error!r}")
        prompt = [int(t) for t in prompt]
        self.engine.check_prompt(prompt, params)  # reads only fixed sizes: safe without the lock
        with self._count_lock:
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.waiting} requests are already waiting (max_queue={self.max_queue}); "
                                f"retry later")
            self._queued += 1
        request_id = request_id or f"areq-{next(self._ids)}"
        if request_id in self._listeners:
            with self._count_lock:
                self._queued -= 1
            raise ValueError(f"request id {request_id!r} is already in use")
        self._listen(request_id, events, sink)
        self._inbox.put(("add", request_id, prompt, params, prompt_embeds))
        self._wakeup.set()
        return request_id

    def abort_now(self, request_id: str) -> None:
        """Abort at the next step boundary (frees the request's slot and pages there)."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    def stats(self) -> dict:
        """The engine's counters after its last step (never waits for a step), plus requests still in the
        inbox as waiting."""
        with self._count_lock:
            stats = dict(self._stats)
            stats["waiting"] += self._queued
        return stats

    def score(self, prompts: list[list[int]], starts: list[int], top_k: int = 0) -> list:
        """Engine.score under the engine's lock, between steps (blocking: call it off the event loop)."""
        with self.lock:
            return self.engine.score(prompts, starts, top_k=top_k)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)
        if self._freeze_gc:
            gc.unfreeze()  # the interpreter's last collection frees them (else native bindings report leaks at exit)


def freeze_long_lived_objects() -> None:
    """Collect once, then exempt every object alive now from later cyclic collections (gc.freeze): a model's,
    a compiler's and a web framework's objects live as long as the server, and every full collection walked them
    all, pausing the process (about 0.25 s for 330K objects on CPU). gc.unfreeze() before exiting."""
    gc.collect()
    gc.freeze()
