"""The chat format: rendering with trainable masks, and robust parsing of tool calls."""

from k3.rl.chat_format import (GENERATION_PROMPT, format_tool_call, parse_tool_calls, render_ids,
                               render_segments, tool_message_ids)


def test_render_marks_only_assistant_tokens_trainable(tokenizer):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Compute 12+30."},
                {"role": "assistant", "content": format_tool_call("python", {"code": "print(12+30)"})},
                {"role": "tool", "content": "42"}]
    ids, mask = render_ids(messages, tokenizer, add_generation_prompt=True)
    segments = render_segments(messages, tokenizer, add_generation_prompt=True)
    assert [len(s.ids) for s in segments if s.trainable] == [sum(mask)]
    trainable = [t for t, m in zip(ids, mask) if m]
    assert trainable[-1] == tokenizer.eos_token_id  # the assistant turn ends with EOS, and EOS is learned
    assert tokenizer.decode(trainable[:-1]) == messages[2]["content"]
    assert tokenizer.decode(ids).endswith(GENERATION_PROMPT)
    # Messages are encoded one by one: the ids of a prefix conversation are a prefix of the whole.
    prefix, _ = render_ids(messages[:2], tokenizer)
    assert ids[:len(prefix)] == prefix
    assert tool_message_ids("42", tokenizer) == ids[-len(tool_message_ids("42", tokenizer)):]


def test_parse_round_trip_and_several_calls():
    text = "thinking " + format_tool_call("bash", {"command": "ls"}) + " then " + \
        format_tool_call("submit", {"answer": "3"})
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("bash", {"command": "ls"}, None),
                                                               ("submit", {"answer": "3"}, None)]


def test_arguments_given_as_a_json_string_are_accepted():
    calls = parse_tool_calls('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>')
    assert calls[0].error is None and calls[0].arguments == {"command": "pwd"}


def test_malformed_calls_come_back_with_an_error_and_never_raise():
    cases = {
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>': "not valid JSON",
        '<tool_call>["bash"]</tool_call>': "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "no 'name'",
        '<tool_call>{"name": "bash", "arguments": [1]}</tool_call>': "'arguments' must be a JSON object",
        '<tool_call>{"name": "bash", "arguments": "{oops"}</tool_call>': "not JSON",
        '<tool_call>{"name": "bash"': "never closed",
        'stray </tool_call>': "without a <tool_call>",
    }
    for text, message in cases.items():
        calls = parse_tool_calls(text)
        assert len(calls) == 1 and calls[0].error is not None and message in calls[0].error, (text, calls)
    assert parse_tool_calls("just an answer: 42") == []
    many = parse_tool_calls(format_tool_call("bash", {"command": "ls"}) * 10, max_calls=3)
    assert len(many) == 4 and "at most 3" in many[-1].error
