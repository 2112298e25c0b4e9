"""One chat format for every entry point: the same conversation through k3 serve, k3 chat, k3 generate --chat,
k3 sft, k3 rl and k3 distill gives the same ids; the built-in formats render as published; templates are
sandboxed and bounded; replies parse the same streamed or whole."""

import argparse
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("jinja2")

from k3.chat import ChatFormat, attach_chat_format, builtin_template, load_chat_format  # noqa: E402
from k3.chat.reply import ReplyParser, parse_reply  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "You solve tasks with tools."},
    {"role": "user", "content": "Compute 37*41+5."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.python:0", "type": "function",
         "function": {"name": "python", "arguments": '{"code": "print(37*41+5)"}'}}]},
    {"role": "tool", "tool_call_id": "functions.python:0", "content": "1522"},
]


def make_run(directory, template_name):
    """A run directory (checkpoint + tokenizer/ with its chat_template.jinja), as k3 sft / rl leave one."""
    import torch

    from k3.checkpoint.native import save_checkpoint
    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.model import K3ForCausalLM

    text = "".join(m["content"] for m in CONVERSATION) + "<|user|><|assistant|><tool_call>functions <|im_middle|>"
    tokenizer = train_bpe([text] * 8, vocab_size=300, show_progress=False)
    attach_chat_format(tokenizer, ChatFormat(builtin_template(template_name)))
    config = ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    directory.mkdir(parents=True)
    save_checkpoint(directory / "checkpoint.pt", {"config": config.to_dict(), "model": model.state_dict(),
                                                  "step": 0})
    tokenizer.save(directory / "tokenizer")
    return directory


@pytest.mark.parametrize("template_name", ["k3", "kimi_k2"])
def test_every_entry_point_gives_the_same_ids(tmp_path, template_name):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infer"))
    from inprocess_server import InProcessServer

    from k3.infer.cli import chat_format_for, load_for_inference
    from k3.infer.chat_template import load_chat_template
    from k3.rl.chat_format import render_ids
    from k3.rl.distill_tasks import task_prompt_ids
    from k3.rl.sft import sft_rows
    from k3.rl.tasks import Task, Verifier

    run = make_run(tmp_path / "run", template_name)
    model, tokenizer = load_for_inference(str(run), None, "cpu")  # what every command loads
    assert tokenizer.chat_template == builtin_template(template_name)  # saved and read back with the tokenizer

    rl_ids, _ = render_ids(CONVERSATION, tokenizer, add_generation_prompt=True)
    chat_ids = chat_format_for(argparse.Namespace(run=str(run), model=None), tokenizer).encode(CONVERSATION,
                                                                                               tokenizer)
    answer = {"role": "assistant", "content": "1522"}
    sft_ids, labels = sft_rows(CONVERSATION + [answer], tokenizer, max_tokens=4096)
    task = Task("t", "Compute 37*41+5.", Verifier("exact", "1522"), system="You solve tasks with tools.")
    distill_ids = task_prompt_ids(task, tokenizer)
    server = InProcessServer(model, tokenizer, load_chat_template(tokenizer, run / "tokenizer"), max_context=512)
    try:
        body = {"model": "tiny", "messages": CONVERSATION, "max_tokens": 1, "return_token_ids": True}
        served = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        serve_ids = served["choices"][0]["prompt_token_ids"]
    finally:
        server.stop()
    assert serve_ids == rl_ids == chat_ids
    assert sft_ids[:len(rl_ids)] == rl_ids  # the training example continues the served prompt
    trained = [t for t, label in zip(sft_ids[1:], labels) if label != -100]
    assert tokenizer.decode(trained).startswith(("<tool_call>", "<|tool_calls_section_begin|>"))
    assert "1522" in tokenizer.decode(trained)[-20:]  # both assistant turns are trained, nothing else
    from k3.rl.rollout import initial_messages

    expected = load_chat_format(tokenizer).encode(initial_messages(task), tokenizer)
    assert distill_ids == expected and distill_ids == render_ids(initial_messages(task), tokenizer, True)[0]


def test_kimi_k2_renders_the_published_format():
    fmt = ChatFormat(builtin_template("kimi_k2"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = fmt.render(CONVERSATION[1:] + [{"role": "assistant", "content": "It is 1522.",
                                           "reasoning_content": "easy"}], tools, add_generation_prompt=False)
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
        '"parameters":{"type":"object"}}}]<|im_end|>'
        '<|im_user|>user<|im_middle|>Compute 37*41+5.<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.python:0'
        '<|tool_call_argument_begin|>{"code": "print(37*41+5)"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        '<|im_system|>tool<|im_middle|>## Return of functions.python:0\n1522<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|><think>easy</think>It is 1522.<|im_end|>')
    assert fmt.tool_syntax == "kimi_k2" and fmt.thinking and fmt.end_of_turn == "<|im_end|>"
    assert fmt.render(CONVERSATION[1:2]).endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_a_format_that_rewrites_earlier_turns_is_refused():
    class Tok:
        eos_token_id = None

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    rewrites = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="message by message"):
        ChatFormat(rewrites).segments([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], Tok())


def test_templates_are_sandboxed_and_bounded():
    with pytest.raises(ValueError, match="more than"):
        ChatFormat("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}").render([{"role": "user",
                                                                                        "content": "a"}])
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        ChatFormat("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": "a"}])


def test_a_template_that_spins_without_writing_is_stopped_at_its_deadline(monkeypatch):
    """Output is bounded, but a loop that writes nothing is not: three nested ranges of the sandbox's cap are 1e15
    iterations (hours of a server's worker thread, once per chat request). Rendering has a deadline."""
    import time

    from k3.chat import render

    monkeypatch.setattr(render, "RENDER_DEADLINE_S", 0.2)
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}" \
           "{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ValueError, match="took more than 0.2 s"):
        ChatFormat(spin).render([{"role": "user", "content": "a"}])
    assert time.monotonic() - start < 5
    assert ChatFormat("{{ messages[0].content }}").render([{"role": "user", "content": "a"}]) == "a"


def test_a_render_that_ends_at_its_deadline_leaves_nothing_pending(monkeypatch):
    """The watchdog raises inside the render's thread; a render that ends as its deadline passes must not get that
    exception later, outside the render. Deadlines about one render long: each render either returns or says it
    ran out of time, and nothing arrives after."""
    import time

    from k3.chat import render

    monkeypatch.setattr(render, "RENDER_DEADLINE_S", 0.0005)
    # Loops of 1,000 to 2M empty iterations: on any machine some end before the deadline, some about then, and some
    # run past it by more than the interpreter's 5 ms thread switch interval (the watchdog needs the GIL to fire).
    fmt = ChatFormat("{% for i in range(messages[0].content | int) %}{% for j in range(1000) %}{% endfor %}"
                     "{% endfor %}done")
    outcomes = []
    for n in [2 ** (i % 12) for i in range(360)]:
        try:
            outcomes.append(fmt.render([{"role": "user", "content": str(n)}]))
        except ValueError as error:
            assert "took more than" in str(error)
            outcomes.append("timeout")
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # bytecodes after every render: a stray exception would surface here
        sum(range(100))
    assert set(outcomes) <= {"done", "timeout"} and "timeout" in outcomes


@pytest.mark.parametrize("syntax,text", [
    ("kimi_k2", '<think>plan</think>On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0'
                '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_call_begin|>functions.g:1'
                '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>'),
    ("k3", '<think>plan</think>On it.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'),
])
def test_replies_parse_the_same_whole_and_streamed_one_character_at_a_time(syntax, text):
    whole = parse_reply(text, syntax, thinking=True)
    assert (whole.reasoning, whole.content) == ("plan", "On it.")
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("f", {"a": 1}), ("g", {})]
    streamed = ReplyParser(syntax, thinking=True)
    for character in text:
        streamed.push(character)
    streamed.finish()
    assert (streamed.reasoning, streamed.content, streamed.calls) == (whole.reasoning, whole.content, whole.calls)


def test_a_call_to_a_tool_not_offered_is_content():
    text = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    parsed = parse_reply(text, "k3", tool_names={"f"})
    assert parsed.calls == [] and parsed.content == text


def test_serve_chat_template_flag_takes_a_builtin_or_a_file(tmp_path):
    from k3.infer.chat_template import ChatTemplate
    from k3.infer.serve_cli import _check_args, chosen_chat_template

    loaded = ChatTemplate()
    assert chosen_chat_template("kimi_k2", loaded).name == "kimi_k2"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chosen_chat_template(str(tmp_path / "t.jinja"), loaded).render([{"role": "user", "content": "a"}]) == "a"
    args = argparse.Namespace(port=0, max_batch=1, max_context=8, max_queue=0, chat_template="nope")
    with pytest.raises(FileNotFoundError, match="not a built-in format"):
        _check_args(args)


def test_a_new_training_run_saves_its_chat_format_with_the_tokenizer(tmp_path):
    """sft / rl / distill start a run through start_or_restore: the format they train in is saved with the
    tokenizer, and what `k3 serve --run` loads from it is that format."""
    from k3.data.tokenizer import load_tokenizer, train_bpe
    from k3.infer.chat_template import load_chat_template
    from k3.rl.sft import RUN
    from k3.train.run_dir import RunDirectory

    tokenizer = train_bpe(["hello world"] * 4, vocab_size=270, show_progress=False)
    assert tokenizer.chat_template is None
    assert RunDirectory(tmp_path, RUN).start_or_restore(None, None, tokenizer, {}, {}) == 0
    assert (tmp_path / "tokenizer" / "chat_template.jinja").read_text() == builtin_template("k3")
    served = load_chat_template(load_tokenizer(tmp_path / "tokenizer"), tmp_path / "tokenizer")
    assert served.name == "k3" and served.tool_syntax == "k3"
