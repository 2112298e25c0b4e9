"""Forced tool calls (tool_choice "required" or a named function) are written with the token ids an unforced
call is written with: the chat format's marker tokens where the tokenizer has them (not the marker spelled out
as text), the format's JSON separators, its end of turn. Fixed-seed tiny models, the engine and the server's
request planning (k3.infer.chat_request) and reply parser (k3.chat.reply)."""

import json

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jinja2")

KIMI_MARKERS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}


def _setup(fmt_name: str, special_markers: bool):
    import torch

    from k3.chat import ChatFormat, attach_chat_format, builtin_template
    from k3.config import ModelConfig
    from k3.data.tokenizer import BPETokenizer, train_bpe
    from k3.infer.engine import Engine
    from k3.infer.structured import GrammarTokenizer
    from k3.model import K3ForCausalLM

    text = ('<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|tool_calls_section_begin|>'
            '{"city": "Paris", "days": 3} <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    tokenizer = train_bpe([text] * 8, vocab_size=330, show_progress=False)
    if special_markers:  # as a K3 / Kimi checkpoint's tokenizer has them
        tokenizer.backend.add_special_tokens(KIMI_MARKERS)
        tokenizer = BPETokenizer(tokenizer.backend)
    fmt = ChatFormat(builtin_template(fmt_name), f"built-in {fmt_name}", eos_token="<|endoftext|>")
    attach_chat_format(tokenizer, fmt)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)).eval()
    engine = Engine(model, tokenizer, max_context=1024, max_batch=16, prefix_cache=False)
    return engine, tokenizer, fmt, GrammarTokenizer(tokenizer, tokenizer.vocab_size)


@pytest.fixture(scope="module")
def kimi():
    return _setup("kimi_k2", special_markers=True)


@pytest.fixture(scope="module")
def k3_format():
    return _setup("k3", special_markers=False)


def _request(setup, tool_choice, seed=None, temperature=0.0, max_tokens=120):
    """(prompt ids, SamplingParams, ChatPlan) as /v1/chat/completions builds them."""
    from k3.infer.chat_request import plan_chat
    from k3.infer.protocol import ChatCompletionRequest
    from k3.infer.sampling import SamplingParams

    _, tokenizer, fmt, grammars = setup
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": [WEATHER, CLOCK],
                                                 "tool_choice": tool_choice})
    plan = plan_chat(body, fmt, tokenizer, lambda: grammars)
    prompt = fmt.encode(plan.messages, tokenizer, plan.tools)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed, stop=plan.stops,
                            stop_token_ids=list(plan.stop_token_ids), grammar=plan.grammar)
    return prompt, params, plan


def _auto_ids(setup) -> list[int]:
    """The ids the format gives an assistant turn holding CALL: what the model writes (and is trained on) unforced."""
    _, tokenizer, fmt, _ = setup
    segments = fmt.segments(ASK + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], tokenizer,
                            tools=[WEATHER, CLOCK])
    return [t for s in segments if s.trainable for t in s.ids]


class _Script:
    """A logits processor: force (or, with bias, only favour) the scripted ids, position by position."""

    def __init__(self, ids: list[int], bias: float | None = None) -> None:
        self.ids, self.bias = ids, bias

    def __call__(self, rows, logits):
        logits = logits.clone()
        for row, seq in enumerate(rows):
            position = len(seq.generated)
            if position < len(self.ids):
                if self.bias is None:
                    logits[row] = float("-inf")
                    logits[row, self.ids[position]] = 0.0
                else:
                    logits[row, self.ids[position]] += self.bias
        return logits


def _run(setup, tool_choice, processor=None, **kwargs):
    """-> (output ids, ChatPlan's parser after the whole reply, finish reason)."""
    engine, tokenizer, _, _ = setup
    prompt, params, plan = _request(setup, tool_choice, **kwargs)
    if processor is not None:
        engine.logits_processors.append(processor)
    try:
        out = engine.complete([prompt], params)[0].outputs[0]
    finally:
        engine.logits_processors.clear()
    return out.token_ids, _parsed(setup, plan, out.token_ids), out.finish_reason


def _parsed(setup, plan, ids):
    engine, tokenizer, _, _ = setup
    stops = engine.stop_ids(_request(setup, "auto")[1]) | set(plan.stop_token_ids)
    text = tokenizer.decode(ids[:-1] if ids and ids[-1] in stops else ids)
    for stop in plan.stops:
        text = text.split(stop)[0]
    parser = plan.parser()
    parser.push(text)
    parser.finish()
    return parser


def _calls(parser):
    return [(c.id, c.name, json.loads(c.arguments)) for c in parser.calls]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("fixture", ["kimi", "k3_format"])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_written_with_the_ids_of_an_unforced_one(request, fixture, choice):
    """Auto: the model is made to write the format's ids of a call. Forced: the same ids are only favoured,
    under the tool-call grammar; the grammar must let every one of them through (before, it refused the
    marker tokens and the format's ", " / ": " separators, and ended the turn with another token)."""
    setup = request.getfixturevalue(fixture)
    auto = _auto_ids(setup)
    auto_ids, auto_parsed, auto_finish = _run(setup, "auto", _Script(auto))
    assert auto_ids == auto and auto_finish == "stop"
    assert _calls(auto_parsed) == [("functions.get_weather:0", "get_weather", {"city": "Paris", "days": 3})]
    forced_ids, forced_parsed, forced_finish = _run(setup, choice, _Script(auto, bias=40.0))
    assert forced_ids == auto_ids
    assert _calls(forced_parsed) == _calls(auto_parsed) and forced_finish == "stop"
    assert forced_parsed.content == auto_parsed.content == ""


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_an_unguided_forced_call_writes_each_marker_as_its_one_token(kimi, choice):
    """A random model under the grammar alone: each Kimi marker is its single special id, never text."""
    from k3.chat.reply import KIMI_CALL_ARGS, KIMI_CALL_CLOSE, KIMI_CALL_OPEN, KIMI_SECTION_CLOSE, KIMI_SECTION_OPEN

    _, tokenizer, _, _ = kimi
    ids, parsed, finish = _run(kimi, choice, temperature=1.0, seed=11, max_tokens=200)
    marker = {m: tokenizer.encode(m) for m in (KIMI_SECTION_OPEN, KIMI_SECTION_CLOSE, KIMI_CALL_OPEN,
                                               KIMI_CALL_ARGS, KIMI_CALL_CLOSE, "<|im_end|>")}
    assert all(len(m) == 1 for m in marker.values())
    assert finish == "stop" and parsed.calls and parsed.content == ""
    assert ids[0] == marker[KIMI_SECTION_OPEN][0] and ids[-2:] == marker[KIMI_SECTION_CLOSE] + marker["<|im_end|>"]
    for text in (KIMI_CALL_OPEN, KIMI_CALL_ARGS, KIMI_CALL_CLOSE):
        assert ids.count(marker[text][0]) == len(parsed.calls)
    # No marker written out as text: every "<|" of the reply's text is one of the special ids.
    assert tokenizer.decode(ids).count("<|") == sum(ids.count(m[0]) for m in marker.values())


def test_50_forced_requests_all_parse_and_validate(kimi):
    jsonschema = pytest.importorskip("jsonschema")
    engine, _, _, _ = kimi
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    requests = [_request(kimi, "required" if i % 2 else {"type": "function", "function": {"name": "get_time"}},
                         seed=i, temperature=1.0, max_tokens=200) for i in range(50)]
    outs = engine.complete([r[0] for r in requests], [r[1] for r in requests])
    for i, ((_, _, plan), out) in enumerate(zip(requests, outs)):
        completion = out.outputs[0]
        parsed = _parsed(kimi, plan, completion.token_ids)
        assert completion.finish_reason == "stop" and parsed.calls and parsed.content == "", (i, completion)
        for call in parsed.calls:
            assert i % 2 or call.name == "get_time"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_the_separators_are_read_from_the_format():
    from k3.chat import ChatFormat, builtin_template

    assert ChatFormat(builtin_template("kimi_k2")).argument_separators == (", ", ": ")
    compact = builtin_template("k3").replace("| tojson)", "| tojson(separators=[',', ':']))")
    assert ChatFormat(compact).argument_separators == (",", ":")
