"""The server's own first requests, sent to itself before /health reports ready.

Engine.warmup builds what the engine's first steps would (graphs, kernel specialisations); a fresh server's first
HTTP request still paid for more: modules the HTTP stack imports on first use, the first event stream, the first
hand-offs between the event loop and the engine thread (a stub-engine server on CPU, its client already warm: 21 ms
to the first token against 10 steady; 11 with these requests). So once the engine is warm, run_server sends itself
one streamed completion and one chat completion over its own socket (the path a client's requests take), then
starts the request metrics afresh and reports ready. A warm-up request that fails is logged and skipped: serving
goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request

log = logging.getLogger("k3.serve")

READY_DEADLINE_S = 3600.0  # an engine warm-up that compiles every decode graph takes minutes, not hours
REQUEST_TIMEOUT_S = 120.0


def warm_request_bodies(vocab_size: int) -> list[tuple[str, dict]]:
    """(path, body) of each warm-up request: short prompts, two tokens each, greedy."""
    prompt = [1 + i % max(1, vocab_size - 1) for i in range(8)]
    return [("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                                      "temperature": 0})]


def post(url: str, body: dict, api_key: str | None, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    """POST body as JSON, read the whole answer (a stream to its end); returns the HTTP status and, for an error,
    the start of its body."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # its own socket, never a proxy
    try:
        with opener.open(request, timeout=timeout_s) as response:
            response.read()
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, error.read(300).decode("utf-8", "replace")


def loopback(url: str) -> str:
    """The address to reach a server bound to `url` from its own host (a wildcard bind is not an address)."""
    return url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")


async def send_warm_requests(server, url: str, api_key: str | None, should_stop) -> None:
    """Wait until the engine is warm and the grammars are built, send the warm-up requests, then start the request
    metrics afresh and set server.warm_requests_done. should_stop(): the server is shutting down."""
    try:
        start = time.monotonic()
        while not (server.aengine.ready.is_set() and server.grammars_ready.is_set()):
            if server.aengine.error is not None or should_stop() or time.monotonic() - start > READY_DEADLINE_S:
                return
            await asyncio.sleep(0.05)
        base = loopback(url)
        for path, body in warm_request_bodies(server.vocab_size):
            status, error = await asyncio.to_thread(post, base + path, {"model": server.model_name, **body}, api_key)
            if status != 200:
                log.warning("the server's own warm-up request to %s answered HTTP %d (%s); serving anyway, the first "
                            "client request there may take longer", path, status, error.strip() or "no body")
    except Exception as error:  # the warm-up must never keep a server from serving
        log.warning("the server's warm-up requests failed (%r); serving without them", error)
    finally:
        server.reset_metrics()
        server.warm_requests_done.set()
