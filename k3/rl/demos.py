"""Demonstrations from a suite's own solver: the solver's tool calls run in a real sandbox prepared for the
task, and the conversation (with the real tool outputs) is kept as an SFT example.

JSONL, one example per line: {"task": id, "messages": [{"role": ..., "content": ...}, ...]} in the chat
format of k3.rl.chat_format (assistant turns hold the tool calls as text).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from k3.atomic import atomic_write_bytes
from k3.rl.chat_format import format_tool_call, parse_tool_calls
from k3.rl.rollout import initial_messages, prepare_sandbox
from k3.rl.tasks import Task
from k3.rl.tools import SandboxGone, run_tool, web_session
from k3.rl.verify import score


def demonstration(suite, task: Task, budget: int = 1000, box=None) -> tuple[list[dict], float, int]:
    """(messages, reward, calls run in the sandbox): the solver's episode for ``task``, in a sandbox prepared
    for it, or in ``box`` (left open) when one is given."""
    messages = initial_messages(task)
    own = box is None
    box = prepare_sandbox(task) if own else box
    answer, ran = None, 0
    web = web_session(task.tools)
    try:
        for name, arguments in suite.solution(task):
            text = format_tool_call(name, arguments)
            messages.append({"role": "assistant", "content": text})
            observation = run_tool(parse_tool_calls(text)[0], box, task.tools, budget, web=web)
            ran += observation.ran
            if observation.submitted is not None:
                answer = observation.submitted
                break
            messages.append({"role": "tool", "content": observation.text})
        reward, _ = score(task, answer, box)
    finally:
        if own:
            box.close()
    return messages, reward, ran


def _reusable(task: Task) -> bool:
    """A task whose sandbox is the default image with at most files written (no setup or image of its own),
    verified by its answer alone (a command verifier would leave its files behind for the next task)."""
    return not task.setup and task.image is None and task.verifier.type == "answer"


def write_demonstrations(suite_name: str, count: int, path: str | os.PathLike, split: str = "train",
                         start: int = 0, threads: int = 4, show_progress: bool = True) -> dict:
    """Write ``count`` solver demonstrations of a built-in suite's ``split`` to ``path`` (JSONL, atomic).
    Returns {"examples", "solved", "sandbox_calls"}; a solver that fails its own task is a bug, counted here."""
    from k3.rl.suites import get_suite
    from k3.sandbox import SandboxError

    suite = get_suite(suite_name)
    tasks = suite.tasks(split, count, start=start)
    # Tasks prepared by files alone (calc's, arith's) need no sandbox started for each: a worker thread runs
    # its tasks' tool calls in one sandbox of its own per set of file paths, each task's files written over the
    # last one's (no other task's files in sight), which saves a sandbox start per demonstration, most of its cost.
    local, boxes = threading.local(), []

    def solve(task: Task):
        if not _reusable(task):
            return demonstration(suite, task)
        own, paths = local.__dict__.setdefault("boxes", {}), frozenset(task.files)
        for attempt in range(2):  # a sandbox that died is replaced once, by a fresh one
            box = own.get(paths)
            try:
                if box is None:
                    box = own[paths] = prepare_sandbox(task)
                    boxes.append(box)
                else:
                    for file_path, text in task.files.items():
                        box.write_file(file_path, text)
                return demonstration(suite, task, box=box)
            except (SandboxGone, SandboxError):
                own[paths] = None
                if attempt:
                    raise

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(tqdm(pool.map(solve, tasks), total=len(tasks), desc=f"{suite_name} demos",
                                disable=not show_progress))
    finally:
        for box in boxes:
            try:
                box.close()
            except Exception:  # a sandbox that died may have lost its cgroup already: nothing left to close
                pass
    lines = [json.dumps({"task": task.id, "messages": messages}) for task, (messages, _, _) in zip(tasks, results)]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return {"examples": len(lines), "solved": sum(r >= 1.0 for _, r, _ in results),
            "sandbox_calls": sum(ran for _, _, ran in results)}


def read_demonstrations(path: str | os.PathLike) -> list[list[dict]]:
    """The message lists of a demonstrations file; errors name the line."""
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            messages = value.get("messages") if isinstance(value, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ValueError(f"{path}:{number}: field 'messages': needs a non-empty list of "
                                 f"{{'role', 'content'}} messages")
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
                raise ValueError(f"{path}:{number}: field 'messages': no assistant message to learn from")
            examples.append(messages)
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples
