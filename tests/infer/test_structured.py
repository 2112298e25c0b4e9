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


def test_the_same_schema_or_tools_reuse_the_compiled_grammar_and_still_validate(engine):
    """Agents send the same tools and schemas request after request: the second request compiles nothing, and
    sequences sampling from the shared compiled grammar each keep their own state (every reply validates)."""
    from k3.chat.reply import parse_reply
    from k3.infer.sampling import SamplingParams
    from k3.infer.structured import GrammarTokenizer, json_grammar, tool_call_grammar

    grammars = GrammarTokenizer(engine.tokenizer, engine.config.vocab_size)
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    first = json_grammar(grammars, SCHEMA)
    forced = tool_call_grammar(grammars, "k3", [tool], parallel=False)
    assert grammars.compiled.builds == 2
    second = json_grammar(grammars, json.loads(json.dumps(SCHEMA)))  # an equal schema from another request
    again = tool_call_grammar(grammars, "k3", [json.loads(json.dumps(tool))], parallel=False)
    assert grammars.compiled.builds == 2 and second._start is first._start and again._start is forced._start
    prompt = engine.tokenizer.encode("hello")
    outs = engine.complete([prompt, prompt, prompt], [
        SamplingParams(max_new_tokens=60, temperature=1.0, seed=1, grammar=first, n=2),
        SamplingParams(max_new_tokens=60, temperature=1.0, seed=2, grammar=second, n=2),
        SamplingParams(max_new_tokens=120, temperature=1.0, seed=3, grammar=again)])
    for out in [o for request in outs[:2] for o in request.outputs]:
        value = json.loads(out.text)
        assert set(value) == {"n", "b"} and 0 <= value["n"] <= 99 and out.finish_reason == "stop"
    [call] = parse_reply(outs[2].outputs[0].text, "k3", tool_names={"f"}).calls
    assert set(json.loads(call.arguments)) == {"n", "b"}


def test_distinct_schemas_do_not_share_a_compiled_grammar(engine):
    from k3.infer.sampling import SamplingParams
    from k3.infer.structured import GrammarTokenizer, json_grammar

    grammars = GrammarTokenizer(engine.tokenizer, engine.config.vocab_size)
    other = {"type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"]}
    a, b = json_grammar(grammars, SCHEMA), json_grammar(grammars, other)
    assert grammars.compiled.builds == 2 and a._start is not b._start and len(grammars.compiled) == 2
    out = engine.complete([engine.tokenizer.encode("hello")],
                          SamplingParams(max_new_tokens=30, temperature=1.0, seed=0, grammar=b))[0].outputs[0]
    assert json.loads(out.text) in ({"z": True}, {"z": False})


def test_many_distinct_schemas_cannot_grow_the_cache_without_bound(engine):
    """Hostile requests with ever new schemas: the cache keeps its newest entries within its entry and character
    bounds, and a grammar larger than the character bound is compiled for its request but not kept."""
    from k3.infer.structured import CompiledGrammars, GrammarTokenizer, json_grammar

    grammars = GrammarTokenizer(engine.tokenizer, engine.config.vocab_size)
    grammars.compiled = CompiledGrammars(max_entries=4, max_chars=2_000)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
               for i in range(10)]
    for schema in schemas:
        json_grammar(grammars, schema)
    assert grammars.compiled.builds == 10 and len(grammars.compiled) == 4 and grammars.compiled.chars <= 2_000
    json_grammar(grammars, schemas[-1])  # the newest is kept
    json_grammar(grammars, schemas[0])  # the oldest was dropped
    assert grammars.compiled.builds == 11
    big = {"type": "object", "properties": {"k": {"type": "string", "description": "x" * 3_000}}}
    json_grammar(grammars, big)
    json_grammar(grammars, big)
    assert grammars.compiled.builds == 13 and len(grammars.compiled) == 4 and grammars.compiled.chars <= 2_000


def test_many_rows_fill_their_masks_in_the_thread_pool_as_one_by_one(engine, monkeypatch):
    """From PARALLEL_MASK_ROWS rows llguidance's thread pool fills the masks: the same masks as one row at a time,
    for 24 matchers walked to different places in their grammar."""
    import torch

    from k3.infer import structured

    grammar = structured.json_grammar(structured.GrammarTokenizer(engine.tokenizer, engine.config.vocab_size), SCHEMA)
    vocab, device = engine.config.vocab_size, torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    matchers = [grammar.matcher() for _ in range(24)]
    for steps, matcher in enumerate(matchers):
        for _ in range(steps % 7):
            allowed = structured.allowed_rows([matcher], vocab, device)[0].nonzero().flatten()
            matcher.advance(int(allowed[torch.randint(len(allowed), (1,), generator=generator)]))
    assert len(matchers) >= structured.PARALLEL_MASK_ROWS
    pooled = structured.allowed_rows(matchers, vocab, device)
    monkeypatch.setattr(structured, "PARALLEL_MASK_ROWS", 10 ** 9)
    one_by_one = structured.allowed_rows(matchers, vocab, device)
    assert torch.equal(pooled, one_by_one)
    assert len({tuple(row.nonzero().flatten().tolist()) for row in one_by_one}) > 2  # the rows differ
