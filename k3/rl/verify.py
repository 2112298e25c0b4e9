"""Verifiable rewards: a task's verifier scores an episode's final answer and sandbox.

``score(task, answer, sandbox)`` returns (reward in [0, 1], reason). It never raises for a bad answer or a
verifier that crashes: a crash is reward 0 with the reason (the error) kept, so it ends only its episode.
"""

from __future__ import annotations

import importlib
import math

from k3.rl.tasks import Task


def normalize_answer(text: str) -> str:
    return " ".join(str(text).strip().split())


def _as_number(text: str) -> float | None:
    try:
        return float(normalize_answer(text).replace(",", ""))
    except ValueError:
        return None


def answer_matches(answer: str | None, expected: str, match: str = "exact") -> bool:
    """exact: equal after whitespace normalisation; number: equal as floats (1e-6 relative); contains:
    expected occurs in the answer."""
    if answer is None:
        return False
    if match == "exact":
        return normalize_answer(answer) == normalize_answer(expected)
    if match == "contains":
        return normalize_answer(expected) in normalize_answer(answer)
    got, want = _as_number(answer), _as_number(expected)
    if got is None or want is None:
        return False
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)


def _python_verifier(spec: str):
    module_name, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"verifier function {spec!r} cannot be imported: {error}") from error


def score(task: Task, answer: str | None, sandbox) -> tuple[float, str]:
    """(reward, reason) for an episode of ``task`` that ended with ``answer`` (None: no answer)."""
    verifier = task.verifier
    try:
        if verifier.type == "answer":
            ok = answer_matches(answer, verifier.expected, verifier.match)
            return (1.0, "correct") if ok else (0.0, "no answer" if answer is None else "wrong answer")
        if verifier.type == "command":
            for path, text in verifier.files.items():
                sandbox.write_file(path, text)
            result = sandbox.exec(verifier.command, timeout=verifier.timeout)
            if result.ok:
                return 1.0, "verifier command passed"
            tail = (result.stdout + result.stderr).strip().splitlines()[-1:] or [""]
            why = "timed out" if result.timed_out else f"exit {result.exit_code}"
            return 0.0, f"verifier command failed ({why}): {tail[0][:200]}"
        value = float(_python_verifier(verifier.function)(answer, sandbox, task))
        if not 0.0 <= value <= 1.0 or math.isnan(value):
            return 0.0, f"verifier {verifier.function} returned {value}, outside [0, 1]"
        return value, f"verifier {verifier.function}"
    except Exception as error:  # a verifier's own failure ends only this episode, with the reason kept
        return 0.0, f"verifier crashed: {type(error).__name__}: {error}"
