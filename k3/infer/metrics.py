"""Server metrics in Prometheus' text format (GET /metrics), without a client library.

Gauges come from the engine's `stats()` at scrape time (waiting and running requests, KDA slots and MLA
pages in use); the server records counters and histograms as requests run: time to first token, time per
output token (each gap between two tokens of one sequence), request latency, tokens produced, and output
tokens per second over the last `window_s` seconds.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
PREFIX = "k3"


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.total:.6g}", f"{name}_count {self.count}"]
        return out


def _metric(name: str, kind: str, help_text: str, value: float) -> list[str]:
    text = "NaN" if isinstance(value, float) and math.isnan(value) else f"{value:.6g}"
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {text}"]


class ServerMetrics:
    """Written from the event loop, read by scrapes; a lock keeps a scrape consistent."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.lock = threading.Lock()
        self.ttft = Histogram()
        self.per_token = Histogram()
        self.latency = Histogram()
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.requests = {"finished": 0, "aborted": 0, "rejected": 0, "failed": 0}
        self.in_flight = 0
        self._recent: deque[list] = deque()  # [time, tokens] for the tokens/s window

    def started(self, prompt_tokens: int) -> None:
        with self.lock:
            self.in_flight += 1
            self.prompt_tokens += prompt_tokens

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def tokens(self, count: int, gap_s: float | None = None, now: float | None = None) -> None:
        """`count` tokens produced at `now`; gap_s: time since the previous token of the same sequence."""
        gaps = [gap_s] + [None] * (count - 1) if count > 0 else []
        self.token_batch(gaps, time.monotonic() if now is None else now)

    def token_batch(self, gaps: list[float | None], now: float) -> None:
        """len(gaps) tokens produced at `now` (a step's worth, under one lock); each gap is the time since the
        previous token of the same sequence, None for a sequence's first token."""
        with self.lock:
            self.output_tokens += len(gaps)
            # Pruned here, not only at scrape time: a server nobody scrapes must not grow. Tokens of one 10 ms
            # share an entry, so the window holds at most window_s / 0.01 entries at any rate.
            if self._recent and now - self._recent[-1][0] < 0.01:
                self._recent[-1][1] += len(gaps)
            else:
                self._recent.append([now, len(gaps)])
            while self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            observe = self.per_token.observe
            for gap in gaps:
                if gap is not None:
                    observe(gap)

    def ended(self, outcome: str, seconds: float) -> None:
        with self.lock:
            self.in_flight -= 1
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
            if outcome == "finished":
                self.latency.observe(seconds)

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            return sum(count for _, count in self._recent) / self.window_s

    def render(self, engine_stats: dict) -> str:
        """The Prometheus text exposition of everything above plus the engine's gauges."""
        rate = self.tokens_per_second()
        p = PREFIX
        out: list[str] = []
        gauges = [("requests_waiting", "waiting", "requests queued for a KDA slot and MLA pages"),
                  ("requests_running", "running", "requests in the running batch"),
                  ("kda_slots_used", "kda_slots_used", "KDA state slots in use"),
                  ("kda_slots_total", "kda_slots_total", "KDA state slots in the pool"),
                  ("mla_pages_used", "mla_pages_used", "MLA latent-cache pages in use"),
                  ("mla_pages_total", "mla_pages_total", "MLA latent-cache pages in the pool")]
        for name, key, help_text in gauges:
            if key in engine_stats:
                out += _metric(f"{p}_{name}", "gauge", help_text, float(engine_stats[key]))
        counters = [("engine_steps_total", "steps", "engine steps (each one batched forward of decodes and prefills)"),
                    ("engine_prefill_forwards_total", "prefill_forwards",
                     "prefill forwards (prompts of one step that share a forward count once)"),
                    ("engine_overlapped_steps_total", "overlapped_steps",
                     "decode steps launched before the previous step's tokens were read")]
        for name, key, help_text in counters:
            if key in engine_stats:
                out += _metric(f"{p}_{name}", "counter", help_text, float(engine_stats[key]))
        if "prefix_cache_hits" in engine_stats:
            out += _metric(f"{p}_prefix_cache_hits_total", "counter",
                           "requests that started from a cached prompt prefix", float(engine_stats["prefix_cache_hits"]))
        with self.lock:
            out += _metric(f"{p}_server_requests_in_flight", "gauge", "requests the server is answering",
                           self.in_flight)
            out += [f"# HELP {p}_requests_total requests by outcome", f"# TYPE {p}_requests_total counter"]
            out += [f'{p}_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            out += _metric(f"{p}_prompt_tokens_total", "counter", "prompt tokens received", self.prompt_tokens)
            out += _metric(f"{p}_generation_tokens_total", "counter", "tokens generated", self.output_tokens)
            out += _metric(f"{p}_generation_tokens_per_second", "gauge",
                           f"tokens generated per second over the last {self.window_s:g} s", rate)
            out += self.ttft.lines(f"{p}_time_to_first_token_seconds", "time from request to its first token")
            out += self.per_token.lines(f"{p}_time_per_output_token_seconds",
                                        "time between consecutive tokens of one sequence")
            out += self.latency.lines(f"{p}_request_latency_seconds", "time from request to its last token")
        return "\n".join(out) + "\n"
