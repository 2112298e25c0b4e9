"""`k3 serve` end to end: a subprocess on a free loopback port, a tiny random model, and real clients (the
official `openai` package, sync and streaming, and plain httpx). After every test the server's requests,
KDA slots and MLA pages in use are back to zero."""

import asyncio
import json
import signal
import socket

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_helpers import Server, make_run  # noqa: E402

from k3.infer.sse import parse_sse  # noqa: E402

MAX_CONTEXT = 160


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("serve") / "run")


@pytest.fixture(scope="module")
def server(run):
    server = Server(run, "--max-batch", "8", "--max-context", str(MAX_CONTEXT), "--max-queue", "128")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(run):
    """The same model in this process, through the engine directly: what the server must return."""
    from k3.infer.cli import load_for_inference
    from k3.infer.engine import Engine

    model, tokenizer = load_for_inference(str(run), None, "cpu")
    return Engine(model, tokenizer, max_context=MAX_CONTEXT, max_batch=1, prefix_cache=False), tokenizer


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client
    server.wait_idle()


def greedy(engine, prompt, max_new_tokens, **kw):
    from k3.infer.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)
    return engine.complete([prompt], params)[0].outputs[0]


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = server.health()
    assert health["status"] == "ok" and health["max_context"] == MAX_CONTEXT and health["kda_slots_total"] >= 8
    text = server.http.get("/metrics").text
    for name in ("k3_requests_waiting", "k3_requests_running", "k3_kda_slots_used", "k3_mla_pages_used",
                 "k3_generation_tokens_per_second", "k3_time_to_first_token_seconds_bucket",
                 "k3_time_per_output_token_seconds_bucket", "k3_engine_steps_total", "k3_engine_prefill_forwards_total",
                 "k3_engine_overlapped_steps_total"):
        assert f"\n{name}" in text, name


def test_completion_matches_the_engine(server, client, reference):
    engine, tokenizer = reference
    prompt = "print('line 3:"
    expected = greedy(engine, tokenizer.encode(prompt), 12, logprobs=2)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_sync_and_streaming(server, client, reference):
    engine, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "print a line"}]
    rendered = "System: Be brief.\nUser: print a line\nAssistant:"
    expected = greedy(engine, tokenizer.encode(rendered), 10, stop=["\n"])
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text and "\n" not in expected.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered))
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, logprobs=True, top_logprobs=3)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == out.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)


def test_n_seed_stop_and_sampling_fields(server, client, reference):
    engine, tokenizer = reference
    kw = dict(model="tiny", prompt="print(", max_tokens=8, temperature=1.0, top_p=0.9, seed=123,
              presence_penalty=0.5, frequency_penalty=0.2,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    first, again = (client.completions.create(n=3, **kw) for _ in range(2))
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # same seed, same samples
    two_prompts = client.completions.create(model="tiny", prompt=["print(", "x = ["], n=2, max_tokens=4,
                                            temperature=0)
    assert sorted(c.index for c in two_prompts.choices) == [0, 1, 2, 3]
    # A stop string taken from the greedy text: the reply ends just before it, with finish_reason "stop".
    full = greedy(engine, tokenizer.encode("print("), 20).text
    assert len(full) >= 9, full
    stop = full[6:9]
    out = client.completions.create(model="tiny", prompt="print(", max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"
    # A stop token: it ends the reply, is counted and returned among the ids, but is not in the text.
    ids = greedy(engine, tokenizer.encode("print("), 20).token_ids
    stop_id = ids[4]
    out = client.completions.create(model="tiny", prompt="print(", max_tokens=20, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "return_token_ids": True})
    choice = out.choices[0]
    cut = ids.index(stop_id)
    assert choice.model_extra["token_ids"] == ids[:cut + 1] and choice.finish_reason == "stop"
    assert choice.text == tokenizer.decode(ids[:cut]) and out.usage.completion_tokens == cut + 1


BAD = [
    ({"model": "gpt-4", "prompt": "x"}, "unknown model 'gpt-4'; this server serves 'tiny'"),
    ({"model": "tiny", "prompt": "print('x') " * 80}, "context is 160 tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "invalid 'max_tokens'"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 1000}, "max_tokens=1000 is too large"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "valid integer"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, "allowed: a number >= 0"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "allowed: a number in (0, 1]"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.01}, "allowed: a number in (0, 1]"),
    ({"model": "tiny", "prompt": [5, 100000]}, "outside [0, "),
    ({"model": "tiny", "prompt": ""}, "empty after tokenization"),
    ({"model": "tiny", "prompt": "x", "n": 1000}, "allowed: an integer in [1, 64]"),
]
BAD_CHAT = [
    ({"model": "tiny", "messages": []}, "invalid 'messages': the list is empty"),
    ({"model": "tiny", "messages": [{"role": "user"}], "temperature": "0"}, "valid number"),
    ({"model": "tiny", "messages": [{"content": "hi"}]}, "'messages.0.role' is required"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, "too large"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "has no vision tower"),
]


@pytest.mark.parametrize("path, body, words", [("/v1/completions", b, w) for b, w in BAD]
                         + [("/v1/chat/completions", b, w) for b, w in BAD_CHAT])
def test_bad_input_is_a_400_that_says_why(server, client, path, body, words):
    response = server.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error["message"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


def test_malformed_bodies_and_unknown_routes(server, client):
    for raw in (b'{"model": "tiny", "prompt": ', b"\xff", b"[]", b""):
        response = server.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = server.http.get("/v1/engines")
    assert response.status_code == 404 and "POST /v1/completions" in response.json()["error"]["message"]
    # The openai client raises its typed error with the server's message.
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client.completions.create(model="nope", prompt="x")


def test_disconnect_mid_stream_frees_the_slot(server, client):
    body = {"model": "tiny", "prompt": "print(", "max_tokens": 150, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        events = parse_sse(response.iter_lines())
        next(events), next(events)
        assert server.health()["running"] == 1
    server.wait_idle()
    # A non-streaming request whose client goes away is aborted too.
    host, port = server.url.removeprefix("http://").split(":")
    raw = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        server.wait_until(lambda h: h["running"] == 1, "the request starting")
    server.wait_idle()
    metrics = dict(line.rsplit(" ", 1) for line in server.http.get("/metrics").text.splitlines() if line[0] != "#")
    assert int(metrics['k3_requests_total{outcome="aborted"}']) >= 2


def test_64_concurrent_requests_give_the_tokens_they_give_alone(server, client, reference):
    """Mixed prompt lengths (1..120 tokens) and output lengths, greedy, a quarter of them streaming: every
    request returns exactly the tokens it gives alone (the engine in this process, one request at a time; the
    server alone was held equal to it above), and nothing is held afterwards."""
    import random

    rng = random.Random(0)
    vocab = 300
    bodies = [{"model": "tiny", "prompt": [rng.randrange(1, vocab) for _ in range(rng.choice([1, 7, 33, 64, 120]))],
               "max_tokens": rng.randint(2, 12), "temperature": 0, "return_token_ids": True, "stream": i % 4 == 0}
              for i in range(64)]

    async def send(http, body):
        if not body["stream"]:
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]
        ids = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return ids

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(send(http, b) for b in bodies))

    together = asyncio.run(main())
    engine, _ = reference
    alone = [greedy(engine, b["prompt"], b["max_tokens"]).token_ids for b in bodies]
    assert [len(a) for a in alone] == [b["max_tokens"] for b in bodies]  # the tokenizer has no EOS
    mismatched = [i for i, (a, t) in enumerate(zip(alone, together)) if a != t]
    assert not mismatched, f"{len(mismatched)} of 64 differ, e.g. #{mismatched[0]}: {alone[mismatched[0]]} vs " \
                           f"{together[mismatched[0]]}"
    server.wait_idle()


def test_sigterm_stops_the_server_cleanly(server):
    """Last in this file: it stops the module's server."""
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert "k3 serve: stopped" in server.log() and "Traceback" not in server.log(), server.log()
