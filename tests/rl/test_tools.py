"""Tools in a real sandbox: each tool works, and anything wrong the model writes is an error observation."""

import pytest

from k3.rl.chat_format import ToolCall, parse_tool_calls
from k3.rl.tools import run_tool, truncate


@pytest.fixture(scope="module")
def box(sandbox_home):
    from k3.sandbox import Sandbox

    sandbox = Sandbox()
    yield sandbox
    sandbox.close()


def call(name, **arguments):
    return ToolCall(name=name, arguments=arguments)


def test_each_tool(box):
    assert run_tool(call("bash", command="echo hi; echo err >&2"), box).text == "hi\n[stderr]\nerr"
    assert run_tool(call("python", code="print(6 * 7)"), box).text == "42"
    failed = run_tool(call("python", code="raise SystemExit(3)"), box)
    assert failed.is_error and "[exit code 3]" in failed.text and failed.ran
    assert run_tool(call("write_file", path="/work/t/a.py", content="x = 1\n"), box).text.startswith("wrote 6 bytes")
    assert run_tool(call("read_file", path="/work/t/a.py"), box).text == "x = 1\n"
    assert not run_tool(call("edit", path="/work/t/a.py", old="x = 1", new="x = 2"), box).is_error
    assert box.read_file("/work/t/a.py") == b"x = 2\n"
    assert run_tool(call("python_repl", code="x = 20"), box).text == "[no output]"
    assert run_tool(call("python_repl", code="x + 22"), box).text == "42"  # the session keeps x
    assert run_tool(call("python_repl", code="1 / 0"), box).is_error
    submitted = run_tool(call("submit", answer=42), box)
    assert submitted.submitted == "42" and not submitted.ran


@pytest.mark.parametrize("bad, message", [
    (call("browser", url="x"), "unknown tool 'browser'"),
    (call("bash"), "needs the argument 'command'"),
    (call("bash", command="ls", cwd="/"), "has no argument 'cwd'"),
    (call("bash", command=["ls"]), "must be a string"),
    (call("bash", command="ls", timeout=-1), "timeout must be a positive number"),
    (call("read_file", path="relative.txt"), "path must be absolute"),
    (call("read_file", path="/work/nothing/here.txt"), "No such file"),
    (call("edit", path="/work/t2.txt", old="a", new="b"), "occurs 2 times"),
    (call("edit", path="/work/t2.txt", old="zzz", new="b"), "does not occur"),
    (call("edit", path="/work/t2.txt", old="", new="b"), "must not be empty"),
    (ToolCall(error="the tool call is not valid JSON"), "not valid JSON"),
])
def test_bad_calls_give_an_error_observation(box, bad, message):
    box.write_file("/work/t2.txt", "a a")
    observation = run_tool(bad, box)
    assert observation.is_error and message in observation.text, observation.text


def test_tools_outside_the_task_list_are_unknown(box):
    observation = run_tool(call("bash", command="ls"), box, allowed=("python", "submit"))
    assert observation.is_error and "the tools are: python, submit" in observation.text


def test_timeout_and_truncation_say_so(box):
    slow = run_tool(call("bash", command="sleep 5", timeout=0.5), box)
    assert slow.is_error and "timed out" in slow.text
    long = run_tool(call("python", code="print('x' * 10000)"), box, budget=300)
    assert long.truncated and "characters cut: tool output is limited to 300 characters" in long.text
    assert len(long.text) < 400
    assert truncate("short", 10) == ("short", False)


def test_a_parsed_garbage_turn_runs_without_raising(box):
    for text in ['<tool_call>{"name": "bash", "arguments": {"command": 7}}</tool_call>', "<tool_call>{",
                 '<tool_call>{"name": "python", "arguments": {"code": "import sys; sys.exit(1)"}}</tool_call>']:
        for parsed in parse_tool_calls(text):
            assert run_tool(parsed, box).is_error
