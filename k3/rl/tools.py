"""The tools a policy calls, each run inside the episode's sandbox.

    bash(command)                       /bin/sh -c command in the task's workdir; stdout, stderr, exit code
    python(code)                        the code as a script (python3), same output as bash
    python_repl(code)                   the code in the sandbox's persistent Python REPL (k3.sandbox's
                                        Sandbox.repl): variables live on from call to call; the last
                                        bare expression's value is shown
    read_file(path)                     the file's text
    write_file(path, content)           creates parents, overwrites
    edit(path, old, new)                replaces the one occurrence of old by new (an error unless exactly one)
    submit(answer)                      ends the episode with this answer

The offline web (k3.sandbox.web: the standard library and Python docs as linked pages), for tasks that name
these tools (the browse suite); each episode has its own browser session, so find and link numbers refer to
the page it has open:

    search(query)                       ranked results with snippets, numbered
    open(url, offset?)                  a page (web://py/...) or the number of a link in the last listing
    find(text)                          the lines of the open page that contain text

A call with an unknown name, a missing or unexpected argument, an argument of the wrong type, or a failure
inside the sandbox (a missing file, a timeout) gives an observation that says what went wrong; nothing here
raises for anything the model wrote. ``SandboxGone`` is raised only when the sandbox itself is dead
(closed, killed), which ends the episode.

Observations are cut to ``budget`` characters (head and tail kept) and then say how much was cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3.rl.chat_format import ToolCall

# name -> (required argument names, optional argument names, description)
TOOLS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "bash": (("command",), ("timeout",), "run a shell command"),
    "python": (("code",), ("timeout",), "run a Python script and print its output"),
    "python_repl": (("code",), ("timeout",), "run code in a persistent Python session (variables persist)"),
    "read_file": (("path",), (), "read a text file"),
    "write_file": (("path", "content"), (), "write a text file"),
    "edit": (("path", "old", "new"), (), "replace the one occurrence of old by new in a file"),
    "submit": (("answer",), (), "give the final answer and end"),
    "search": (("query",), (), "search the offline web (Python's standard library and docs)"),
    "open": (("url",), ("offset",), "open a web://py/... page, or the number of a link in the last listing"),
    "find": (("text",), (), "the lines of the open page that contain text"),
}
WEB_TOOLS = ("search", "open", "find")
DEFAULT_TOOLS = tuple(name for name in TOOLS if name not in WEB_TOOLS)  # what a task gets unless it names its own
DEFAULT_BUDGET = 2000
MAX_TOOL_TIMEOUT = 60.0


class SandboxGone(RuntimeError):
    """The episode's sandbox is closed or its supervisor died: the episode cannot go on."""


@dataclass
class Observation:
    text: str
    is_error: bool = False
    submitted: str | None = None  # set by submit
    truncated: bool = False
    seconds: float = 0.0
    ran: bool = False  # the call reached the sandbox (submit and rejected calls do not)


def tool_list_text(tools: tuple[str, ...] | None = None) -> str:
    """One line per tool, for a system prompt."""
    names = tools or DEFAULT_TOOLS
    lines = []
    for name in names:
        required, optional, description = TOOLS[name]
        args = ", ".join(list(required) + [f"{o}?" for o in optional])
        lines.append(f"- {name}({args}): {description}")
    return "\n".join(lines)


def truncate(text: str, budget: int) -> tuple[str, bool]:
    """text cut to about ``budget`` characters, keeping its head and tail and saying how much went."""
    if len(text) <= budget:
        return text, False
    head = budget * 2 // 3
    tail = budget - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut: tool output is limited to {budget} characters ...]\n" \
           f"{text[len(text) - tail:]}", True


def check_arguments(call: ToolCall, allowed: tuple[str, ...] | None = None) -> str | None:
    """None when the call names an allowed tool with the right arguments, else the error to show."""
    if call.error:
        return call.error
    names = allowed or DEFAULT_TOOLS
    if call.name not in TOOLS or call.name not in names:
        return f"unknown tool {call.name!r}; the tools are: {', '.join(names)}"
    required, optional, _ = TOOLS[call.name]
    missing = [a for a in required if a not in call.arguments]
    if missing:
        return f"{call.name} needs the argument {missing[0]!r} (arguments: {', '.join(required + optional)})"
    unexpected = [a for a in call.arguments if a not in required + optional]
    if unexpected:
        return f"{call.name} has no argument {unexpected[0]!r} (arguments: {', '.join(required + optional)})"
    for name in required:
        if name == "answer":
            continue  # an answer may be a number or a string; it is compared as text
        if name == "url" and isinstance(call.arguments[name], int) and not isinstance(call.arguments[name], bool):
            continue  # open(3): the third link of the last listing
        if not isinstance(call.arguments[name], str):
            return f"{call.name}: argument {name!r} must be a string, got {type(call.arguments[name]).__name__}"
    if "timeout" in call.arguments:
        timeout = call.arguments["timeout"]
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            return f"{call.name}: timeout must be a positive number of seconds, got {timeout!r}"
    if "offset" in call.arguments:
        offset = call.arguments["offset"]
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            return f"{call.name}: offset must be a character position >= 0, got {offset!r}"
    if call.name in ("read_file", "write_file", "edit") and not call.arguments["path"].startswith("/"):
        return f"{call.name}: path must be absolute, like /work/main.py; got {call.arguments['path']!r}"
    return None


def _exec_text(result) -> str:
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[timed out after {result.duration_s:.1f} s; the command was killed]")
    elif result.oom_killed:
        parts.append("[killed: out of memory]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


def web_session(tools: tuple[str, ...] | None):
    """A fresh offline-web browser (k3.sandbox.web.tools.WebSession) when ``tools`` name a web tool, else None."""
    if not tools or not any(name in WEB_TOOLS for name in tools):
        return None
    from k3.sandbox.web.tools import WebSession, default_tools

    return WebSession(default_tools())


def run_tool(call: ToolCall, sandbox, allowed: tuple[str, ...] | None = None, budget: int = DEFAULT_BUDGET,
             default_timeout: float = 20.0, web=None) -> Observation:
    """Run one parsed call in ``sandbox`` (a k3.sandbox.Sandbox, or anything with its exec/read_file/write_file)
    and return what the model sees next. web: the episode's offline-web session (web_session) for the web
    tools."""
    import time

    from k3.sandbox.local import SandboxError

    problem = check_arguments(call, allowed)
    if problem is not None:
        return Observation(f"error: {problem}", is_error=True)
    args = call.arguments
    if call.name == "submit":
        answer = args["answer"]
        return Observation("submitted", submitted=answer if isinstance(answer, str) else json_text(answer))
    timeout = min(float(args.get("timeout", default_timeout)), MAX_TOOL_TIMEOUT)
    started = time.perf_counter()
    if call.name in WEB_TOOLS:
        if web is None:
            return Observation(f"error: {call.name}: the offline web is not available in this task", is_error=True)
        if call.name == "search":
            text = web.search(args["query"])
        elif call.name == "open":
            text = web.open(args["url"], args.get("offset", 0))
        else:
            text = web.find(args["text"])
        text, cut = truncate(text, budget)  # answered on the host: the web is read-only, the sandbox not involved
        return Observation(text, is_error=text.startswith("error:"), truncated=cut,
                           seconds=time.perf_counter() - started)
    try:
        if call.name == "bash":
            result = sandbox.exec(args["command"], timeout=timeout)
            text, is_error = _exec_text(result), not result.ok
        elif call.name == "python":
            sandbox.write_file("/tmp/.k3_tool_script.py", args["code"])
            result = sandbox.exec("python3 /tmp/.k3_tool_script.py", timeout=timeout)
            text, is_error = _exec_text(result), not result.ok
        elif call.name == "python_repl":
            result = sandbox.repl().run(args["code"], timeout=timeout)
            text, is_error = result.as_text().rstrip("\n") or "[no output]", not result.ok
            if result.error and result.error not in text:
                text += f"\n{result.error}"
        elif call.name == "read_file":
            text, is_error = sandbox.read_file(args["path"]).decode(errors="replace"), False
        elif call.name == "write_file":
            sandbox.write_file(args["path"], args["content"])
            text, is_error = f"wrote {len(args['content'].encode())} bytes to {args['path']}", False
        else:
            text, is_error = _edit(sandbox, args["path"], args["old"], args["new"])
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as error:
        text, is_error = f"error: {call.name}: {error.strerror or error} ({args.get('path', '')})", True
    except OSError as error:
        text, is_error = f"error: {call.name}: {error}", True
    except SandboxError as error:  # the sandbox's supervisor is gone or refused: not the model's doing
        raise SandboxGone(str(error)) from error
    except (BrokenPipeError, EOFError, ConnectionError) as error:
        raise SandboxGone(f"the sandbox stopped answering ({type(error).__name__}: {error})") from error
    text, cut = truncate(text, budget)
    return Observation(text, is_error=is_error, truncated=cut, seconds=time.perf_counter() - started, ran=True)


def _edit(sandbox, path: str, old: str, new: str) -> tuple[str, bool]:
    if not old:
        return "error: edit: 'old' must not be empty (use write_file to create a file)", True
    text = sandbox.read_file(path).decode(errors="replace")
    count = text.count(old)
    if count != 1:
        where = "does not occur" if count == 0 else f"occurs {count} times"
        return f"error: edit: the text to replace {where} in {path}; 'old' must match exactly one place", True
    sandbox.write_file(path, text.replace(old, new, 1))
    return f"edited {path}: replaced 1 occurrence", False


def json_text(value: Any) -> str:
    import json

    return json.dumps(value) if not isinstance(value, (int, float)) else repr(value)
