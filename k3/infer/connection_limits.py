"""Bounds on what one client can hold of `k3 serve`: request bodies, prompt sizes, connections, time, and log
lines.

    ServerLimits           the numbers, with their defaults (k3 serve's flags set them)
    read_body              a request body up to max_body_bytes (413 past it), read within body_timeout_s
    limited_h11_protocol   uvicorn's h11 protocol, closing connections whose request headers do not arrive within
                           header_timeout_s and refusing connections past max_connections at once (503)
    RateLimitFilter        at most `burst` records per message per `period_s`, then one line saying how many
                           were dropped (a flood of accept() errors must not fill the disk)

uvicorn's own timeout_keep_alive closes idle connections between requests, and limit_concurrency answers 503
to requests past the cap; neither closes a connection that never finishes its request headers, which is what
the protocol here adds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from k3.infer.protocol import APIError

CONNECTION_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                      b"connection: close\r\ncontent-length: 48\r\n\r\n"
                      b"too many open connections to this server; retry\n")


@dataclass
class ServerLimits:
    max_body_bytes: int = 32 * 2**20  # image data: URLs make chat bodies large; text alone is far below this
    # A prompt longer than this many characters per context token cannot fit whatever the tokenizer: refused
    # before tokenizing (a BPE token of more characters than this is not seen in practice).
    max_chars_per_token: int = 64
    header_timeout_s: float = 10.0  # from the connection (or the last response) to a request's complete headers
    body_timeout_s: float = 30.0  # from the headers to the whole body
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    max_connections: int = 1024  # open connections; past it new ones get a 503 and are closed

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_chars_per_token", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")


async def read_body(request, limits: ServerLimits) -> bytes:
    """The request's body, refused with 413 once it passes max_body_bytes (by its Content-Length, or while
    reading a chunked one) and with 408 when it takes longer than body_timeout_s."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise APIError(f"the request body is {int(declared)} bytes; this server takes at most "
                       f"{limits.max_body_bytes} (--max-body-mb)", status=413, code="request_too_large")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise APIError(f"the request body passed {limits.max_body_bytes} bytes, the most this server "
                               f"takes (--max-body-mb)", status=413, code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(f"the request body did not arrive within {limits.body_timeout_s:g} s", status=408,
                       code="request_timeout") from None


def check_prompt_chars(chars: int, max_context: int, limits: ServerLimits, what: str = "prompt") -> None:
    """Refuse, before tokenizing, text too long to fit the context whatever its tokens."""
    most = max_context * limits.max_chars_per_token
    if chars > most:
        raise APIError(f"the {what} has {chars} characters; this server's context is {max_context} tokens, so it "
                       f"takes at most {most} characters ({limits.max_chars_per_token} per token); shorten it",
                       param=what.split()[0], code="context_length_exceeded")


def limited_h11_protocol(limits: ServerLimits):
    """uvicorn's H11Protocol with a deadline for request headers and a cap on open connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            if len(self.connections) > limits.max_connections:
                transport.write(CONNECTION_REFUSED)
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no complete request in time: nothing to answer

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return LimitedH11Protocol


class RateLimitFilter(logging.Filter):
    """Pass at most `burst` records with the same message template per `period_s`; the first record after a
    quiet period says how many were dropped."""

    def __init__(self, burst: int = 10, period_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.period_s = burst, period_s
        self._windows: dict[tuple[str, str], list] = {}  # (logger, template) -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = (record.name, str(record.msg)[:200])
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.period_s:
            dropped = window[2] if window is not None else 0
            if len(self._windows) > 1000:  # many distinct messages: start over rather than grow
                self._windows.clear()
            self._windows[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like this were not logged in the last " \
                             f"{self.period_s:g} s)"
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        return False


RATE_LIMITED_LOGGERS = ("asyncio", "uvicorn.error", "k3.serve", "k3.engine")


def rate_limit_logs(burst: int = 10, period_s: float = 10.0) -> RateLimitFilter:
    """Attach one RateLimitFilter to the loggers a flood of errors comes from (idempotent)."""
    shared = RateLimitFilter(burst, period_s)
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RateLimitFilter)]:
            logger.removeFilter(old)
        logger.addFilter(shared)
    return shared
