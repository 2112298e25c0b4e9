"""The server's pure parts, without a server: request validation, incremental text with stop strings, SSE
framing, chat templates and the Prometheus text."""

import json
import random

import pytest

from k3.infer.chat_template import ChatTemplate, load_chat_template, render_default
from k3.infer.detokenize import IncrementalDecoder, TextAssembler
from k3.infer.metrics import Histogram, ServerMetrics
from k3.infer.protocol import (LOGPROB_FLOOR, MAX_JSON_DEPTH, APIError, ChatCompletionRequest, CompletionRequest,
                               check_model, check_prompt, parse_request, reported_logprob, resolve_max_tokens)
from k3.infer.sse import SSE_DONE, parse_sse, sse_chunks, sse_event

TEXTS = ["héllo wörld, ça va? 你好世界 🙂🙃 naïve café", "print('line 1')\n\tx = [1, 2, 3]  # ✓", "ab" * 40]


@pytest.fixture(scope="module")
def tokenizer():
    from k3.data.tokenizer import train_bpe

    return train_bpe(TEXTS * 20, vocab_size=300, show_progress=False)


def refused(body, kind=CompletionRequest) -> APIError:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    with pytest.raises(APIError) as caught:
        parse_request(raw.encode() if isinstance(raw, str) else raw, kind)
    assert caught.value.status == 400
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}
    return caught.value


def test_good_requests_parse():
    request = parse_request(json.dumps({"model": "m", "prompt": [[1, 2], [3]], "n": 2, "logprobs": 3,
                                        "stop": "\n", "temperature": 0, "top_k": -1, "seed": 7}).encode(),
                            CompletionRequest)
    assert request.prompts() == [[1, 2], [3]] and request.stop_strings() == ["\n"] and request.top_logprobs_count() == 3
    assert parse_request(b'{"model": "m", "prompt": [5, 6]}', CompletionRequest).prompts() == [[5, 6]]
    chat = parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "logprobs": True, "top_logprobs": 2,
        "max_completion_tokens": 5}).encode(), ChatCompletionRequest)
    assert chat.messages[0].text() == "ab" and chat.top_logprobs_count() == 2 and chat.max_tokens == 5
    assert parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
                         ChatCompletionRequest).top_logprobs_count() is None


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m", "prompt": "x", "temperature": -0.5}, "temperature", "a number >= 0"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "integer >= 1"),
    ({"model": "m", "prompt": "x", "max_tokens": "10"}, "max_tokens", "valid integer"),
    ({"model": "m", "prompt": "x", "n": True}, "n", "valid integer"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"model": "m", "prompt": 5}, "prompt", "a list of token ids"),
    ({"model": "m", "prompt": []}, "prompt", "the list is empty"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop", "non-empty strings"),
    ({"model": "m", "prompt": "x", "echo": True, "stream": True}, "echo", "without streaming only"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "only with \"echo\": true"),
    ({"model": "m"}, "prompt", "'prompt' is required"),
    ({"prompt": "x"}, "model", "'model' is required"),
])
def test_bad_completion_requests_say_what_is_wrong(body, param, words):
    error = refused(body)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m", "messages": []}, "messages", "the list is empty"),
    ({"model": "m", "messages": "hi"}, "messages", "valid list"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'robot'"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages.0.content", "allowed"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", "valid boolean"),
])
def test_bad_chat_requests_say_what_is_wrong(body, param, words):
    error = refused(body, ChatCompletionRequest)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("raw, param", [
    ('"seed": 18446744073709551616', "seed"),  # 2**64: past what a generator's seed holds
    ('"seed": 1208925819614629174706176', "seed"),  # 2**80
    ('"seed": -9223372036854775809', "seed"),  # -2**63 - 1
    ('"temperature": Infinity', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"top_p": NaN', "top_p"),
    ('"presence_penalty": -Infinity', "presence_penalty"),
    ('"repetition_penalty": 1e-300', "repetition_penalty"),
    ('"repetition_penalty": 1e300', "repetition_penalty"),
])
def test_numeric_fields_out_of_the_kernels_range_are_refused(raw, param):
    # Python's json reads Infinity and NaN, so they reach the checks: each must be a 400 naming its field.
    error = refused('{"model": "m", "prompt": "x", ' + raw + '}')
    assert error.param == param, error.message


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("function_call", "auto")])
def test_the_legacy_functions_api_is_refused_by_name(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    error = refused(body, ChatCompletionRequest)
    assert error.param == field and f"'{field}' is not supported" in error.message


@pytest.mark.parametrize("field, value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("tool_choice", "auto"), ("response_format", {"type": "json_object"})])
def test_chat_only_fields_are_refused_by_name_on_completions(field, value):
    error = refused({"model": "m", "prompt": "x", field: value})
    assert error.param == field and f"'{field}' is not supported" in error.message


@pytest.mark.parametrize("body, param", [
    ('{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
    ('{"model": "m", "prompt": ["ok", "\\udfff"]}', "prompt"),
    ('{"model": "m", "prompt": "x", "stop": "\\ud800"}', "stop"),
])
def test_a_lone_surrogate_is_a_400_not_a_500(body, param):
    assert refused(body).param == param


def test_a_lone_surrogate_in_a_chat_message_is_a_400():
    error = refused('{"model": "m", "messages": [{"role": "user", "content": "hi \\udc80"}]}', ChatCompletionRequest)
    assert error.param == "messages.0.content" and "surrogate" in error.message


def test_top_k_past_the_vocabulary_is_clipped_to_it():
    from k3.infer.protocol import sampling_params

    request = parse_request(b'{"model": "m", "prompt": "x", "top_k": 1180591620717411303424}', CompletionRequest)
    assert sampling_params(request, 4, [], None, vocab_size=300).top_k == 300


def test_malformed_bodies():
    assert "not valid JSON" in refused(b'{"model": "m", "prompt": ').message
    assert "not valid JSON" in refused(b"\xff\xfe").message
    assert "must be a JSON object" in refused(b"[1, 2]").message


def _nested_schema(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "integer"}' + "}}" * levels


@pytest.mark.parametrize("raw, kind", [
    # past Python's recursion limit: json.loads itself gives up (it was a 500)
    ('{"model": "m", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", CompletionRequest),
    ('{"model": "m", "prompt": "x", "logit_bias": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}", CompletionRequest),
    # within it, but deep enough to exhaust whatever recurses later (validation, templates, grammar compilers)
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
     '"json_schema": {"name": "s", "schema": ' + _nested_schema(400) + "}}}", ChatCompletionRequest),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
     '{"name": "f", "parameters": ' + _nested_schema(3000) + "}}]}", ChatCompletionRequest),
])
def test_json_nested_past_the_limit_is_a_400(raw, kind):
    error = refused(raw, kind)
    assert error.code == "invalid_json" and f"at most {MAX_JSON_DEPTH}" in error.message, error.message


def test_json_nested_to_the_limit_is_accepted():
    depth_of_wrappers = 6  # body, response_format, json_schema, schema's own object, properties, "a"
    levels = (MAX_JSON_DEPTH - depth_of_wrappers) // 2
    raw = ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
           '"json_schema", "json_schema": {"name": "s", "schema": ' + _nested_schema(levels) + "}}}")
    assert parse_request(raw.encode(), ChatCompletionRequest).response_format is not None


def test_model_prompt_and_length_checks():
    with pytest.raises(APIError, match="unknown model 'gpt-4'; this server serves 'tiny'"):
        check_model("gpt-4", "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(APIError, match="empty after tokenization"):
        check_prompt([], 16, 100)
    with pytest.raises(APIError, match="has 16 tokens but this server's context is 16"):
        check_prompt(list(range(16)), 16, 100)
    with pytest.raises(APIError, match=r"outside \[0, 100\): \[100\]"):
        check_prompt([1, 100], 16, 100)
    assert resolve_max_tokens(None, 10, 16, 16) == 6 and resolve_max_tokens(None, 10, 16, None) == 6
    assert resolve_max_tokens(None, 2, 64, 16) == 16 and resolve_max_tokens(6, 10, 16, 16) == 6
    with pytest.raises(APIError, match="max_tokens=7 is too large: the prompt has 10 tokens and the context is 16, "
                                       "so at most 6 new tokens fit"):
        resolve_max_tokens(7, 10, 16, 16)


def _visible(tokenizer, ids, stops):
    """What a client must see: the full decode, cut before the first stop string."""
    text = tokenizer.decode(ids)
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def test_incremental_text_equals_the_full_decode(tokenizer):
    rng = random.Random(0)
    sequences = [tokenizer.encode(t) for t in TEXTS]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(60)] for _ in range(20)]  # broken UTF-8 too
    for ids in sequences:
        decoder = IncrementalDecoder(tokenizer)
        streamed = "".join(decoder.push(t) for t in ids) + decoder.flush()
        assert streamed == tokenizer.decode(ids)


@pytest.mark.parametrize("stops", [["wörld"], ["你好", "ça"], ["\n\t"], ["abab", "zzz"], ["🙃 na"], ["never"]])
def test_stop_strings_cut_the_text_and_are_never_shown(tokenizer, stops):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assembler = TextAssembler(tokenizer, stops)
        pieces = []
        for token in ids:
            pieces.append(assembler.push(token))
            shown = "".join(pieces)
            # Nothing shown may already contain a stop string or end in one's unfinished start.
            assert not any(s in shown for s in stops)
            if assembler.stopped:
                break
        pieces.append(assembler.finish())
        assert "".join(pieces) == assembler.text == _visible(tokenizer, ids, stops)
        assert assembler.stopped == any(s in tokenizer.decode(ids) for s in stops)


def test_held_back_text_is_released_when_no_stop_follows(tokenizer):
    assembler = TextAssembler(tokenizer, ["abX"])
    shown = "".join(assembler.push(t) for t in tokenizer.encode("ab" * 40))
    assert len(shown) < 80  # the last "ab" might start "abX"
    assert shown + assembler.finish() == "ab" * 40 and not assembler.stopped


def test_a_token_costs_its_own_text_not_all_text_so_far():
    """Streaming holds back at most a stop string's length and decodes a window of a token or two per token
    (the whole text each time made long outputs quadratic)."""
    class Counting:
        longest = 0

        def decode(self, ids):
            Counting.longest = max(Counting.longest, len(ids))
            return "".join(chr(97 + i % 26) for i in ids)

    assembler = TextAssembler(Counting(), ["zzzz", "xyq"])
    shown = "".join(assembler.push(i % 25) for i in range(2000))  # never a "z": nothing stops
    assert Counting.longest <= 2 and len(assembler.matcher.pending) < 4
    assert shown + assembler.finish() == assembler.text == Counting().decode([i % 25 for i in range(2000)])


def test_sse_framing_round_trips():
    chunks = [{"choices": [{"text": "line one\nline two", "index": 0}]}, {"choices": [{"text": "é 🙂 \"q\""}]}]
    stream = "".join(sse_event(c) for c in chunks) + SSE_DONE + sse_event({"after": "done"})
    assert all(event.startswith("data: ") and event.count("\n") == 2 for event in map(sse_event, chunks))
    assert list(parse_sse(stream.splitlines(keepends=True))) == chunks
    assert list(parse_sse([": keep-alive\n", "\n", "data: {\"a\": 1}\n", "\n"])) == [{"a": 1}]


def test_sse_chunks_with_the_head_serialised_once_are_the_same_bytes():
    head = {"id": "cmpl-1", "created": 1, "model": "tiny é", "object": "text_completion"}
    chunk = sse_chunks(head)
    for choice in ({"index": 0, "text": "line\n\"q\" 🙂", "logprobs": None}, {"index": 3, "delta": {}}):
        assert chunk(choice) == sse_event({**head, "choices": [choice]})
        assert list(parse_sse(chunk(choice).splitlines(keepends=True))) == [{**head, "choices": [choice]}]


def test_default_chat_template():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    assert render_default(messages) == "System: Be terse.\nUser: hi\nAssistant: hello\nUser: and?\nAssistant:"
    template = ChatTemplate()
    assert template.render(messages[1:2], add_generation_prompt=False) == "User: hi"
    assert template.stop == ["\n"] and template.source == "built-in plain"
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        template.render([{"role": "robot", "content": "x"}])


def test_chat_template_from_a_tokenizer_directory(tokenizer, tmp_path):
    pytest.importorskip("jinja2")
    tokenizer.save(tmp_path)
    assert load_chat_template(tokenizer, tmp_path).source == "built-in plain"  # no template file: the default
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    template = load_chat_template(tokenizer, tmp_path)
    assert template.source == str(tmp_path) and template.stop == []
    assert template.render([{"role": "user", "content": "hi"}]) == "<|user|>hi<|endoftext|><|assistant|>"
    assert tokenizer.eos_token_id in template.encode([{"role": "user", "content": "hi"}], tokenizer)

    class WithTemplate:  # an HF tokenizer carries its template itself
        chat_template = "{{ bos_token }}{{ messages[0].content }}"
        bos_token, eos_token = "<s>", "</s>"

    assert load_chat_template(WithTemplate()).render([{"role": "user", "content": "x"}]) == "<s>x"


def test_prometheus_text():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    lines = histogram.lines("t", "help")
    assert lines[2:] == ['t_bucket{le="0.1"} 2', 't_bucket{le="1"} 3', 't_bucket{le="+Inf"} 4', "t_sum 3.65",
                         "t_count 4"]
    metrics = ServerMetrics(window_s=10)
    metrics.started(5)
    metrics.first_token(0.2)
    metrics.tokens(1, now=100.0)
    metrics.tokens(1, gap_s=0.01, now=101.0)
    metrics.ended("finished", 1.5)
    assert metrics.tokens_per_second(now=105.0) == pytest.approx(0.2)
    assert metrics.tokens_per_second(now=1000.0) == 0
    text = metrics.render({"waiting": 2, "running": 3, "kda_slots_used": 3, "mla_pages_used": 7})
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples["k3_requests_waiting"] == "2" and samples["k3_mla_pages_used"] == "7"
    assert samples['k3_requests_total{outcome="finished"}'] == "1" and samples["k3_generation_tokens_total"] == "2"
    assert samples["k3_time_to_first_token_seconds_count"] == "1"
    assert samples["k3_time_per_output_token_seconds_count"] == "1"
    assert samples["k3_server_requests_in_flight"] == "0"


def test_the_tokens_per_second_window_is_pruned_without_scrapes():
    metrics = ServerMetrics(window_s=10)
    for i in range(100_000):  # one token every 5 ms for 500 s, and nobody reads /metrics
        metrics.tokens(1, now=i * 0.005)
    assert len(metrics._recent) <= 10 / 0.01 + 1
    assert metrics.tokens_per_second(now=100_000 * 0.005) == pytest.approx(200, rel=0.01)


def test_a_ruled_out_token_is_reported_at_the_floor():
    assert reported_logprob(-0.25) == -0.25 and reported_logprob(LOGPROB_FLOOR) == LOGPROB_FLOOR
    assert reported_logprob(float("-inf")) == reported_logprob(float("nan")) == LOGPROB_FLOOR
    json.dumps([reported_logprob(float("-inf"))], allow_nan=False)  # what a response renderer does
