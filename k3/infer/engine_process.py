"""The engine in a process of its own, so that the HTTP server's Python work (parsing, tokenizing, detokenizing,
JSON, server-sent events) and the engine's step loop do not take turns on one interpreter lock.

    aengine = EngineProcess(functools.partial(build_engine_fn, ...), max_queue=256)   # waits for the child
    create_app(aengine, ...)                                                           # as with an AsyncEngine
    aengine.shutdown()                                                                 # stops the child

The child (a `spawn`ed process) builds its engine with the given picklable callable, runs it under an
AsyncEngine (the same loop, warm-up, failure handling and queue limit as in process) and relays over two
one-way pipes: requests in (add, abort, score, stop), one message of token events per engine step out, plus
the engine's counters, readiness and death. Messages are JSON (plain data only, nothing is unpickled);
sampling parameters cross as their fields (range-checked again on both sides), a grammar as its Lark text
(compiled again, from the child's own cache). Images (prompt embeddings) need the in-process engine.

Every wait has a deadline: the child's start (start_timeout_s), each read (a poll that also checks the child
is alive), scoring calls, and shutdown (stop message, then terminate, then kill). A child that dies sets
`error` (EngineDead naming its exit code), ends every stream with it, and a server's engine watcher shuts the
server down; a child whose parent dies sees its request pipe close and exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import multiprocessing
import queue
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

from k3.infer.engine import ScoreOutput, TokenEvent, check_prompt_fields
from k3.infer.event_streams import EngineDead, EventStreams, QueueFull, RequestFailed, Sink
from k3.infer.sampling import SamplingParams

log = logging.getLogger("k3.engine")
POLL_S = 0.5  # how often a blocked reader checks that the other side is still alive
STATS_EVERY_S = 0.2  # the child's counters reach the parent at least this often while it is busy
ERRORS = {"ValueError": ValueError, "RequestFailed": RequestFailed, "EngineDead": EngineDead, "QueueFull": QueueFull}


# --- what crosses the pipes -------------------------------------------------------------------------------
def params_to_wire(params: SamplingParams, vocab_size: int, max_context: int) -> dict[str, Any]:
    """SamplingParams -> plain fields, range-checked here, before they cross (the child checks them again)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams) if f.name != "grammar"}
    fields["stop_token_ids"], fields["stop"] = list(fields["stop_token_ids"]), list(fields["stop"])
    SamplingParams(**fields)  # the dataclass's own checks (a field changed after construction is caught here)
    if not all(0 <= t < vocab_size for t in fields["stop_token_ids"]):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {fields['stop_token_ids']}")
    if fields["max_new_tokens"] > max_context:
        raise ValueError(f"max_new_tokens must be at most the context ({max_context}), got {fields['max_new_tokens']}")
    grammar = params.grammar
    if grammar is not None:
        fields["grammar"] = {"lark": grammar.lark, "description": grammar.description}
    return fields


def params_from_wire(fields: dict[str, Any], grammar_tokenizer: Callable[[], Any]) -> SamplingParams:
    if not isinstance(fields, dict):
        raise ValueError(f"sampling parameters must be an object, got {type(fields).__name__}")
    fields = dict(fields)
    grammar = fields.pop("grammar", None)
    allowed = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"unknown sampling parameters {unknown}")
    params = SamplingParams(**fields)
    if grammar is not None:
        from k3.infer.structured import Grammar

        if not (isinstance(grammar, dict) and isinstance(grammar.get("lark"), str)
                and isinstance(grammar.get("description"), str)):
            raise ValueError("a grammar must be {\"lark\": str, \"description\": str}")
        params.grammar = Grammar(grammar_tokenizer(), grammar["lark"], grammar["description"])
    return params


def _event_to_wire(item) -> list:
    if isinstance(item, TokenEvent):
        top = [list(pair) for pair in item.top_logprobs] if item.top_logprobs is not None else None
        return ["t", item.index, item.token_id, item.logprob, top, item.finished, item.finish_reason]
    kind = next((name for name, cls in ERRORS.items() if isinstance(item, cls)), "EngineDead")
    return ["e", kind, str(item) if kind != "EngineDead" else f"the engine loop stopped: {item!r}"]


def _event_from_wire(request_id: str, item: list):
    if item[0] == "t":
        _, index, token, logprob, top, finished, reason = item
        return TokenEvent(request_id, index, token, logprob, [tuple(p) for p in top] if top is not None else None,
                          finished, reason)
    return ERRORS.get(item[1], EngineDead)(item[2])


def _events_from_wire(request_id: str, items: list) -> list:
    return [_event_from_wire(request_id, item) for item in items]


def _send(connection, message: list) -> None:
    connection.send_bytes(json.dumps(message).encode("utf-8"))


def _receive(connection) -> list:
    message = json.loads(connection.recv_bytes().decode("utf-8"))
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError(f"malformed message {str(message)[:100]}")
    return message


# --- the parent's side -------------------------------------------------------------------------------------
class EngineInfo:
    """What the server reads of the engine (k3.infer.server): its vocabulary, limits and stop ids, from the
    child's first message; check_prompt range-checks a prompt before it crosses."""

    def __init__(self, hello: dict[str, Any]) -> None:
        self.config = SimpleNamespace(vocab_size=int(hello["vocab_size"]))
        self.max_context, self.max_batch = int(hello["max_context"]), int(hello["max_batch"])
        self.eos_token_id = hello.get("eos_token_id")
        self.device = hello.get("device", "?")

    def stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())

    def check_prompt(self, ids: list[int], params: SamplingParams, name: str = "the prompt") -> None:
        check_prompt_fields(ids, params, name, self.max_context, self.config.vocab_size, self.max_batch)


class EngineProcess(EventStreams):
    """An AsyncEngine's interface (add / cancel / stream / stats / score / ready / error / shutdown) over an
    engine in a child process. build: a picklable callable (a module-level function, or functools.partial of
    one) that returns the Engine in the child. warmup: run Engine.warmup there before `ready`."""

    def __init__(self, build: Callable[[], Any], max_queue: int = 256, warmup: bool = True,
                 start_timeout_s: float = 1800.0, on_ready: Callable[[float | None], None] | None = None) -> None:
        super().__init__()
        context = multiprocessing.get_context("spawn")
        child_requests, self._requests = context.Pipe(duplex=False)
        self._events, child_events = context.Pipe(duplex=False)
        self.process = context.Process(target=_child_main, name="k3-engine",
                                       args=(build, max_queue, warmup, child_requests, child_events))
        self.process.start()
        child_requests.close()  # the parent keeps only its ends: the child's exit then reads as EOF
        child_events.close()
        self.max_queue = max_queue
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.warmup_s: float | None = None
        self._on_ready = on_ready
        self._stopping = False
        self._ids = itertools.count()
        self._calls: dict[int, list] = {}  # call id -> [threading.Event, reply]
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        try:
            hello = self._wait_for_hello(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.engine = EngineInfo(hello)
        self._stats: dict[str, Any] = hello["stats"]
        self._reader = threading.Thread(target=self._read_loop, name="k3-engine-reader", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="k3-engine-sender", daemon=True)
        self._reader.start()
        self._sender.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _wait_for_hello(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._events.poll(POLL_S):
                try:
                    message = _receive(self._events)
                except (EOFError, OSError):
                    break
                if message[0] == "hello":
                    return message[1]
                if message[0] == "failed":
                    raise RuntimeError(f"the engine process could not build its engine: {message[1]}")
            elif not self.process.is_alive():
                break
        else:
            raise RuntimeError(f"the engine process did not start within {timeout_s:.0f} s")
        self.process.join(5)
        raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})")

    # --- threads --------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            try:
                message = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                if self._stopping or self.error is not None:
                    return
                continue
            try:
                _send(self._requests, message)
            except (OSError, ValueError):  # the child is gone: the reader says so
                return
            if message[0] == "stop":
                return

    def _read_loop(self) -> None:
        while True:
            try:
                if not self._events.poll(POLL_S):
                    if self.process.is_alive():
                        continue
                    raise EOFError
                message = _receive(self._events)
            except (EOFError, OSError):
                break
            except ValueError as error:  # a message that is not ours: the pipe cannot be trusted any more
                self._die(EngineDead(f"the engine process sent a malformed message ({error})"))
                return
            kind = message[0]
            if kind == "events":
                self.deliver(message[1], _events_from_wire)
                if message[2] is not None:
                    self._stats = message[2]
            elif kind == "stats":
                self._stats = message[1]
            elif kind == "ready":
                self.warmup_s = message[1]
                self.ready.set()
                if self._on_ready is not None:
                    self._on_ready(self.warmup_s)
            elif kind == "reply":
                call = self._calls.get(message[1])
                if call is not None:
                    call[1] = message[2:]
                    call[0].set()
            elif kind == "dead":
                self._die(EngineDead(message[1]))
                return
        if not self._stopping:
            self.process.join(5)
            self._die(EngineDead(f"the engine process exited (exit code {self.process.exitcode})"))

    def _die(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            log.error("the engine stopped; no further requests are served: %s", error)
        for call in list(self._calls.values()):
            call[0].set()
        self.deliver_to_all(error)

    # --- requests (any thread) ----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return int(self._stats.get("waiting", 0))

    def add(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
            events: asyncio.Queue | None = None, prompt_embeds=None, sink: Sink | None = None) -> str:
        """As AsyncEngine.add: raises EngineDead, QueueFull (as of the child's last counters; the child holds
        the exact limit), ValueError for a prompt or parameters out of range (checked here, before crossing)."""
        if self.error is not None:
            raise EngineDead(f"the engine loop stopped: {self.error!r}")
        if prompt_embeds is not None:
            raise ValueError("prompt embeddings (images) need the engine in the server's process; serve this model "
                             "with --no-engine-process")
        prompt = [int(t) for t in prompt]
        self.engine.check_prompt(prompt, params)
        wire = params_to_wire(params, self.engine.config.vocab_size, self.engine.max_context)
        if self.waiting >= self.max_queue:
            raise QueueFull(f"{self.waiting} requests are already waiting (max_queue={self.max_queue}); retry later")
        request_id = request_id or f"preq-{next(self._ids)}"
        if request_id in self._listeners:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._listen(request_id, events, sink)
        self._outbox.put(["add", request_id, prompt, wire])
        return request_id

    def abort_now(self, request_id: str) -> None:
        self._outbox.put(["abort", request_id])

    def stats(self) -> dict:
        return dict(self._stats)

    def score(self, prompts: list[list[int]], starts: list[int], top_k: int = 0,
              timeout_s: float = 600.0) -> list[ScoreOutput]:
        """Engine.score in the child (blocking; call it off the event loop)."""
        vocab = self.engine.config.vocab_size
        for ids in prompts:
            if not ids or len(ids) > self.engine.max_context or not all(isinstance(t, int) and 0 <= t < vocab
                                                                         for t in ids):
                raise ValueError(f"a prompt to score must hold 1 to {self.engine.max_context} ids in [0, {vocab})")
        if not 0 <= top_k <= 20:
            raise ValueError(f"top_k must be in [0, 20], got {top_k}")
        call_id = next(self._call_ids)
        call = self._calls[call_id] = [threading.Event(), None]
        self._outbox.put(["score", call_id, [list(p) for p in prompts], list(starts), top_k])
        try:
            if not call[0].wait(timeout_s):
                raise TimeoutError(f"scoring took longer than {timeout_s:.0f} s")
        finally:
            self._calls.pop(call_id, None)
        if call[1] is None:
            raise EngineDead(f"the engine loop stopped: {self.error!r}")
        ok, value = call[1]
        if not ok:
            raise ERRORS.get(value[0], RuntimeError)(value[1])
        return [ScoreOutput(row[0], [[tuple(p) for p in top] for top in row[1]] if row[1] is not None else None)
                for row in value]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the child: a stop message, then SIGTERM, then SIGKILL, each with its deadline."""
        self._stopping = True
        if self.process.is_alive():
            self._outbox.put(["stop"])
            if not getattr(self, "_sender", None) or not self._sender.is_alive():
                try:
                    _send(self._requests, ["stop"])
                except (OSError, ValueError):
                    pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for thread in (getattr(self, "_sender", None), getattr(self, "_reader", None)):
            if thread is not None and thread is not threading.current_thread():
                thread.join(2 * POLL_S + 1)
        self._requests.close()
        self._events.close()



# --- the child's side --------------------------------------------------------------------------------------
def _child_main(build: Callable[[], Any], max_queue: int, warmup: bool, requests, events) -> None:
    import signal
    import sys

    # Ctrl-C in a terminal reaches the whole process group: the server stops this process itself, in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = build()
    except BaseException as error:  # noqa: BLE001 - the parent must hear why
        _send(events, ["failed", f"{type(error).__name__}: {error}"])
        sys.exit(1)
    from k3.infer.async_engine import AsyncEngine

    run_warmup = getattr(engine, "warmup", None) if warmup else None
    aengine = AsyncEngine(engine, max_queue=max_queue, warmup=run_warmup, freeze_gc=True)
    tokenizer = getattr(engine, "tokenizer", None)
    _send(events, ["hello", {"vocab_size": engine.config.vocab_size,
                             "max_context": getattr(engine, "max_context", 2**31 - 1),
                             "max_batch": getattr(engine, "max_batch", 2**31 - 1),
                             "eos_token_id": getattr(tokenizer, "eos_token_id", None) if tokenizer else None,
                             "device": str(getattr(engine, "device", "?")), "stats": aengine.stats()}])
    relay = _Relay(aengine, requests, events)
    if tokenizer is not None:  # the grammar library's first import takes seconds: not on a request's time
        threading.Thread(target=relay.prepare_grammars, name="k3-grammar-setup", daemon=True).start()
    try:
        asyncio.run(relay.run())
    finally:
        aengine.shutdown()


class _Relay:
    """The child's event loop: requests from the pipe into the AsyncEngine, its events back, one message per
    step. Any message it cannot use fails its own request (or is logged), never the engine."""

    def __init__(self, aengine, requests, events) -> None:
        self.aengine, self.requests, self.events = aengine, requests, events
        self.pending: list = []
        self.stats_at = 0.0
        self.done = asyncio.Event()
        self._grammar_tokenizer = None
        self._grammar_lock = threading.Lock()

    def grammar_tokenizer(self):
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                from k3.infer.structured import GrammarTokenizer

                engine = self.aengine.engine
                self._grammar_tokenizer = GrammarTokenizer(engine.tokenizer, engine.config.vocab_size)
            return self._grammar_tokenizer

    def prepare_grammars(self) -> None:
        from k3.infer.structured import build_ahead

        build_ahead(self.grammar_tokenizer)

    def send(self, message: list) -> None:
        try:
            _send(self.events, message)
        except (OSError, ValueError):  # the parent is gone
            self.done.set()

    def sink(self, request_id: str, items: list) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append([request_id, [_event_to_wire(item) for item in items]])

    def flush(self) -> None:
        now = time.monotonic()
        stats = None
        if now - self.stats_at > STATS_EVERY_S:
            stats, self.stats_at = self.aengine.stats(), now
        pending, self.pending = self.pending, []
        self.send(["events", pending, stats])

    def readable(self) -> None:
        try:
            while self.requests.poll():
                try:
                    self.handle(_receive(self.requests))
                except (EOFError, OSError):
                    raise
                except Exception as error:  # noqa: BLE001 - one bad message must not stop the relay
                    log.error("the engine process could not use a message: %s: %s", type(error).__name__, error)
        except (EOFError, OSError):  # the parent is gone
            self.done.set()

    def handle(self, message: list) -> None:
        kind = message[0]
        if kind == "add":
            request_id = message[1] if len(message) > 1 and isinstance(message[1], str) else None
            if request_id is None:
                log.error("an add message without a request id was dropped")
                return
            try:
                if len(message) != 4 or not isinstance(message[2], list):
                    raise ValueError("an add message is [\"add\", id, prompt ids, sampling parameters]")
                params = params_from_wire(message[3], self.grammar_tokenizer)
                self.aengine.add(message[2], params, request_id, sink=self.sink)
            except Exception as error:  # noqa: BLE001 - fails this request, never the engine
                known = isinstance(error, (ValueError, QueueFull, EngineDead))
                self.sink(request_id, [error if known else ValueError(f"{type(error).__name__}: {error}")])
        elif kind == "abort":
            if len(message) == 2 and isinstance(message[1], str):
                self.aengine.cancel(message[1])
        elif kind == "score":
            asyncio.get_running_loop().create_task(self.score(*message[1:]))
        elif kind == "stop":
            self.done.set()
        else:
            log.error("the engine process got an unknown message %r", kind)

    async def score(self, call_id, prompts, starts, top_k) -> None:
        def run():
            with self.aengine.lock:
                return self.aengine.engine.score(prompts, starts, top_k=top_k)
        try:
            rows = await asyncio.to_thread(run)
            self.send(["reply", call_id, True, [[r.logprobs, r.top_logprobs] for r in rows]])
        except Exception as error:  # noqa: BLE001 - answered to the caller
            kind = "ValueError" if isinstance(error, ValueError) else "RequestFailed"
            self.send(["reply", call_id, False, [kind, f"{type(error).__name__}: {error}"]])

    async def watch(self) -> None:
        """Readiness, death and the counters while idle."""
        told_ready = False
        while not self.done.is_set():
            if not told_ready and self.aengine.ready.is_set():
                told_ready = True
                self.send(["ready", self.aengine.warmup_s])
            if self.aengine.error is not None:
                self.send(["dead", f"the engine loop stopped: {self.aengine.error!r}"])
                self.done.set()
                return
            if time.monotonic() - self.stats_at > STATS_EVERY_S:
                self.stats_at = time.monotonic()
                self.send(["stats", self.aengine.stats()])
            await asyncio.sleep(0.05)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.requests.fileno(), self.readable)
        watcher = loop.create_task(self.watch())
        await self.done.wait()
        watcher.cancel()
        loop.remove_reader(self.requests.fileno())
