"""`k3 serve --engine-process`: the engine in a child process. Through the official `openai` client (chat,
streaming and not, forced tool calls, echo logprobs), the same tokens as the engine in process; cancellation
frees the slot; bad requests end alone; a malformed message to the child fails its request only; the child
is stopped with the server, and a dead child makes the server exit non-zero. Every process is stopped."""

import asyncio
import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from engine_process_helpers import failing_build, tiny_engine  # noqa: E402
from server_helpers import Server, make_run  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "print('héllo')"}]


def engine_child(server: Server) -> int:
    """The server's engine process (multiprocessing's resource tracker is its other child)."""
    pid = server.process.pid
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    [engine] = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return engine


def gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.05)
    return False


def stop_all(server: Server) -> None:
    """Stop the server; its engine process must then be gone too (killed here if not, and the test fails)."""
    child = None
    try:
        child = engine_child(server)
    except (OSError, ValueError):
        pass
    server.stop()
    if child is not None and not gone(child, 15):
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"the engine process {child} outlived the server")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("engine_process") / "run")


@pytest.fixture(scope="module")
def launched(run):
    """The server, started here and waited for in `served`: the file's other engines (`process`, `in_process`)
    start meanwhile, side by side with it (each start-up is seconds of imports on one core)."""
    server = Server(run, "--engine-process", "--chat-template", "kimi_k2", "--max-batch", "8", "--max-context",
                    "1024", start_timeout_s=180, wait=False)
    try:
        yield server
    finally:
        stop_all(server)


@pytest.fixture(scope="module")
def served(launched, process, in_process):
    launched.ready().wait_until(lambda h: h["status"] == "ok", "the engine process's readiness", 120)
    return launched


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def in_process(run):
    """The same run's engine in this process: what the engine process must equal."""
    from k3.infer.cli import load_for_inference
    from k3.infer.engine import Engine

    model, tokenizer = load_for_inference(str(run), None, "cpu", "auto")
    return Engine(model, tokenizer, max_context=1024, max_batch=8)


def test_chat_streamed_and_not_give_the_in_process_engines_tokens(served, client, in_process):
    from k3.infer.sampling import SamplingParams

    assert "engine in its own process" in served.log()
    whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0,
                                           extra_body={"return_token_ids": True})
    extra = whole.choices[0].model_extra
    expected = in_process.generate_ids([extra["prompt_token_ids"]],
                                       SamplingParams(max_new_tokens=24, temperature=0))[0]
    assert extra["token_ids"] == expected
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_cross_to_the_engine_process(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=300,
                  parallel_tool_calls=False, temperature=1.0, seed=4)
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for part in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = list(calls.values())
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        finish = choice.finish_reason
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_echo_logprobs_come_from_the_engine_process(served, in_process):
    response = served.http.post("/v1/completions", json={"model": "tiny", "prompt": "print('x')", "echo": True,
                                                         "logprobs": 2, "max_tokens": 0})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    ids = in_process.tokenizer.encode("print('x')")
    [scored] = in_process.score([ids], [1], top_k=2)
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(scored.logprobs, abs=1e-4)


def test_a_cancelled_stream_frees_its_slot_in_the_engine_process(served):
    body = {"model": "tiny", "prompt": "print(", "max_tokens": 400, "temperature": 0, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        served.wait_until(lambda h: h["running"] == 1, "the request running in the engine process")
    served.wait_idle()


@pytest.mark.parametrize("fields", [{"prompt": [10**9]}, {"seed": 2**80}, {"temperature": float("nan")},
                                    {"max_tokens": 10**12}])
def test_a_bad_request_ends_alone_and_the_engine_process_serves_on(served, fields):
    body = {"model": "tiny", "prompt": "print(", "max_tokens": 2, "temperature": 0}
    response = served.http.post("/v1/completions", content=json.dumps({**body, **fields}, allow_nan=True),
                                headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert served.http.post("/v1/completions", json=body).status_code == 200
    assert served.health()["status"] == "ok"


@pytest.fixture(scope="module")
def process():
    from k3.infer.engine_process import EngineProcess

    engine = EngineProcess(functools.partial(tiny_engine, 256, 4), max_queue=8, start_timeout_s=120)
    try:
        assert engine.ready.wait(60)
        yield engine
    finally:
        engine.shutdown()
        assert not engine.process.is_alive()


@pytest.mark.parametrize("message", [
    ["add", "bad-ids", [10**9], {"max_new_tokens": 2}],
    ["add", "bad-float", [5, 6], {"max_new_tokens": 2, "temperature": "hot"}],
    ["add", "bad-field", [5, 6], {"max_new_tokens": 2, "no_such_field": 1}],
    ["add", "bad-grammar", [5, 6], {"max_new_tokens": 2, "grammar": {"lark": "start: (", "description": "x"}}],
    ["add", "bad-shape", "not a prompt", {}],
])
def test_a_malformed_message_fails_its_request_only(process, message):
    """Messages that skip the parent's checks (as a bug or a hostile peer would send them) end their own
    request with a ValueError in the child; the engine serves the next request."""
    from k3.infer.sampling import SamplingParams

    async def main():
        got: asyncio.Queue = asyncio.Queue()
        process._listeners[message[1]] = (asyncio.get_running_loop(), lambda rid, items: got.put_nowait(items))
        process._outbox.put(message)
        [error] = await asyncio.wait_for(got.get(), 30)
        process._listeners.pop(message[1], None)
        tokens = [e.token_id async for e in process.stream([5, 6, 7], SamplingParams(max_new_tokens=3,
                                                                                     temperature=0))]
        return error, tokens

    error, tokens = asyncio.run(main())
    assert isinstance(error, ValueError) and len(tokens) == 3
    assert process.error is None and process.process.is_alive()


def test_a_child_that_cannot_build_its_engine_fails_clearly():
    from k3.infer.engine_process import EngineProcess

    with pytest.raises(RuntimeError, match="could not build its engine: RuntimeError: no model here"):
        EngineProcess(failing_build, start_timeout_s=120)


@pytest.mark.slow  # two more server starts (about 20 s each on two shared cores)
def test_a_dead_engine_process_makes_the_server_exit_non_zero(run):
    server = Server(run, "--engine-process", "--no-warmup", start_timeout_s=180)
    try:
        os.kill(engine_child(server), signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        assert "the engine process exited (exit code -9)" in server.log()
    finally:
        server.stop()


@pytest.mark.slow
def test_the_engine_process_exits_when_its_server_is_killed(run):
    server = Server(run, "--engine-process", "--no-warmup", start_timeout_s=180)
    child = engine_child(server)
    try:
        server.process.kill()  # no shutdown at all: the child must notice its request pipe close
        server.process.wait(timeout=30)
        assert gone(child, 15)
    finally:
        if not gone(child, 0.1):
            os.kill(child, signal.SIGKILL)
        server.stop()


@pytest.mark.parametrize("change, words", [
    (lambda p: setattr(p, "temperature", float("nan")), "temperature must be a finite number"),
    (lambda p: p.stop_token_ids.append(10**6), "stop_token_ids must be in"),
    (lambda p: setattr(p, "max_new_tokens", 10**9), "max_new_tokens must be at most the context"),
    (lambda p: setattr(p, "n", 0), "n must be an integer in"),
])
def test_sampling_fields_are_range_checked_before_they_cross(change, words):
    """A field changed after SamplingParams checked it (the server edits stop ids and the grammar) is checked
    again before the message is written."""
    from k3.infer.engine_process import params_to_wire
    from k3.infer.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=4)
    change(params)
    with pytest.raises(ValueError, match=words):
        params_to_wire(params, vocab_size=300, max_context=512)
