"""Structured output in the engine: constrained rows share a batch with free ones without changing them, every
constrained reply follows its grammar, and bad schemas are refused with a 400 before any work."""

import json

import pytest

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "boolean"}}, "required": ["n", "b"]}


@pytest.fixture(scope="module")
def engine():
    import torch

    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.infer.engine import Engine
    from k3.model import K3ForCausalLM

    tokenizer = train_bpe(['{"n": 12, "b": true} hello world'] * 8, vocab_size=300, show_progress=False)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size))
    return Engine(model, tokenizer, max_context=512, max_batch=8, prefix_cache=False)


def test_free_rows_are_unchanged_by_constrained_rows_beside_them(engine):
    from k3.infer.sampling import SamplingParams
    from k3.infer.structured import GrammarTokenizer, json_grammar

    grammar = json_grammar(GrammarTokenizer(engine.tokenizer, engine.config.vocab_size), SCHEMA)
    prompt = engine.tokenizer.encode("hello")
    free = SamplingParams(max_new_tokens=12, temperature=0)
    alone = engine.complete([prompt], free)[0].outputs[0].token_ids
    constrained = SamplingParams(max_new_tokens=60, temperature=1.0, seed=5, grammar=grammar, n=3)
    outs = engine.complete([prompt, prompt], [free, constrained])
    assert outs[0].outputs[0].token_ids == alone
    for out in outs[1].outputs:  # three samples, each with its own grammar state
        value = json.loads(out.text)
        assert set(value) == {"n", "b"} and 0 <= value["n"] <= 99 and out.finish_reason == "stop"


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {f"k{i}": {"type": "string", "description": "x" * 100} for i in range(2000)}},
     "at most"),
    ({"type": "no-such-type"}, "invalid response_format"),
])
def test_a_bad_schema_is_a_400(engine, schema, words):
    from k3.chat import ChatFormat, builtin_template
    from k3.infer.chat_request import plan_chat
    from k3.infer.protocol import APIError, ChatCompletionRequest
    from k3.infer.structured import GrammarTokenizer

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "json_schema", "json_schema": {
                                                     "name": "s", "schema": schema}}})
    with pytest.raises(APIError, match=words) as caught:
        plan_chat(body, ChatFormat(builtin_template("k3")), engine.tokenizer,
                  lambda: GrammarTokenizer(engine.tokenizer, engine.config.vocab_size))
    assert caught.value.status == 400 and caught.value.param == "response_format"


def test_a_forced_reply_holds_at_most_max_calls(engine):
    """A model that would call tools without end (here: '<', which opens another call, is made far more likely)
    stops after max_calls calls under tool_choice "required" (8 in k3 serve; 3 here, to keep the test short)."""
    from k3.chat.reply import parse_reply
    from k3.infer.sampling import SamplingParams
    from k3.infer.structured import GrammarTokenizer, tool_call_grammar

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    grammar = tool_call_grammar(GrammarTokenizer(engine.tokenizer, engine.config.vocab_size), "k3", [tool],
                                max_calls=3)
    [opener] = engine.tokenizer.encode("<")

    def prefer_another_call(rows, logits):
        logits = logits.clone()
        logits[:, opener] += 50.0
        return logits

    engine.logits_processors.append(prefer_another_call)
    try:
        params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=0, grammar=grammar, n=2)  # 3 calls: 144
        outputs = engine.complete([engine.tokenizer.encode("hello")], params)[0].outputs
    finally:
        engine.logits_processors.remove(prefer_another_call)
    for out in outputs:
        parsed = parse_reply(out.text, "k3", tool_names={"f"})
        assert out.finish_reason == "stop" and len(parsed.calls) == 3 and parsed.content == ""
