"""Serving under load: `k3 serve` (HTTP, streaming) at several concurrencies, against the same requests one by
one through the engine in process, and against transformers' `generate` on the matched Kimi-Linear config.

Usage: python bench/serve.py [--preset debug|tiny|small] [--prompt 1024] [--new 256] [--concurrency 1 16 64]
                             [--requests-per-level 2] [--url URL] [--device cpu|cuda] [--out F]
                             [--mixed tools json_schema] [--no-warmup]

Model: the preset with random weights (seed 0) and a bench-only tokenizer with no EOS (token i <-> " i"),
so every request runs its full --new tokens. Prompts are random token ids, a fresh set per level (no
prefix-cache hits). The phases run one after another, never side by side (they would share the CPU/GPU):
  server       a `k3 serve`-equivalent subprocess (this script with --serve: the same create_app and
               run_server) unless --url names a running one. An open-loop generator: requests are released
               at --rate per second (default: all at once) with at most C in flight, C in --concurrency;
               each level sends C x --requests-per-level requests, from one client process per 16 streams
               (--client-processes; a client parses every token, and one process fell behind at C=64).
               Streaming with token ids, so every token is timed as the client sees it: output tokens/s over
               the level's wall time; time to first token (TTFT) and per-output-token time (TPOT, mean gap
               after the first token), p50 / p99; the clients' CPU time per token beside the server's.
               The engine's steps, prefill forwards and overlapped steps during each level come from /metrics
               (from Engine.stats() for the in-process rows): fewer, fuller prefill forwards are cheaper.
  one-by-one   the same engine in process, requests one at a time (bench/engine.py's run_load with one
               prompt): what the server's batching is measured against.
  in process   the largest level's requests submitted at once to the engine in process with max_batch C:
               the same batching without HTTP, so the gap to the server's row is the server's own cost.
               On a shared CPU, wall times move with other processes' load; "CPU ms / token" (the server
               process's, or this process's for the in-process rows) much less: it is the number to compare.
  transformers KimiLinearForCausalLM.generate, greedy, one request at a time: TTFT = the time to generate
               one token, TPOT = (time for 1 + new tokens - time for 1) / new, as in bench/decode.py. On the
               `small` preset the peer is bench/train.py's matched config; on others a Kimi-Linear config of
               the preset's widths, layers and MLA positions (no AttnRes, latent MoE or output gates).
  fresh        the server's start: seconds from spawning it to /health 200 (after its warm-up, unless
               --no-warmup), the warm-up's own seconds, and the TTFT of the very first request (same shape),
               sent after this process has streamed once from a stub of its own (warm_client: the client's
               own first-use cost is not the server's).
  mixed        --mixed tools json_schema: a second server speaking chat (a small byte-level BPE tokenizer, the
               k3 chat format, the preset's model with that vocabulary), at the top concurrency: plain chat
               requests, then the same with every other request carrying `tools` (tool_choice required) or a
               `json_schema` response_format (both grammar-constrained in the engine's sampling).
Presets also set the default sizes: debug 64 in / 16 out, tiny 256 / 32, small 1024 / 256 (the issue's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name, print_table, synchronize, write_json  # noqa: E402
from engine import percentile, prompts_for, run_load  # noqa: E402

from k3 import K3ForCausalLM, ModelConfig  # noqa: E402
from k3.infer import Engine, SamplingParams  # noqa: E402

SIZES = {"debug": (64, 16), "tiny": (256, 32), "small": (1024, 256)}
# One client process per this many concurrent streams by default: parsing every streamed token costs the client
# more CPU than the server spends sending it (0.11-0.20 against 0.06-0.11 ms a token, measured on 2 CPU cores),
# so one client process at C=64 held its requests back and the server was measured against a slow client.
CLIENT_STREAMS = 16
CLIENT_START_TIMEOUT_S = 120.0
CLIENT_LEVEL_TIMEOUT_S = 3600.0


class NumberTokenizer:
    """Bench-only: token i is the text " i"; no EOS, so generation always runs to max_tokens."""

    eos_token_id = bos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) % self.vocab_size for t in text.split() if t.isdigit()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {int(i)}" for i in ids)


def build_model(preset: str, device: torch.device, dtype: torch.dtype, vocab_size: int | None = None):
    torch.manual_seed(0)
    config = ModelConfig.from_preset(preset, **({"vocab_size": vocab_size} if vocab_size else {}))
    with torch.device(device):
        model = K3ForCausalLM(config)
    return model.to(dtype).eval(), config


class StubEngine:
    """--stub-step-ms: what AsyncEngine and the server read of an Engine, with steps that give every running
    request one token after sleeping the given time (as a GPU step leaves the host free), and no model: the
    server's own cost per token, and whether it keeps up with an engine of that step time."""

    def __init__(self, vocab_size: int, max_batch: int, step_s: float, handoffs: int = 1) -> None:
        from collections import deque
        from types import SimpleNamespace

        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.max_batch, self.step_s, self.tokenizer = max_batch, step_s, None
        self.handoffs = max(1, handoffs)  # the step sleeps in this many pieces, each giving up the GIL
        self.waiting: deque = deque()
        self.running: dict[str, list] = {}  # request id -> [params, tokens given]
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.device = torch.device("cpu")
        self.steps = 0

    def stop_ids(self, params) -> set[int]:
        return set(params.stop_token_ids)

    def warmup(self) -> float:
        return 0.0  # nothing to compile

    def gather_wait_s(self) -> float:
        return 0.0  # prompts start at the next step: nothing to gather

    def check_prompt(self, ids, params, name: str = "the prompt") -> None:
        if not ids:
            raise ValueError(f"{name} is empty")

    def add_request(self, prompt, params, request_id=None, prompt_embeds=None) -> str:
        self.waiting.append((request_id, params))
        return request_id

    def abort(self, request_id: str) -> bool:
        self.waiting = type(self.waiting)(w for w in self.waiting if w[0] != request_id)
        return self.running.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
        from k3.infer.engine import TokenEvent

        while self.waiting and len(self.running) < self.max_batch:
            request_id, params = self.waiting.popleft()
            self.running[request_id] = [params, 0]
        for _ in range(self.handoffs):  # as a GPU step's torch calls give up the GIL and wait to take it back
            time.sleep(self.step_s / self.handoffs)
        events = []
        for request_id, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0].max_new_tokens
            events.append(TokenEvent(request_id, 0, 1 + state[1] % 200, finished=done,
                                     finish_reason="length" if done else None))
            if done:
                del self.running[request_id]
        self.steps += 1
        return events

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running), "prefilling": 0, "kda_slots_total": 0,
                "kda_slots_used": 0, "mla_pages_total": 0, "mla_pages_used": 0, "mla_pages_free": 0,
                "prefix_entries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0, "prompt_tokens": 0,
                "generated_tokens": 0, "steps": self.steps, "finished": 0}


CHAT_TEXT = ('{"city": "Paris", "zone": "UTC", "answer": [1, 2, 3], "ok": true} ' * 8
             + "<|user|>What is the weather?<|assistant|><think>Let me look.</think><tool_call>")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "array", "items": {"type": "integer"}, "maxItems": 64},
                                     "ok": {"type": "boolean"}},
    "required": ["answer", "ok"], "additionalProperties": False}}}


def chat_tokenizer():
    """--mixed: a small byte-level BPE in the k3 chat format (any text encodes; JSON has tokens to use)."""
    from k3.chat import ChatFormat, attach_chat_format, builtin_template
    from k3.data.tokenizer import train_bpe

    tokenizer = train_bpe([CHAT_TEXT] * 8, vocab_size=512, show_progress=False)
    attach_chat_format(tokenizer, ChatFormat(builtin_template("k3"), "built-in k3"))
    return tokenizer


def bench_engine(args):
    """The bench server's engine (module level: with --engine-process the spawned engine process builds it)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stub_step_ms is not None:
        if not args.chat:
            return StubEngine(ModelConfig.from_preset(args.preset).vocab_size, args.max_batch, args.stub_step_ms / 1e3,
                              args.stub_handoffs)
        tokenizer = chat_tokenizer()  # a BPE trained here: once
        stub = StubEngine(tokenizer.vocab_size, args.max_batch, args.stub_step_ms / 1e3, args.stub_handoffs)
        stub.tokenizer = tokenizer  # what the engine process builds constrained requests' grammars from
        return stub
    tokenizer = chat_tokenizer() if args.chat else None
    model, config = build_model(args.preset, torch.device(args.device), _dtype(args),
                                tokenizer.vocab_size if tokenizer else None)
    return Engine(model, tokenizer or NumberTokenizer(config.vocab_size), max_context=args.max_context,
                  max_batch=args.max_batch, overlap_steps=args.overlap_steps, **gather_option(args))


def serve_main(args) -> None:
    """--serve: the server side, in its own process."""
    from k3.infer import AsyncEngine
    from k3.infer.server import create_app, run_server

    if args.engine_process:
        import functools

        from k3.infer.engine_process import EngineProcess

        tokenizer = chat_tokenizer() if args.chat else NumberTokenizer(ModelConfig.from_preset(args.preset).vocab_size)
        aengine = EngineProcess(functools.partial(bench_engine, args), max_queue=4096, warmup=not args.no_warmup)
        app = create_app(aengine, "bench", tokenizer, args.max_context, 4096, prepare_grammars=not args.no_warmup)
        try:
            run_server(app, "127.0.0.1", 0, on_listening=lambda url: print(f"listening {url}", flush=True),
                       **({"switch_interval_s": args.switch_interval} if args.switch_interval else {}))
        finally:
            aengine.shutdown()
        return
    if args.stub_step_ms is not None:  # with --chat, the chat tokenizer: the chat path's own cost per token
        tokenizer = chat_tokenizer() if args.chat else NumberTokenizer(ModelConfig.from_preset(args.preset).vocab_size)
        engine = StubEngine(tokenizer.vocab_size, args.max_batch, args.stub_step_ms / 1e3, args.stub_handoffs)
    elif args.chat:
        tokenizer = chat_tokenizer()
        model, config = build_model(args.preset, torch.device(args.device), _dtype(args), tokenizer.vocab_size)
    else:
        model, config = build_model(args.preset, torch.device(args.device), _dtype(args))
        tokenizer = NumberTokenizer(config.vocab_size)
    if args.stub_step_ms is None:
        engine = Engine(model, tokenizer, max_context=args.max_context, max_batch=args.max_batch,
                        overlap_steps=args.overlap_steps, **gather_option(args))
    # Without the warm-up argument when it is off, so the same script drives an older k3 (before/after runs).
    aengine = AsyncEngine(engine, max_queue=4096, **({} if args.no_warmup else {"warmup": engine.warmup}))
    app = create_app(aengine, "bench", tokenizer, args.max_context, 4096, prepare_grammars=not args.no_warmup)
    try:
        run_server(app, "127.0.0.1", 0, on_listening=lambda url: print(f"listening {url}", flush=True),
                   **({"switch_interval_s": args.switch_interval} if args.switch_interval else {}))
    finally:
        aengine.shutdown()


def gather_option(args) -> dict:
    """EngineConfig.gather_prompts_ms when --gather-prompts-ms is given (else the engine's default)."""
    return {} if args.gather_prompts_ms is None else {"gather_prompts_ms": args.gather_prompts_ms}


def _dtype(args) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def start_server(args, chat: bool = False, engine_process: bool = False) -> tuple[subprocess.Popen, str, dict]:
    """The bench server as a subprocess -> (process, url, its start: seconds to listening and to /health 200,
    and the warm-up's seconds as /health reports them)."""
    started = time.perf_counter()
    command = [sys.executable, __file__, "--serve", "--preset", args.preset, "--device", args.device,
               "--max-batch", str(max(args.concurrency)), "--max-context", str(args.prompt + args.new + 64)]
    if chat:  # room for the tool definitions the chat format writes into the prompt
        command += ["--chat", "--max-context", str(args.prompt + args.new + 1024)]
    if args.no_warmup:
        command.append("--no-warmup")
    if engine_process:
        command.append("--engine-process")
    if args.switch_interval:
        command += ["--switch-interval", str(args.switch_interval)]
    if args.stub_step_ms is not None:
        command += ["--stub-step-ms", str(args.stub_step_ms), "--stub-handoffs", str(args.stub_handoffs)]
    if args.overlap_steps is not None:
        command.append("--overlap-steps" if args.overlap_steps else "--no-overlap-steps")
    if args.gather_prompts_ms is not None:
        command += ["--gather-prompts-ms", str(args.gather_prompts_ms)]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # blocks until the server listens, or it dies (EOF)
    if not line.startswith("listening "):
        process.kill()
        raise RuntimeError(f"the bench server did not start (exit {process.wait()})")
    url = line.split()[1]
    listening = time.perf_counter() - started
    import httpx

    deadline = time.monotonic() + 1800  # a warm-up that compiles every decode graph can take minutes
    while True:
        health = httpx.get(f"{url}/health", timeout=60)
        if health.status_code == 200:
            break
        if health.json().get("status") != "warming up" or time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError(f"the bench server did not get ready: {health.text[:300]}")
        time.sleep(0.1)
    return process, url, {"listening_s": listening, "ready_s": time.perf_counter() - started,
                          "warmup_s": health.json().get("warmup_s")}


async def one_request(http, model: str, prompt: list[int] | dict, new: int) -> dict:
    """prompt: token ids (/v1/completions), or a chat body's fields (/v1/chat/completions)."""
    chat = isinstance(prompt, dict)
    body = {"model": model, "max_tokens": new, "temperature": 0, "stream": True, "return_token_ids": True,
            **(prompt if chat else {"prompt": prompt})}
    start = time.monotonic()  # one clock for every client process of a level
    times: list[float] = []
    async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                count = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                times += [time.monotonic()] * count
    if not times:
        raise RuntimeError("a request returned no tokens")
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return dict(start=start, end=times[-1], tokens=len(times), ttft=times[0] - start, tpot=tpot)


async def client_requests(url: str, model: str, prompts: list, new: int, concurrency: int,
                          rate: float | None, seed: int = 0) -> list[dict]:
    """Each prompt as a streamed request, at most `concurrency` in flight: one dict per request."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(concurrency + 1000 * seed)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def gated(prompt):
            async with gate:
                return await one_request(http, model, prompt, new)

        tasks = []
        for prompt in prompts:  # open loop: releases follow the schedule, not the completions
            tasks.append(asyncio.create_task(gated(prompt)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def level_summary(results: list[dict]) -> dict:
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return summary(len(results), tokens, wall, [r["ttft"] for r in results],
                   [r["tpot"] for r in results if r["tokens"] > 1])


async def load_level(url: str, model: str, prompts: list, new: int, concurrency: int,
                     rate: float | None) -> dict:
    return level_summary(await client_requests(url, model, prompts, new, concurrency, rate))


def client_processes_for(concurrency: int, asked: int | None) -> int:
    """--client-processes, or by default one client process per CLIENT_STREAMS concurrent streams, leaving
    most cores to the server and its engine (one on a machine of fewer than 8 cores)."""
    if asked is not None:
        return max(1, min(asked, concurrency))
    return max(1, min(-(-concurrency // CLIENT_STREAMS), (os.cpu_count() or 1) // 4))


def _client_part(url, model, prompts, new, concurrency, rate, seed, ready, go, results) -> None:
    """One client process's share of a level (spawned: nothing of the parent's state). Puts (seed, rows or an
    error's text, CPU seconds)."""
    asyncio.run(warm_client())  # its first stream's one-off costs (imports, first connection) before the level
    ready.put(os.getpid())
    if not go.wait(CLIENT_START_TIMEOUT_S):
        results.put((seed, "the level did not start in time", 0.0))
        return
    cpu = time.process_time()
    try:
        done = asyncio.run(client_requests(url, model, prompts, new, concurrency, rate, seed))
    except Exception as error:  # noqa: BLE001 - the parent reports it
        done = f"{type(error).__name__}: {error}"
    results.put((seed, done, time.process_time() - cpu))


def _collect(queue, workers: list, count: int, timeout_s: float, what: str) -> list:
    """count items from queue within timeout_s, failing early if a worker died without putting its item."""
    import queue as queues

    items, deadline = [], time.monotonic() + timeout_s
    while len(items) < count:
        try:
            items.append(queue.get(timeout=1.0))
        except queues.Empty:
            if time.monotonic() > deadline:
                raise RuntimeError(f"client processes: {what} took longer than {timeout_s:.0f} s") from None
            if any(not w.is_alive() and w.exitcode != 0 for w in workers):
                raise RuntimeError(f"a client process exited (codes {[w.exitcode for w in workers]}) before "
                                   f"{what}") from None
    return items


def client_level(url: str, model: str, prompts: list, new: int, concurrency: int, rate: float | None,
                 processes: int) -> dict:
    """A level's requests from `processes` client processes (their streams and prompts dealt out evenly, started
    together), so that the client's own parsing of every streamed token does not hold the server back; the
    summary over all of them, with the clients' CPU time per output token."""
    if processes <= 1:
        cpu = time.process_time()
        r = asyncio.run(load_level(url, model, prompts, new, concurrency, rate))
        return {**r, "client_processes": 1,
                "client_cpu_ms_per_token": (time.process_time() - cpu) * 1e3 / r["output_tokens"]}
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA or threads
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    workers = []
    for part in range(processes):
        share = concurrency // processes + (part < concurrency % processes)
        args = (url, model, prompts[part::processes], new, share, rate / processes if rate else None, part,
                ready, go, results)
        workers.append(context.Process(target=_client_part, args=args, daemon=True))
    try:
        for worker in workers:
            worker.start()
        _collect(ready, workers, processes, CLIENT_START_TIMEOUT_S, "starting")
        go.set()
        parts = _collect(results, workers, processes, CLIENT_LEVEL_TIMEOUT_S, "the level")
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    failed = [rows for _, rows, _ in parts if isinstance(rows, str)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {processes} client processes failed: {failed[0]}")
    r = level_summary([row for _, rows, _ in parts for row in rows])
    return {**r, "client_processes": processes,
            "client_cpu_ms_per_token": sum(cpu for _, _, cpu in parts) * 1e3 / r["output_tokens"]}


def chat_bodies(count: int, prompt_tokens: int, kind: str, seed: int) -> list[dict]:
    """Chat requests of about prompt_tokens tokens each (random words of the tokenizer's text); with kind
    "tools" or "json_schema" every other one carries tools (tool_choice required) or a json_schema format."""
    rng = random.Random(seed)
    words = CHAT_TEXT.split()
    per_word = len(chat_tokenizer().encode(" ".join(words))) / len(words)
    length = max(1, int(0.9 * (prompt_tokens - 48) / per_word))  # room for the chat format's own tokens
    bodies = []
    for i in range(count):
        text = " ".join(rng.choice(words) for _ in range(length))
        body: dict = {"messages": [{"role": "user", "content": text}]}
        if i % 2 and kind == "tools":
            body.update(tools=[WEATHER_TOOL], tool_choice="required")
        elif i % 2 and kind == "json_schema":
            body["response_format"] = ANSWER_SCHEMA
        bodies.append(body)
    return bodies


def mixed_levels(args) -> dict:
    """The chat server at the top concurrency: plain chat, then each --mixed kind mixed into it. The engine runs
    where `k3 serve` puts it on this device (its own process on CUDA): chat streams keep the event loop busy, and
    an engine thread in the same process then waits for the GIL in every torch call."""
    from k3.infer.serve_cli import engine_process_default

    top = max(args.concurrency)
    engine_process = engine_process_default(args.device)
    process, url, start = start_server(args, chat=True, engine_process=engine_process)
    levels = {"start": start, "engine": "process" if engine_process else "in-process"}
    try:
        asyncio.run(load_level(url, "bench", chat_bodies(2, args.prompt, "plain", 7), 4, 2, None))  # warm-up
        for kind in ["plain", *args.mixed]:
            bodies = chat_bodies(top * args.requests_per_level, args.prompt, kind, 200)
            levels[kind] = r = client_level(url, "bench", bodies, args.new, top, args.rate,
                                            client_processes_for(top, args.client_processes))
            print(f"chat server ({levels['engine']}) C={top}, {kind}: {r}", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return levels


def process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system) a process has used: the server's cost of a level apart from the load
    other processes put on a shared machine (wall times move with it, CPU time much less). None off Linux."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(requests: int, tokens: int, seconds: float, ttft_s: list[float], tpot_s: list[float]) -> dict:
    return dict(requests=requests, output_tokens=tokens, seconds=seconds, output_tokens_per_s=tokens / seconds,
                ttft_p50_ms=percentile([t * 1e3 for t in ttft_s], 50), ttft_p99_ms=percentile([t * 1e3 for t in ttft_s], 99),
                tpot_p50_ms=percentile([t * 1e3 for t in tpot_s], 50), tpot_p99_ms=percentile([t * 1e3 for t in tpot_s], 99))


def one_by_one(model, config, prompts: list[list[int]], new: int, max_context: int,
               overlap: bool | None = None) -> dict:
    engine = Engine(model, None, max_context=max_context, max_batch=1, prefix_cache=False, overlap_steps=overlap)
    run_load(engine, prompts[:1], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
    runs = [run_load(engine, [p], SamplingParams(max_new_tokens=new, temperature=0)) for p in prompts]
    tokens, seconds = sum(r["output_tokens"] for r in runs), sum(r["seconds"] for r in runs)
    # With one request per run, its TPOT is the mean gap; TTFT its only first token.
    return summary(len(runs), tokens, seconds, [r["ttft_p50_ms"] / 1e3 for r in runs],
                   [(r["seconds"] - r["ttft_p50_ms"] / 1e3) / max(1, r["output_tokens"] - 1) for r in runs])


def peer_for(preset: str, config: ModelConfig, device: torch.device, dtype: torch.dtype):
    if preset == "small":
        from train import peer_model

        return peer_model(device).to(dtype).eval()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    layer_types = ["full_attention" if t == "mla" else "linear_attention" for t in config.layer_types]
    peer = KimiLinearConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        intermediate_size=config.intermediate_size, linear_num_heads=config.kda_num_heads,
        linear_head_dim=config.kda_head_dim, num_attention_heads=config.mla_num_heads,
        num_key_value_heads=config.mla_num_heads, kv_lora_rank=config.kv_lora_rank, q_lora_rank=config.q_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, num_local_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
        n_shared_experts=config.num_shared_experts, layer_types=layer_types, first_k_dense_replace=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    if device.type == "cuda":
        peer._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        model = KimiLinearForCausalLM(peer)
    return model.to(dtype).eval()


@torch.no_grad()
def transformers_one_by_one(model, prompts: list[list[int]], new: int, device) -> dict:
    def generate(ids, n: int) -> float:
        synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        synchronize()
        return time.perf_counter() - t0

    first = torch.tensor([prompts[0]], device=device)
    generate(first, 2)  # warm-up
    ttft, tpot, seconds = [], [], 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        one, many = generate(ids, 1), generate(ids, 1 + new)
        ttft.append(one)
        tpot.append((many - one) / new)
        seconds += many
    return summary(len(prompts), len(prompts) * (1 + new), seconds, ttft, tpot)


async def warm_client() -> None:
    """One streamed request from this process to a stub HTTP server of its own (two SSE events), so that a fresh
    server's first TTFT leaves out what the client pays for its own first stream (imports, the first connection,
    parsing): 22-27 ms of the 43-48 a stub-engine server's first request took on CPU, against 10 steady."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        events = b'data: {"choices": [{"token_ids": [1]}]}\n\ndata: {"choices": [{"token_ids": [2]}]}\n\n' \
                 b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(events), events))
        await writer.drain()
        writer.close()

    stub = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        port = stub.sockets[0].getsockname()[1]
        await asyncio.wait_for(load_level(f"http://127.0.0.1:{port}", "stub", [[1, 2, 3]], 2, 1, None), 30)
    finally:
        stub.close()
        await stub.wait_closed()


def server_levels(args, mode: str, vocab: int, results: dict) -> dict:
    """The server with its engine in process or in its own process: a fresh server's first request, then each
    concurrency level, with the server process's CPU time per token (its engine process's apart)."""
    out: dict = {"levels": {}}
    process, url, start = (None, args.url, None) if args.url else start_server(args, engine_process=mode == "process")
    try:
        import httpx

        model_name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        if start is not None:  # a fresh server: its very first request, as a user's would be
            asyncio.run(warm_client())  # this process's own first stream is not the server's to pay
            first = asyncio.run(load_level(url, model_name, prompts_for(1, args.prompt, vocab, seed=5), args.new,
                                           1, None))
            out["fresh"] = {**start, "first_request_ttft_ms": first["ttft_p50_ms"],
                            "first_request_tpot_ms": first["tpot_p50_ms"]}
            print(f"fresh server ({mode}): {out['fresh']}", flush=True)
        asyncio.run(load_level(url, model_name, prompts_for(2, args.prompt, vocab, seed=7), 4, 2, None))  # warm-up
        children = child_pids(process.pid) if process is not None else []
        for level, concurrency in enumerate(args.concurrency):
            prompts = prompts_for(concurrency * args.requests_per_level, args.prompt, vocab, seed=100 + level)
            cpu = process_cpu_s(process.pid) if process is not None else None
            child_cpu = [process_cpu_s(pid) for pid in children]
            counted = engine_counters(url)
            r = client_level(url, model_name, prompts, args.new, concurrency, args.rate,
                             client_processes_for(concurrency, args.client_processes))
            r.update(counted_since(url, counted))
            if cpu is not None:
                r["cpu_ms_per_token"] = (process_cpu_s(process.pid) - cpu) * 1e3 / r["output_tokens"]
            if children:
                used = sum((process_cpu_s(pid) or 0) - (before or 0) for pid, before in zip(children, child_cpu))
                r["engine_process_cpu_ms_per_token"] = used * 1e3 / r["output_tokens"]
            out["levels"][concurrency] = r
            print(f"server ({mode}) C={concurrency}: {r}", flush=True)
            write_json(args.out, {**results, "partial": True})
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    return out


# The engine's step counters as /metrics shows them -> their names in Engine.stats() (and in this bench's results).
COUNTERS = {"k3_engine_steps_total": "steps", "k3_engine_prefill_forwards_total": "prefill_forwards",
            "k3_engine_overlapped_steps_total": "overlapped_steps"}


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step counters from the server's /metrics ({} from a server without them)."""
    import httpx

    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            found[COUNTERS[name]] = float(value)
    return found


def counted_since(url: str, before: dict[str, float]) -> dict[str, int]:
    """How far each counter moved since `before`. An engine in its own process reports its counters every 0.2 s
    (k3.infer.engine_process.STATS_EVERY_S): read until two reads agree, at most 2 s."""
    now = engine_counters(url)
    for _ in range(8):
        time.sleep(0.25)
        again = engine_counters(url)
        if again == now:
            break
        now = again
    return {key: int(now[key] - before.get(key, 0)) for key in now}


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (its engine process, and multiprocessing's resource tracker), from /proc;
    [] off Linux."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug", choices=sorted(SIZES))
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: by preset)")
    parser.add_argument("--new", type=int, default=None, help="output tokens per request (default: by preset)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=2, help="requests per level = C x this")
    parser.add_argument("--rate", type=float, default=None, help="requests released per second (default: all)")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="client processes a level's requests are sent from (default: one per "
                             f"{CLIENT_STREAMS} concurrent streams, at most a quarter of the cores)")
    parser.add_argument("--baseline-requests", type=int, default=4, help="requests of each one-by-one baseline")
    parser.add_argument("--skip", nargs="*", default=[], choices=["one-by-one", "in-process", "transformers"])
    parser.add_argument("--url", default=None, help="a running k3 serve of the same preset instead of starting one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of every phase")
    parser.add_argument("--out", default=None)
    parser.add_argument("--mixed", nargs="*", default=[], choices=["tools", "json_schema"],
                        help="also chat at the top concurrency with these grammar-constrained requests mixed in")
    parser.add_argument("--no-warmup", action="store_true", help="start the bench servers without their warm-up")
    parser.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="every engine (servers and baselines) with EngineConfig.overlap_steps on / off "
                             "(default: the engine's, on with CUDA-graph decode)")
    parser.add_argument("--gather-prompts-ms", type=float, default=None,
                        help="every engine (servers and baselines) with EngineConfig.gather_prompts_ms (default: "
                             "the engine's)")
    parser.add_argument("--engine-step-tokens", type=int, nargs="*", default=[],
                        help="also run the engine in process at these step budgets (max_step_tokens)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the server process's sys.setswitchinterval in seconds (default: Python's 0.005)")
    parser.add_argument("--stub-step-ms", type=float, default=None,
                        help="serve a stub engine (no model: every step sleeps this long, then gives each running "
                             "request a token) to measure the server's own cost; skips the in-process rows")
    parser.add_argument("--stub-handoffs", type=int, default=1,
                        help="with --stub-step-ms: the step sleeps in this many pieces, giving up the GIL each time as "
                             "a GPU step's torch calls do (a busy event loop then delays the engine thread)")
    parser.add_argument("--engine-modes", nargs="+", default=["in-process"], choices=["in-process", "process"],
                        help="server levels with the engine in the server's process, in its own process, or both "
                             "(one after the other, same requests)")
    parser.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--max-context", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        return serve_main(args)
    default_prompt, default_new = SIZES[args.preset]
    args.prompt, args.new = args.prompt or default_prompt, args.new or default_new
    device, dtype = torch.device(args.device), _dtype(args)
    vocab = ModelConfig.from_preset(args.preset).vocab_size
    # On a shared CPU machine the other processes' load moves every number: it is recorded with them.
    results: dict = {"bench": "serve", "device_name": device_name(), "preset": args.preset, "prompt": args.prompt,
                     "new": args.new, "dtype": str(dtype), "rate": args.rate, "switch_interval": args.switch_interval,
                     "stub_step_ms": args.stub_step_ms, "stub_handoffs": args.stub_handoffs,
                     "overlap_steps": args.overlap_steps, "gather_prompts_ms": args.gather_prompts_ms,
                     "cpu_count": os.cpu_count(),
                     "load_average_at_start": os.getloadavg(), "modes": {}}

    for mode in args.engine_modes:
        results["modes"][mode] = server_levels(args, mode, vocab, results)
    first = results["modes"][args.engine_modes[0]]
    results["levels"] = first["levels"]  # the first mode's, where earlier results had them
    if "fresh" in first:
        results["fresh"] = first["fresh"]

    if args.stub_step_ms is not None:  # no model: the engine rows would measure nothing of the server
        args.skip = ["one-by-one", "in-process", "transformers"]
    baselines = {}
    prompts = prompts_for(args.baseline_requests, args.prompt, vocab, seed=100)
    if set(args.skip) != {"one-by-one", "in-process", "transformers"}:
        model, config = build_model(args.preset, device, dtype)
    if "one-by-one" not in args.skip:
        cpu = process_cpu_s()
        baselines["engine one-by-one"] = one_by_one(model, config, prompts, args.new, args.prompt + args.new + 64,
                                                    args.overlap_steps)
        baselines["engine one-by-one"]["cpu_ms_per_token"] = ((process_cpu_s() - cpu) * 1e3
                                                             / baselines["engine one-by-one"]["output_tokens"])
        print(f"one-by-one: {baselines['engine one-by-one']}", flush=True)
    if "in-process" not in args.skip:
        # The server's own cost: the top level's requests through the engine in process, submitted at once
        # with max_batch C (so at most C run, as at the server), warmed up as the server's engine is (its decode
        # graphs captured before the timed requests, not during them). --engine-step-tokens: the same with other
        # step budgets (max_step_tokens) beside the default.
        top = max(args.concurrency)
        level_prompts = prompts_for(top * args.requests_per_level, args.prompt, vocab,
                                    seed=100 + args.concurrency.index(top))
        for step_tokens in [None] + list(args.engine_step_tokens or []):
            options = {"overlap_steps": args.overlap_steps, **gather_option(args)}
            if step_tokens is not None:
                options["max_step_tokens"] = step_tokens
            engine = Engine(model, None, max_context=args.prompt + args.new + 64, max_batch=top, **options)
            engine.warmup()
            run_load(engine, prompts_for(2, args.prompt, vocab, seed=7),
                     SamplingParams(max_new_tokens=4, temperature=0))
            name = f"engine in process, C={top}" + ("" if step_tokens is None else f", step tokens {step_tokens}")
            cpu, before = process_cpu_s(), dict(engine.stats_counters)
            baselines[name] = run_load(engine, level_prompts, SamplingParams(max_new_tokens=args.new, temperature=0))
            baselines[name].update({key: engine.stats_counters[key] - before[key] for key in COUNTERS.values()
                                    if key in before})
            baselines[name]["cpu_ms_per_token"] = (process_cpu_s() - cpu) * 1e3 / baselines[name]["output_tokens"]
            baselines[name]["max_step_tokens"] = engine.scheduler.max_step_tokens
            print(f"{name}: {baselines[name]}", flush=True)
            del engine
    if "transformers" not in args.skip:
        del model
        peer = peer_for(args.preset, config, device, dtype)
        baselines["transformers one-by-one"] = transformers_one_by_one(peer, prompts, args.new, device)
        print(f"transformers: {baselines['transformers one-by-one']}", flush=True)
    results["baselines"] = baselines
    write_json(args.out, {**results, "partial": True})
    # After the baselines: the targets compare the server with them, and a time limit should cut chat first.
    if args.mixed:
        results["mixed"] = mixed_levels(args)
    results["load_average_at_end"] = os.getloadavg()

    base = baselines.get("engine one-by-one")
    rows = []
    named = [(f"k3 serve{'' if mode == 'in-process' else ' (engine process)'}, C={c}", r)
             for mode, levels in results["modes"].items() for c, r in levels["levels"].items()]
    named += list(baselines.items())
    top = max(args.concurrency)
    named += [(f"k3 serve chat, C={top}, {kind}", r) for kind, r in results.get("mixed", {}).items()
              if kind not in ("start", "engine")]
    for name, r in named:
        rows.append([name, r["requests"], r["output_tokens_per_s"],
                     f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x" if base else "",
                     r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"], r["tpot_p99_ms"],
                     f"{r['tpot_p50_ms'] / base['tpot_p50_ms']:.2f}x" if base else "",
                     r.get("cpu_ms_per_token", ""), r.get("engine_process_cpu_ms_per_token", ""),
                     r.get("client_cpu_ms_per_token", ""), r.get("client_processes", ""), r.get("steps", ""),
                     r.get("prefill_forwards", ""), r.get("overlapped_steps", "")])
    load = f", load average {results['load_average_at_start'][0]:.1f} on {os.cpu_count()} cores" \
        if device.type == "cpu" else ""
    print_table(f"Serving {args.preset} ({args.prompt} in / {args.new} out, {dtype}) on {device_name()}{load}",
                ["", "requests", "output tok/s", "vs one-by-one", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms", "TPOT vs one-by-one", "CPU ms / token", "engine process CPU ms / token",
                 "client CPU ms / token", "client processes", "steps",
                 "prefill forwards", "overlapped steps"], rows)
    if "fresh" in results:
        fresh = results["fresh"]
        print(f"fresh server: ready {fresh['ready_s']:.1f} s after spawning (warm-up {fresh['warmup_s'] or 0:.1f} "
              f"s), first request TTFT {fresh['first_request_ttft_ms']:.1f} ms")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
