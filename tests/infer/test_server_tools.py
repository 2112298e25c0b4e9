"""Tool calls, reasoning, structured output, echo and API keys through `k3 serve`'s app on a real socket, with
the official `openai` client, on a tiny random-init model in the Kimi-K2 chat format. Where a test needs a
given reply (a tool call, a malformed call, reasoning), a logits processor on the engine forces its tokens;
everything from the engine's events to the client's parsed objects is the real path."""

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
llguidance = pytest.importorskip("llguidance")

from inprocess_server import ForceReply, InProcessServer  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    import torch

    from k3.chat import attach_chat_format, builtin_template, ChatFormat
    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.model import K3ForCausalLM

    text = "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|tool_calls_section_begin|>{\"city\": 1}"
    tokenizer = train_bpe([text] * 8, vocab_size=320, show_progress=False)
    attach_chat_format(tokenizer, ChatFormat(builtin_template("kimi_k2")))
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)).eval()
    force = ForceReply()
    server = InProcessServer(model, tokenizer, max_context=1024)
    server.engine.logits_processors.append(force)
    try:
        yield server, tokenizer, force
    finally:
        server.stop()


@pytest.fixture
def client(served):
    server, _, force = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
    force.ids = None


def reply(tokenizer, force, text):
    force.ids = tokenizer.encode(text)


CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')


def test_a_tool_call_comes_back_parsed(served, client):
    _, tokenizer, force = served
    reply(tokenizer, force, "Let me look." + CALL)
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=250, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("functions.get_weather:0", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call_gives_the_same_objects(served, client):
    _, tokenizer, force = served
    reply(tokenizer, force, "Let me look." + CALL)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=250,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look." and finish == "tool_calls"
    assert calls == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_choice_none_reads_no_calls(served, client):
    _, tokenizer, force = served
    reply(tokenizer, force, CALL)
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                            max_tokens=250, temperature=0).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "functions.get_weather:0" in choice.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_is_content_never_an_error(served, client, stream, caplog):
    _, tokenizer, force = served
    bad = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
           '{"city": Paris}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    reply(tokenizer, force, bad)
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=250, temperature=0)
    with caplog.at_level("WARNING", logger="k3.chat"):
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            content, finish = choice.message.content, choice.finish_reason
            assert not choice.message.tool_calls
    assert finish == "stop" and '{"city": Paris}' in content
    assert "could not be read" in caplog.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_choice_force_a_valid_call(served, client, choice):
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                                         max_tokens=250, temperature=1.0, seed=3)
    result = out.choices[0]
    assert result.finish_reason == "tool_calls", result
    assert result.message.tool_calls
    for call in result.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
        else:
            assert call.function.name in ("get_weather", "get_time")


def test_a_forced_call_streams_its_arguments_in_fragments(served, client):
    """Under a grammar the arguments are valid as they come: id and name first, then argument fragments that
    add up to the non-streamed call's arguments."""
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], parallel_tool_calls=False, max_tokens=250,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    parts = [part for chunk in client.chat.completions.create(stream=True, **kwargs)
             for part in chunk.choices[0].delta.tool_calls or []]
    assert len(parts) > 2 and {part.index for part in parts} == {0}
    assert (parts[0].id, parts[0].function.name) == (whole.message.tool_calls[0].id, "get_weather")
    assert all(part.id is None and part.function.name is None for part in parts[1:])
    arguments = "".join(part.function.arguments or "" for part in parts)
    assert arguments == whole.message.tool_calls[0].function.arguments and "city" in json.loads(arguments)
    assert whole.finish_reason == "tool_calls"


def test_history_with_tool_calls_and_results_renders(served, client):
    server, tokenizer, force = served
    reply(tokenizer, force, "Sunny.<|im_end|>")
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "sunny"}'}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=40,
                                         temperature=0, extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(out.choices[0].model_extra["prompt_token_ids"])
    assert prompt.endswith('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
                           '<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>'
                           '## Return of functions.get_weather:0\n{"sky": "sunny"}<|im_end|>'
                           '<|im_assistant|>assistant<|im_middle|>')
    assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":')
    assert out.choices[0].message.content == "Sunny." and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_apart_from_the_answer(served, client, stream):
    _, tokenizer, force = served
    reply(tokenizer, force, "<think>Paris is in France.</think>It is sunny.<|im_end|>")
    kwargs = dict(model="tiny", messages=ASK, max_tokens=60, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
    assert (reasoning, content) == ("Paris is in France.", "It is sunny.")


def test_tools_without_a_tool_syntax_are_a_400():
    pytest.importorskip("jinja2")
    from k3.chat import builtin_template
    from k3.infer.chat_request import plan_chat
    from k3.infer.chat_template import ChatTemplate
    from k3.infer.protocol import APIError, ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": [WEATHER]})
    with pytest.raises(APIError, match="no tool-call syntax"):
        plan_chat(body, ChatTemplate(builtin_template("plain")), None, None)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": [WEATHER],
                                                 "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    with pytest.raises(APIError, match="not among the request's tools"):
        plan_chat(body, ChatTemplate(builtin_template("kimi_k2")), None, None)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "age", "member", "color", "tags"], "additionalProperties": False}


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "y": {"type": "number", "minimum": 0, "maximum": 1}},
         "required": ["x", "y"], "additionalProperties": False}


def _constrained_requests(served, count):
    """Constrained and free requests in one batch: every constrained reply is valid JSON under its schema."""
    import asyncio

    jsonschema = pytest.importorskip("jsonschema")
    server, _, _ = served

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            def constrained(i):
                schema = PERSON if i % 2 else POINT
                fmt = {"type": "json_schema", "json_schema": {"name": "value", "schema": schema}}
                return client.chat.completions.create(model="tiny", messages=ASK, max_tokens=150, seed=i,
                                                      temperature=1.0, response_format=fmt)
            free = [client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, seed=i)
                    for i in range(4)]
            return await asyncio.gather(*[constrained(i) for i in range(count)], *free)

    results = asyncio.run(main())
    for i, out in enumerate(results[:count]):
        value = json.loads(out.choices[0].message.content)
        assert isinstance(value, dict), out
        jsonschema.validate(value, PERSON if i % 2 else POINT)
        assert out.choices[0].finish_reason == "stop"
    assert all(len(out.choices[0].message.content) > 0 for out in results[count:])



@pytest.mark.slow  # 24 s on two shared CPU cores
def test_50_constrained_requests_all_parse_and_validate(served):
    _constrained_requests(served, 50)


def test_8_constrained_requests_parse_and_validate(served):
    _constrained_requests(served, 8)


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_of_a_constrained_reply_report_ruled_out_tokens_at_the_floor(served, client, stream):
    """A grammar masks most of the vocabulary to -inf, so 20 top logprobs name ruled-out tokens: JSON has no -inf
    (this was a 500), so they come back at LOGPROB_FLOOR, as vLLM reports them."""
    from k3.infer.protocol import LOGPROB_FLOOR

    fmt = {"type": "json_schema", "json_schema": {"name": "value", "schema": POINT}}
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0, logprobs=True,
                                         top_logprobs=20, response_format=fmt, stream=stream)
    entries = [entry for chunk in out for entry in (chunk.choices[0].logprobs.content or [])
               if chunk.choices and chunk.choices[0].logprobs] if stream else out.choices[0].logprobs.content
    assert entries
    tops = [top.logprob for entry in entries for top in entry.top_logprobs]
    assert all(LOGPROB_FLOOR <= entry.logprob <= 0 for entry in entries)
    assert all(LOGPROB_FLOOR <= lp <= 0 for lp in tops) and LOGPROB_FLOOR in tops


def test_echo_logprobs_equal_score_and_a_plain_forward(served):
    import torch

    server, tokenizer, _ = served
    prompt = "Weather in Paris?"
    ids = tokenizer.encode(prompt)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        out = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=2,
                                        temperature=0)
        generated = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=3, logprobs=0,
                                              temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
    served_lp = choice.logprobs.token_logprobs[1:]
    scored = server.engine.score([ids], [1])[0].logprobs
    with torch.no_grad():
        logits = server.engine.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    plain = [logits[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
    assert served_lp == pytest.approx(scored, abs=1e-5) and served_lp == pytest.approx(plain, abs=1e-4)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    g = generated.choices[0]
    assert g.text.startswith(prompt) and len(g.logprobs.token_logprobs) == len(ids) + 3
    assert g.logprobs.token_logprobs[1:len(ids)] == pytest.approx(scored, abs=1e-5)


def test_an_api_key_is_required_when_set():
    import torch

    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.model import K3ForCausalLM

    tokenizer = train_bpe(["hello world"] * 4, vocab_size=270, show_progress=False)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)).eval()
    server = InProcessServer(model, tokenizer, max_context=64, api_key="s3cret")
    try:
        import httpx

        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert response.status_code == 401
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        with openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0) as client:
            assert len(client.completions.create(**body).choices) == 1
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
    finally:
        server.stop()


@pytest.mark.parametrize("tools,words", [
    ([WEATHER] * 129, "at most 128"),
    ([{"type": "function", "function": {"name": "rm -rf /", "parameters": {}}}], "string should match pattern"),
    ([WEATHER, WEATHER], "same name"),
    ([{"type": "retrieval"}], "tools"),
])
def test_bad_tools_are_a_400_that_says_why(tools, words):
    from k3.chat import ChatFormat, builtin_template
    from k3.infer.chat_request import plan_chat
    from k3.infer.protocol import APIError, ChatCompletionRequest, parse_request

    with pytest.raises(APIError) as caught:
        body = parse_request(json.dumps({"model": "m", "messages": ASK, "tools": tools}).encode(),
                             ChatCompletionRequest)
        plan_chat(body, ChatFormat(builtin_template("kimi_k2")), None, None)
    assert caught.value.status == 400 and caught.value.param.startswith("tools")
    assert words in caught.value.message.lower() or words in caught.value.message, caught.value.message
