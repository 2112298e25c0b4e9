"""The task schema and loader (errors name file, line and field), and the built-in suites' splits."""

import json

import pytest

from k3.rl.suites import get_suite, prompt_split
from k3.rl.tasks import TaskFormatError, load_tasks

GOOD = {"id": "t1", "prompt": "Compute 2+2.", "verifier": {"type": "answer", "expected": "4", "match": "number"},
        "files": {"/work/a.txt": "hi"}, "limits": {"turns": 3}, "tools": ["python", "submit"]}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loads_jsonl_and_directories(tmp_path):
    tasks = load_tasks(_jsonl(tmp_path / "a.jsonl", [GOOD, {**GOOD, "id": "t2", "split": "heldout"}]))
    assert [t.id for t in tasks] == ["t1", "t2"] and tasks[1].split == "heldout"
    assert tasks[0].limits.turns == 3 and tasks[0].limits.tokens_per_turn == 128  # the rest default
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "one.json").write_text(json.dumps({**GOOD, "id": "t3"}))
    _jsonl(tmp_path / "dir" / "more.jsonl", [{**GOOD, "id": "t4"}])
    assert sorted(t.id for t in load_tasks(tmp_path / "dir")) == ["t3", "t4"]


@pytest.mark.parametrize("change, message", [
    ({"prompt": ""}, "field 'prompt': required"),
    ({"verifier": {"type": "regex"}}, "field 'verifier.type': must be one of"),
    ({"verifier": {"type": "answer"}}, "field 'verifier.expected'"),
    ({"verifier": {"type": "answer", "expected": "4", "match": "fuzzy"}}, "field 'verifier.match'"),
    ({"verifier": {"type": "command", "command": "true", "timeout": -1}}, "field 'verifier.timeout'"),
    ({"verifier": {"type": "python", "function": "nocolon"}}, "field 'verifier.function'"),
    ({"verifier": {"type": "answer", "expected": "4", "command": "x"}}, "field 'verifier.command': not a field"),
    ({"files": {"relative.txt": "x"}}, "field 'files.relative.txt': sandbox paths must be absolute"),
    ({"limits": {"turns": 0}}, "field 'limits'"),
    ({"limits": {"minutes": 3}}, "field 'limits.minutes'"),
    ({"tools": ["browser"]}, "field 'tools': unknown tool 'browser'"),
    ({"split": "test"}, "field 'split'"),
    ({"colour": "red"}, "field 'colour': not a task field"),
    ({"image": "no/such/dir"}, "field 'image'"),
])
def test_bad_tasks_name_the_file_line_and_field(tmp_path, change, message):
    path = _jsonl(tmp_path / "suite.jsonl", [GOOD, {**GOOD, "id": "t2", **change}])
    with pytest.raises(TaskFormatError) as error:
        load_tasks(path)
    assert f"{path}:2: " in str(error.value) and message in str(error.value)


def test_bad_json_and_duplicate_ids(tmp_path):
    path = tmp_path / "suite.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(TaskFormatError, match=r"suite.jsonl:2: not valid JSON"):
        load_tasks(path)
    with pytest.raises(TaskFormatError, match="'t1' is used twice"):
        load_tasks(_jsonl(tmp_path / "dup.jsonl", [GOOD, GOOD]))
    with pytest.raises(FileNotFoundError, match="built-in suite name"):
        load_tasks(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name", ["calc", "arith", "fix", "files"])
def test_suites_are_deterministic_and_splits_disjoint(name):
    suite = get_suite(name)
    train, heldout = suite.tasks("train", 60), suite.tasks("heldout", 30)
    assert [t.prompt for t in train[:5]] == [t.prompt for t in suite.tasks("train", 5)]  # same index, same task
    assert all(prompt_split(t.prompt) == "train" for t in train)
    assert all(prompt_split(t.prompt) == "heldout" for t in heldout)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert len({t.id for t in train + heldout}) == 90
    assert all(len(suite.solution(t)) >= 2 and suite.solution(t)[-1][0] == "submit" for t in train[:10])


def test_unknown_suite_says_what_exists():
    with pytest.raises(ValueError, match=r"built-in suites are \['arith', 'browse', 'calc', 'files', 'fix'\]"):
        get_suite("chess")


def test_arith_puts_the_expression_in_a_file_and_its_solver_evaluates_it():
    tasks = get_suite("arith").tasks("train", 20)
    for task in tasks:
        expression = task.files["/work/expr.txt"].strip()
        assert task.prompt == f"Compute {expression} (it is in /work/expr.txt)."
        assert task.verifier.expected == str(eval(expression))  # digits and + - * only
    code = "print(eval(open('/work/expr.txt').read()))"
    assert all(get_suite("arith").solution(t)[0] == ("python", {"code": code}) for t in tasks)


def test_heldout_prompts_are_distinct():
    from k3.rl.loop import TaskSource

    tasks = TaskSource("calc", seed=0).heldout(120)  # calc's word puzzles repeat prompts; the held-out set does not
    assert len(tasks) == 120 and len({t.prompt for t in tasks}) == 120
    assert len({t.prompt for t in get_suite("calc").tasks("heldout", 120)}) < 120
