"""Where a fresh server's first request spends its time: `k3 serve`'s app (engine in the server's process) on a
random-init preset, its warm-up done, then --requests requests one at a time from a client process; while each
waits for its first token, this process samples every thread's stack (sys._current_frames, every --every-ms).

Usage: python bench/first_request.py [--preset small] [--device cuda] [--prompt 1024] [--requests 4]
                                     [--top 15] [--out F]

Prints each request's TTFT as the client saw it, then for the first two requests the most sampled stacks
(innermost frame first; idle waits in selectors, locks and thread pools left out) with their sample counts:
what the first request does that the second does not. Timings are wall-clock on whatever shares the machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
import traceback

import torch

from common import write_json
from serve import NumberTokenizer, build_model

from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.server import create_app, run_server

CLIENT = r'''
import asyncio, httpx, json, random, sys, time
url, prompt, vocab, count, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rng = random.Random(5)
async def main():
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while (await http.get("/health")).status_code != 200:
            await asyncio.sleep(0.1)
        spans = []
        for _ in range(count):
            body = {"model": "bench", "prompt": [rng.randrange(1, vocab) for _ in range(prompt)], "max_tokens": new,
                    "temperature": 0, "stream": True, "return_token_ids": True}
            start, first = time.time(), None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and first is None:
                        first = time.time()
            spans.append((start, first))
            await asyncio.sleep(0.5)
    print(json.dumps(spans))
asyncio.run(main())
'''

IDLE = ("selectors.py", "threading.py:3", "thread.py:8", "queue.py")


def short(frame: traceback.FrameSummary) -> str:
    name = frame.filename
    for cut in ("site-packages/", os.getcwd() + "/", "lib/python3"):
        name = name.split(cut)[-1]
    return f"{name}:{frame.lineno}:{frame.name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=10, help="frames kept of each stack")
    parser.add_argument("--every-ms", type=float, default=1.0, help="sampling interval")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, config = build_model(args.preset, device, dtype)
    tokenizer = NumberTokenizer(config.vocab_size)
    engine = Engine(model, tokenizer, max_context=args.prompt + 256 + 64, max_batch=64)
    aengine = AsyncEngine(engine, max_queue=4096, warmup=engine.warmup)
    app = create_app(aengine, "bench", tokenizer, args.prompt + 256 + 64, 4096, prepare_grammars=True)

    samples: list[tuple[float, tuple[str, ...]]] = []

    def sample() -> None:
        # Raw (code, line) pairs only: formatting each stack as it is taken held the interpreter long enough to
        # make the sampled requests twice as slow (small on one H100: 142-170 ms steady against 87 unsampled).
        me = threading.get_ident()
        while True:
            now = time.time()
            for thread, frame in sys._current_frames().items():
                if thread != me:
                    stack = []
                    while frame is not None and len(stack) < args.depth:
                        stack.append((frame.f_code, frame.f_lineno))
                        frame = frame.f_back
                    samples.append((now, tuple(stack)))
            time.sleep(args.every_ms / 1e3)

    def client(url: str) -> None:
        done = subprocess.run([sys.executable, "-c", CLIENT, url, str(args.prompt), str(config.vocab_size),
                               str(args.requests), str(args.new)], capture_output=True, text=True, timeout=1800)
        result: dict = {"device": str(device), "preset": args.preset, "prompt": args.prompt,
                        "warmup_s": aengine.warmup_s, "requests": []}
        try:
            spans = json.loads(done.stdout)
        except ValueError:
            print(f"the client failed: {done.stderr[-2000:]}", flush=True)
            os._exit(1)
        for index, (start, first) in enumerate(spans):
            ttft = (first - start) * 1e3
            print(f"request {index}: TTFT {ttft:.1f} ms", flush=True)
            entry = {"ttft_ms": ttft}
            if index < 2:
                named = (tuple(short(traceback.FrameSummary(code.co_filename, line, code.co_name))
                               for code, line in stack) for t, stack in samples if start <= t <= first)
                stacks = collections.Counter(" <- ".join(stack) for stack in named
                                             if stack and not any(i in stack[0] for i in IDLE))
                entry["top_stacks"] = stacks.most_common(args.top)
                for stack, count in entry["top_stacks"]:
                    print(f"  {count:5d}  {stack[:700]}", flush=True)
            result["requests"].append(entry)
        write_json(args.out, result)
        os._exit(0)  # the server runs in the main thread until the process ends

    threading.Thread(target=sample, daemon=True).start()
    run_server(app, "127.0.0.1", 0, on_listening=lambda url: threading.Thread(target=client, args=(url,),
                                                                                 daemon=True).start())


if __name__ == "__main__":
    main()
