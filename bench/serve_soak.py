"""A long-running server's memory: many small requests to a random-init server, its RSS read along the way.

Usage: python bench/serve_soak.py [--requests 100000] [--concurrency 8] [--scrape-every 0] [--preset debug]
                                  [--threads 1] [--out F]

The server is bench/serve.py's (`--serve`: the same create_app and run_server as `k3 serve`, a random-init
preset and a number tokenizer) in its own process. Each request is a non-streaming /v1/completions of 8 random
token ids with max_tokens 1, at most --concurrency in flight. With --scrape-every N, GET /metrics follows every
N requests (a Prometheus scraper); with 0 nothing scrapes. The server's RSS (VmRSS of its process) is read
after a warm-up of --warmup requests ("start") and after every tenth of the rest; "end" is the last reading.
With --max-seconds the run stops there (after the warm-up), and reports the requests it made; --out is
rewritten at every reading, so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, str(Path(__file__).parent / "serve.py"), "--serve", "--preset", args.preset,
               "--device", "cpu", "--max-batch", str(args.concurrency), "--max-context", "64",
               "--threads", str(args.threads)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # blocks until the server listens, or it dies (EOF)
    if not line.startswith("listening "):
        process.kill()
        raise RuntimeError(f"the bench server did not start (exit {process.wait()})")
    return process, line.split()[1]


async def drive(url: str, pid: int, args) -> dict:
    rng = random.Random(0)
    total = args.warmup + args.requests
    marks = {args.warmup + round(args.requests * k / 10) for k in range(1, 11)}
    stop_at = None  # perf_counter time to stop at (--max-seconds after the warm-up)
    readings: list[tuple[int, float, float]] = []  # (requests done, seconds since start, RSS MB)
    done = failed = scrapes = 0
    started = time.perf_counter()
    next_index = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done, failed, scrapes, next_index, stop_at
        while next_index < total and (stop_at is None or time.perf_counter() < stop_at):
            next_index += 1
            body = {"model": "bench", "prompt": [rng.randrange(1, 250) for _ in range(8)], "max_tokens": 1,
                    "temperature": 0}
            response = await http.post("/v1/completions", json=body)
            if response.status_code != 200:
                failed += 1
                if failed == 1:
                    print(f"first failure: HTTP {response.status_code} {response.text[:300]}", file=sys.stderr)
            done += 1
            count = done  # this request's number: other workers move `done` while this one awaits below
            if count == args.warmup or count in marks:
                readings.append((count, time.perf_counter() - started, rss_mb(pid)))
                report(summary())
            if count == args.warmup and args.max_seconds:
                stop_at = time.perf_counter() + args.max_seconds
            if args.scrape_every and count % args.scrape_every == 0:
                (await http.get("/metrics")).raise_for_status()
                scrapes += 1

    def summary() -> dict:
        warm, last = readings[0], readings[-1]
        return {"requests": last[0] - args.warmup, "warmup": args.warmup, "failed": failed, "scrapes": scrapes,
                "scrape_every": args.scrape_every, "concurrency": args.concurrency, "preset": args.preset,
                "seconds": round(last[1] - warm[1], 1), "rss_start_mb": round(warm[2], 1),
                "rss_end_mb": round(last[2], 1), "rss_growth_percent": round(100 * (last[2] / warm[2] - 1), 2),
                "readings": [{"requests": r[0] - args.warmup, "seconds": round(r[1] - warm[1], 1),
                              "rss_mb": round(r[2], 1)} for r in readings]}

    def report(result: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    if readings[-1][0] != done:  # stopped by --max-seconds between two readings
        readings.append((done, time.perf_counter() - started, rss_mb(pid)))
    result = summary()
    report(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--scrape-every", type=int, default=0, help="GET /metrics after every N requests (0: never)")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=0, help="stop after this long (0: run every request)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    process, url = start_server(args)
    try:
        result = asyncio.run(drive(url, process.pid, args))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
