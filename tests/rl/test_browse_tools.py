"""The offline web as RL tools (search / open / find, one browser per episode) and the browse suite: solver
demonstrations that score 1 in a real sandbox, tool errors as observations, `k3 rl --suite browse` (a small
corpus of the standard library stands in for the whole one)."""

import json

import pytest

from k3.rl.chat_format import ToolCall
from k3.rl.tools import DEFAULT_TOOLS, WEB_TOOLS, run_tool, tool_list_text, web_session

MODULES = ["http.server", "socketserver", "http.client", "http.cookies", "email.message", "email.generator",
           "mailbox", "json", "json.decoder", "json.encoder", "json.scanner", "concurrent.futures.thread",
           "concurrent.futures._base", "csv", "io", "string", "re", "shlex", "textwrap", "calendar", "datetime"]


@pytest.fixture(scope="module")
def small_web(sandbox_home):
    import k3.sandbox.web.tools as web_tools

    tools = web_tools.default_tools(modules=MODULES, docs=False)
    saved, web_tools._default = web_tools._default, tools  # default_tools() serves the small corpus here
    yield tools
    web_tools._default = saved


def call(name, **arguments):
    return ToolCall(name=name, arguments=arguments, error=None)


def test_web_tools_browse_per_episode_and_errors_are_observations(small_web):
    allowed = ("search", "open", "find", "submit")
    assert web_session(DEFAULT_TOOLS) is None and not set(WEB_TOOLS) & set(DEFAULT_TOOLS)
    assert "search(query)" not in tool_list_text() and "search(query)" in tool_list_text(allowed)
    web, other = web_session(allowed), web_session(allowed)
    found = run_tool(call("search", query="json decoder"), None, allowed, web=web)
    assert not found.is_error and "web://py/mod/json.decoder" in found.text and not found.ran
    page = run_tool(call("open", url="web://py/mod/json.decoder"), None, allowed, web=web)
    assert page.text.startswith("Module json.decoder") and not page.is_error
    hits = run_tool(call("find", text="JSONDecodeError"), None, allowed, web=web)
    assert hits.text.startswith("line ") and not hits.is_error
    link = run_tool(call("open", url=1), None, allowed, web=web)  # the first link of the open page
    assert not link.is_error and link.text.startswith("Source of json.decoder")
    assert run_tool(call("find", text="x"), None, allowed, web=other).text == "error: no page is open; open one first"
    for bad, expected in [(call("open", url="file:///etc/passwd"), "is not a page of the offline web"),
                          (call("open", url="web://py/mod/json", offset=-1), "offset must be"),
                          (call("open", url=7.5), "argument 'url' must be a string"),
                          (call("search"), "needs the argument 'query'")]:
        observation = run_tool(bad, None, allowed, web=web)
        assert observation.is_error and expected in observation.text, (bad, observation.text)
    assert "not available" in run_tool(call("search", query="json"), None, allowed, web=None).text
    assert "unknown tool 'search'" in run_tool(call("search", query="json"), None, DEFAULT_TOOLS, web=web).text
    cut = run_tool(call("open", url="web://py/mod/json.decoder"), None, allowed, budget=300, web=web)
    assert cut.truncated and "characters cut" in cut.text


def test_browse_suite_solver_scores_in_a_real_sandbox(small_web):
    from k3.rl.demos import demonstration
    from k3.rl.suites import get_suite

    suite = get_suite("browse")
    train, heldout = suite.tasks("train", 3), suite.tasks("heldout", 2)
    assert {t.split for t in train} == {"train"} and {t.split for t in heldout} == {"heldout"}
    assert not {t.meta["question"] for t in train} & {t.meta["question"] for t in heldout}
    for task in train + heldout:
        messages, reward, ran = demonstration(suite, task)
        assert reward == 1.0, (task.prompt, messages[-1])
        assert sum(m["role"] == "tool" for m in messages) == len(task.meta["pages"])  # one page read per hop
    from k3.rl.suites.browse import verify

    assert verify("not it", None, train[0]) == 0.0 and verify(None, None, train[0]) == 0.0
    assert verify(f" `{train[0].meta['answer']}`. ", None, train[0]) == 1.0


def test_k3_rl_suite_browse_runs_a_step(small_web, tokenizer, tiny_model, tmp_path, capsys):
    from k3.checkpoint.native import directory_files, save_checkpoint
    from k3.cli import main

    run = tmp_path / "start"
    tokenizer.save(run / "tokenizer")
    save_checkpoint(run / "checkpoint.pt", {"model": tiny_model.state_dict(), "config": tiny_model.config.to_dict(),
                                            "step": 0, "tokenizer": directory_files(run / "tokenizer")})
    out = tmp_path / "rl"
    assert main(["rl", "--run", str(run), "--suite", "browse", "--out", str(out), "--group", "2",
                 "--tasks-per-step", "1", "--steps", "1", "--heldout-tasks", "1", "--device", "cpu",
                 "--max-context", "1024"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and records[1]["episodes"] == 2
    assert records[0]["heldout_tasks"] == 1
    demos = tmp_path / "browse.jsonl"
    assert main(["rl", "demos", "--suite", "browse", "--count", "2", "--out", str(demos)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["solved"] == 2
