"""Tasks: what an episode is asked to do, where it runs, how it is scored, and its limits; and the loader of
user task suites (a JSONL file, or a directory of .json / .jsonl files).

Task schema (one JSON object per JSONL line, or per .json file):

    id         str, required, unique in the suite
    prompt     str, required: the user message
    split      "train" (default) or "heldout"
    system     str, optional: the system message (default: the suite's, listing the tools)
    image      str, optional: a directory to use as the sandbox image (default: k3.sandbox's default image);
               relative paths are relative to the task file
    files      {absolute sandbox path: text}, optional: written into the sandbox before the episode
    setup      str, optional: a shell command run after the files are written (its failure fails the task)
    tools      [str], optional: tools the model may call (default: k3.rl.tools.DEFAULT_TOOLS; the web tools
               search / open / find only when named)
    verifier   required, one of
                 {"type": "answer", "expected": str, "match": "exact" | "number" | "contains"}
                    compares the submitted answer (exact: after stripping whitespace; number: as floats,
                    within 1e-6 relative; contains: expected is a substring)
                 {"type": "command", "command": str, "files": {path: text}, "timeout": seconds}
                    writes the hidden files (not visible during the episode), runs the command in the
                    episode's sandbox; exit code 0 is reward 1
                 {"type": "python", "function": "package.module:name"}
                    calls name(answer: str | None, sandbox, task) -> float in [0, 1]
    limits     optional {"turns": int, "tokens_per_turn": int, "total_tokens": int, "seconds": float}
    meta       optional dict, free (suites keep their solver's plan here)

A bad file raises TaskFormatError naming the file, the line (JSONL) and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MATCH_KINDS = ("exact", "number", "contains")
VERIFIER_TYPES = ("answer", "command", "python")
SPLITS = ("train", "heldout")


class TaskFormatError(ValueError):
    """A task file that does not follow the schema; the message names the file, line and field."""


@dataclass(frozen=True)
class EpisodeLimits:
    turns: int = 6
    tokens_per_turn: int = 128
    total_tokens: int = 1024
    seconds: float = 120.0

    def __post_init__(self) -> None:
        for name in ("turns", "tokens_per_turn", "total_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.seconds, (int, float)) or self.seconds <= 0:
            raise ValueError(f"limits.seconds must be a positive number, got {self.seconds!r}")


@dataclass(frozen=True)
class Verifier:
    type: str
    expected: str | None = None
    match: str = "exact"
    command: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    function: str | None = None


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    verifier: Verifier
    split: str = "train"
    system: str | None = None
    image: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    setup: str | None = None
    tools: tuple[str, ...] | None = None
    limits: EpisodeLimits = EpisodeLimits()
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tools"] = list(self.tools) if self.tools is not None else None
        return {k: v for k, v in data.items() if v is not None}


def _where(source: str, line: int | None) -> str:
    return f"{source}:{line}" if line is not None else source


def _fail(source: str, line: int | None, field_name: str, message: str) -> TaskFormatError:
    return TaskFormatError(f"{_where(source, line)}: field '{field_name}': {message}")


def _str_map(value: Any, source: str, line: int | None, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(source, line, name, f"must be an object {{absolute path: text}}, got {type(value).__name__}")
    for path, text in value.items():
        if not path.startswith("/"):
            raise _fail(source, line, f"{name}.{path}", "sandbox paths must be absolute, like /work/main.py")
        if not isinstance(text, str):
            raise _fail(source, line, f"{name}.{path}", f"the content must be a string, got {type(text).__name__}")
    return dict(value)


def _verifier(value: Any, source: str, line: int | None) -> Verifier:
    if not isinstance(value, dict):
        raise _fail(source, line, "verifier", f"must be an object with a 'type' (one of {VERIFIER_TYPES})")
    kind = value.get("type")
    if kind not in VERIFIER_TYPES:
        raise _fail(source, line, "verifier.type", f"must be one of {VERIFIER_TYPES}, got {kind!r}")
    allowed = {"answer": {"type", "expected", "match"}, "command": {"type", "command", "files", "timeout"},
               "python": {"type", "function"}}[kind]
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _fail(source, line, f"verifier.{unknown[0]}", f"not a field of a {kind!r} verifier "
                                                           f"(fields: {sorted(allowed)})")
    if kind == "answer":
        if not isinstance(value.get("expected"), str):
            raise _fail(source, line, "verifier.expected", "an answer verifier needs the expected answer as a string")
        if value.get("match", "exact") not in MATCH_KINDS:
            raise _fail(source, line, "verifier.match", f"must be one of {MATCH_KINDS}, got {value.get('match')!r}")
        return Verifier("answer", expected=value["expected"], match=value.get("match", "exact"))
    if kind == "command":
        if not isinstance(value.get("command"), str) or not value["command"].strip():
            raise _fail(source, line, "verifier.command", "a command verifier needs a shell command string")
        timeout = value.get("timeout", 60.0)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise _fail(source, line, "verifier.timeout", f"must be a positive number of seconds, got {timeout!r}")
        return Verifier("command", command=value["command"], files=_str_map(value.get("files"), source, line,
                                                                            "verifier.files"), timeout=float(timeout))
    function = value.get("function")
    if not isinstance(function, str) or ":" not in function:
        raise _fail(source, line, "verifier.function", f"must be 'package.module:name', got {function!r}")
    return Verifier("python", function=function)


TASK_FIELDS = {"id", "prompt", "split", "system", "image", "files", "setup", "tools", "verifier", "limits", "meta"}


def task_from_dict(data: Any, source: str = "<task>", line: int | None = None, base_dir: str | None = None) -> Task:
    """Validate one task object (see the module doc); errors name ``source``, ``line`` and the field."""
    from k3.rl.tools import TOOLS

    if not isinstance(data, dict):
        raise TaskFormatError(f"{_where(source, line)}: a task must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - TASK_FIELDS)
    if unknown:
        raise _fail(source, line, unknown[0], f"not a task field (fields: {sorted(TASK_FIELDS)})")
    for name in ("id", "prompt"):
        if not isinstance(data.get(name), str) or not data[name].strip():
            raise _fail(source, line, name, "required, a non-empty string")
    split = data.get("split", "train")
    if split not in SPLITS:
        raise _fail(source, line, "split", f"must be one of {SPLITS}, got {split!r}")
    for name in ("system", "setup", "image"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise _fail(source, line, name, f"must be a string, got {type(data[name]).__name__}")
    image = data.get("image")
    if image is not None:
        image = os.path.normpath(os.path.join(base_dir or ".", image))
        if not os.path.isdir(image):
            raise _fail(source, line, "image", f"{image} is not a directory (an image is a root filesystem tree)")
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
            raise _fail(source, line, "tools", "must be a list of tool names")
        bad = [t for t in tools if t not in TOOLS]
        if bad:
            raise _fail(source, line, "tools", f"unknown tool {bad[0]!r}; tools are {sorted(TOOLS)}")
        tools = tuple(tools)
    limits_value = data.get("limits") or {}
    if not isinstance(limits_value, dict):
        raise _fail(source, line, "limits", "must be an object {turns, tokens_per_turn, total_tokens, seconds}")
    limit_names = {f for f in EpisodeLimits.__dataclass_fields__}
    for name in limits_value:
        if name not in limit_names:
            raise _fail(source, line, f"limits.{name}", f"not a limit (limits: {sorted(limit_names)})")
    try:
        limits = EpisodeLimits(**limits_value)
    except ValueError as error:
        raise _fail(source, line, "limits", str(error)) from None
    meta = data.get("meta") or {}
    if not isinstance(meta, dict):
        raise _fail(source, line, "meta", "must be an object")
    return Task(id=data["id"], prompt=data["prompt"], verifier=_verifier(data.get("verifier"), source, line),
                split=split, system=data.get("system"), image=image,
                files=_str_map(data.get("files"), source, line, "files"), setup=data.get("setup"),
                tools=tools, limits=limits, meta=meta)


def _load_jsonl(path: Path) -> list[Task]:
    tasks = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise TaskFormatError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") from None
        tasks.append(task_from_dict(data, str(path), number, str(path.parent)))
    return tasks


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Tasks from a .jsonl file, a .json file (one task or a list), or a directory of such files (sorted by
    name, not recursive). Ids must be unique across everything loaded."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task suite {path} does not exist; give a .jsonl file or a directory of .json / "
                                f".jsonl task files, or a built-in suite name (calc, fix, files)")
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path} holds no .json or .jsonl task files")
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for file in files:
        if file.suffix == ".jsonl":
            loaded = _load_jsonl(file)
        elif file.suffix == ".json":
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:
                raise TaskFormatError(f"{file}:{error.lineno}: not valid JSON ({error.msg})") from None
            items = data if isinstance(data, list) else [data]
            loaded = [task_from_dict(item, f"{file}[{i}]" if isinstance(data, list) else str(file), None,
                                     str(file.parent)) for i, item in enumerate(items)]
        else:
            raise TaskFormatError(f"{file}: task files must end in .jsonl or .json")
        for task in loaded:
            if task.id in seen:
                raise TaskFormatError(f"{file}: field 'id': {task.id!r} is used twice (also in {seen[task.id]})")
            seen[task.id] = str(file)
        tasks.extend(loaded)
    if not tasks:
        raise TaskFormatError(f"{path}: no tasks found (every line was empty)")
    return tasks
