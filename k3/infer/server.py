"""`k3 serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine.

    POST /v1/completions        prompt (text, texts, token ids), n, logprobs (int), stop, seed, stream, echo
    POST /v1/chat/completions   messages through the model's chat format (k3.chat), logprobs (bool) +
                                top_logprobs (int), tools / tool_choice, response_format; replies read back
                                into content, reasoning_content and tool_calls (k3.infer.chat_request)
    GET  /v1/models, /health, /metrics (Prometheus text)

One HTTP request becomes one engine request per prompt (n samples each). Their token events are merged into
one queue (`_Generation`), decoded incrementally (k3.infer.detokenize) and sent as JSON or as server-sent
events. The response starts only once every prompt has been admitted and has its first token, so a full
queue is a 429 and a bad prompt a 400, never an error inside a 200 stream. A client that goes away cancels
the merge tasks, whose engine streams abort their requests at once (freeing KDA slots and MLA pages);
non-streaming requests watch for the disconnect themselves, streaming ones through Starlette.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.chat.reply import ReplyParser
from k3.infer.async_engine import EngineDead, QueueFull, RequestFailed, freeze_long_lived_objects
from k3.infer.chat_request import plan_chat
from k3.infer.chat_template import ChatTemplate, load_chat_template
from k3.infer.connection_limits import (ServerLimits, check_prompt_chars, limited_h11_protocol, rate_limit_logs,
                                        read_body)
from k3.infer.detokenize import TextAssembler
from k3.infer.echo import join_logprobs, prompt_logprobs, score_prompts
from k3.infer.metrics import ServerMetrics
from k3.infer.origins import add_origin_checks
from k3.infer.protocol import (IMAGE_MARKER, APIError, ChatCompletionRequest, CompletionRequest, check_model,
                               check_prompt, parse_request, reported_logprob, resolve_max_tokens, sampling_params)
from k3.infer.sse import SSE_DONE, sse_chunks, sse_event
from k3.infer.warm_requests import send_warm_requests

log = logging.getLogger("k3.serve")
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (chat: all the room left)


@dataclass
class Choice:
    """One generated sequence of a response (prompt p, sample i -> index p * n + i)."""

    index: int
    assembler: TextAssembler
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)  # joined once at the end, not once per token
    text_chars: int = 0
    finish_reason: str | None = None
    last_token_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    def add_text(self, text: str) -> None:
        if text:
            self.text_pieces.append(text)
            self.text_chars += len(text)


@dataclass
class Update:
    """What one token event changed: new visible text, tokens from `first` on, and whether it ended."""

    choice: Choice
    text: str
    first: int
    finished: bool


class _Server:
    def __init__(self, aengine, model_name: str, tokenizer, max_context: int, max_queue: int,
                 chat_template: ChatTemplate, images=None) -> None:
        self.aengine, self.model_name, self.tokenizer = aengine, model_name, tokenizer
        self.images = images  # k3.infer.image_inputs.ImageInputs for a multimodal model, else None
        self.max_context, self.max_queue, self.chat_template = max_context, max_queue, chat_template
        self.vocab_size = aengine.engine.config.vocab_size
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.active: set[_Generation] = set()
        self._token_text: dict[int, str] = {}
        self._grammar_tokenizer = None
        # Chat requests are planned in worker threads: one build, however many constrained requests come at once.
        self._grammar_lock = threading.Lock()
        self.grammars_ready = threading.Event()  # unset while prepare_grammars runs (/health: warming up)
        self.grammars_ready.set()
        # unset while run_server sends the server's own first requests (k3.infer.warm_requests)
        self.warm_requests_done = threading.Event()
        self.warm_requests_done.set()
        self.api_key: str | None = None

    def reset_metrics(self) -> None:
        """Start the request metrics afresh (after the warm-up requests); requests in flight keep the old ones."""
        self.metrics = ServerMetrics(self.metrics.window_s)

    def grammar_tokenizer(self):
        """The vocabulary as the grammar library reads it (k3.infer.structured), built on first use."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                from k3.infer.structured import GrammarTokenizer

                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size)
            return self._grammar_tokenizer

    def prepare_grammars(self) -> None:
        """Build the grammar tokenizer now (k3.infer.structured.build_ahead), then say the grammars are ready."""
        from k3.infer.structured import build_ahead

        try:
            build_ahead(self.grammar_tokenizer)
        finally:
            self.grammars_ready.set()

    def abort_all(self) -> None:
        """End every request now (shutdown): streams finish with finish_reason "abort" and [DONE]."""
        for generation in list(self.active):
            generation.close()

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text


class _Generation:
    """One HTTP request's engine requests (one per prompt, n samples each), merged into one stream of Updates."""

    def __init__(self, server: _Server, prompts: list[list[int]], params, stops: list[str],
                 prompt_embeds: list | None = None) -> None:
        self.server, self.prompts, self.params = server, prompts, params
        self.prompt_embeds = prompt_embeds or [None] * len(prompts)
        self.n = params.n
        self.choices = [Choice(p * self.n + i, TextAssembler(server.tokenizer, stops))
                        for p in range(len(prompts)) for i in range(self.n)]
        self.stop_ids = server.aengine.engine.stop_ids(params)
        # What arrived, not yet read: (prompt, the engine's events of one step for it | an exception | None: the
        # prompt was let go). A list and one future to wake the reader: cheaper per step than an asyncio.Queue.
        self._arrived: list[tuple[int, Any]] = []
        self._waiter: asyncio.Future | None = None
        self.request_ids: list[str | None] = [None] * len(prompts)
        self.open = set(range(len(prompts)))  # prompts whose engine request has not ended
        self._unfinished = [self.n] * len(prompts)  # samples of each prompt still running in the engine
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self._buffered: list[tuple[int, Any]] = []

    def _put(self, entry: tuple[int, Any]) -> None:
        self._arrived.append(entry)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _take(self) -> list[tuple[int, Any]]:
        """Everything that has arrived since the last take (waits for at least one entry)."""
        while not self._arrived:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        arrived, self._arrived = self._arrived, []
        return arrived

    def _sink(self, p: int):
        """Where the engine thread's events for prompt p land (on this loop, a step's worth at a time)."""
        def sink(request_id: str, items: list) -> None:
            self._put((p, items))
        return sink

    async def start(self) -> None:
        """Submit every prompt and wait until each has been admitted and produced its first event."""
        aengine = self.server.aengine
        for p, ids in enumerate(self.prompts):
            try:
                self.request_ids[p] = aengine.add(ids, self.params, prompt_embeds=self.prompt_embeds[p],
                                                  sink=self._sink(p))
            except Exception as error:  # noqa: BLE001 - answered as the request's error
                self.close()
                raise self._api_error(error) from error
        waiting = set(range(len(self.prompts)))
        while waiting:
            for p, payload in await self._take():
                if payload and isinstance(payload[0], BaseException):
                    self.close()
                    raise self._api_error(self._engine_error(payload[0]))
                self._buffered.append((p, payload))
                waiting.discard(p)

    @staticmethod
    def _engine_error(error: BaseException) -> BaseException:
        if isinstance(error, (ValueError, RequestFailed, EngineDead, QueueFull)):  # QueueFull: from an engine process
            return error
        return EngineDead(f"the engine loop stopped: {error!r}")

    def _api_error(self, error: BaseException) -> APIError:
        if isinstance(error, APIError):
            return error
        if isinstance(error, QueueFull):
            return APIError(f"the server is busy: {error} (--max-queue {self.server.max_queue})", status=429,
                            code="queue_full")
        if isinstance(error, EngineDead):
            return APIError(str(error), status=503, code="engine_dead")
        if isinstance(error, RequestFailed):  # logged by the engine loop
            return APIError(f"generation failed: {error}; other requests are not affected", status=500,
                            code="generation_failed")
        if isinstance(error, ValueError):
            return APIError(str(error))
        log.error("generation failed", exc_info=error)
        return APIError(f"generation failed: {type(error).__name__}: {error}", status=500)

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Updates in batches: everything that arrived since the last batch, one Update per choice that changed
        (a reader that fell behind gets several tokens of a choice in one update, so one chunk, one write)."""
        metrics = self.server.metrics
        while self.open:
            batch, self._buffered = self._buffered, []
            if self._arrived or not batch:
                batch += await self._take()
            merged: dict[int, Update] = {}
            error = None
            now = time.monotonic()
            gaps: list[float | None] = []  # per token: the time since its sequence's previous one (None: first)
            for p, items in batch:
                if p not in self.open:
                    continue
                if items is None:
                    self.open.discard(p)
                    for choice in self.choices[p * self.n:(p + 1) * self.n]:
                        if choice.finish_reason is None:  # let go (shutdown) before its last token
                            choice.finish_reason = "abort"
                            _merge(merged, Update(choice, choice.assembler.finish(), len(choice.token_ids), True))
                    continue
                for event in items:
                    if isinstance(event, BaseException):
                        error = error or self._engine_error(event)
                        break
                    self._unfinished[p] -= bool(event.finished)
                    update = self._apply(p, event, now, gaps)
                    if update is not None:
                        _merge(merged, update)
                group = self.choices[p * self.n:(p + 1) * self.n]
                if self._unfinished[p] == 0:
                    self.open.discard(p)
                elif all(c.finish_reason for c in group):
                    # Ended here (a stop string) before the engine noticed: stop its request now.
                    self.open.discard(p)
                    self.server.aengine.cancel(self.request_ids[p])
            if gaps:
                metrics.token_batch(gaps, now)
            if merged:
                yield list(merged.values())
            if error is not None:
                raise self._api_error(error)

    def _apply(self, p: int, event, now: float, gaps: list[float | None]) -> Update | None:
        choice = self.choices[p * self.n + event.index]
        if choice.finish_reason is not None:
            return None
        if event.token_id is None:  # aborted inside the engine: no token
            choice.finish_reason = event.finish_reason or "abort"
            return Update(choice, choice.assembler.finish(), len(choice.token_ids), True)
        if self.first_token_at is None:
            self.first_token_at = now
            self.server.metrics.first_token(now - self.started_at)
        gaps.append(None if choice.last_token_at is None else now - choice.last_token_at)
        choice.last_token_at = now
        first = len(choice.token_ids)
        token = int(event.token_id)
        choice.token_ids.append(token)
        if event.logprob is not None:  # masked tokens' -inf (a grammar's) as LOGPROB_FLOOR: JSON has no -inf
            choice.logprobs.append(reported_logprob(float(event.logprob)))
            choice.top_logprobs.append([(t, reported_logprob(lp)) for t, lp in event.top_logprobs or []])
        stop_token = event.finished and event.finish_reason == "stop" and token in self.stop_ids
        text = "" if stop_token else choice.assembler.push(token)
        if choice.assembler.stopped:
            choice.finish_reason = "stop"
        elif event.finished:
            text += choice.assembler.finish()
            choice.finish_reason = event.finish_reason or "stop"
        choice.add_text(text)
        return Update(choice, text, first, choice.finish_reason is not None)

    def close(self) -> None:
        """Let go of every engine request still running (each is aborted at the next step boundary); a reader
        still waiting sees those prompts end (their unfinished choices with "abort"). Synchronous, so it works
        inside a cancelled scope."""
        for p in list(self.open):
            if self.request_ids[p] is not None:
                self.server.aengine.cancel(self.request_ids[p])
            self._put((p, None))

    def usage(self) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _merge(merged: dict[int, Update], update: Update) -> None:
    """Fold a choice's later update into its earlier one of the same batch."""
    earlier = merged.get(update.choice.index)
    if earlier is None:
        merged[update.choice.index] = update
    else:
        earlier.text += update.text
        earlier.finished = earlier.finished or update.finished


class _ClientGone(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Callable[[], Any]):
    """Run the coroutine work(); if the client disconnects first, cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
    if gone:
        raise _ClientGone()
    return task.result()


class _Format:
    """The response shapes of one endpoint (completions or chat)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, server: _Server, top_logprobs: int | None, return_token_ids: bool) -> None:
        self.server, self.top, self.return_token_ids = server, top_logprobs, return_token_ids
        self.echo: list[tuple[str, dict | None]] | None = None  # completions with echo: see k3.infer.echo
        self.n = 1

    def logprobs(self, choice: Choice, first: int, last: int) -> dict | None:
        if self.top is None:
            return None
        text = self.server.token_text
        tokens = [text(t) for t in choice.token_ids[first:last]]
        offsets, offset = [], choice.text_chars - sum(len(t) for t in tokens) if first else 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": choice.logprobs[first:last],
                "top_logprobs": [{text(t): lp for t, lp in top[:self.top]} for top in choice.top_logprobs[first:last]],
                "text_offset": offsets}

    def choice(self, choice: Choice, prompt: list[int]) -> dict:
        text, logprobs = choice.text, self.logprobs(choice, 0, len(choice.token_ids))
        if self.echo is not None:  # (prompt text, prompt logprobs or None) per prompt
            prompt_text, prompt_logprobs = self.echo[choice.index // self.n]
            text, logprobs = prompt_text + text, join_logprobs(prompt_logprobs, logprobs, len(prompt_text))
        out = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        return self._with_ids(out, choice, prompt, 0)

    def chunk_choice(self, update: Update, prompt: list[int]) -> dict:
        choice = update.choice
        out = {"index": choice.index, "text": update.text,
               "logprobs": self.logprobs(choice, update.first, len(choice.token_ids)),
               "finish_reason": choice.finish_reason if update.finished else None}
        return self._with_ids(out, choice, prompt, update.first)

    def _with_ids(self, out: dict, choice: Choice, prompt: list[int], first: int) -> dict:
        if self.return_token_ids:
            out["token_ids"] = choice.token_ids[first:]
            if first == 0:
                out["prompt_token_ids"] = prompt
        return out


class _ChatFormat(_Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.server.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, choice: Choice, first: int, last: int) -> dict | None:
        if self.top is None:
            return None
        content = []
        for token, logprob, top in zip(choice.token_ids[first:last], choice.logprobs[first:last],
                                       choice.top_logprobs[first:last]):
            entry = self._entry(token, logprob)
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in top[:self.top]]
            content.append(entry)
        return {"content": content}

    def __init__(self, server: _Server, top_logprobs: int | None, return_token_ids: bool, plan=None) -> None:
        super().__init__(server, top_logprobs, return_token_ids)
        self.plan = plan  # k3.infer.chat_request.ChatPlan: how replies are read (reasoning, tool calls)
        self.parsers: dict[int, Any] = {}

    def _parser(self, choice: Choice):
        if choice.index not in self.parsers:
            self.parsers[choice.index] = self.plan.parser() if self.plan is not None else ReplyParser()
        return self.parsers[choice.index]

    def _finish_reason(self, choice: Choice, parser) -> str | None:
        return "tool_calls" if parser.calls and choice.finish_reason == "stop" else choice.finish_reason

    def choice(self, choice: Choice, prompt: list[int]) -> dict:
        parser = self._parser(choice)
        parser.push(choice.text)
        parser.finish()
        message: dict[str, Any] = {"role": "assistant", "content": parser.content}
        if parser.reasoning:
            message["reasoning_content"] = parser.reasoning
        if parser.calls:
            message["tool_calls"] = [call.as_openai() for call in parser.calls]
            message["content"] = parser.content or None
        out = {"index": choice.index, "message": message,
               "logprobs": self.logprobs(choice, 0, len(choice.token_ids)),
               "finish_reason": self._finish_reason(choice, parser)}
        return self._with_ids(out, choice, prompt, 0)

    def chunk_choice(self, update: Update, prompt: list[int]) -> dict:
        choice = update.choice
        parser = self._parser(choice)
        parsed = parser.push(update.text)
        if update.finished:
            last = parser.finish()
            parsed.content += last.content
            parsed.reasoning += last.reasoning
            parsed.calls += last.calls
            parsed.call_parts += last.call_parts
        delta: dict[str, Any] = {"content": parsed.content}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        calls = [{"index": index, **({"id": call_id, "type": "function"} if call_id else {}),
                  "function": {**({"name": name} if name else {}), "arguments": fragment}}
                 for index, call_id, name, fragment in parsed.call_parts]
        calls += [{"index": call.index, **call.as_openai()} for call in parsed.calls if not call.streamed]
        if calls:
            delta["tool_calls"] = calls
        if update.first == 0:
            delta["role"] = "assistant"
        out = {"index": choice.index, "delta": delta,
               "logprobs": self.logprobs(choice, update.first, len(choice.token_ids)),
               "finish_reason": self._finish_reason(choice, parser) if update.finished else None}
        return self._with_ids(out, choice, prompt, update.first)


async def _respond(request: Request, server: _Server, fmt: _Format, prompts: list[list[int]], params,
                   stops: list[str], stream: bool, include_usage: bool, prompt_embeds: list | None = None) -> Response:
    generation = _Generation(server, prompts, params, stops, prompt_embeds)
    metrics = server.metrics
    metrics.started(sum(len(p) for p in prompts))
    head = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name}
    prompt_of = [prompts[c.index // params.n] for c in generation.choices]
    ended = False

    def end(outcome: str) -> None:
        nonlocal ended
        if not ended:
            ended = True
            generation.close()
            server.active.discard(generation)
            metrics.ended(outcome, time.monotonic() - generation.started_at)

    server.active.add(generation)

    try:
        await _unless_disconnected(request, generation.start)
    except _ClientGone:
        end("aborted")
        return Response(status_code=499)
    except APIError as error:
        end("rejected" if error.status == 429 else "failed")
        raise
    except BaseException:
        end("failed")
        raise

    if not stream:
        async def collect() -> None:
            async for _ in generation.updates():
                pass
        try:
            await _unless_disconnected(request, collect)
        except _ClientGone:
            end("aborted")
            return Response(status_code=499)
        except BaseException:
            end("failed")
            raise
        end("aborted" if any(c.finish_reason == "abort" for c in generation.choices) else "finished")
        body = {**head, "object": fmt.object,
                "choices": [fmt.choice(c, prompt_of[c.index]) for c in generation.choices],
                "usage": generation.usage()}
        return JSONResponse(body)

    async def events() -> AsyncIterator[str]:
        outcome = "aborted"  # unless the loop below completes: a cancelled stream is a client gone
        try:
            chunk = sse_chunks({**head, "object": fmt.chunk_object})
            async for batch in generation.updates():
                # One write for the batch: the events of every choice that changed.
                yield "".join(chunk(fmt.chunk_choice(update, prompt_of[update.choice.index])) for update in batch)
            if include_usage:
                yield sse_event({**head, "object": fmt.chunk_object, "choices": [], "usage": generation.usage()})
            yield SSE_DONE
            outcome = "aborted" if any(c.finish_reason == "abort" for c in generation.choices) else "finished"
        except APIError as error:
            outcome = "failed"
            yield sse_event(error.body())
            yield SSE_DONE
        finally:
            end(outcome)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(async_engine, model_name: str, tokenizer, max_context: int, max_queue: int,
               chat_template: ChatTemplate | None = None, images=None, limits: ServerLimits | None = None,
               allowed_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = ("*",),
               api_key: str | None = None, prepare_grammars: bool = False) -> "FastAPI":
    """The FastAPI application. async_engine: k3.infer.AsyncEngine (its engine's tokenizer must be
    `tokenizer`); max_context: longest prompt + generation; max_queue: as given to the AsyncEngine (shown in
    errors and /health); images: k3.infer.image_inputs.ImageInputs when the model has a vision tower (chat
    messages may then carry image_url parts with data: URLs); limits: body and prompt sizes (defaults if None);
    allowed_origins / allowed_hosts: see k3.infer.origins; api_key: when given, every /v1/ route needs
    `Authorization: Bearer <api_key>` (k3.infer.auth); prepare_grammars: build what structured output needs
    (k3.infer.structured's GrammarTokenizer) in a thread now, /health not ready until it is done (warm-up).
    Tokenizing runs in worker threads, so a long prompt does not hold up other requests."""
    limits = limits or ServerLimits()
    server = _Server(async_engine, model_name, tokenizer, max_context, max_queue,
                     chat_template or load_chat_template(tokenizer), images)
    if prepare_grammars:
        server.grammars_ready.clear()
        threading.Thread(target=server.prepare_grammars, name="k3-grammar-setup", daemon=True).start()
    app = FastAPI(title="k3", description="OpenAI-compatible inference for K3-architecture models")
    app.state.k3 = server
    add_origin_checks(app, allowed_origins, allowed_hosts)
    server.api_key = api_key
    if api_key:
        from k3.infer.auth import require_api_key

        require_api_key(app, api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = (f"no route {request.method} {request.url.path}; this server has POST /v1/completions, "
                   f"POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
                   if error.status_code in (404, 405) else str(error.detail))
        return JSONResponse(APIError(message, status=error.status_code).body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(f"invalid request: {error.errors()[:1]}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        log.error("request failed", exc_info=error)
        body = APIError(f"internal error: {type(error).__name__}: {error}", status=500).body()
        return JSONResponse(body, status_code=500)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "k3", "max_model_len": server.max_context}]}

    # stats() waits for the engine's lock, which a step holds: wait in a worker thread, not in the event loop.
    @app.get("/health")
    async def health() -> JSONResponse:
        stats = await asyncio.to_thread(async_engine.stats)
        alive = async_engine.error is None
        # Until the engine has warmed up (k3.infer.AsyncEngine's warmup), the grammar tokenizer is built (when
        # asked) and run_server's own first requests are answered (k3.infer.warm_requests): not ready.
        ready = (alive and async_engine.ready.is_set() and server.grammars_ready.is_set()
                 and server.warm_requests_done.is_set())
        status = "ok" if ready else "warming up" if alive else f"engine stopped: {async_engine.error!r}"
        body = {"status": status, "model": server.model_name, "max_context": server.max_context,
                "max_queue": server.max_queue, "in_flight": server.metrics.in_flight,
                "warmup_s": async_engine.warmup_s, **stats}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(await asyncio.to_thread(async_engine.stats)),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(await read_body(request, limits), CompletionRequest)
        check_model(body.model, server.model_name)
        if len(body.prompts()) > max(server.max_queue, 1):
            raise APIError(f"the request has {len(body.prompts())} prompts, more than this server ever queues at "
                           f"once ({server.max_queue}, --max-queue); send at most that many per request",
                           param="prompt")
        prompts = []
        many = len(body.prompts()) > 1
        for i, prompt in enumerate(body.prompts()):
            what = f"prompt {i}" if many else "prompt"
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), server.max_context, limits, what)
                ids = await asyncio.to_thread(tokenizer.encode, prompt)
            else:
                ids = list(prompt)
            check_prompt(ids, server.max_context, server.vocab_size, what)
            prompts.append(ids)
        max_tokens = resolve_max_tokens(body.max_tokens, max(map(len, prompts)), server.max_context,
                                        DEFAULT_COMPLETION_TOKENS)
        stops = body.stop_strings()
        fmt = _Format(server, body.top_logprobs_count(), body.return_token_ids)
        if body.echo:
            top = body.top_logprobs_count()
            scored = await score_prompts(async_engine, prompts, top or 0) if top is not None else [None] * len(prompts)
            fmt.echo = [(tokenizer.decode(ids), None if s is None else prompt_logprobs(ids, s, top, server.token_text))
                        for ids, s in zip(prompts, scored)]
            fmt.n = body.n
            if body.max_tokens == 0:  # nothing to generate: the prompts alone
                choices = [{"index": p * body.n + i, "text": fmt.echo[p][0], "logprobs": fmt.echo[p][1],
                            "finish_reason": "length"} for p in range(len(prompts)) for i in range(body.n)]
                used = sum(map(len, prompts))
                return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                     "created": int(time.time()), "model": server.model_name, "choices": choices,
                                     "usage": {"prompt_tokens": used, "completion_tokens": 0, "total_tokens": used}})
        params = sampling_params(body, max_tokens, stops, body.top_logprobs_count(), server.vocab_size)
        return await _respond(request, server, fmt, prompts, params, stops, body.stream, body.include_usage())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(await read_body(request, limits), ChatCompletionRequest)
        check_model(body.model, server.model_name)
        check_prompt_chars(sum(len(m.text()) for m in body.messages), server.max_context, limits, "messages")
        # Off the event loop: compiling a request's grammar (a large schema) takes a while.
        plan = await asyncio.to_thread(plan_chat, body, server.chat_template, tokenizer, server.grammar_tokenizer)
        messages = plan.messages
        urls = [url for m in body.messages for url in m.image_urls()]
        if urls and server.images is None:
            raise APIError(f"this model has no vision tower, so messages cannot carry image_url parts (got "
                           f"{len(urls)}); serve a multimodal K3 directory (one with a vision_config) for images",
                           param="messages")
        embeds = None
        try:
            if urls:  # off the event loop as below: a template may take up to its render deadline
                text = await asyncio.to_thread(server.chat_template.render, messages, plan.tools)
            else:  # message by message, as the model was trained (k3.chat)
                ids = await asyncio.to_thread(server.chat_template.encode, messages, tokenizer, plan.tools)
        except ValueError as error:
            raise APIError(f"the messages could not be put through the chat template "
                           f"({server.chat_template.source}): {error}", param="messages") from error
        if urls:
            try:
                ids, embeds = await asyncio.to_thread(server.images.prompt, text, IMAGE_MARKER, urls, tokenizer)
            except ValueError as error:
                raise APIError(f"invalid image_url: {error}", param="messages") from error
        check_prompt(ids, server.max_context, server.vocab_size, "messages")
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), server.max_context, None)
        stops = body.stop_strings() + [s for s in plan.stops if s not in body.stop_strings()]
        params = sampling_params(body, max_tokens, stops, body.top_logprobs_count(), server.vocab_size)
        params.stop_token_ids += [t for t in plan.stop_token_ids if t not in params.stop_token_ids]
        params.grammar = plan.grammar
        fmt = _ChatFormat(server, body.top_logprobs_count(), body.return_token_ids, plan)
        return await _respond(request, server, fmt, [ids], params, stops, body.stream, body.include_usage(),
                              [embeds])

    return app


def run_server(app, host: str = "127.0.0.1", port: int = 8000, on_listening: Callable[[str], None] | None = None,
               log_level: str = "warning", graceful_timeout_s: float = 5.0, exit_on_engine_death: bool = True,
               limits: ServerLimits | None = None, switch_interval_s: float | None = None,
               warm_requests: bool = True) -> None:
    """Serve `app` until SIGINT or SIGTERM. on_listening(url) is called once the socket is bound (port 0
    picks a free port; the url names the real one). warm_requests (an app from create_app): once its engine is
    warm, the server sends itself a completion and a chat request before /health reports ready
    (k3.infer.warm_requests), and its request metrics start after them. On the signal, requests in progress end
    at once with finish_reason "abort" (an app from create_app), so the graceful shutdown does not wait for long
    streams.
    exit_on_engine_death: when the engine loop stops, shut down and raise EngineDead (so the process exits
    non-zero and a supervisor restarts it); else keep answering, /health with 503. limits: connection count and
    timeouts (k3.infer.connection_limits). switch_interval_s: the interpreter's thread switch interval for the
    process (sys.setswitchinterval; Python's default 5 ms): the engine thread gives up the GIL in every torch
    call and may then wait that long for the event loop to hand it back. The objects alive when it starts (the
    app's; with the engine in process, the model's) are frozen out of the garbage collector's later passes."""
    import uvicorn

    freeze_long_lived_objects()  # the app's and (in process) the model's objects: out of every later collection
    if switch_interval_s is not None:
        import sys

        sys.setswitchinterval(switch_interval_s)

    limits = limits or ServerLimits()
    # lifespan off: the app has no startup/shutdown hooks (the engine is started and stopped by the caller).
    # limit_concurrency one past the connection cap: the protocol refuses extra connections itself, uvicorn
    # refuses extra requests (503) should tasks pile up on the connections it keeps.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=graceful_timeout_s, http=limited_h11_protocol(limits),
                            timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections + 1)
    server = uvicorn.Server(config)
    k3_server = getattr(app.state, "k3", None)
    warming = warm_requests and k3_server is not None
    if warming:
        k3_server.warm_requests_done.clear()  # /health: warming up until they are answered
    signalled: list[int] = []

    def remember(signum, frame) -> None:
        # Outside uvicorn's own handlers (just before it starts, and when it re-raises the signal it shut
        # down for): note it, so a signal during startup still stops the server, and exit normally.
        signalled.append(signum)
        server.should_exit = True

    bind_failed: list[bool] = []
    engine_died: list[BaseException] = []

    async def watch_engine(serving: asyncio.Task) -> None:
        while not serving.done():
            error = k3_server.aengine.error
            if error is not None:
                engine_died.append(error)
                k3_server.abort_all()
                server.should_exit = True
                return
            await asyncio.sleep(0.2)

    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn exits when it cannot bind (it has logged why)
            bind_failed.append(True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        uvicorn_exit = server.handle_exit

        def handle_exit(sig, frame) -> None:  # runs as the signal handler while uvicorn serves
            uvicorn_exit(sig, frame)
            if k3_server is not None:
                loop.call_soon_threadsafe(k3_server.abort_all)

        server.handle_exit = handle_exit
        task = asyncio.create_task(serve())
        if exit_on_engine_death and k3_server is not None:
            asyncio.create_task(watch_engine(task))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        # An engine that died during its warm-up may have shut the server down already: no socket to name.
        if server.started and server.servers and server.servers[0].sockets:
            bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
            url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
            if warming:
                asyncio.create_task(send_warm_requests(k3_server, url, k3_server.api_key,
                                                       lambda: server.should_exit))
            if on_listening is not None:
                on_listening(url)
        elif warming:
            k3_server.warm_requests_done.set()
        await task

    # uvicorn takes SIGINT/SIGTERM while it runs, shuts down, then re-raises the signal to these handlers.
    previous = {sig: signal.signal(sig, remember) for sig in (signal.SIGINT, signal.SIGTERM)}
    rate_limit_logs()
    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()  # the interpreter's last collection frees them (else native bindings report leaks at exit)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if bind_failed:
        raise RuntimeError(f"could not listen on {host}:{port} (is the port in use? --port 0 picks a free one)")
    if engine_died:
        raise EngineDead(f"the engine loop stopped ({engine_died[0]!r}); the server shut down so that a "
                         f"supervisor can restart it (--keep-serving-after-engine-error keeps it answering 503)")
