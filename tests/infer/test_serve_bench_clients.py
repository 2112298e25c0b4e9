"""bench/serve.py's load from several client processes: every request counted once, the level's time spanning
all of them, and the default number of processes by concurrency and cores."""

import asyncio
import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def serve_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import serve

    yield serve
    sys.modules.pop("serve", None)


@pytest.fixture
def stub_stream_server():
    """An HTTP server on a thread of its own answering every POST with three streamed tokens (or, once
    `answered` holds "fail", with HTTP 500); its URL, and the requests it answered."""
    answered = []
    ready = threading.Event()
    holder = {}

    async def answer(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        if "fail" in answered:
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\nConnection: close\r\n\r\noops")
            await writer.drain()
            writer.close()
            return
        answered.append(1)
        events = b"".join(b'data: {"choices": [{"token_ids": [%d]}]}\n\n' % t for t in (1, 2, 3)) + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(events), events))
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        holder["port"] = server.sockets[0].getsockname()[1]
        holder["stop"] = asyncio.Event()
        holder["loop"] = asyncio.get_running_loop()
        ready.set()
        await holder["stop"].wait()
        server.close()
        await server.wait_closed()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"http://127.0.0.1:{holder['port']}", answered
    holder["loop"].call_soon_threadsafe(holder["stop"].set)
    thread.join(30)


def test_a_level_from_two_client_processes_counts_every_request_once(serve_bench, stub_stream_server):
    url, answered = stub_stream_server
    prompts = [[i, i + 1] for i in range(7)]
    r = serve_bench.client_level(url, "stub", prompts, 3, 4, None, processes=2)
    assert len(answered) == 7
    assert r["requests"] == 7 and r["output_tokens"] == 21 and r["client_processes"] == 2
    assert r["seconds"] > 0 and r["client_cpu_ms_per_token"] > 0
    one = serve_bench.client_level(url, "stub", prompts[:3], 3, 2, None, processes=1)
    assert one["requests"] == 3 and one["client_processes"] == 1 and len(answered) == 10


def test_a_failing_client_process_fails_the_level_at_once(serve_bench, stub_stream_server):
    url, answered = stub_stream_server
    answered.append("fail")
    with pytest.raises(RuntimeError, match="2 of 2 client processes failed: RuntimeError: HTTP 500"):
        serve_bench.client_level(url, "stub", [[1], [2], [3], [4]], 3, 2, None, processes=2)


def test_client_processes_follow_concurrency_and_cores(serve_bench, monkeypatch):
    monkeypatch.setattr(serve_bench.os, "cpu_count", lambda: 16)
    assert [serve_bench.client_processes_for(c, None) for c in (1, 16, 17, 64, 256)] == [1, 1, 2, 4, 4]
    monkeypatch.setattr(serve_bench.os, "cpu_count", lambda: 2)
    assert serve_bench.client_processes_for(64, None) == 1
    assert serve_bench.client_processes_for(64, 8) == 8 and serve_bench.client_processes_for(3, 8) == 3
