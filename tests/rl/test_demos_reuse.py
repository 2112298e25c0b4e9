"""Demonstrations of tasks prepared by files alone run in one sandbox per worker thread, each task's files
written over the last one's: fewer sandbox starts, and every demonstration still sees its own task's files."""

import json

import k3.rl.demos as demos_module
from k3.rl.demos import write_demonstrations


def test_file_only_tasks_share_a_worker_sandbox_and_see_their_own_files(sandbox_home, tmp_path, monkeypatch):
    started = []
    real_prepare = demos_module.prepare_sandbox
    monkeypatch.setattr(demos_module, "prepare_sandbox", lambda task, limits=None: started.append(task.id)
                        or real_prepare(task, limits))
    path = tmp_path / "arith.jsonl"
    made = write_demonstrations("arith", 6, path, start=123, threads=2, show_progress=False)
    assert made == {"examples": 6, "solved": 6, "sandbox_calls": 6}
    assert 1 <= len(started) <= 2  # one sandbox per worker thread, not one per task
    from k3.rl.suites import get_suite

    tasks = get_suite("arith").tasks("train", 6, start=123)
    for task, line in zip(tasks, path.read_text().splitlines()):
        row = json.loads(line)
        assert row["task"] == task.id
        # the tool's output is this task's expression evaluated from its own /work/expr.txt
        assert row["messages"][3] == {"role": "tool", "content": task.meta["answer"]}
